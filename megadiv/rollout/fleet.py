"""FleetEngine: SGLang servers (one or several) behind the one rollout protocol.

    rollout: {engine: sglang}                                                   # one, launched here
    rollout: {engine: sglang, num_servers: 4}                                   # four, launched here
    rollout: {engine: sglang, server_urls: [http://node7:30000, http://node8:30000]}  # attached

Each server is driven by its own single-server :class:`SGLangEngine` (a *member*), so everything
one server does (launch, timeouts, errors naming it, its weight-update session) stays in that
class; the fleet routes work to them and gathers it back:

- **generation** is a stream of GRPO groups (fleet_stream.py): one request per group, sent to
  the least-loaded live server, every server heartbeated, a lost server dropped (:meth:`drop`)
  and its groups re-sent to the others. ``generate`` (evaluation) is the same stream over its
  prompts, answered in prompt order; the rollout driver keeps one open per batch (open_stream).
- **score** (the probe check): the prompts are cut into one contiguous slice per member, scored
  concurrently and concatenated in order. The first member to fail fails the call, with its error
  (which names its server), without waiting for the others.
- **update_weights**: every bucket goes to every member. With ``distributed`` (the default for
  servers on GPUs of their own, and on CPU) over *one* process group spanning every TP rank of
  every server, so each bucket leaves the trainer once whatever the fleet's size, the next bucket
  exported while this one is sent (weight_sync.exported_ahead). Every server must answer
  /server_info (no generation) once, at the start of the push; nothing is probed per bucket. A
  server that dies during the push fails the next broadcast (its update request is refused at
  once, the group aborted: on gloo this releases the servers waiting in the collective); the
  fleet then drops the servers that no longer answer /server_info, rebuilds the group over the
  others and goes on from that bucket. A server that refuses while alive fails the sync, named.
  Not handled: on NCCL, rank 0's abort does not release the servers waiting in the collective
  (untested here), so the rebuilt group cannot form and the sync fails (within
  rollout.sync_timeout_s, named). With
  ``tensor`` or ``disk`` each member runs its own sync in its own thread, fed the same bucket
  objects through a bounded queue (buckets produced once, at most ``QUEUE_DEPTH`` held per
  member); a refusing or dead server fails its own sync within ``rollout.sync_timeout_s``, named,
  and the others are told to abort.
- **probe check**: :func:`megadiv.rollout.mismatch.check_mismatch` scores the probe batch on every
  member (``members``), so a server that missed an update is caught and named.

After a failed sync the servers may hold a mix of old and new tensors; the next successful sync
(and its probe check) restores a known state.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator, Sequence

import torch

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import (
    Bucket,
    Completion,
    RolloutError,
    SamplingParams,
    SyncReport,
    WeightSyncError,
    check_prompts,
    split_evenly,
)
from megadiv.rollout.fleet_stream import FleetStream
from megadiv.rollout.sglang_engine import SGLangEngine
from megadiv.rollout.sglang_server import TrainerMemory
from megadiv.rollout.weight_sync import alive, answers, exported_ahead

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2
"""Buckets queued per member during a sync (bounds the trainer memory a slow server can pin)."""

_END = object()


class FleetEngine:
    """The rollout protocol over one :class:`SGLangEngine` per server (see the module docstring)."""

    def __init__(self, hf_dir: str, cfg: RolloutConfig, trainer_memory: TrainerMemory | None = None):
        """``trainer_memory``: as for one SGLangEngine; launched server i gets its own GPUs
        (``--base-gpu-id``, sglang_server.place_server with index i)."""
        if cfg.server_urls:
            wait_for_attached(cfg.server_urls, cfg.startup_timeout_s, cfg.heartbeat_timeout_s)
            configs = [cfg.attached([url]) for url in cfg.server_urls]
        else:  # launch cfg.num_servers, concurrently (CPU start-up takes 20-80 s each)
            configs = [dataclasses.replace(cfg, num_servers=1) for _ in range(cfg.num_servers)]
        self.cfg, self.hf_dir = cfg, hf_dir
        self._sync: SGLangEngine | None = None  # the fleet-wide broadcast (_fleet_sync)
        self._pool = ThreadPoolExecutor(max_workers=2 * len(configs), thread_name_prefix="fleet")
        futures = [self._pool.submit(SGLangEngine, hf_dir, c, trainer_memory, i) for i, c in enumerate(configs)]
        wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = {c.server_urls[0] if c.server_urls else f"server {i}": f.exception()
                  for i, (c, f) in enumerate(zip(configs, futures)) if f.exception() is not None}
        # an attached server that does not answer (a dead node at a restart) is left out, in one line;
        # a server that fails to launch here is a broken setup, and fails the run
        if failed and (not cfg.server_urls or not started):
            for engine in started:
                engine.shutdown()
            self._pool.shutdown(wait=False)
            raise next(iter(failed.values()))
        self.members: dict[str, SGLangEngine] = {e.urls[0]: e for e in started}
        """The live member engines by server URL, in the order ties in load are broken."""
        self.dropped: dict[str, str] = {url: _short(e) for url, e in failed.items()}
        """Servers dropped from the fleet, and why."""
        for url, why in self.dropped.items():
            log.warning("rollout fleet: left out %s, which does not answer (%s); serving on %s", url, why,
                        list(self.members))
        self._paused = False
        log.info("rollout fleet of %d SGLang servers: %s", len(self.members), list(self.members))

    @property
    def urls(self) -> list[str]:
        return list(self.members)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """The ``params.n`` completions of each prompt, in prompt order, through one stream."""
        check_prompts(prompts)
        stream = self.open_stream(params)
        groups = {}
        try:
            for i, prompt in enumerate(prompts):
                stream.submit(i, prompt)
            while stream.pending:
                group = stream.next_done()
                groups[group.key] = group.completions
        finally:
            stream.close()
        return [groups[i] for i in range(len(prompts))]

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        check_prompts(prompts)
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self._spread(len(prompts), lambda m, s: m.score(prompts[s], responses[s]), "score")

    def _spread(self, n: int, call: Callable[[SGLangEngine, slice], list], what: str) -> list:
        """Run ``call(member, prompt_slice)`` on every member's contiguous share of ``n`` prompts,
        concurrently; concatenate in prompt order. The first failure is raised at once."""
        jobs = [(m, s) for m, s in zip(self.members.values(), split_evenly(n, len(self.members))) if s.stop > s.start]
        futures = [self._pool.submit(call, m, s) for m, s in jobs]
        done, _ = wait(futures, timeout=self.cfg.request_timeout_s + 60, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()
        if len(done) < len(futures):  # members time out their own requests; this is a backstop
            late = [m.urls[0] for (m, _), f in zip(jobs, futures) if f not in done]
            raise RolloutError(f"{what}: no answer from {late} within rollout.request_timeout_s")
        return [x for f in futures for x in f.result()]

    def open_stream(self, params: SamplingParams) -> FleetStream:
        """A stream of GRPO groups over the live servers (fleet_stream.py)."""
        if self._paused:
            raise RolloutError("the engine is paused: call resume() before generating")
        return FleetStream(self.urls, self.cfg, params, on_lost=self.drop)

    def adopt(self, urls: Sequence[str]) -> None:
        """Serve on exactly ``urls`` (the servers rank 0 has just pushed the current weights to):
        attach the ones missing here, drop the ones rank 0 no longer pushes to. What the driver's
        fleet does after each push, so a server that came back takes groups only once it serves
        the current weights."""
        for url in [u for u in self.members if u not in urls]:
            self.drop(url, "the trainer's fleet no longer pushes to it")
        for url in [u for u in urls if u not in self.members]:
            self.members[url] = self._attach(url)
            self.dropped.pop(url, None)
            log.info("rollout fleet: %s is back, serving on %s", url, list(self.members))

    def _rejoin(self) -> None:
        """Before a sync: an attached server dropped earlier that answers again (restarted) joins
        the fleet, so this sync gives it the current weights before it serves anything."""
        for url in [u for u in self.dropped if u in self.cfg.server_urls and answers(u)]:
            try:
                member = self._attach(url)
            except RolloutError as e:
                log.warning("rollout fleet: %s answers again but cannot rejoin: %s", url, _short(e))
                continue
            del self.dropped[url]
            self.members[url] = member
            log.warning("rollout fleet: %s answers again and rejoins; this sync gives it the current weights", url)

    def _attach(self, url: str) -> SGLangEngine:
        """A member engine for the running server at ``url``."""
        return SGLangEngine(self.hf_dir, self.cfg.attached([url]))

    def drop(self, url: str, why: str) -> None:
        """Take ``url`` out of the fleet (a launched server is stopped): it failed its heartbeat or
        its requests (FleetStream), or the driver process dropped it from its own fleet."""
        member = self.members.pop(url, None)
        if member is None:
            return
        self.dropped[url] = why
        log.warning("rollout fleet: dropped %s (%s); serving on %s", url, why, list(self.members))
        member.shutdown()

    # ------------------------------------------------------------------ weights

    def update_weights(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        """Every bucket to every member: one broadcast per bucket over one group spanning the fleet
        (``distributed``), else each member's own sync, concurrently (``tensor``, ``disk``). The
        next bucket is exported while this one is sent (weight_sync.exported_ahead)."""
        self._rejoin()
        buckets = exported_ahead(buckets)
        if all(m.sync_method == "distributed" for m in self.members.values()):
            return self._broadcast_to_all(buckets, version)
        return self._sync_each(buckets, version)

    def _broadcast_to_all(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        """One process group over every TP rank of every server, so each bucket leaves the trainer
        once whatever the fleet's size. A server found lost when the sync fails (it no longer answers
        /server_info: dead before the push, or its broadcast failed, which aborts the group) is
        dropped, the group is rebuilt over the others and the sync goes on from the bucket that
        failed. A server that refuses while alive fails the sync, named (a bad bucket would fail
        anywhere). On NCCL the survivors of a broadcast that lost a server stay blocked in it: the
        rebuilt group cannot form, and the sync fails within rollout.sync_timeout_s (see the module
        docstring). The report counts the model once (buckets taken from the export) and every
        byte broadcast (bytes_sent)."""
        t0 = time.perf_counter()
        drawn = [0, 0, 0]  # buckets, tensors, bytes taken from the export: the model, counted once
        last: list[Bucket] = []  # the bucket in flight, sent again after a rebuild
        sent_before = 0  # bytes broadcast by the attempts that failed

        def counted(items: Iterable[Bucket]) -> Iterator[Bucket]:
            for bucket in items:
                drawn[0], drawn[1] = drawn[0] + 1, drawn[1] + len(bucket)
                drawn[2] += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        def remembered(items: Iterable[Bucket]) -> Iterator[Bucket]:
            for bucket in items:
                last[:] = [bucket]
                yield bucket

        exported = counted(buckets)
        feed = remembered(exported)
        while True:
            sync = self._fleet_sync()
            try:
                report = sync.update_weights(feed, version)
                return dataclasses.replace(report, num_buckets=drawn[0], num_tensors=drawn[1], bytes=drawn[2],
                                           seconds=time.perf_counter() - t0,
                                           bytes_sent=sent_before + report.bytes_sent)
            except WeightSyncError as e:
                urls = list(self.members)
                lost = [url for url, ok in zip(urls, self._pool.map(alive, urls)) if not ok]
                if not lost or len(lost) == len(self.members):
                    raise
                sent_before += sync.bytes_sent
                for url in lost:
                    self.drop(url, f"lost during weight sync {version!r}: {_short(e)}")
                feed = remembered(itertools.chain(list(last), exported))

    def _fleet_sync(self) -> SGLangEngine:
        """An SGLangEngine attached to every live server, whose lazy broadcast group spans them
        all; rebuilt when the fleet changes."""
        urls = tuple(self.members)
        if self._sync is None or tuple(self._sync.urls) != urls:
            if self._sync is not None:
                self._sync.shutdown()  # leaves its group on the servers that still answer
            self._sync = SGLangEngine(self.hf_dir, self.cfg.attached(urls, sync_method="distributed"))
        return self._sync

    def _sync_each(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        """Every bucket to every member, concurrently: one sync (and session) per server."""
        t0 = time.perf_counter()
        feeds = {url: _Feed() for url in self.members}
        futures = {url: self._pool.submit(m.update_weights, feeds[url], version) for url, m in self.members.items()}
        try:
            for bucket in buckets:
                for url, feed in feeds.items():
                    feed.put(bucket, futures[url])
                _raise_first_failure(futures)
            for url, feed in feeds.items():
                feed.put(_END, futures[url])
            # what is left per member: its queued buckets, the session end and the version, each
            # bounded by the member's own sync_timeout_s
            wait(futures.values(), timeout=self.cfg.sync_timeout_s * (QUEUE_DEPTH + 3))
            _raise_first_failure(futures)
        except BaseException as e:
            for url, feed in feeds.items():
                feed.abort(f"weight sync {version!r} aborted on {url}: {_short(e)}")
            wait(futures.values(), timeout=self.cfg.sync_timeout_s + 60)
            raise
        if not all(f.done() for f in futures.values()):
            late = [u for u, f in futures.items() if not f.done()]
            raise WeightSyncError(f"weight sync {version!r}: {late} did not finish within rollout.sync_timeout_s")
        first = next(iter(futures.values())).result()
        return dataclasses.replace(first, seconds=time.perf_counter() - t0,
                                   bytes_sent=sum(f.result().bytes_sent for f in futures.values()))

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        for m in self.members.values():
            m.pause()
        self._paused = True

    def resume(self) -> None:
        for m in self.members.values():
            m.resume()
        self._paused = False

    @property
    def weight_version(self) -> str:
        versions = {url: m.weight_version for url, m in self.members.items()}
        if len(set(versions.values())) > 1:
            raise RolloutError(f"servers disagree on the weight version: {versions}")
        return next(iter(versions.values()))

    def shutdown(self) -> None:
        if self._sync is not None:
            self._sync.shutdown()
        for m in self.members.values():
            m.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_for_attached(urls: Sequence[str], timeout_s: float, grace_s: float) -> None:
    """Servers at rollout.server_urls may still be starting (docs/install.md starts one in the
    background and the trainer at once; a server loads its model before it answers): wait until
    each answers /health, with one line naming those it waits for, up to ``timeout_s``
    (rollout.startup_timeout_s) for the first, and ``grace_s`` (rollout.heartbeat_timeout_s) more
    for the rest once one answers: a server dead at a restart then delays it by the grace, not the
    start-up timeout. One that never answers is left out by the caller, as a dead one is, and
    rejoins before a later push when it answers (FleetEngine._rejoin)."""
    waiting = [u for u in urls if not answers(u)]
    if not waiting:
        return
    log.warning("waiting up to %.0f s (rollout.startup_timeout_s) for attached SGLang servers to answer: %s",
                timeout_s, waiting)
    deadline = time.monotonic() + (min(timeout_s, grace_s) if len(waiting) < len(urls) else timeout_s)
    while waiting and time.monotonic() < deadline:
        time.sleep(1.0)
        before = len(waiting)
        waiting = [u for u in waiting if not answers(u)]
        if len(waiting) < before:   # one more serves: the rest get the grace from now on
            deadline = min(deadline, time.monotonic() + grace_s)
    if waiting:
        log.warning("attached SGLang servers %s did not answer: serving without them for now", waiting)


class _Feed:
    """The bucket iterator one member's update_weights consumes, filled by the fleet's thread."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self._abort = threading.Event()
        self._why = ""

    def put(self, item, consumer: Future) -> None:
        """Queue ``item`` (a bucket, or _END) unless the consumer has stopped reading (it failed)."""
        while not consumer.done():
            try:
                return self._q.put(item, timeout=0.1)
            except queue.Full:
                continue

    def abort(self, why: str) -> None:
        self._why = why
        self._abort.set()

    def __iter__(self) -> Iterator[Bucket]:
        while True:
            if self._abort.is_set():
                # raised inside the member's update_weights, which closes its session and re-raises
                raise WeightSyncError(self._why)
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _END:
                return
            yield item


def _raise_first_failure(futures: dict) -> None:
    for f in futures.values():
        if f.done() and f.exception() is not None:
            raise f.exception()


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__
