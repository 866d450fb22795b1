"""FleetStream: GRPO groups over a fleet of SGLang servers, one request per group, each sent to the
least-loaded healthy server (the GroupStream protocol of rollout/stream.py).

    stream = fleet.open_stream(params)
    stream.submit(key, prompt)      # queued here; sent when a server has a free slot
    group = stream.next_done()      # the next group back, from whichever server
    stream.abort_pending()          # the step is full: /abort_request on every busy server

- **One request per group**: the ``n`` samples of a prompt go to one server as one batch of n
  copies, so its radix cache computes the prompt once.
- **Least loaded, with a cap from the server's KV cache**: a group goes to the live server whose
  in-flight groups fill the smallest share of its cap, and a server holds at most its cap; the
  rest wait here, not in one server's queue, so the server that finishes first takes the next
  group and a slow server ends up with fewer. The cap is what the server's KV cache holds,

      cap = max(1, min(max_total_num_tokens // (n x tokens per sample), max_running_requests // n))

  (both summed over its DP ranks, from ``/v1/loads``), tokens per sample being the mean prompt
  length plus the mean completion length of the groups this stream (a batch) has had back
  (``max_new_tokens / 2`` before any, weighted as one group). A server with half the KV takes half the groups, and a wave larger
  than the fleet's KV waits here. ``rollout.max_inflight_groups`` sets every server's cap instead.
- **Heartbeat**: while the stream is open every live server answers ``/health_generate`` (a
  one-token generation when idle) every ``rollout.heartbeat_s`` within
  ``rollout.heartbeat_timeout_s``. A server that misses it, refuses a connection or lets a request
  time out is *lost*: dropped from the fleet (FleetEngine.drop) and its groups in flight are sent
  again to the others first (``stats.resent_groups``). The stream fails, in one line naming every
  lost server, only when none is left. A server that answers a request with an error is not lost:
  that error fails the stream (a bad request would fail everywhere).
- **Abort**: ``abort_pending`` posts ``/abort_request {"abort_all": true}`` to every server with
  groups in flight (the stream is its servers' only client while it is open), forgets the queue,
  and waits until every request in flight has answered, aborting again the servers of those
  still unanswered after ``ABORT_RETRY_S``: an abort reaches only the requests its server's
  scheduler holds, so a request sent just before it (the top-up of the last ``next_done``, still
  in transit or being tokenized) would otherwise run to its end. Aborted completions never come
  back as a group.

Threads: one daemon thread per request in flight and one heartbeat thread per server; they only
put events on a queue. All state changes in the caller's thread (submit / next_done / abort), so
nothing is locked. Daemon threads, because a request to a hung server is abandoned, not joined (it
ends by itself at ``rollout.request_timeout_s``).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import requests

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import RolloutError, SamplingParams
from megadiv.rollout.sglang_engine import parse_completion, sampling_payload
from megadiv.rollout.stream import GroupResult, StreamStats
from megadiv.rollout.weight_sync import post

log = logging.getLogger(__name__)

ABORT_RETRY_S = 1.0
"""How long abort_pending waits for the aborted requests' answers before aborting their servers
again. A request the scheduler held answers at its next iteration (a forward pass: well under a
second on a GPU); one still running after this reached the server after the abort."""


@dataclass
class _Group:
    key: Hashable
    prompt: list[int]
    server: str = ""
    """The server its current request went to ("" while it waits here)."""


class FleetStream:
    """The GroupStream over a fleet's servers (see the module docstring). ``on_lost(url, why)`` is
    told of each server the stream drops (FleetEngine.drop), so the fleet stops using it too."""

    def __init__(self, urls: Sequence[str], cfg: RolloutConfig, params: SamplingParams,
                 on_lost: Callable[[str, str], None]):
        self.params, self.cfg, self._on_lost = params, cfg, on_lost
        self.stats = StreamStats()
        self._payload = {"sampling_params": sampling_payload(params), "return_logprob": True}
        self._waiting: deque[_Group] = deque()
        self._sent: dict[int, _Group] = {}  # ticket -> group; a ticket's answer is ignored once it is gone
        self._tickets = itertools.count()
        self._events: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._load: dict[str, int] = {}      # groups in flight per live server
        self._kv: dict[str, tuple[int, int]] = {}  # (KV tokens, batch slots) per server, /v1/loads
        self._prompt_tokens = self._prompts = 0          # over the groups submitted
        self._completion_tokens = self._completions = 0  # over the completions back (unaborted)
        self._lost: dict[str, str] = {}      # server -> why it was dropped
        unreachable = {}
        for url in urls:
            try:
                self._kv[url] = _kv_capacity(url)
            except requests.RequestException as e:
                unreachable[url] = f"unreachable (dead?): /v1/loads: {e}"
                continue
            self._load[url] = 0
            threading.Thread(target=self._heartbeat, args=(url,), daemon=True, name="megadiv-heartbeat").start()
        for url, why in unreachable.items():
            self._lose(url, why)
        self._check_servers_left()

    # ------------------------------------------------------------------ GroupStream

    def submit(self, key: Hashable, prompt: Sequence[int]) -> None:
        self._waiting.append(_Group(key, list(prompt)))
        self._prompt_tokens += len(prompt)
        self._prompts += 1
        self._dispatch()

    def next_done(self) -> GroupResult:
        while True:
            if not self.pending:
                raise RuntimeError("next_done() with no group pending")
            kind, ticket, url, value = self._events.get()  # every thread ends in an event (request timeouts)
            if kind == "lost":
                self._lose(url, value)
                continue
            group = self._sent.pop(ticket, None)
            if group is None:  # aborted, or re-sent after its server was lost
                continue
            self._load[url] -= 1
            if kind == "refused":
                raise RolloutError(f"generation refused by {url}: {value}")
            self.stats.groups_by_server[url] = self.stats.groups_by_server.get(url, 0) + 1
            done = [c for c in value if c.finish_reason != "abort"]  # an aborted one says nothing of lengths
            self._completion_tokens += sum(len(c.token_ids) for c in done)
            self._completions += len(done)
            self._dispatch()
            return GroupResult(group.key, group.prompt, value, url)

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._sent)

    def abort_pending(self) -> int:
        given_up = self.pending
        unanswered = {ticket: g.server for ticket, g in self._sent.items()}
        for url in set(unanswered.values()):
            self._load[url] = 0
        self._sent.clear()
        self._waiting.clear()
        self._abort(unanswered)
        self.stats.aborted_groups += given_up
        return given_up

    def close(self) -> None:
        self.abort_pending()
        self._closed.set()

    def _abort(self, unanswered: dict[int, str]) -> None:
        """Abort the requests ``unanswered`` (ticket -> server) and wait until each has answered
        (its answer is dropped), aborting their servers again every ABORT_RETRY_S: the request of
        a group dispatched just before the abort may reach its server's scheduler after it. Within
        rollout.heartbeat_timeout_s (what a live server takes at most to answer); past it, or where
        the abort itself fails, the requests end by themselves at rollout.request_timeout_s."""
        deadline, others = time.monotonic() + self.cfg.heartbeat_timeout_s, []
        while unanswered and time.monotonic() < deadline:
            for url in set(unanswered.values()):
                try:
                    post(url, "/abort_request", {"abort_all": True}, self.cfg.heartbeat_timeout_s)
                except RolloutError as e:
                    log.warning("could not abort the requests running on %s: %s", url, e)
                    unanswered = {t: u for t, u in unanswered.items() if u != url}
            retry = min(deadline, time.monotonic() + ABORT_RETRY_S)
            while unanswered and (left := retry - time.monotonic()) > 0:
                try:
                    event = self._events.get(timeout=left)
                except queue.Empty:
                    break
                if unanswered.pop(event[1], None) is None:  # a heartbeat's, or an answer ignored already
                    others.append(event)
        if unanswered:
            log.warning("%d aborted requests on %s did not answer within rollout.heartbeat_timeout_s=%g s",
                        len(unanswered), sorted(set(unanswered.values())), self.cfg.heartbeat_timeout_s)
        for event in others:  # a lost server stays news for next_done
            self._events.put(event)

    # ------------------------------------------------------------------ routing

    def _caps(self) -> dict[str, int]:
        """Groups each live server may hold in flight (see the module docstring)."""
        if self.cfg.max_inflight_groups:
            return dict.fromkeys(self._load, self.cfg.max_inflight_groups)
        n = self.params.n
        # one sample holds its prompt and its completion in the KV cache at its end; the prompt is
        # counted for each of the n copies, as SGLang reserves it per request until its radix cache
        # holds it. Completion: a running mean seeded with max_new_tokens / 2 (a length anywhere in
        # [0, max_new_tokens]) weighted as one group of n, so the first group back moves it halfway
        prompt = self._prompt_tokens / max(1, self._prompts)
        completion = (n * self.params.max_new_tokens / 2 + self._completion_tokens) / (n + self._completions)
        group_tokens = n * (prompt + completion)
        return {url: max(1, min(int(self._kv[url][0] // group_tokens), self._kv[url][1] // n)) for url in self._load}

    def _dispatch(self) -> None:
        """Send waiting groups to the least-loaded servers with a free slot."""
        caps = self._caps() if self._waiting else {}
        while self._waiting:
            free = [u for u, n in self._load.items() if n < caps[u]]
            if not free:
                return
            # the smallest share of its cap, not the fewest groups: a server with twice the KV takes
            # twice the groups before both are equally full (ties: fleet order)
            url = min(free, key=lambda u: self._load[u] / caps[u])
            group = self._waiting.popleft()
            group.server, ticket = url, next(self._tickets)
            self._sent[ticket] = group
            self._load[url] += 1
            payload = dict(self._payload, input_ids=[group.prompt] * self.params.n)
            threading.Thread(target=self._request, args=(ticket, url, payload), daemon=True,
                             name="megadiv-group").start()

    def _lose(self, url: str, why: str) -> None:
        """Drop ``url`` from the stream and the fleet; its groups in flight go first in line."""
        if url in self._lost:
            return
        self._lost[url] = why
        self._load.pop(url, None)
        self.stats.dropped_servers.append(url)
        resent = [t for t, g in self._sent.items() if g.server == url]
        for ticket in reversed(resent):
            self._waiting.appendleft(self._sent.pop(ticket))
        self.stats.resent_groups += len(resent)
        log.warning("rollout: dropped SGLang server %s (%s); %d groups re-sent, %d servers left", url, why,
                    len(resent), len(self._load))
        self._on_lost(url, why)
        self._check_servers_left()
        self._dispatch()

    def _check_servers_left(self) -> None:
        if not self._load:
            self._closed.set()
            lost = "; ".join(f"{u}: {why}" for u, why in self._lost.items())
            raise RolloutError(f"no SGLang server left to generate on (lost {lost})")

    # ------------------------------------------------------------------ threads (events only)

    def _request(self, ticket: int, url: str, payload: dict) -> None:
        try:
            r = requests.post(url + "/generate", json=payload, timeout=self.cfg.request_timeout_s)
        except requests.Timeout:
            return self._events.put(("lost", ticket, url, f"no answer within rollout.request_timeout_s="
                                                          f"{self.cfg.request_timeout_s:g} s"))
        except requests.RequestException as e:
            return self._events.put(("lost", ticket, url, f"unreachable (dead?): {e}"))
        try:
            if r.status_code != 200:
                raise RolloutError(f"HTTP {r.status_code}: {r.text[:2000]}")
            out = r.json()
            self._events.put(("done", ticket, url, [parse_completion(o) for o in (out if isinstance(out, list)
                                                                                  else [out])]))
        except Exception as e:  # any bad answer fails the stream (named), not this thread
            self._events.put(("refused", ticket, url, f"{type(e).__name__}: {e}"))

    def _heartbeat(self, url: str) -> None:
        while not self._closed.wait(self.cfg.heartbeat_s) and url not in self._lost:
            try:
                r = requests.get(url + "/health_generate", timeout=self.cfg.heartbeat_timeout_s)
                if r.status_code == 200:
                    continue
                why = f"heartbeat /health_generate answered HTTP {r.status_code}"
            except requests.RequestException as e:
                why = (f"no heartbeat within rollout.heartbeat_timeout_s={self.cfg.heartbeat_timeout_s:g} s"
                       if isinstance(e, requests.Timeout) else f"heartbeat failed: {e}")
            return self._events.put(("lost", None, url, why))


def _kv_capacity(url: str) -> tuple[int, int]:
    """The tokens a server's KV cache holds and the sequences its batch runs at once
    (max_total_num_tokens, max_running_requests), each summed over its DP ranks."""
    r = requests.get(url + "/v1/loads", timeout=60)
    r.raise_for_status()
    loads = r.json()["loads"]
    return (sum(int(load["max_total_num_tokens"]) for load in loads),
            sum(int(load["max_running_requests"]) for load in loads))
