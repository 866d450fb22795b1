"""Token-budget micro-batches (grpo.max_tokens_per_micro_batch): the grouping, the config checks,
and training equal to the padded path at TP=1, TP=2, PP=2 and DP=2, for the budget and for the
default (rows grouped by length, micro_batch_size each)."""
from __future__ import annotations

import math

import pytest
import torch

from megadiv.config import ConfigError
from megadiv.policy.batches import ModelInput, SequenceBatch, row_lengths, token_budget_groups
from tests.dist.token_budget import AGGREGATIONS, BUDGET, PROMPT_LENGTHS, RESPONSE_LENGTHS, skewed_batch
from tests.torchrun import run_torchrun


def test_groups_are_sorted_runs_within_the_budget():
    # longest first; each run: rows x its longest row (rounded up to the multiple) <= budget
    assert token_budget_groups([9, 2, 8, 3, 2, 1], 18, max_rows=8) == [[0, 2], [3, 1, 4, 5]]
    assert token_budget_groups([9, 2, 8, 3, 2, 1], 18, max_rows=3) == [[0, 2], [3, 1, 4], [5]]
    assert token_budget_groups([9, 2, 8, 3, 2, 1], 18, max_rows=8, multiple=4) == [[0], [2, 3], [1, 4, 5]]
    assert token_budget_groups([30, 2], 16, max_rows=8) == [[0], [1]]  # longer than the budget: alone
    lengths = torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = token_budget_groups(lengths, 100, max_rows=6, multiple=2)
    assert sorted(i for g in groups for i in g) == list(range(40))
    for g in groups:
        assert len(g) <= 6 and len(g) * -(-max(lengths[i] for i in g) // 2) * 2 <= 100
        assert lengths[g[0]] == max(lengths[i] for i in g)


def test_micro_batches_keep_every_row_and_feed_each_at_its_own_width():
    batch = skewed_batch()
    lengths = row_lengths(batch.loss_mask)
    assert lengths.tolist() == [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    assert max(RESPONSE_LENGTHS) / min(RESPONSE_LENGTHS) == 10
    parts, order = batch.by_token_budget(BUDGET, max_rows=4)
    assert sorted(order.tolist()) == list(range(len(batch)))
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens[order])
    fed = [ModelInput.padded(p, int(row_lengths(p.loss_mask).max())) for p in parts]
    assert all(x.tokens.numel() <= BUDGET for x in fed)
    padded, budget = batch.tokens.numel(), sum(x.tokens.numel() for x in fed)
    assert budget < padded / 1.5  # 8 x 36 = 288 tokens padded, 160 under the budget
    # the fed columns of the rows, zeros after them
    x, rows = fed[-1], parts[-1].tokens
    assert torch.equal(x.tokens, rows[:, :x.tokens.shape[1]]) and rows[:, x.tokens.shape[1]:].abs().sum() == 0


def test_a_row_without_response_tokens_keeps_its_place():
    batch = SequenceBatch.pack([[5, 6], [7]], [[1, 2, 3], [4]], pad_id=0)
    batch.loss_mask[1] = 0  # e.g. grpo.mask_truncated
    assert row_lengths(batch.loss_mask).tolist() == [5, 1]
    parts, order = batch.by_token_budget(8, max_rows=8)
    assert order.tolist() == [0, 1] and [len(p) for p in parts] == [1, 1]


def test_packing_concatenates_the_rows_and_unpacks_them_in_place():
    """THD: rows of 5, 1 and 3 tokens -> one row of 9 (rounded up to 12 by extending the last row),
    positions restarting per row, cumulative lengths for Transformer Engine; the response positions
    (index) at their packed offsets, and values come back to the rows' own positions with gradients
    flowing through (tests/test_response_logits.py: the padded layout too)."""
    rows = SequenceBatch.pack([[1, 2, 3], [6], [7]], [[4, 5], [], [8, 9]], pad_id=0)
    x = ModelInput.packed(rows, multiple=4)
    assert x.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert x.positions.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5]]
    params = x.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 6, 12]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == 6
    assert x.index.tolist() == [2, 3, 6, 7] and x.targets.tolist() == [4, 5, 8, 9]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    back = x.to_rows(values[None])
    assert back.tolist() == [[0, 0, 1, 2, 0], [0, 0, 0, 0, 0], [3, 4, 0, 0, 0]]
    back.sum().backward()
    assert values.grad.tolist() == [1.0] * 4


