"""A rollout fleet of two real SGLang CPU servers (megadiv.rollout.fleet): prompt groups spread
over the servers, every weight update reaching both over one broadcast group (probe check on
each) with one liveness call per server per push and no generating health check, a refusing
server named in the error within the configured timeout, a killed one dropped during a push
while the fleet goes on.

The module launches its two servers once (``rollout.num_servers: 2``, concurrently; 30-90 s on
2 cores) and stops both process groups at the end; the last test kills one of them.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megadiv.rollout import (
    RolloutConfig,
    RolloutError,
    SamplingParams,
    WeightSyncError,
    check_mismatch,
    make_engine,
)
from megadiv.rollout.fleet import FleetEngine
from megadiv.rollout.sglang_server import SGLangServer, child_env, free_port, launch_command, live_group_members
from megadiv.rollout.weight_sync import post
from tests.test_rollout import TOL, base, buckets_of, hf_dir, perturbed, random_probe, reference  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(600)]

SYNC_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fleet(hf_dir, tmp_path_factory):
    cfg = RolloutConfig(engine="sglang", num_servers=2, bucket_bytes=64 << 10, startup_timeout_s=400,
                        request_timeout_s=120, sync_timeout_s=SYNC_TIMEOUT_S,
                        log_dir=str(tmp_path_factory.mktemp("fleet-log")))
    engine = make_engine(cfg, hf_dir)
    assert isinstance(engine, FleetEngine) and len(engine.members) == 2
    members = list(engine.members.values())  # the fleet forgets the ones it drops
    yield engine
    engine.shutdown()
    for member in members:
        assert not live_group_members(member.server.proc.pid)  # nothing of either server is left


def test_prompt_groups_are_spread_over_the_servers(fleet, hf_dir, base, reference):
    """Each server serves the same weights under its own version name: every completion of a
    prompt carries one server's version, and with all groups sent at once (the servers' batches
    hold them all) the least-loaded routing alternates: a, b, a, b."""
    (url_a, a), (url_b, b) = fleet.members.items()
    a.update_weights(iter(buckets_of(base)), "on-a")
    b.update_weights(iter(buckets_of(base)), "on-b")
    with pytest.raises(RolloutError, match="disagree on the weight version"):
        _ = fleet.weight_version
    prompts = [[5, 17, 33, 8], [40, 41], [9, 60, 61], [70, 71, 72, 73, 74]]
    groups = fleet.generate(prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=6))
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert [{c.weight_version for c in g} for g in groups] == [{"on-a"}, {"on-b"}, {"on-a"}, {"on-b"}]
    reference.load(base)  # and the completions are the model's, whichever server sampled them
    rows = [(p, c) for p, g in zip(prompts, groups) for c in g]
    expected = reference.logprobs([p for p, _ in rows], [c.token_ids for _, c in rows], temperature=0.8)
    assert max(float((e - torch.tensor(c.logprobs)).abs().max()) for e, (_, c) in zip(expected, rows)) < TOL
    # an attached fleet over the same servers sees what they serve (and stops neither)
    attached = make_engine(RolloutConfig(engine="sglang", server_urls=(url_a, url_b), sync_timeout_s=SYNC_TIMEOUT_S),
                           hf_dir)
    try:
        assert isinstance(attached, FleetEngine) and attached.urls == [url_a, url_b]
        assert [m.weight_version for m in attached.members.values()] == ["on-a", "on-b"]
    finally:
        attached.shutdown()
    assert all(m.server.alive() for m in fleet.members.values())


def test_every_update_reaches_every_server(fleet, base, reference):
    """A fleet sync lands on both servers (the probe check scores on each); a server that missed
    an update is caught by the check and named, the up-to-date one is not."""
    (url_a, _), (url_b, b) = fleet.members.items()
    probe = random_probe(seed=0)
    for step, seed in enumerate((1, 2), start=1):
        new = perturbed(base, seed=seed)
        report = fleet.update_weights(iter(buckets_of(new, per=3)), f"step-{step}")
        assert report.num_tensors == len(new) and report.num_buckets == -(-len(new) // 3)
        assert fleet.weight_version == f"step-{step}"
        trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
        assert check_mismatch(fleet, probe, trainer, 0.05, f"step-{step}").max_abs < TOL  # worst server
        for member in fleet.members.values():  # and each on its own, against the independent reference
            got = member.score(probe.prompts, probe.responses)
            assert max(float((g - e).abs().max()) for g, e in zip(got, trainer)) < TOL
    newer = perturbed(base, seed=3)
    b.update_weights(iter(buckets_of(newer)), "step-3")  # only the second server gets step 3
    trainer = reference.load(newer).logprobs(probe.prompts, probe.responses)
    with pytest.raises(WeightSyncError, match="not serving the trainer's weights") as caught:
        check_mismatch(fleet, probe, trainer, 0.05, "step-3")
    assert url_a in str(caught.value) and url_b not in str(caught.value)


def test_a_refusing_server_is_named_and_the_fleet_recovers(fleet, base, reference):
    """A weight-update session left open on the first server (a crashed trainer's) makes it refuse
    the next sync: the error names it, the other server's sync is aborted, and the next sync
    after the session is closed reaches both."""
    (url_a, _), (url_b, _) = fleet.members.items()
    post(url_a, "/begin_weight_update", {}, 30)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as caught:
        fleet.update_weights(iter(buckets_of(perturbed(base, seed=4))), "refused")
    assert time.monotonic() - t0 < SYNC_TIMEOUT_S
    assert f"{url_a}/begin_weight_update refused" in str(caught.value)
    post(url_a, "/end_weight_update", {}, 30)
    new = perturbed(base, seed=5)
    fleet.update_weights(iter(buckets_of(new)), "step-5")
    probe = random_probe(seed=0)
    trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
    assert check_mismatch(fleet, probe, trainer, 0.05, "step-5").max_abs < TOL
    assert fleet.weight_version == "step-5"


def test_a_push_checks_each_server_once_and_never_generates(fleet, base, reference):
    """A push of one tensor per bucket (many buckets) as the servers saw it, read from their
    access logs: each server's liveness endpoint (/server_info) answered once for the whole push,
    every bucket arrived, and nothing reached /health or /health_generate (a one-token
    generation of at least 1 s each in SGLang 0.5.23). The push still lands (probe check)."""
    fleet.update_weights(iter(buckets_of(perturbed(base, seed=8))), "warm-up")  # the group exists
    logs = {url: m.server.log_path for url, m in fleet.members.items()}
    start = {url: path.stat().st_size for url, path in logs.items()}
    new = perturbed(base, seed=9)
    buckets = buckets_of(new, per=1)
    assert len(buckets) > 20
    fleet.update_weights(iter(buckets), "many-buckets")
    for url, path in logs.items():
        with open(path, "rb") as f:
            f.seek(start[url])
            requests_seen = collections.Counter(re.findall(r'"(?:GET|POST) (/[^ ?"]*)', f.read().decode(errors="replace")))
        assert requests_seen["/server_info"] == 1, (url, requests_seen)
        assert requests_seen["/update_weights_from_distributed"] == len(buckets), (url, requests_seen)
        assert requests_seen["/health"] == requests_seen["/health_generate"] == 0, (url, requests_seen)
    probe = random_probe(seed=0)
    trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
    assert check_mismatch(fleet, probe, trainer, 0.05, "many-buckets").max_abs < TOL


def test_bench_push_reports_the_ratio(fleet, hf_dir):
    """benchmarks/bench_push.py attached to this module's two servers, in its quickest form (one
    timed push each way): it prints seconds per bucket for the probing baseline and for the push,
    and their ratio."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_push.py"), "--hf-dir", hf_dir,
                          "--server-urls", *fleet.urls, "--bucket-kb", "64", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| baseline: /health on every server before each bucket |" in out.stdout, out.stdout
    assert "| now: /server_info once per server per push |" in out.stdout, out.stdout
    assert re.search(r"ratio baseline / now: \d+\.\dx", out.stdout), out.stdout


