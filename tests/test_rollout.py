"""The rollout engine protocol, tested once and run on both engines, plus SGLang's weight sync
from a TP=2 Megatron actor and its failure modes.

One SGLang server serves the whole module (CPU start-up takes 20-80 s); it is launched by the
``sglang_engine`` fixture and killed at the end (the last test kills it mid-generation).
References are independent: a transformers model loaded with the weights the engine should serve,
run one unpadded sequence at a time.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megadiv.rollout import (
    ProbeBatch,
    RolloutConfig,
    RolloutError,
    SamplingParams,
    WeightSyncError,
    check_mismatch,
    make_engine,
    probe_limit,
    probe_mismatch,
)
from megadiv.rollout.embedded import EmbeddedEngine
from megadiv.rollout.sglang_server import live_group_members
from tests.torchrun import run_torchrun

ENGINES = ["embedded", pytest.param("sglang", marks=pytest.mark.sglang)]
TOL = 1e-4  # float32 everywhere: engine and reference log-probs agree to ~1e-6


# --------------------------------------------------------------------------- fixtures and references


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from megadiv.models.tiny import make_tiny_model  # qwen2: 2 layers, 4 heads / 2 KV heads, tied, vocab 100
    return str(make_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny-qwen2", "qwen2"))


@pytest.fixture(scope="module")
def base(hf_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(hf_dir, "model.safetensors"))


def perturbed(base: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sorted(base.items())}


def buckets_of(sd: dict, per: int = 5) -> list[list[tuple[str, torch.Tensor]]]:
    names = list(sd)
    return [[(n, sd[n]) for n in names[i:i + per]] for i in range(0, len(names), per)]


class Reference:
    """transformers forward, one unpadded sequence at a time, with the weights it is given."""

    def __init__(self, hf_dir: str):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        gen = self.model.generation_config
        self.eos = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])

    def load(self, sd: dict) -> Reference:
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        return self

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
        return self.model(torch.tensor([tokens])).logits[0].float()

    def logprobs(self, prompts, responses, temperature: float = 1.0) -> list[torch.Tensor]:
        out = []
        for p, r in zip(prompts, responses):
            logp = F.log_softmax(self.logits(list(p) + list(r)) / temperature, dim=-1)
            out.append(logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.tensor(list(r), dtype=torch.long)])
        return out


@pytest.fixture(scope="module")
def reference(hf_dir) -> Reference:
    return Reference(hf_dir)


@pytest.fixture(scope="module")
def embedded_engine(hf_dir):
    engine = make_engine(RolloutConfig(), hf_dir)  # engine "auto" on a CPU machine
    assert isinstance(engine, EmbeddedEngine)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sglang_engine(hf_dir, tmp_path_factory):
    from megadiv.rollout.sglang_engine import SGLangEngine
    cfg = RolloutConfig(engine="sglang", bucket_bytes=64 << 10, startup_timeout_s=400, request_timeout_s=120,
                        sync_timeout_s=60, log_dir=str(tmp_path_factory.mktemp("sglang-log")))
    engine = SGLangEngine(hf_dir, cfg)
    yield engine
    engine.shutdown()
    assert not live_group_members(engine.server.proc.pid)  # nothing of the server is left


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


def serve(engine, sd: dict, version: str) -> None:
    report = engine.update_weights(iter(buckets_of(sd)), version)
    assert report.num_tensors == len(sd) and engine.weight_version == version


PROMPTS = [[5, 17, 33, 8], [40, 41], [9, 60, 61, 62, 63, 64, 70]]


def random_probe(seed: int, rows: int = 4, length: int = 16) -> ProbeBatch:
    """Random ids of the tiny model's whole (unpadded) vocabulary, for the tests that compare
    float32 log-probs exactly, where any tokens do; a run's probe is the engine's answers to
    held-out prompts (ProbeBatch.answer, tested below)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randint(0, 100, (length,), generator=g).tolist()  # noqa: E731
    return ProbeBatch([draw() for _ in range(rows)], [draw() for _ in range(rows)])


# --------------------------------------------------------------------------- the protocol, on both engines