def _cfg(**over):
    from megadiv.config import ModelConfig, ParallelConfig
    from megadiv.rollout import RolloutConfig
    from megadiv.trainer.config import GRPOConfig, TrainConfig, WarmStartConfig

    parallel = over.pop("parallel", ParallelConfig())
    model = over.pop("model", {})
    return TrainConfig(model=ModelConfig(hf_dir="/nonexistent", **model),
                       warm_start=WarmStartConfig(make_model="qwen2"), rollout=RolloutConfig(max_new_tokens=64),
                       parallel=parallel, grpo=GRPOConfig(prompts_per_step=2, **{"micro_batch_size": 3, **over}))


def test_config_checks_the_budget():
    from megadiv.config import ParallelConfig

    cfg = _cfg(max_tokens_per_micro_batch=65)  # no whole micro_batch_size split needed under a budget
    assert cfg.grpo.max_tokens_per_micro_batch == 65
    with pytest.raises(ConfigError, match="must split into"):
        _cfg()  # 16 rows do not split into micro-batches of 3
    with pytest.raises(ConfigError, match="cannot hold one full-length row.*64.*65 tokens"):
        _cfg(max_tokens_per_micro_batch=64)
    with pytest.raises(ConfigError, match="sequence multiple 16, is 80 tokens"):
        _cfg(max_tokens_per_micro_batch=65, model={"fp8": "tensorwise"})
    with pytest.raises(ConfigError, match=">= 1"):
        _cfg(max_tokens_per_micro_batch=0)
    assert _cfg(max_tokens_per_micro_batch=65).grpo.pack_sequences is None  # auto: where TE attention runs
    assert _cfg(micro_batch_size=4, pack_sequences=True).grpo.pack_sequences  # no budget needed
    with pytest.raises(ConfigError, match="pack_sequences cannot be combined with parallel.virtual_pipeline"):
        _cfg(micro_batch_size=4, pack_sequences=True, parallel=ParallelConfig(pipeline_parallel=2, virtual_pipeline=2))
    with pytest.raises(ConfigError, match="transformer_impl is 'local'"):
        _cfg(max_tokens_per_micro_batch=100, pack_sequences=True, model={"transformer_impl": "local"})
    with pytest.raises(ConfigError, match="virtual_pipeline"):
        _cfg(max_tokens_per_micro_batch=100, parallel=ParallelConfig(pipeline_parallel=2, virtual_pipeline=2))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=64, heads=4, kv_heads=2, ffn=128, layers=3))


# name -> (TP, PP, ranks, extra args)
LAYOUTS = {"tp1": (1, 1, 1, {}), "tp2": (2, 1, 2, {}),
           "pp2": (1, 2, 2, {"stage_layers": [2, 1]}), "dp2": (1, 1, 2, {})}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tiny_model):
    tp, pp, nproc, extra = LAYOUTS[request.param]
    results = run_torchrun("tests.dist.token_budget:budget_vs_padded", nproc, timeout_s=600,
                           args={"tp": tp, "pp": pp, "hf_dir": tiny_model, **extra})
    return request.param, results


# Observed budget vs padded (float32 weights, float64 metric reductions; the two paths sum the same
# terms in other orders and run matmuls of other shapes): metrics <= 5.4e-6 relative (TP=2; 1.5e-6
# elsewhere), weights after two clipped SGD steps <= 1.2e-7 absolute, log-probs <= 3.4e-6 absolute.
METRIC_TOL = dict(rel=1e-5, abs=1e-7)
WEIGHT_ATOL, LOGP_ATOL = 1e-6, 1e-5


