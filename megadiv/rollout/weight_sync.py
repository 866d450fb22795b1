"""Moving HF-named weight buckets from the trainer into SGLang servers: the pieces under
SGLangEngine.update_weights.

- :func:`read_manifest` / :func:`check_bucket`: names, shapes and dtypes of the served checkpoint,
  checked before anything is sent (SGLang's loaders skip unknown names silently).
- :func:`exported_ahead`: the next bucket exported (TP gather, PP broadcast) while this one is sent.
- :func:`flatten_bucket`: one contiguous byte tensor per bucket (SGLang's ``flattened_bucket``
  format): one broadcast per bucket instead of one per tensor.
- :class:`BroadcastGroup`: the trainer's end of SGLang's weight-update process group (gloo on CPU,
  NCCL on GPU), whose broadcasts never hang: each one runs alongside the servers' HTTP requests and
  fails as soon as a server refuses, or after the timeout, by aborting the communicator and raising
  WeightSyncError (never left to the NCCL watchdog, which would kill the trainer).
- :func:`serialize_bucket` (CUDA-IPC handles, pickled without sglang) and :func:`write_bucket` (safetensors).
"""
from __future__ import annotations

import base64
import datetime
import io
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import urlparse

import requests
import torch
import torch.distributed as dist

from megadiv.rollout.engine import Bucket, RolloutError, WeightSyncError
from megadiv.rollout.sglang_server import free_port

log = logging.getLogger(__name__)

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]


# --------------------------------------------------------------------------- HTTP


def post(url: str, path: str, payload: dict, timeout_s: float) -> dict:
    """POST JSON to a server; RolloutError naming the server on refusal, death or timeout."""
    try:
        r = requests.post(url + path, json=payload, timeout=timeout_s)
    except requests.Timeout:
        raise RolloutError(f"{url}{path}: no answer within {timeout_s:.0f} s") from None
    except requests.ConnectionError as e:
        raise RolloutError(f"{url}{path}: server unreachable (dead?): {e}") from None
    try:
        body = r.json()
    except ValueError:
        body = {"message": r.text[:2000]}
    if r.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
        message = body.get("message", body) if isinstance(body, dict) else body
        raise RolloutError(f"{url}{path} refused (HTTP {r.status_code}): {message}")
    return body


# --------------------------------------------------------------------------- validation