def test_generate_returns_consistent_completions(engine, base):
    serve(engine, base, "base")
    stop = (7, 11, 13)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, stop_token_ids=stop)
    groups = engine.generate(PROMPTS, params)
    assert [len(g) for g in groups] == [4, 4, 4]
    eos = {0, 2}  # the tiny model's generation_config.eos_token_id
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 10
        assert all(-1e3 < lp <= 0 for lp in c.logprobs)
        enders = [i for i, t in enumerate(c.token_ids) if t in eos | set(stop)]
        if c.finish_reason == "stop":
            assert enders == [len(c.token_ids) - 1]  # the stop token is kept, and is the only one
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 10 and not enders
        assert c.weight_version == "base"


def test_stop_tokens_end_every_completion(engine):
    groups = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=8, stop_token_ids=tuple(range(100))))
    assert all(c.finish_reason == "stop" and len(c.token_ids) == 1 for g in groups for c in g)


def test_sampled_logprobs_are_of_the_tempered_untruncated_distribution(engine, base, reference):
    """log_softmax(logits / T)[token], top-k / top-p not applied (the protocol's convention)."""
    reference.load(base)
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12)
    rows = [(p, c) for p, g in zip(PROMPTS, engine.generate(PROMPTS, params)) for c in g]
    expected = reference.logprobs([p for p, _ in rows], [c.token_ids for _, c in rows], temperature=0.7)
    assert max(float((e - torch.tensor(c.logprobs)).abs().max()) for e, (_, c) in zip(expected, rows)) < TOL


def test_greedy_follows_the_argmax_with_untempered_logprobs(engine, base, reference):
    reference.load(base)
    (first,), = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8))
    (again,), = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert first.token_ids == again.token_ids
    tokens = list(PROMPTS[2])
    for t, lp in zip(first.token_ids, first.logprobs):
        logp = F.log_softmax(reference.logits(tokens)[-1], dim=-1)
        assert t == int(logp.argmax()) and abs(float(logp[t]) - lp) < TOL
        tokens.append(t)


def test_score_matches_the_reference(engine, base, reference):
    reference.load(base)
    responses = [[1, 2, 3], [50, 51, 52, 53, 54, 55], [99]]
    got = engine.score(PROMPTS, responses)
    expected = reference.logprobs(PROMPTS, responses)
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert max(float((g - e).abs().max()) for g, e in zip(got, expected)) < TOL


