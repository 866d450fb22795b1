"""The SGLang rollout stream (megadiv/rollout/fleet_stream.py) and the rollout driver on top of it,
against three real SGLang CPU servers this module launches and attaches to (as a multi-node job
attaches to its fleet), one of them (C) with a KV cache of 128 tokens:

    KV cap        with no routing key set, the server with the smaller KV cache (C: it holds fewer
                  sequences at once) receives fewer groups of a wave than a default one
    balance       a server slowed by a real cause (SGLang's /slow_down: its scheduler sleeps before
                  every forward pass) receives fewer groups than a fast one (max_inflight_groups=1)
    over-sample   dynamic sampling with grpo.oversample draws its groups in one wave, fills the step
                  and aborts the rest: the slow server, whose group would run for 30 s more, has no
                  request running or waiting soon after
    aborted       completions a server aborts (an /abort_request from outside) never reach the
                  rows trained on: their group is dropped, counted and replaced by another prompt
    SIGSTOP       an attached server stopped mid-step is dropped by its heartbeat (its request
                  timeout lies beyond the test's), its group re-sent, the step completed
    SIGKILL       a server killed mid-step: its group is re-sent, the step has exactly
                  prompts_per_step groups, each prompt drawn once; rank 0's fleet drops the server
                  the driver reports and pushes to the survivor; a fleet attached again with the
                  dead server configured (a restart) leaves it out and serves; the server
                  relaunched on its address rejoins at the next push, gets the weights, and only
                  then takes groups

Slow servers are slowed by a forward-pass sleep, not by load, so what each test relies on (a
slowed group outlasts a fast server's several groups by a factor of ten or more) holds on a busy
machine too. Waits for a server state poll with a deadline; nothing asserts a duration.

The routing caps and the abort's race are also tested against FakeSGLang, an in-process stand-in
for the HTTP surface the stream uses, where the interleaving can be forced (no sglang needed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import torch

from megadiv.config import load_config
from megadiv.models.tiny import make_tiny_model
from megadiv.rewards import RewardResult, register_reward
from megadiv.rollout import RolloutConfig, SamplingParams
from megadiv.rollout.fleet import FleetEngine
from megadiv.rollout.fleet_stream import FleetStream
from megadiv.rollout.sglang_server import SGLangServer
from megadiv.rollout.weight_sync import post
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.driver import RolloutDriver
from megadiv.trainer.handoff import Handoff, ReplicaRows, from_torch_bytes

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 8
SMALL_KV = 128
"""Server C's KV cache in tokens (--max-total-tokens): 4 groups of 4 x (3 + MAX_NEW / 2) tokens."""


def on_servers(test):
    """The tests on the real SGLang servers (the CPU SGLang tier, left out of ``make test``), which
    each start unslowed."""
    return pytest.mark.usefixtures("unslowed")(pytest.mark.sglang(pytest.mark.slow(test)))


class FakeSGLang(ThreadingHTTPServer):
    """The HTTP surface of an SGLang server as the stream uses it, on loopback: ``/v1/loads`` (its
    KV and batch sizes), ``/health_generate``, ``/generate`` and ``/abort_request {"abort_all"}``.
    A request is answered at once with ``finish_tokens``-token completions while that is set;
    otherwise its scheduler holds it until an abort. An abort reaches the requests the scheduler
    holds, as SGLang's does; with ``late`` a request reaches the scheduler only after the next
    abort (one still in transit or being tokenized when the abort arrives)."""

    def __init__(self, kv_tokens: int, batch: int = 4096):
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.kv_tokens, self.batch = kv_tokens, batch
        self.finish_tokens: int | None = None
        self.late = False
        self.lock = threading.Lock()
        self.received = 0
        self.held: set[threading.Event] = set()  # the requests its scheduler holds
        self.reached = threading.Event()         # a late request reached the scheduler
        self.aborted = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHandler(BaseHTTPRequestHandler):
    server: FakeSGLang

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        fake = self.server
        self._answer({"loads": [{"max_total_num_tokens": fake.kv_tokens, "max_running_requests": fake.batch}]}
                     if self.path == "/v1/loads" else {})

    def do_POST(self) -> None:
        fake, body = self.server, json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            with fake.lock:
                for request in fake.held:
                    request.set()
                fake.held.clear()
                fake.aborted.set()
            return self._answer({})
        with fake.lock:
            fake.received += 1
            tokens, late = fake.finish_tokens, fake.late
        if tokens is None:
            if late:
                fake.aborted.clear()
                fake.aborted.wait(60)
            request = threading.Event()
            with fake.lock:
                fake.held.add(request)
            fake.reached.set()
            request.wait(60)
        finish = {"type": "length"} if tokens is not None else {"type": "abort"}
        self._answer([{"output_ids": [1] * (tokens or 0), "meta_info": {
            "finish_reason": finish, "output_token_logprobs": [[-1.0, 1, None]] * (tokens or 0)}}
            for _ in body["input_ids"]])


