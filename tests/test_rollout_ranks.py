"""The embedded engine on every trainer rank: row-seeded sampling, weights shared with the actor
instead of copied, and generation split over the ranks (one torchrun launch, tests/dist/embedded_ranks.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megadiv.rollout import SamplingParams
from megadiv.rollout.embedded import EmbeddedEngine, hashed_uniforms, inverse_cdf_sample
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


def test_inverse_cdf_on_the_hashed_uniforms_samples_the_softmax():
    """200k rows at one position, a vocabulary of 1,000 tokens in blocks of 64 with tokens of weight 0
    in between (top-k / top-p) and a padded last block: every draw is the token a float64 search of
    the whole CDF gives, weight-0 tokens are never drawn, and the counts fit softmax(logits)
    (chi-square over the 696 live tokens within 4.5 standard deviations of its mean; deterministic:
    the uniforms are functions of their counters)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=gen, dtype=torch.float64) * 2
    logits[torch.randperm(1000, generator=gen)[:300]] = float("-inf")  # truncated away
    logits[[0, 63, 64, 999]] = float("-inf")  # at block edges
    rows = 200_000
    u = hashed_uniforms(seed=123, rows=torch.arange(rows), step=2)
    weights = (logits - logits.max()).exp().float().expand(rows, -1)
    draws = inverse_cdf_sample(weights, u, block=64)
    cdf = weights[0].double().cumsum(0)
    assert torch.equal(draws, torch.searchsorted(cdf, u * cdf[-1], right=True))
    counts = torch.bincount(draws, minlength=len(logits)).double()
    expected = logits.softmax(-1) * rows
    live = expected > 0
    assert (counts[~live] == 0).all()
    chi2, dof = float(((counts - expected)[live] ** 2 / expected[live]).sum()), int(live.sum()) - 1
    assert abs(chi2 - dof) <= 4.5 * (2 * dof) ** 0.5, (chi2, dof)


def test_inverse_cdf_sample_at_the_edges_of_the_mass():
    """u near 0 and near 1 return the first and last token of positive weight, whatever the blocks."""
    weights = torch.zeros(2, 300)
    weights[:, [5, 130, 290]] = torch.tensor([1.0, 2.0, 1.0])
    u = torch.tensor([2.0**-53, 1 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf_sample(weights, u, block=64).tolist() == [5, 290]
    u = torch.tensor([0.25 - 1e-9, 0.25 + 1e-9], dtype=torch.float64)  # around the first boundary
    assert inverse_cdf_sample(weights, u, block=64).tolist() == [5, 130]


def test_hashed_uniforms_depend_on_each_counter_and_nothing_else():
    u = hashed_uniforms(7, torch.arange(100_000), 0)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert torch.equal(u[10:20], hashed_uniforms(7, torch.arange(10, 20), 0))  # a row alone = in a batch
    for other in (hashed_uniforms(8, torch.arange(100_000), 0), hashed_uniforms(7, torch.arange(100_000), 1)):
        assert (other != u).all()
        assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.015  # 4.7 sigma at n = 1e5
    # uniform: 100 equal bins within 4.5 standard errors of 1,000 each; consecutive rows uncorrelated
    counts = torch.histc(u, bins=100, min=0, max=1)
    assert ((counts - 1000).abs() <= 4.5 * (1000 * 0.99) ** 0.5).all()
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.015
    assert len(set(u.tolist())) == len(u)  # 53 bits: no repeats among 1e5 draws


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


@pytest.mark.parametrize("params", [SamplingParams(n=4, temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=8),
                                    SamplingParams(n=3, temperature=0.0, max_new_tokens=8)], ids=["sampled", "greedy"])
def test_the_prompt_prefill_shared_by_a_prompts_samples_changes_nothing(engine, params):
    """n > 1: each prompt's KV cache is computed once and repeated for its n samples. The same rows
    as n = 1 calls on the prompts repeated n times (no sharing; row r = i * n + j either way) give
    the same tokens, log-probs to float32 rounding; prompts of 1 to 7 tokens (the shortest is all
    padding in the shared prefill)."""
    prompts = PROMPTS + [[11]]
    shared = engine.generate(prompts, params, seed=5)
    repeated = engine.generate([p for p in prompts for _ in range(params.n)], dataclasses.replace(params, n=1), seed=5)
    flat = [c for g in shared for c in g]
    assert [c.token_ids for c in flat] == [g[0].token_ids for g in repeated]
    assert [c.finish_reason for c in flat] == [g[0].finish_reason for g in repeated]
    diff = max(abs(a - b) for c, g in zip(flat, repeated) for a, b in zip(c.logprobs, g[0].logprobs))
    assert diff < 1e-5


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