def test_a_server_killed_during_a_push_is_dropped_and_the_fleet_goes_on(fleet, base, reference):
    """Runs last: kills the second server's process group in the middle of a push, once the
    broadcast group over both servers has carried a bucket (the kill runs in the export thread,
    as the third bucket is exported, so during or after the second's broadcast). Nothing probes
    between buckets: the next broadcast finds it gone (its update request is refused, rank 0
    aborts the group, which releases the survivor waiting in the collective), the push drops it
    (named, with the push that lost it), rebuilds the group over the survivor and finishes there
    from the bucket in flight: the report counts the model once, and the bytes broadcast count
    the model plus that one bucket sent again; the survivor serves the new weights (probe check);
    the next push (the next step's) succeeds to the survivor. With the last server killed too, a
    generation fails in one line naming it (tests/test_rollout_stream.py kills one mid-step)."""
    (url_a, _), (url_b, b) = fleet.members.items()
    new = perturbed(base, seed=6)
    buckets = buckets_of(new, per=3)
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())

    def killing_b_after_two(items):
        for i, bucket in enumerate(items):
            if i == 2:
                os.killpg(b.server.proc.pid, signal.SIGKILL)
                b.server.proc.wait(timeout=30)
            yield bucket

    report = fleet.update_weights(killing_b_after_two(buckets), "mid-push")
    assert fleet.urls == [url_a] and "lost during weight sync 'mid-push'" in fleet.dropped[url_b]
    assert (report.num_tensors, report.num_buckets, report.bytes) == (len(new), len(buckets), model_bytes)
    resent = report.bytes_sent - model_bytes  # the bucket in flight went out again, nothing else did
    assert resent in {sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets[1:3]}, resent
    probe = random_probe(seed=0)
    trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
    assert check_mismatch(fleet, probe, trainer, 0.05, "mid-push").max_abs < TOL
    newer = perturbed(base, seed=7)
    report = fleet.update_weights(iter(buckets_of(newer)), "next-step")
    assert report.bytes_sent == report.bytes == model_bytes
    trainer = reference.load(newer).logprobs(probe.prompts, probe.responses)
    assert check_mismatch(fleet, probe, trainer, 0.05, "next-step").max_abs < TOL
    groups = fleet.generate([[5, 6, 7]] * 4, SamplingParams(n=2, max_new_tokens=8))
    assert [len(g) for g in groups] == [2, 2, 2, 2] and {c.weight_version for g in groups for c in g} == {"next-step"}
    os.killpg(fleet.members[url_a].server.proc.pid, signal.SIGKILL)
    with pytest.raises(RolloutError, match=f"no SGLang server left.*{url_a}"):
        fleet.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=8))