@pytest.fixture
def fakes():
    made: list[FakeSGLang] = []

    def make(kv_tokens: int) -> FakeSGLang:
        made.append(FakeSGLang(kv_tokens))
        return made[-1]

    yield make
    for fake in made:
        with fake.lock:
            for request in fake.held:
                request.set()
        fake.shutdown()
        fake.server_close()


def fake_stream(fakes: list[FakeSGLang], **rollout) -> FleetStream:
    cfg = RolloutConfig(engine="sglang", server_urls=tuple(f.url for f in fakes), **rollout)
    return FleetStream(cfg.server_urls, cfg, SamplingParams(n=4, max_new_tokens=MAX_NEW), on_lost=pytest.fail)


def test_each_server_holds_the_groups_its_kv_cache_holds(fakes):
    big, small = fakes(256), fakes(SMALL_KV)
    stream = fake_stream([big, small])
    for key in range(20):
        stream.submit(key, [3, 4, 5])
    # a group: 4 x (3 + MAX_NEW / 2) = 28 tokens: 256 // 28 = 9 and 128 // 28 = 4 in flight, 7 wait here;
    # abort_pending returns once every request sent has answered, so every one has been received
    assert stream.abort_pending() == 20
    assert (big.received, small.received) == (9, 4)
    stream.close()


def test_max_inflight_groups_sets_every_server_s_cap(fakes):
    big, small = fakes(256), fakes(SMALL_KV)
    stream = fake_stream([big, small], max_inflight_groups=2)
    for key in range(20):
        stream.submit(key, [3, 4, 5])
    assert stream.abort_pending() == 20
    assert (big.received, small.received) == (2, 2)
    stream.close()


def test_the_cap_follows_the_completion_lengths_back(fakes):
    fake = fakes(SMALL_KV)
    fake.finish_tokens = MAX_NEW
    stream = fake_stream([fake])
    stream.submit("long", [3, 4, 5])
    assert len(stream.next_done().completions) == 4
    fake.finish_tokens = None  # hold the rest
    for key in range(10):
        stream.submit(key, [3, 4, 5])
    # completion mean: (4 x MAX_NEW / 2 + 4 x MAX_NEW) / (4 + 4) = 6; 128 // (4 x (3 + 6)) = 3 (4 before)
    stream.abort_pending()
    assert fake.received == 1 + 3
    stream.close()


def test_a_request_reaching_its_server_after_the_abort_is_aborted_too(fakes):
    """The top-up race: the group dispatched by the last next_done reaches its server's scheduler
    only after abort_pending's /abort_request (forced here); it must not run on unaborted."""
    fake = fakes(4096)
    fake.late = True
    stream = fake_stream([fake])
    stream.submit("top-up", [3, 4, 5])
    assert stream.abort_pending() == 1
    assert fake.reached.wait(60), "the request never reached the scheduler"
    with fake.lock:
        assert not fake.held, "a request sent before the abort still runs after it"
    stream.close()