@pytest.mark.parametrize("path", ["grouped", "budget"])
def test_length_grouped_micro_batches_train_like_the_padded_path(layout, path):
    """For every loss aggregation (and a full-vocabulary regulariser at PP=1): two SGD steps from the
    same weights, padded (2 rows per micro-batch in batch order, all at the batch's width) and
    grouped by length, 2 rows each (the default) or under the token budget: the same losses, KL,
    entropy, gradient norms, weights after the steps, and reference, old and updated log-probs in
    the batch's row order, on every rank."""
    name, results = layout
    tp, pp, nproc, _ = LAYOUTS[name]
    worst = {"metric_rel": 0.0, "weight_abs": 0.0, "logp_abs": 0.0}  # printed with -s: the observed figures
    for rank, r in enumerate(results):
        assert r["dp_size"] == nproc // (tp * pp)
        runs = [k for k in r if isinstance(k, tuple)]
        assert len(runs) == len(AGGREGATIONS) + (pp == 1)
        for run in runs:
            padded, budget = r[run]["padded"], r[run][path]
            for step, (p, b) in enumerate(zip(padded["steps"], budget["steps"], strict=True)):
                assert p["skipped"] == b["skipped"] == 0.0
                for key in ("loss/total", "loss/policy", "loss/kl", "grad_norm", "entropy", "clip/frac_low",
                            "clip/frac_high") + (("loss/regularizer",) if run[1] else ()):
                    assert b[key] == pytest.approx(p[key], **METRIC_TOL), (name, rank, run, step, key, b[key], p[key])
                    worst["metric_rel"] = max(worst["metric_rel"], abs(b[key] - p[key]) / max(abs(p[key]), 1e-7))
            assert padded["steps"][1]["loss/kl"] > 0 and padded["steps"][1]["grad_norm"] > 0
            for k, w in padded["weights"].items():
                torch.testing.assert_close(budget["weights"][k], w, rtol=0, atol=WEIGHT_ATOL,
                                           msg=lambda m, rank=rank, run=run, k=k: f"{name} rank {rank} {run} {k}: {m}")
                worst["weight_abs"] = max(worst["weight_abs"], float((budget["weights"][k] - w).abs().max()))
            if padded["logp_after"] is None:  # not a last pipeline stage: no log-probs here
                assert budget["logp_after"] is None
                continue
            # positions that predict a token of their row (past it: padding, never read)
            columns = torch.arange(padded["logp_after"].shape[1])
            predicts = columns[None] < torch.tensor(r["lengths"])[:, None] - 1
            for key in ("logp_ref", "logp_old", "logp_after"):
                assert budget[key].shape == padded[key].shape
                torch.testing.assert_close(budget[key][predicts], padded[key][predicts], rtol=0, atol=LOGP_ATOL,
                                           msg=lambda m, rank=rank, run=run, key=key: f"{name} rank {rank} {run} {key}: {m}")
                worst["logp_abs"] = max(worst["logp_abs"], float((budget[key] - padded[key])[predicts].abs().max()))
    print(f"\n{name}: {path} vs padded, largest differences {worst}; micro-batches per rank "
          f"{[r['micro_batches'] for r in results]}")


def test_dp_replicas_may_form_different_numbers_of_micro_batches(layout):
    """Megatron's schedules and gradient reduction need no common micro-batch count over DP: the
    replica with the long rows runs more micro-batches, and the step above still matched."""
    name, results = layout
    if name == "dp2":
        assert results[0]["micro_batches"] > results[1]["micro_batches"]


def test_packing_is_refused_without_transformer_engine_and_off_by_default_there(layout):
    name, results = layout
    if name == "tp1":
        assert "grpo.pack_sequences needs the Transformer Engine layer spec" in results[0]["pack_refused"]
    assert not any(r["packs_by_default"] for r in results)  # megatron's local spec: padded rows


@pytest.mark.slow
def test_grpo_steps_under_a_token_budget_at_pp2(tmp_path):
    """``megadiv train`` end to end at PP=2 with a token budget: micro-batches of varying shapes
    through the pipeline (reference-free on-policy steps, old log-probs for two mini-batches, the
    post-sync probe), every step applied, and the engine serving the trainer's weights."""
    from tests.test_trainer import megadiv_train, step_records

    run = tmp_path / "budget"
    out = megadiv_train(run, "grpo.steps=2", "grpo.mini_batches=2", "eval.every=0", "eval.samples=0",
                        "parallel.tensor_parallel=1", "parallel.pipeline_parallel=2",
                        "grpo.max_tokens_per_micro_batch=24",
                        "grpo.overlong_buffer=3", nproc=2)  # a reward signal: see test_trainer_features.py
    steps = step_records(run)
    assert [r["step"] for r in steps] == [1, 2] and "step 2/2 | " in out
    for r in steps:
        assert r["skipped"] == 0 and math.isfinite(r["loss/total"]) and r["grad_norm"] > 0
        assert r["sync/probe_abs_diff_mean"] < 1e-4