def answers(url: str) -> bool:
    """Whether the server is ready to serve: it answers /health (a dead, stopped or still loading
    one does not, within 10 s). In SGLang 0.5.23 /health is /health_generate, a one-token
    generation that takes at least 1 s: a readiness check for start-up and rejoining, never used
    by a push (:func:`alive`)."""
    try:
        return requests.get(url + "/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def alive(url: str) -> bool:
    """Whether the server's scheduler answers /server_info within ``LIVENESS_TIMEOUT_S`` (a dead
    or stopped one does not). Generates nothing: the scheduler reports its state between batches,
    the round trip the weight-update requests need too. A push checks it once per server."""
    try:
        return requests.get(url + "/server_info", timeout=LIVENESS_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False


LIVENESS_TIMEOUT_S = 10.0


def read_manifest(hf_dir: str | Path) -> Manifest | None:
    """{hf_name: (shape, dtype)} of the safetensors checkpoint in ``hf_dir`` (headers only);
    None when the directory is not readable here (a server on another node)."""
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors")) if Path(hf_dir).is_dir() else []
    if not files:
        return None
    manifest: Manifest = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                manifest[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
    return manifest


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def check_bucket(bucket: Bucket, manifest: Manifest, where: str) -> None:
    """Raise WeightSyncError if a tensor's name or shape is not the served checkpoint's.
    Dtypes may differ (a bf16 trainer may feed an fp32 server: the loader casts)."""
    for name, t in bucket:
        if name not in manifest:
            close = [n for n in manifest if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
            raise WeightSyncError(f"{where}: tensor {name!r} is not a weight of the served model"
                                  + (f" (similar: {close})" if close else ""))
        shape = manifest[name][0]
        if tuple(t.shape) != shape:
            raise WeightSyncError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the served model's "
                                  f"is {shape}")


# --------------------------------------------------------------------------- payloads


def exported_ahead(buckets: Iterable[Bucket]) -> Iterator[Bucket]:
    """``buckets``, each produced in a thread while the caller sends the one before: double
    buffering, so the trainer's export of bucket k+1 (a TP all-gather and a PP broadcast, on the
    training groups) overlaps the transfer of bucket k (on the weight-update group), for one more
    bucket held. The producer waits for the caller to take a bucket before making the next, so
    never more than one is ahead; its exception is raised here, in order. The thread runs under
    no_grad and on the caller's CUDA device (both are per thread in torch)."""
    slot, ready = threading.Semaphore(1), threading.Semaphore(0)
    box: list = []  # the one bucket ahead, or the producer's exception, or _EXPORTED when done
    stop = threading.Event()
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def on_device() -> Iterator[Bucket]:
        if device is not None:
            torch.cuda.set_device(device)
        yield from buckets

    def produce() -> None:
        source = on_device()
        with torch.no_grad():
            while True:
                slot.acquire()  # the box is empty: the caller has taken the last bucket
                if stop.is_set():
                    return
                try:
                    item = next(source)
                except StopIteration:
                    item = _EXPORTED
                except BaseException as e:  # raised in the caller's thread, which owns the error
                    item = e
                box.append(item)
                ready.release()
                if item is _EXPORTED or isinstance(item, BaseException):
                    return

    threading.Thread(target=produce, daemon=True, name="megadiv-export").start()
    try:
        while True:
            ready.acquire()
            item = box.pop()
            slot.release()  # the producer makes the next one while the caller sends this one
            if item is _EXPORTED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # a caller that stops early (a failed sync) ends the producer at its next bucket
        slot.release()


_EXPORTED = object()


def flatten_bucket(bucket: Bucket) -> tuple[torch.Tensor, dict]:
    """(bytes [total] uint8, request fields) for SGLang's ``flattened_bucket`` load format.

    SGLang rebuilds tensor i from bytes [offset_i, offset_i + nbytes_i) and requires offset_i to be
    a multiple of its element size: ordering by element size, largest first, guarantees it (every
    size is a power of two, so each offset is a multiple of every later element size)."""
    ordered = sorted(bucket, key=lambda nt: -nt[1].element_size())
    flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in ordered])
    fields = {"names": [n for n, _ in ordered], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
              "shapes": [list(t.shape) for _, t in ordered], "load_format": "flattened_bucket"}
    return flat, fields


def serialize_bucket(bucket: Bucket) -> str:
    """base64 of the bucket pickled as SGLang's ``update_weights_from_tensor`` unpickles it: each CUDA
    tensor travels as an IPC handle (no copy) that only a process on the same machine can open.

    Needs no sglang here. torch's own reduction (``reduce_tensor``) names the GPU by its index,
    which means another GPU in a server with other CUDA_VISIBLE_DEVICES; the device argument is
    replaced by the GPU's UUID, which the server's rebuild accepts: SGLang patches
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (the global this pickle names, one
    its safe unpickler allows) before unpickling, and the patched rebuild maps a UUID string back
    to its own device index (sglang/srt/utils/patch_torch.py, 0.5.23).

    CUDA only: CPU tensors would travel as file descriptors fetched over an authenticated
    multiprocessing connection that an unrelated server process cannot open."""
    if not all(t.is_cuda for _, t in bucket):
        raise WeightSyncError("sync_method 'tensor' needs CUDA tensors; use 'distributed' or 'disk' on CPU")
    buf = io.BytesIO()
    _HandlePickler(buf).dump([(n, t.detach().contiguous()) for n, t in bucket])
    return base64.b64encode(buf.getvalue()).decode()


# The position of the device in torch.multiprocessing.reductions.reduce_tensor's arguments for a
# CUDA tensor (tensor class, size, stride, offset, storage class, dtype, device, handle, ...):
# unchanged since torch 1.x, and the index SGLang's patch rewrites too.
_DEVICE_ARG = 6


class _HandlePickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors name their GPU by UUID (see :func:`serialize_bucket`)."""

    def reducer_override(self, obj):
        if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
            return NotImplemented
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(obj)
        return rebuild, (*args[:_DEVICE_ARG], device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as SGLang compares it (``str(properties.uuid)``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def write_bucket(bucket: Bucket, directory: Path, index: int) -> None:
    """One safetensors shard per bucket; SGLang's disk loader reads every *.safetensors there."""
    from safetensors.torch import save_file
    save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, str(directory / f"bucket-{index:05d}.safetensors"))