class Alternating:
    """Scores a group's samples 0, 1, 0, 1, ...: every group is informative for dynamic sampling,
    so which groups fill a step depends only on the order they come back in."""

    def __call__(self, responses, records) -> RewardResult:
        return RewardResult([float(i % 2) for i in range(len(responses))],
                            ["correct" if i % 2 else "wrong" for i in range(len(responses))])

    def close(self) -> None:
        pass


register_reward("test_alternating", lambda cfg: Alternating(), overwrite=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("stream") / "m", "qwen2", tokenizer="char",
                           chars="0123456789+=", hidden=32, heads=4, kv_heads=2, ffn=64, layers=1, max_positions=64)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """Three CPU servers (A, B, C), launched concurrently (each test starts them unslowed). C's KV
    cache holds SMALL_KV tokens (A's and B's: SGLang's CPU default, 16384)."""
    cfg = RolloutConfig(engine="sglang", startup_timeout_s=600, log_dir=str(tmp_path_factory.mktemp("logs")))
    small = dataclasses.replace(cfg, server_args=("--max-total-tokens", str(SMALL_KV)))
    # the launching threads live as long as the servers: a server's parent-death signal is its
    # launching thread's exit (prctl PR_SET_PDEATHSIG), as in FleetEngine, whose pool does the same
    pool = ThreadPoolExecutor(3)
    futures = [pool.submit(SGLangServer.launch, str(model), c) for c in (cfg, cfg, small)]
    launched = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(launched) == 3, [f.exception() for f in futures]
        yield launched
    finally:
        for server in launched:
            server.stop()
        pool.shutdown()


@pytest.fixture
def unslowed(servers):
    for server in servers:
        if server.alive():
            post(server.url, "/slow_down", {"forward_sleep_time": None}, 60)


def slow_down(url: str, seconds: float) -> None:
    post(url, "/slow_down", {"forward_sleep_time": seconds}, 60)


def loads(url: str) -> tuple[int, int]:
    """(running, waiting) requests on the server."""
    load = requests.get(url + "/v1/loads", timeout=60).json()["loads"][0]
    return load["num_running_reqs"], load["num_waiting_reqs"]


def when_running(url: str, action, deadline_s: float = 300) -> threading.Thread:
    """Run ``action()`` in a thread as soon as ``url`` has a request running."""
    def watch():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and loads(url)[0] == 0:
            time.sleep(0.1)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def driver_on(model: Path, urls: list[str], *overrides: str, **rollout) -> tuple[RolloutDriver, Handoff]:
    """A rollout driver (as the driver process builds it) attached to ``urls``, with a rank's
    hand-off client; the tiny arithmetic task, groups of 4, MAX_NEW tokens."""
    from transformers import AutoTokenizer

    cfg = load_config(TrainConfig, REPO / "examples" / "tiny" / "grpo.yaml", [
        f"model.hf_dir={model}", "warm_start.make_model=none", "warm_start.sft_steps=0", "eval.data=null",
        "rollout.engine=sglang", "rollout.n_samples=4", "advantage.group_size=4", f"rollout.max_new_tokens={MAX_NEW}",
        "grpo.micro_batch_size=4", *overrides])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, server_urls=tuple(urls), **rollout))
    store, port = Handoff.host(300)
    return RolloutDriver(cfg, str(model), AutoTokenizer.from_pretrained(model), store, 1), \
        Handoff.connect("127.0.0.1", port, 300)


def batch(driver: RolloutDriver, handoff: Handoff, step: int = 1) -> tuple[ReplicaRows, dict]:
    driver.start_batch(step)
    metrics = from_torch_bytes(handoff.wait(f"batch/{step}"))
    return ReplicaRows.decode(handoff.take(f"batch/{step}/0")), metrics