def test_weight_sync_is_verified_by_the_mismatch_check(engine, base, reference):
    """The run's probe: the engine's answers on the starting weights, a baseline on them (float32:
    the floor rules). Before the sync the engine serves stale weights: the check raises. After it
    the engine's probe log-probs equal the trainer's (the reference with the new weights)."""
    serve(engine, base, "base")
    cfg = RolloutConfig()
    probe = ProbeBatch.answer(engine, PROMPTS, cfg, real_vocab=100)
    baseline = probe_mismatch(engine, probe, reference.load(base).logprobs(probe.prompts, probe.responses), "base")
    limit = probe_limit(baseline.mean_abs, cfg)
    assert baseline.max_abs < TOL and limit == cfg.probe_floor
    new = perturbed(base, seed=1)
    trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
    with pytest.raises(WeightSyncError, match="differ from the trainer's"):
        check_mismatch(engine, probe, trainer, limit, "step-1")
    report = engine.update_weights(iter(buckets_of(new, per=3)), "step-1")
    assert (report.num_tensors, report.num_buckets) == (len(new), -(-len(new) // 3))
    assert report.bytes == sum(t.numel() * 4 for t in new.values())
    assert engine.weight_version == "step-1"
    mismatch = check_mismatch(engine, probe, trainer, limit, "step-1")
    assert mismatch.max_abs < TOL and mismatch.tokens == sum(len(r) for r in probe.responses)


def test_the_limit_scales_with_a_low_precision_baseline_and_still_catches_a_stale_tensor(embedded_engine, base,
                                                                                          hf_dir):
    """A bf16 trainer against the float32 engine: the baseline on identical weights is bf16's noise
    (~3e-3 on the tiny model), the limit follows it above a low floor, noise after a push of new
    weights passes, and the same push with one tensor left stale (0.26 mean) is caught."""
    bf16 = Reference(hf_dir)
    bf16.model.to(torch.bfloat16)
    cfg = RolloutConfig(probe_floor=1e-3)
    serve(embedded_engine, base, "base")
    probe = ProbeBatch.answer(embedded_engine, PROMPTS, cfg, real_vocab=100)
    baseline = probe_mismatch(embedded_engine, probe, bf16.load(base).logprobs(probe.prompts, probe.responses), "base")
    limit = probe_limit(baseline.mean_abs, cfg)
    assert baseline.mean_abs > TOL and limit == cfg.probe_factor * baseline.mean_abs > cfg.probe_floor
    new = perturbed(base, seed=1)
    trainer = bf16.load(new).logprobs(probe.prompts, probe.responses)
    serve(embedded_engine, new, "step-1")
    assert check_mismatch(embedded_engine, probe, trainer, limit, "step-1").mean_abs > TOL  # bf16 noise, passed
    stale = new | {"model.layers.0.mlp.down_proj.weight": base["model.layers.0.mlp.down_proj.weight"]}
    serve(embedded_engine, stale, "step-2")
    with pytest.raises(WeightSyncError, match="not serving the trainer's weights"):
        check_mismatch(embedded_engine, probe, trainer, limit, "step-2")


def test_probe_answers_are_real_text_never_padding_ids(tmp_path):
    """A padded vocabulary (as Qwen3's 151936 rows over a 151669-token tokenizer) whose padding rows
    the random model samples often: the probe keeps the chat-templated prompts and answers made of
    the tokenizer's own ids only."""
    from transformers import AutoTokenizer

    from megadiv.models.tiny import make_tiny_model

    hf_padded = str(make_tiny_model(tmp_path / "padded", "qwen2", vocab=128))
    tokenizer = AutoTokenizer.from_pretrained(hf_padded)
    assert len(tokenizer) == 100
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True))
               for q in ("What is 17 + 25?", "Name a prime above 40.", "Sort 3 1 2.", "2 * 3 = ?")]
    cfg = RolloutConfig(probe_response_len=12)
    engine = make_engine(cfg, hf_padded)
    try:
        torch.manual_seed(0)
        drawn = [t for g in engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12)) for c in g
                 for t in c.token_ids]
        assert max(drawn) >= 100  # the engine does sample padding ids here
        probe = ProbeBatch.answer(engine, prompts, cfg, real_vocab=len(tokenizer))
    finally:
        engine.shutdown()
    assert probe.prompts == prompts
    assert all(1 <= len(r) <= 12 for r in probe.responses)
    assert all(0 <= t < len(tokenizer) for r in probe.responses for t in r)


