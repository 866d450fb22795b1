"""Trainer pieces: packing rows, shaping, dynamic sampling, and the Policy's layout independence."""
from __future__ import annotations

import pytest
import torch

from megadiv.divergence import AdvantageConfig
from megadiv.rollout import Completion
from megadiv.trainer.experience import (build_experience, informative_groups, overlong_shaping, take_groups)
from megadiv.trainer.policy import SequenceBatch
from tests.torchrun import run_torchrun


def test_pack_puts_the_mask_on_positions_that_predict_response_tokens():
    b = SequenceBatch.pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0, response_values=[[-.1, -.2], [-.3, -.4, -.5]])
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    # position t predicts token t + 1: the last prompt token's position predicts the first response token
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert b.logp_rollout[0, 2:4].tolist() == pytest.approx([-.1, -.2])
    assert b.logp_rollout[1, 0:3].tolist() == pytest.approx([-.3, -.4, -.5])
    assert len(b.micro_batches(1)) == 2 and b.rows(slice(1, 2)).tokens.tolist() == [[8, 3, 4, 9, 0]]


def test_overlong_shaping_is_dapos_linear_ramp():
    lengths = torch.tensor([10, 12, 14, 16])
    assert overlong_shaping(lengths, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_shaping(lengths, 16, 0, 1.0).tolist() == [0.0] * 4


def _completions(rewards_per_group):
    return [[Completion([1] * (i + 1), [-0.5] * (i + 1), "stop", "v") for i, _ in enumerate(g)]
            for g in rewards_per_group]


def test_experience_advantages_and_dynamic_sampling():
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    exp = build_experience([[7], [8], [9], [10]], _completions(rewards), sum(rewards, []),
                           ["correct" if r else "wrong" for r in sum(rewards, [])],
                           AdvantageConfig(estimator="grpo", group_size=2), max_new_tokens=8)
    assert exp.prompts == [[7], [7], [8], [8], [9], [9], [10], [10]]
    assert exp.metrics["reward/uniform_groups"] == 0.5 and exp.metrics["reward/reason_correct"] == 0.5
    assert exp.advantages[2:6].abs().max() == 0  # equal rewards: no signal
    assert informative_groups(exp, 2) == [0, 3]
    kept = take_groups(exp, [3], 2)
    assert kept.prompts == [[10], [10]] and kept.rewards.tolist() == [0.0, 1.0]


def test_mask_truncated_drops_cut_completions_from_the_loss_only():
    groups = [[Completion([1, 2], [-0.5] * 2, "length", "v"), Completion([3], [-0.5], "stop", "v")],
              [Completion([4], [-0.5], "stop", "v"), Completion([5, 6], [-0.5] * 2, "length", "v")]]
    args = ([[7], [8]], groups, [1.0, 0.0, 1.0, 0.0], ["correct", "wrong", "correct", "wrong"],
            AdvantageConfig(estimator="dr_grpo", group_size=2), 2)
    kept, masked = build_experience(*args), build_experience(*args, mask_truncated=True)
    assert masked.advantages.tolist() == kept.advantages.tolist() == [0.5, -0.5, 0.5, -0.5]  # baseline unchanged
    assert masked.in_loss.tolist() == [0.0, 1.0, 1.0, 0.0] and kept.in_loss.tolist() == [1.0] * 4
    assert masked.metrics["response/truncated_frac"] == 0.5
    full, cut = kept.to_batch(pad_id=0).loss_mask, masked.to_batch(pad_id=0).loss_mask
    assert full.sum(-1).tolist() == [2, 1, 1, 2] and cut.sum(-1).tolist() == [0, 1, 1, 0]
    assert take_groups(masked, [1], 2).in_loss.tolist() == [1.0, 0.0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=64, heads=4, kv_heads=2, ffn=128, layers=2))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_steps_do_not_depend_on_the_layout(tiny_model, agg):
    """TP=1, TP=2 and PP=2 (also DP=2 at TP=1) give the same losses, gradient norms, metrics and
    updated weights: per-token loss scaling over micro-batches and DP, grad norms that count each
    TP shard once (megatron-core sets TP attributes only with CPU init, see builder.py), metrics
    reduced over stages. A NaN step is skipped without touching the weights."""
    runs = {name: run_torchrun("tests.dist.trainer_policy:policy_steps", nproc, timeout_s=400,
                               args={"tp": tp, "pp": pp, "hf_dir": tiny_model, "agg": agg})
            for name, (tp, pp, nproc) in {"tp1": (1, 1, 1), "tp2": (2, 1, 2), "pp2": (1, 2, 2)}.items()}
    ref = runs["tp1"][0]
    assert ref["steps"][-1]["loss/total"] != ref["steps"][0]["loss/total"]  # it learns
    for name, results in runs.items():
        for r in results:
            assert r["skipped"] == 1.0 and r["unchanged"]
            for s, s_ref in zip(r["steps"], ref["steps"]):
                for key in ("loss/total", "loss/kl", "grad_norm", "entropy", "clip/frac_low", "clip/frac_high",
                            "ratio/max", "ratio/min", "ref/k3"):
                    assert s[key] == pytest.approx(s_ref[key], rel=1e-5, abs=1e-6), (name, key)
        last = [r["logp_sum"] for r in results if r["logp_sum"] is not None]
        assert last and last[0] == pytest.approx(ref["logp_sum"], rel=1e-5), name


def test_full_vocabulary_regularizer_in_training_does_not_depend_on_tp(tiny_model):
    """A full-vocabulary ProbL2 regulariser on the actor's and the reference's logit shards (the
    reference logits recomputed per micro-batch and consumed): TP=2 trains exactly like TP=1."""
    runs = [run_torchrun("tests.dist.trainer_policy:policy_steps", nproc, timeout_s=400,
                         args={"tp": tp, "pp": 1, "hf_dir": tiny_model, "agg": "token-mean",
                               "regularizer": "full_prob_l2"})
            for tp, nproc in ((1, 1), (2, 2))]
    ref = runs[0][0]
    assert ref["steps"][-1]["loss/regularizer"] > 0
    for r in runs[1]:
        for s, s_ref in zip(r["steps"], ref["steps"]):
            for key in ("loss/total", "loss/regularizer", "grad_norm", "entropy"):
                assert s[key] == pytest.approx(s_ref[key], rel=1e-5, abs=1e-7), key