def assert_complete(rows: ReplicaRows, model: Path) -> None:
    """Every trained response is a finished one: MAX_NEW tokens, or shorter and ending in one of
    the model's EOS tokens (its generation config's, which the server stops on)."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model).eos_token_id
    ends = torch.cumsum(rows.prompt_lens + rows.response_lens, 0) - 1
    for length, last in zip(rows.response_lens.tolist(), rows.tokens[ends].tolist()):
        assert length == MAX_NEW or (length > 0 and last in eos), (length, last, eos)


@on_servers
def test_a_server_with_a_smaller_kv_cache_receives_fewer_groups_with_no_key_set(model, servers):
    fast, small = servers[0].url, servers[2].url
    fleet = FleetEngine(str(model), RolloutConfig(engine="sglang", server_urls=(fast, small)))
    stream = fleet.open_stream(SamplingParams(n=4, max_new_tokens=MAX_NEW))
    try:
        for key in range(12):  # one wave: each goes to the server whose cap it fills least
            stream.submit(key, [3, 4, 5])
        groups = [stream.next_done() for _ in range(12)]
        assert sorted(g.key for g in groups) == list(range(12)) and stream.pending == 0
        by_server = stream.stats.groups_by_server
        # caps 16384 // 28 = 585 and 128 // 28 = 4 (by max_running_requests alone: 1024 and 16, 6 each)
        assert by_server[fast] > 2 * by_server[small] > 0, by_server
    finally:
        stream.close()
        fleet.shutdown()


@on_servers
def test_a_slow_server_receives_fewer_groups(model, servers):
    fast, slow = servers[0].url, servers[1].url
    slow_down(slow, 0.5)  # a group of MAX_NEW tokens: >= 4.5 s there, well under 1 s on the fast one
    fleet = FleetEngine(str(model), RolloutConfig(engine="sglang", server_urls=(fast, slow), max_inflight_groups=1))
    stream = fleet.open_stream(SamplingParams(n=4, max_new_tokens=MAX_NEW))
    try:
        for key in range(12):
            stream.submit(key, [3, 4, 5])
        groups = [stream.next_done() for _ in range(12)]
        assert sorted(g.key for g in groups) == list(range(12)) and stream.pending == 0
        assert all(len(g.completions) == 4 and g.server in (fast, slow) for g in groups)
        by_server = stream.stats.groups_by_server
        assert by_server[fast] > 2 * by_server[slow] >= 2, by_server  # the slow one took its first group
        assert stream.stats.resent_groups == 0 and not stream.stats.dropped_servers
    finally:
        stream.close()
        fleet.shutdown()


@on_servers
def test_oversampling_fills_the_step_in_one_wave_and_aborts_the_rest(model, servers):
    fast, slow = servers[0].url, servers[1].url
    slow_down(slow, 1.0)  # its group would run >= 30 s: still running when the fast server has filled the step
    driver, handoff = driver_on(model, [fast, slow], "reward.name=test_alternating", "grpo.dynamic_sampling=true",
                                "grpo.oversample=3", "grpo.prompts_per_step=2", "rollout.max_new_tokens=30",
                                max_inflight_groups=1)
    try:
        rows, metrics = batch(driver, handoff)
        assert len(rows) == 2 * 4
        assert metrics["rollout/drawn_groups"] == 6 and metrics["dynamic/rounds"] == 1  # one wave of 2 x 3
        assert metrics["dynamic/kept_groups"] == 1 and metrics["rollout/aborted_groups"] >= 1
        deadline = time.monotonic() + 20  # the abort takes one forward pass; unaborted, 30 s or more
        while loads(slow) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loads(slow) == (0, 0) and loads(fast) == (0, 0)
    finally:
        driver.close()


@on_servers
def test_aborted_completions_are_never_trained(model, servers):
    a, b = servers[0].url, servers[1].url
    slow_down(a, 0.5)
    driver, handoff = driver_on(model, [a, b], "grpo.prompts_per_step=4", max_inflight_groups=1)
    aborted = []
    watcher = when_running(a, lambda: aborted.append(post(a, "/abort_request", {"abort_all": True}, 60)))
    try:
        rows, metrics = batch(driver, handoff)
        watcher.join(60)
        assert aborted, "the abort was never sent"
        assert len(rows) == 4 * 4
        assert metrics["rollout/dropped_groups"] >= 1 and metrics["rollout/aborted_completions"] >= 1
        assert metrics["rollout/drawn_groups"] == 4 + metrics["rollout/dropped_groups"]  # each replaced once
        assert_complete(rows, model)
    finally:
        driver.close()


@on_servers
def test_a_stopped_attached_server_is_dropped_by_its_heartbeat(model, servers):
    a, stopped = servers[0], servers[2]
    slow_down(stopped.url, 0.5)  # it holds a group when it is stopped
    # only the heartbeat can drop it before the test's own timeout: the request timeout lies beyond it
    driver, handoff = driver_on(model, [a.url, stopped.url], "grpo.prompts_per_step=4", max_inflight_groups=1,
                                heartbeat_s=1.0, heartbeat_timeout_s=5.0, request_timeout_s=3600.0)
    watcher = when_running(stopped.url, lambda: os.killpg(stopped.proc.pid, signal.SIGSTOP))
    try:
        rows, metrics = batch(driver, handoff)
        watcher.join(60)
        assert len(rows) == 4 * 4 and metrics["rollout/dropped_servers"] == 1
        assert metrics["rollout/resent_groups"] >= 1 and metrics["rollout/drawn_groups"] == 4
        dropped = driver.quiesce(1)
        assert list(dropped) == [stopped.url] and "heartbeat" in dropped[stopped.url], dropped
        assert driver.engine.urls == [a.url]
    finally:
        os.killpg(stopped.proc.pid, signal.SIGCONT)
        driver.close()
        stopped.stop()


@on_servers
def test_a_killed_server_s_groups_are_resent_and_the_push_reaches_the_survivor(model, servers):
    from safetensors.torch import load_file

    a, killed = servers[0], servers[1]
    slow_down(killed.url, 0.5)
    rank0 = FleetEngine(str(model), RolloutConfig(engine="sglang", server_urls=(a.url, killed.url)))  # pushes
    driver, handoff = driver_on(model, [a.url, killed.url], "grpo.prompts_per_step=6", max_inflight_groups=1)
    watcher = when_running(killed.url, lambda: os.killpg(killed.proc.pid, signal.SIGKILL))
    back = []
    try:
        rows, metrics = batch(driver, handoff)
        watcher.join(60)
        assert not killed.alive()
        assert len(rows) == 6 * 4 and metrics["rollout/drawn_groups"] == 6  # exactly the step, each prompt once
        assert metrics["rollout/resent_groups"] >= 1 and metrics["rollout/dropped_servers"] == 1
        assert list(driver.engine.dropped) == [killed.url]
        for url, why in driver.quiesce(1).items():  # what Rollout.push_weights does on rank 0
            rank0.drop(url, why)
        weights = load_file(model / "model.safetensors")
        rank0.update_weights(iter([list(weights.items())]), "step-1")
        assert rank0.urls == [a.url] and rank0.weight_version == "step-1"
        # a restart with the dead server still configured leaves it out, in one line, and goes on (after
        # waiting rollout.startup_timeout_s for it to answer, as for a server still starting)
        restarted = FleetEngine(str(model), RolloutConfig(engine="sglang", server_urls=(a.url, killed.url),
                                                          startup_timeout_s=5))
        assert restarted.urls == [a.url] and "unreachable" in restarted.dropped[killed.url]
        restarted.shutdown()
        # the server comes back on its address: the next push gives it the weights, then it serves
        back.append(SGLangServer.launch(str(model), RolloutConfig(engine="sglang", startup_timeout_s=600),
                                        port=int(killed.url.rsplit(":", 1)[1])))
        rank0.update_weights(iter([list(weights.items())]), "step-2")
        assert rank0.urls == [a.url, killed.url]
        assert [m.weight_version for m in rank0.members.values()] == ["step-2", "step-2"]
        assert driver.engine.urls == [a.url]  # nothing is sent to it before the driver is told
        driver.served(2, rank0.urls)
        rows, metrics = batch(driver, handoff, step=3)
        assert len(rows) == 6 * 4 and metrics["rollout/servers"] == 2  # completions all of step-2 (checked)
    finally:
        driver.close()
        rank0.shutdown()
        for server in back:
            server.stop()