def test_bad_tensor_is_refused_and_the_engine_keeps_serving(engine, base, reference):
    serve(engine, base, "base")
    name, weight = "model.layers.0.mlp.down_proj.weight", base["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"'model.layers.0.mlp.down_projj.weight' is not a weight"):
        engine.update_weights(iter([[("model.layers.0.mlp.down_projj.weight", weight)]]), "bad")
    with pytest.raises(WeightSyncError, match=r"has shape \(128, 64\)"):
        engine.update_weights(iter([[(name, weight.t().contiguous())]]), "bad")
    assert engine.weight_version == "base"
    got = engine.score(PROMPTS, [[1, 2], [3], [4, 5, 6]])
    expected = reference.load(base).logprobs(PROMPTS, [[1, 2], [3], [4, 5, 6]])
    assert max(float((g - e).abs().max()) for g, e in zip(got, expected)) < TOL


def test_pause_blocks_generation_until_resume(engine):
    engine.pause()
    try:
        with pytest.raises(RolloutError, match="paused"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    finally:
        engine.resume()
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 3


# --------------------------------------------------------------------------- SGLang only


@pytest.mark.sglang
def test_tp2_megatron_actor_syncs_into_sglang(sglang_engine, hf_dir):
    """A TP=2 Megatron actor (torchrun, gloo) exports its weights with iter_hf_weight_buckets and
    pushes them into the running server, by broadcast then by disk; each time SGLang's log-probs
    of the probe tokens must equal the actor's within 1e-4 (and differ before the push)."""
    figures, _ = run_torchrun("tests.dist.rollout_sync:sync_to_sglang", nproc=2, timeout_s=600,
                              args={"hf_dir": hf_dir, "url": sglang_engine.urls[0], "bucket_bytes": 48 << 10})
    assert figures["tp_size"] == 2
    for step, method in enumerate(("distributed", "disk"), start=1):
        f = figures[method]
        assert f["before_max"] > 0.1, f  # the server was stale before the push
        assert f["after_max"] < TOL, f
        assert f["buckets"] > 1 and f["version"] == f"step-{step}"
    assert figures["generate_max"] < TOL and figures["generate_versions"] == ["step-2"]
    assert figures["generated_tokens"] > 0


@pytest.mark.sglang
@pytest.mark.timeout(300)  # a hang would otherwise last until the 60 s group timeout at best
def test_server_refusals_are_errors_not_hangs(sglang_engine, hf_dir, base, reference):
    """What the server itself refuses (unchecked names), including a refusal that leaves the
    trainer's broadcast without a receiver, and what it silently ignores (caught by the check)."""
    import dataclasses

    from megadiv.rollout.sglang_engine import SGLangEngine
    from megadiv.rollout.weight_sync import flatten_bucket, post

    url = sglang_engine.urls[0]
    unchecked = SGLangEngine(hf_dir, dataclasses.replace(sglang_engine.cfg, server_urls=(url,),
                                                         check_weight_names=False))
    try:
        # 1. a wrong shape reaches the server, whose loader refuses it
        bad = [("model.norm.weight", torch.ones(65))]
        with pytest.raises(WeightSyncError, match=rf"version 'bad'.*{url}/update_weights_from_distributed refused"):
            unchecked.update_weights(iter([bad]), "bad")
        # 2. a refusal before the server joins the broadcast (here: no begin_weight_update session,
        #    HTTP 400 in 0.5.23): the broadcast fails at once instead of waiting for a receiver
        group = unchecked._group
        flat, fields = flatten_bucket([("model.norm.weight", base["model.norm.weight"])])
        request = unchecked._pool.submit(post, url, "/update_weights_from_distributed",
                                         dict(fields, group_name=group.name, flush_cache=False), 60)
        with pytest.raises(WeightSyncError, match="refused the bucket.*begin_weight_update"):
            group.broadcast(flat, [(url, request)], "test")
        assert group.broken and group.pg is None  # aborted (gloo: dropped), nothing left pending for a watchdog
        # 3. the engine recovers: a new group, a full sync, exact log-probs
        new = perturbed(base, seed=2)
        serve(unchecked, new, "step-good")
        probe = random_probe(seed=0)
        trainer = reference.load(new).logprobs(probe.prompts, probe.responses)
        assert check_mismatch(unchecked, probe, trainer, 1e-3, "step-good").max_abs < TOL
        # 4. a misnamed tensor is silently skipped by SGLang: only the mismatch check sees it
        newer = perturbed(base, seed=3)
        renamed = {k.replace("mlp.down_proj", "mlp.down_prj"): v for k, v in newer.items()}
        serve(unchecked, renamed, "step-misnamed")
        trainer = reference.load(newer).logprobs(probe.prompts, probe.responses)
        with pytest.raises(WeightSyncError, match="not serving the trainer's weights"):
            check_mismatch(unchecked, probe, trainer, unchecked.cfg.probe_floor, "step-misnamed")
    finally:
        unchecked.shutdown()
    assert sglang_engine.server.alive()


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_server_killed_during_generate_is_a_clear_error(sglang_engine, monkeypatch):
    """Runs last: kills the module's server (its whole process group) while a generate request is in
    flight. The server is stopped (SIGSTOP) before the request goes out, so it cannot answer before
    the kill however fast the machine is: the outcome does not depend on timing."""
    import megadiv.rollout.sglang_engine as sglang_engine_module
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=480)
    outcome, sent = {}, threading.Event()
    post_generate = sglang_engine_module._post_generate

    def post_then_signal(*args, **kwargs):
        sent.set()
        return post_generate(*args, **kwargs)

    monkeypatch.setattr(sglang_engine_module, "_post_generate", post_then_signal)

    def rollout():
        try:
            outcome["result"] = sglang_engine.generate([[5, 6, 7]] * 32, params)
        except RolloutError as e:
            outcome["error"] = e

    pgid = sglang_engine.server.proc.pid
    os.killpg(pgid, signal.SIGSTOP)
    thread = threading.Thread(target=rollout)
    thread.start()
    assert sent.wait(timeout=60)
    os.killpg(pgid, signal.SIGKILL)
    thread.join(timeout=sglang_engine.cfg.request_timeout_s + 30)
    assert not thread.is_alive() and "result" not in outcome
    message = str(outcome["error"])
    assert sglang_engine.urls[0] in message and str(sglang_engine.server.log_path) in message
    assert "died" in message or "unreachable" in message
