"""The optional algorithm pieces inside real ``megadiv train`` steps (megatron-core, embedded
engine, real rewards), each with a figure that only comes out right when the piece does its job:

    KL in the reward   pi_old = pi_ref at step 1, so the penalty is exactly 0; then > 0
    dynamic sampling   either every group kept, or all resample rounds used
    TIS                pi_old / pi_rollout ~ 1 (the engine serves the trainer's weights), none capped
    GSPO               on-policy (one update per batch) the sequence ratio is 1: nothing clipped
    SAPO               on-policy the gate's slope 4 s (1 - s) at w = 1 is exactly 1
"""
from __future__ import annotations

import math

import pytest

from tests.test_trainer import megadiv_train, step_records

COMMON = ["grpo.steps=2", "grpo.mini_batches=1", "eval.every=0", "eval.samples=0", "parallel.tensor_parallel=1"]


@pytest.mark.slow
def test_kl_in_reward_dynamic_sampling_tis_and_gspo(tmp_path):
    run = tmp_path / "gspo"
    megadiv_train(run, *COMMON, "loss.policy_loss=gspo", "loss.eps_low=3e-4", "loss.eps_high=4e-4",
                  "loss.kl_coef=0.05", "loss.kl_placement=reward", "grpo.dynamic_sampling=true",
                  "grpo.max_resample_rounds=2", "loss.tis_cap=2.0",
                  # DAPO's overlong shaping gives rewards that vary with the length even while the
                  # barely warm-started model answers nothing right: the first step does update
                  "grpo.overlong_buffer=3", nproc=1)
    steps = step_records(run)
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["grad_norm"] > 0
    assert steps[0]["reward/kl_penalty_mean"] == 0.0 and steps[1]["reward/kl_penalty_mean"] > 0
    assert "loss/kl" not in steps[0]                          # not in the loss as well
    for r in steps:
        assert r["dynamic/kept_groups"] == 1.0 or r["dynamic/rounds"] == 3, r
        assert abs(r["tis/weight_mean"] - 1) < 1e-3 and r["tis/truncated_frac"] == 0
        assert r["clip/frac_low"] == 0 and r["clip/frac_high"] == 0
        assert math.isfinite(r["loss/total"]) and r["skipped"] == 0


@pytest.mark.slow
def test_sapo(tmp_path):
    run = tmp_path / "sapo"
    megadiv_train(run, *COMMON, "loss.policy_loss=sapo", "grpo.overlong_buffer=3", nproc=1)  # signal: see above
    steps = step_records(run)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["sapo/slope_mean"] == pytest.approx(1.0, abs=1e-12) and r["skipped"] == 0 for r in steps)
    assert steps[0]["grad_norm"] > 0