# --------------------------------------------------------------------------- process group


@dataclass(frozen=True)
class Peer:
    url: str
    tp_size: int
    """Ranks the server contributes to the weight-update group (one per TP rank)."""


class BroadcastGroup:
    """Rank 0 (the trainer's exporting rank) of a process group joined by every TP rank of every
    server; one broadcast delivers a bucket to all of them.

    torch has no public API for a second, independent world next to torchrun's default group,
    so this follows SGLang's own ``init_custom_process_group`` (a TCP store, a prefix store named
    after the group, torch's private ``_new_process_group_helper``): the same construction on both
    ends makes the store keys agree.

    Ordering (the same for gloo and NCCL): the servers are asked to join first (their HTTP calls
    block until every rank joined), then this rank joins. Neither end passes ``device_id``, so an
    NCCL communicator is created lazily, at the first broadcast, on both ends at once: with
    ``device_id`` this rank's join would initialise it eagerly and block (torch >= 2.7.1) for
    servers that only create theirs at the first broadcast, which is sent after the join returns.
    """

    def __init__(self, peers: list[Peer], timeout_s: float, pool: ThreadPoolExecutor):
        self.peers, self.timeout_s, self.pool = peers, timeout_s, pool
        self.name = f"megadiv-{uuid.uuid4().hex[:12]}"
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.world_size = 1 + sum(p.tp_size for p in peers)
        self.pg = None
        self.broken = False  # a broadcast failed: the communicator was aborted, the group is gone
        host = _address_seen_by(peers[0].url)
        port = free_port(host)
        offsets = [1 + sum(p.tp_size for p in peers[:i]) for i in range(len(peers))]
        # every server blocks in its /init_weights_update_group until all ranks joined: ask all
        # of them first (threads), then join as rank 0 (hosting the TCP store)
        futures = [pool.submit(post, p.url, "/init_weights_update_group",
                               {"master_address": host, "master_port": port, "rank_offset": off,
                                "world_size": self.world_size, "group_name": self.name, "backend": self.backend},
                               timeout_s) for p, off in zip(peers, offsets)]
        try:
            self.pg = _custom_group(self.backend, host, port, self.world_size, self.name,
                                    timeout_s + COLLECTIVE_GRACE_S)
        except Exception as e:
            errors = [str(f.exception(timeout=1)) for f in futures if f.done() and f.exception(timeout=0)]
            raise WeightSyncError(f"weight-update group {self.name} ({self.backend}, {host}:{port}) with "
                                  f"{[p.url for p in peers]} failed: {e}; servers: {errors}") from None
        for f in futures:
            f.result(timeout=timeout_s)
        log.info("weight-update group %s: %s, world %d, store %s:%d", self.name, self.backend, self.world_size,
                 host, port)

    def broadcast(self, flat: torch.Tensor, requests_: list[tuple[str, Future]], where: str) -> None:
        """Broadcast ``flat`` to the servers while their HTTP requests run; fail fast if one refuses.

        A server that refuses an update before receiving (wrong group, no open session, bad
        metadata) never joins the broadcast, which would otherwise block this rank forever. The
        collective's own timeout is ``COLLECTIVE_GRACE_S`` longer than ours, so that this rank, not
        the NCCL watchdog, decides: it aborts the communicator and raises."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s + COLLECTIVE_GRACE_S)
        # issued from a worker thread: with lazy initialisation the first NCCL collective creates the
        # communicator and blocks until every server joined, which a refusing server never does
        issued = self.pool.submit(self.pg.broadcast, [flat], opts)
        deadline = time.monotonic() + self.timeout_s
        while not _finished(issued):
            for url, fut in requests_:
                if fut.done() and fut.exception() is not None:
                    self.abort(issued)
                    raise WeightSyncError(f"{where}: server {url} refused the bucket: {fut.exception()}")
            if time.monotonic() > deadline:
                self.abort(issued)
                raise WeightSyncError(f"{where}: broadcast not received within {self.timeout_s:.0f} s "
                                      f"(rollout.sync_timeout_s) by {[u for u, _ in requests_]}")
            time.sleep(0.002)
        try:
            issued.result().wait()  # re-raises a gloo/NCCL error (e.g. a server died mid-transfer)
        except Exception as e:
            self.abort(issued)
            raise WeightSyncError(f"{where}: broadcast failed: {e}") from None

    def abort(self, issued: Future | None = None) -> None:
        """Drop the group after a failed broadcast (``issued``: this rank's part of it): the
        pending work would otherwise stay queued on the communicator (NCCL: until the watchdog's
        timeout kills the process). NCCL's abort cancels it at once (ncclCommAbort); a worker
        thread still waiting for a lazy NCCL initialisation that no server joins is left behind,
        harmlessly. A gloo group is destroyed once this rank's part is over, which closes its
        connections: the servers still waiting in the collective for bytes relayed from here then
        fail at once ("connection closed") instead of blocking until SGLang's 30-minute group
        timeout, and answer their update request. A dead server ends that part at once (its
        connection is closed); a live one that never joined keeps it pending, and destroying
        would wait for it: that group is only dropped, and its own timeout ends the work in a
        background thread. The servers' ends go with /destroy_weights_update_group."""
        self.broken = True
        if self.pg is None:
            return
        if self.backend == "nccl":
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group(self.pg)
            except Exception as e:  # aborting is best effort: the group is unusable either way
                log.warning("aborting weight-update group %s: %s", self.name, e)
        elif issued is None or _finished(issued, within_s=ABORT_GRACE_S):
            dist.destroy_process_group(self.pg)
        self.pg = None

    def destroy(self, pool: ThreadPoolExecutor) -> None:
        """Leave the group on both sides (best effort: a dead server cannot answer)."""
        futures = [pool.submit(post, p.url, "/destroy_weights_update_group", {"group_name": self.name}, 30.0)
                   for p in self.peers]
        for f in futures:
            if f.exception() is not None:
                log.warning("destroying weight-update group %s: %s", self.name, f.exception())
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
        self.pg = None


# Extra time the collectives get beyond rollout.sync_timeout_s: our deadline fires first.
COLLECTIVE_GRACE_S = 60.0

# How long an abort waits for this rank's part of a failed gloo broadcast to end: a server that
# died ends it within milliseconds (its connection is closed).
ABORT_GRACE_S = 2.0


def _finished(issued: Future, within_s: float = 0.0) -> bool:
    """Whether this rank's part of a broadcast (the Work returned by the call in ``issued``) is
    over, successfully or not, polling up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        if issued.done() and (issued.exception() is not None or issued.result().is_completed()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _custom_group(backend: str, host: str, port: int, world_size: int, name: str, timeout_s: float):
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # host the store ourselves: torch's tcp:// rendezvous would only connect as a client under
    # torchrun (TORCHELASTIC_USE_AGENT_STORE), and the servers connect as clients too
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                          multi_tenant=True)
    # no device_id: lazy NCCL initialisation, as on the servers' end (see BroadcastGroup)
    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _address_seen_by(url: str) -> str:
    """This machine's address as the server at ``url`` reaches it (loopback for local servers)."""
    return address_seen_by(urlparse(url).hostname or "127.0.0.1")


def address_seen_by(host: str) -> str:
    """This machine's address as ``host`` reaches it: the interface that routes there."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((host, 80))
        return s.getsockname()[0]
