"""BroadcastGroup's ordering, its lazy communicator and its abort, against a peer process that
joins the group as SGLang does (tests/weight_sync_peer.py), over gloo on CPU.

What is backend-independent and tested here: the servers are asked to join before this rank
joins; this rank's group is created without ``device_id`` (lazy NCCL initialisation, as on
SGLang's end); a broadcast runs alongside the servers' update requests; a refusal or a silent
server ends in WeightSyncError within the sync timeout, with the group aborted, not a hang; a
dead server fails the broadcast and the abort releases the others waiting in it.
"""
import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import requests
import torch

from megadiv.rollout.engine import WeightSyncError
from megadiv.rollout.sglang_server import free_port
from megadiv.rollout.weight_sync import BroadcastGroup, Peer, flatten_bucket, post

PEER = Path(__file__).resolve().parent / "weight_sync_peer.py"


@pytest.fixture(scope="module")
def peer():
    with _peers(1) as [(url, _)]:
        yield url


@contextlib.contextmanager
def _peers(n: int):
    """``n`` peer processes as (url, process), started concurrently; killed (process group) at the end."""
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, str(PEER), str(port)], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        deadline = time.monotonic() + 60
        for url, proc in zip(urls, procs):
            while True:
                try:
                    requests.post(url + "/destroy_weights_update_group", json={"group_name": "none"}, timeout=2)
                    break
                except requests.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("weight-sync peer did not start") from None
                    time.sleep(0.2)
        yield list(zip(urls, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _request(pool, url, bucket, group, mode):
    _, fields = flatten_bucket(bucket)
    return [(url, pool.submit(post, url, f"/update_weights_from_distributed?mode={mode}",
                              dict(fields, group_name=group.name), 60))]


@pytest.mark.timeout(180)
def test_a_dead_peer_fails_the_broadcast_and_releases_the_others():
    """Four peers (world 5); the first is killed between two broadcasts. Nothing probes it: its
    update request is refused (connection refused) or rank 0's send to it fails (connection
    closed), whichever comes first; rank 0 aborts the group, and the survivors,
    which gloo's tree has waiting for bytes relayed through the dead one or from rank 0, fail at
    once (rank 0's end is destroyed, its connections closed) and answer their requests, instead
    of staying blocked until their 60 s group timeout."""
    bucket = [("w", torch.ones(1 << 16))]
    flat, _ = flatten_bucket(bucket)
    with _peers(4) as peers, ThreadPoolExecutor(16) as pool:
        urls = [u for u, _ in peers]
        group = BroadcastGroup([Peer(u, 1) for u in urls], timeout_s=30, pool=pool)
        group.broadcast(flat, [r for u in urls for r in _request(pool, u, bucket, group, "ok")], "first")
        os.killpg(peers[0][1].pid, signal.SIGKILL)
        peers[0][1].wait(timeout=10)  # dead: the kernel has closed its connections
        survivors = [r for u in urls[1:] for r in _request(pool, u, bucket, group, "ok")]
        with pytest.raises(WeightSyncError, match="refused the bucket|broadcast failed: .*Connection closed"):
            group.broadcast(flat, _request(pool, urls[0], bucket, group, "ok") + survivors, "second")
        assert group.broken and group.pg is None
        _, pending = wait([f for _, f in survivors], timeout=30)  # the peers' group timeout is 60 s
        assert not pending, [u for u, f in survivors if f in pending]
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(120)
def test_group_joins_lazily_and_delivers_a_bucket(peer, monkeypatch):
    from torch.distributed import distributed_c10d

    calls = []
    real = distributed_c10d._new_process_group_helper
    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    bucket = [("w", torch.linspace(-1, 1, 7)), ("b", torch.arange(5, dtype=torch.int64))]
    flat, _ = flatten_bucket(bucket)
    with ThreadPoolExecutor(8) as pool:
        group = BroadcastGroup([Peer(peer, 1)], timeout_s=30, pool=pool)
        assert calls and all(k.get("device_id") is None for k in calls)  # no eager NCCL init
        requests_ = _request(pool, peer, bucket, group, "ok")
        group.broadcast(flat, requests_, "test")
        assert requests_[0][1].result()["checksum"] == int(flat.long().sum())
        group.destroy(pool)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, message", [("refuse", "refused the bucket.*no weight-update session"),
                                           ("silent", "not received within 3 s")])
def test_refusal_or_silence_aborts_the_group_and_raises(peer, mode, message):
    bucket = [("w", torch.ones(16))]
    flat, _ = flatten_bucket(bucket)
    with ThreadPoolExecutor(8) as pool:
        group = BroadcastGroup([Peer(peer, 1)], timeout_s=3, pool=pool)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=message):
            group.broadcast(flat, _request(pool, peer, bucket, group, mode), "test")
        assert time.monotonic() - t0 < 10
        assert group.broken and group.pg is None  # aborted: nothing left for a watchdog
        group.destroy(pool)  # the server's end goes too; no hang on the aborted group
        pool.shutdown(wait=False, cancel_futures=True)