def test_an_attached_server_still_starting_is_waited_for(hf_dir, tmp_path, caplog):
    """docs/install.md's one-node example starts a server in the background and the trainer at
    once: the fleet waits for the server still loading (rollout.startup_timeout_s, one line) instead
    of failing at its first request, then generates on it."""
    cfg = RolloutConfig(engine="sglang", startup_timeout_s=400, request_timeout_s=120, sync_timeout_s=SYNC_TIMEOUT_S)
    port = free_port()
    log_path = tmp_path / "sglang.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(launch_command(hf_dir, port, cfg, None), env=child_env(cuda=False), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = SGLangServer(proc, f"http://127.0.0.1:{port}", log_path, cfg.shutdown_grace_s)  # stops its group
    try:
        with caplog.at_level(logging.WARNING, logger="megadiv.rollout.fleet"):
            engine = make_engine(dataclasses.replace(cfg, server_urls=(server.url,)), hf_dir)
        try:
            assert engine.urls == [server.url] and not engine.dropped
            waits = [r.getMessage() for r in caplog.records if r.name == "megadiv.rollout.fleet"]
            assert waits == [f"waiting up to 400 s (rollout.startup_timeout_s) for attached SGLang servers to "
                             f"answer: ['{server.url}']"], waits
            (group,) = engine.generate([[5, 17, 33]], SamplingParams(n=2, temperature=0.8, max_new_tokens=4))
            assert len(group) == 2 and all(len(c.token_ids) > 0 for c in group)
        finally:
            engine.shutdown()
    finally:
        server.stop()
    assert not live_group_members(proc.pid)
