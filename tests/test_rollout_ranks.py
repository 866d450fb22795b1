"""The embedded engine on every trainer rank: row-seeded sampling, weights shared with the actor
instead of copied, and generation split over the ranks (one torchrun launch, tests/dist/embedded_ranks.py)."""
from __future__ import annotations

import pytest
import torch

from megadiv.rollout import SamplingParams
from megadiv.rollout.embedded import EmbeddedEngine, hashed_uniforms
from tests.torchrun import run_torchrun

PROMPTS = [[5, 17, 33, 8], [40, 41], [9, 60, 61, 62, 63, 64, 70], [3, 3, 3]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from megadiv.models.tiny import make_tiny_model  # qwen2: 2 layers, 4 heads / 2 KV heads, tied, vocab 100
    return str(make_tiny_model(tmp_path_factory.mktemp("ranks") / "tiny-qwen2", "qwen2"))


@pytest.fixture(scope="module")
def engine(hf_dir):
    engine = EmbeddedEngine(hf_dir)
    yield engine
    engine.shutdown()


def test_gumbel_max_on_the_hashed_uniforms_samples_the_softmax():
    """argmax(logits + Gumbel(u)) over 200k rows: each token's frequency within 4.5 standard errors
    of softmax(logits) (deterministic: the noise is a function of its counters)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.25, 1.5], dtype=torch.float64)
    rows = 200_000
    u = hashed_uniforms(seed=123, rows=torch.arange(rows), step=2, vocab=len(logits))
    assert 0 < float(u.min()) and float(u.max()) < 1
    draws = (logits - torch.log(-torch.log(u))).argmax(-1)
    freq = torch.bincount(draws, minlength=len(logits)).double() / rows
    p = logits.softmax(-1)
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / rows).sqrt()).all(), (freq, p)


def test_hashed_uniforms_depend_on_each_counter_and_nothing_else():
    u = hashed_uniforms(7, torch.arange(64), 0, 50)
    assert torch.equal(u[10:20], hashed_uniforms(7, torch.arange(10, 20), 0, 50))  # a row alone = in a batch
    for other in (hashed_uniforms(8, torch.arange(64), 0, 50), hashed_uniforms(7, torch.arange(64), 1, 50)):
        assert (other != u).float().mean() > 0.99
    # no two rows share (a permutation of) one noise vector; rows are uncorrelated
    assert len({tuple(sorted(row.tolist())) for row in u}) == 64
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(64)).abs().max() < 0.6  # 50 samples per pair: |r| > 0.6 is a 4.2 sigma event


def test_a_call_split_into_slices_gives_the_completions_of_one_call(engine):
    """Row seeds: prompts generated as slices (first_prompt = their index) sample the same tokens
    as one call with the same seed; log-probs differ only by float32 batch-composition rounding."""
    params = SamplingParams(n=4, temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=8)
    whole = engine.generate(PROMPTS, params, seed=99)
    parts = engine.generate(PROMPTS[:1], params, seed=99) + engine.generate(PROMPTS[1:], params, seed=99,
                                                                            first_prompt=1)
    assert [[c.token_ids for c in g] for g in whole] == [[c.token_ids for c in g] for g in parts]
    diff = max(abs(a - b) for gw, gp in zip(whole, parts) for cw, cp in zip(gw, gp)
               for a, b in zip(cw.logprobs, cp.logprobs))
    assert diff < 1e-5
    other = engine.generate(PROMPTS, params, seed=100)
    assert [[c.token_ids for c in g] for g in whole] != [[c.token_ids for c in g] for g in other]
    torch.manual_seed(3)
    first = engine.generate(PROMPTS, params)  # no seed: drawn from torch's generator
    torch.manual_seed(3)
    assert [[c.token_ids for c in g] for g in engine.generate(PROMPTS, params)] == [[c.token_ids for c in g]
                                                                                    for g in first]


def test_top_k_sampling_stays_in_the_top_k(engine):
    params = SamplingParams(n=8, temperature=1.0, top_k=2, max_new_tokens=1)
    groups = engine.generate(PROMPTS, params, seed=1)
    for p, g in zip(PROMPTS, groups):
        top2 = set(engine.model(torch.tensor([p])).logits[0, -1].topk(2).indices.tolist())
        assert {c.token_ids[0] for c in g} <= top2


def test_shared_tensors_are_served_without_a_copy_and_never_written(engine, hf_dir):
    """share=True: the engine's parameters are the given tensors (generation follows them in
    place); a later copy gives the engine storage of its own and leaves the given tensors alone."""
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    mine = {n: t.clone() for n, t in base.items()}
    engine.update_weights([list(mine.items())], "shared", share=True)
    assert all(p.data_ptr() == mine[n].data_ptr() for n, p in engine.model.named_parameters())
    params = SamplingParams(n=1, temperature=0, max_new_tokens=4)
    before = engine.generate(PROMPTS, params)
    with torch.no_grad():
        mine["model.norm.weight"].mul_(-3.0)  # the trainer changes its parameter: the engine sees it
    assert [c.token_ids for g in engine.generate(PROMPTS, params) for c in g] != [c.token_ids for g in before
                                                                                  for c in g]
    kept = {n: t.clone() for n, t in mine.items()}
    engine.update_weights([list(base.items())], "copied")  # copy mode again
    assert all(torch.equal(kept[n], mine[n]) for n in mine)
    assert all(p.data_ptr() != mine[n].data_ptr() for n, p in engine.model.named_parameters())
    assert not any(p.requires_grad for p in engine.model.parameters())


@pytest.fixture(scope="module")
def ranks(hf_dir):
    return run_torchrun("tests.dist.embedded_ranks:engines_on_every_rank", 2, timeout_s=600, args={"hf_dir": hf_dir})


def test_shared_and_copied_engines_sample_and_train_alike(ranks):
    for r in (ranks[0]["tp1"], ranks[1]["tp1"]):
        assert r["method"] == "embedded-shared"
        # views of the actor's parameters, except q/k/v: 2 query groups interleave in linear_qkv
        copies = {n for n, is_view in r["views"].items() if not is_view}
        assert copies == {f"model.layers.{i}.self_attn.{x}_proj.{w}" for i in range(2) for x in "qkv"
                          for w in ("weight", "bias")}
        assert {n for n, aliased in r["engine_aliases"].items() if not aliased} == copies
        assert r["same_completions"] and r["untouched_by_generation"]
        assert r["same_metrics"] and r["same_grads"] and r["same_weights"] and r["moved"]
        assert r["metrics"]["skipped"] == 0
        assert r["same_after_step"] and r["probe_shared"] < 1e-5
        assert r["copy_leaves_actor"] and r["copy_owns_storage"]
    assert ranks[0]["tp1"]["metrics"] == ranks[1]["tp1"]["metrics"]  # reduced over DP


@pytest.mark.parametrize("layout", ["split_tp1", "split_tp2"])
def test_generation_split_over_the_ranks_equals_one_engine(ranks, layout):
    r = ranks[0][layout]
    assert r["tokens_equal"] and r["greedy_equal"] and r["lp_diff"] < 1e-5
    assert r["versions"] == {"step-1"}  # rank 1's completions carry its own engine's version
    assert r["failure"] is not None and "rank 1" in r["failure"]
    assert r["own_failure"] == "IndexError" and r["recovered"]


def test_every_rank_engine_at_tp2_is_a_full_copy_that_passes_the_probe(ranks):
    for r in ranks:
        assert r["tp2_views"] is None
        assert r["probe_tp2"] < 1e-5
