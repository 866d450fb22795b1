"""End to end: ``megadiv train`` under torchrun on CPU, from a random tiny model to metrics,
checkpoints and exported weights. Each launch is a real run (real megatron-core, embedded engine
or SGLang server, real rewards); the runs are tiny so that the module stays CI-sized."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "grpo.yaml"

# The demo config, shrunk: hidden 64, 5 warm-start steps, 4 prompts x 4 samples, 20 held-out problems.
TINY = ["model.hidden_size=64", "model.ffn_hidden_size=128", "warm_start.sft_steps=5", "warm_start.sft_batch_size=16",
        "grpo.prompts_per_step=4", "rollout.n_samples=4", "advantage.group_size=4", "grpo.micro_batch_size=8",
        "eval.data.max_items=20", "eval.every=1", "eval.samples=2", "checkpoint.every=1", "checkpoint.keep_last=2",
        "grpo.check_mismatch_every=1"]

# What the progress line and metrics.jsonl must carry every step (issue: step, reward, accuracy,
# clip fractions, entropy, KL, response length, time split rollout/reward/train/sync).
STEP_FIELDS = ["step", "reward/mean", "reward/accuracy", "clip/frac_low", "clip/frac_high", "entropy", "old/k3",
               "response/length_mean", "time/rollout", "time/reward", "time/train", "time/sync",
               "sync/probe_abs_diff_mean", "grad_norm", "lr", "guard/skipped_steps"]


def megadiv_train(run_dir: Path, *overrides: str, nproc: int = 2, timeout_s: float = 900) -> str:
    """Run ``megadiv train`` on the tiny config; returns its output, fails the test on error."""
    return run_megadiv("train", str(CONFIG), f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
                       f"model.hf_dir={run_dir}/init", *TINY, *overrides, "--nproc", str(nproc), timeout_s=timeout_s)


def run_megadiv(*args: str, timeout_s: float) -> str:
    """Run ``megadiv ARGS`` in its own process group; returns its output, fails the test on error or
    on timeout (then the whole group, servers included, is killed, as when the test is interrupted)."""
    cmd = [sys.executable, "-m", "megadiv.cli", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # CPU tier: gloo even on a GPU machine (tests/torchrun.py)
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"megadiv {args[0]} timed out after {timeout_s}s:\n{out[-6000:]}")
    except BaseException:  # pytest-timeout's failure, Ctrl-C: nothing of the run may outlive the test
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, f"megadiv {args[0]} failed ({proc.returncode}):\n{out[-8000:]}"
    return out


def step_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r]


def hf_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "hf").glob("*.safetensors")):
        out |= load_file(f)
    return out


# tp2 stays in the fast tier: the one end-to-end run of the megatron backend with the embedded engine
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tensor_parallel=2"], id="tp2"),
    pytest.param(["parallel.tensor_parallel=1", "parallel.pipeline_parallel=2"], id="pp2", marks=pytest.mark.slow)])
def test_two_grpo_steps_end_to_end(tmp_path, layout):
    run_dir = tmp_path / "run"
    out = megadiv_train(run_dir, "grpo.steps=2", "grpo.mask_truncated=true",
                        "eval.extra_data=[{name: arithmetic, split: train, template: raw, max_items: 8}]", *layout)
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        missing = [k for k in STEP_FIELDS if k not in r]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert r["skipped"] == 0 and r["sync/probe_abs_diff_mean"] < 1e-4  # engine serves the trainer's weights
        assert r["sync/probe_limit"] == 0.05  # float32: the step-0 baseline is ~1e-7, rollout.probe_floor rules
    assert "weight-sync probe: " in out and "on identical weights, limit 0.05" in out
    assert "step 2/2 | " in out and "time[s] rollout" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert {"eval/accuracy", "eval/avg@2", "eval/pass@2"} <= set(summary["eval_after"])
    assert summary["eval_after"]["eval/avg@2"] <= summary["eval_after"]["eval/pass@2"]
    extra = {k: v for k, v in summary["eval_after"].items() if k.startswith("eval/arithmetic_train/")}
    assert set(extra) == {"eval/arithmetic_train/pass@1", "eval/arithmetic_train/avg@2", "eval/arithmetic_train/pass@2"}
    assert f"run directory: {run_dir}" in out
    assert (run_dir / "curves.png").stat().st_size > 0 and any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    # each checkpoint (written in the background) is a record of its own once sealed, in step order
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "checkpoint/blocking_s" in r]
    assert [r["step"] for r in saves] == [1, 2] and "checkpoint 2/2 | blocked_s " in out
    assert all(0 < r["checkpoint/blocking_s"] <= r["checkpoint/total_s"] and r["checkpoint/write_s"] > 0 for r in saves)
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    assert len(hf_weights(run_dir)) > 0
    # the exported policy evaluates with the run's prompt template, engine and length
    evaluated = subprocess.run([sys.executable, "-m", "megadiv.cli", "eval", "--model", str(run_dir / "hf"),
                                "--data", "arithmetic", "--limit", "10"], cwd=REPO, capture_output=True, text=True,
                               timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    report = json.loads((run_dir / "eval.json").read_text())
    split = report["results"]["arithmetic:test"]
    assert split["max_new_tokens"] == 4 and split["n"] == 10
    assert "arithmetic:test" in evaluated.stdout and "pass@1" in evaluated.stdout


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """3 steps straight == 2 steps, stop, resume, 1 step: same losses, same final weights."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    megadiv_train(straight, "grpo.steps=3", "eval.every=0")
    out = megadiv_train(resumed, "grpo.steps=3", "eval.every=0", "grpo.stop_after=2")
    assert "stopped after step 2" in out and not (resumed / "summary.json").exists()
    out = megadiv_train(resumed, "grpo.steps=3", "eval.every=0")
    assert "resumed from" in out and "weight-sync probe: " in out  # the baseline, again at the loaded weights
    a, b = step_records(straight), step_records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("loss/total", "reward/mean", "entropy", "grad_norm", "response/length_mean"):
            assert ra[key] == rb[key], (ra["step"], key)
    wa, wb = hf_weights(straight), hf_weights(resumed)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_mbpp_code_reward_step_runs(tmp_path):
    """The plumbing of a code task: MBPP prompts, a tiny model with a BPE tokenizer, the sandboxed
    reward. Rewards are ~0 (the model is random); the step must still run and count reasons."""
    run_dir = tmp_path / "mbpp"
    megadiv_train(run_dir, "grpo.steps=1", "data.name=mbpp", "data.split=train", "data.template=plain",
                  "reward.name=code", "reward.workers=1", "warm_start.tokenizer=bpe", "rollout.max_new_tokens=16", "warm_start.sft_steps=0",
                  "eval.data=null", "model.max_position_embeddings=1024", "parallel.tensor_parallel=2")
    (step,) = step_records(run_dir)
    reasons = sum(step[f"reward/reason_{r}"] for r in ("correct", "wrong", "unparsable", "timeout", "crashed"))
    assert reasons == pytest.approx(1.0)
    assert 0 <= step["reward/mean"] <= 1


@pytest.mark.slow
@pytest.mark.sglang
def test_ranks_wait_for_a_server_slower_to_start_than_the_collective_timeout(tmp_path):
    """Rank 0 starts the server and the driver while the other rank waits on a key of the launch's
    store: a server whose start takes twice parallel.timeout_s (its Python sleeps 30 s first) no
    longer ends that rank in a collective's timeout (on GPUs, the NCCL watchdog)."""
    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\ncase "$*" in *sglang.launch_server*) sleep 30;; esac\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    run_dir = tmp_path / "slow"
    megadiv_train(run_dir, "grpo.steps=1", "rollout.engine=sglang", "rollout.sync_method=distributed",
                  f"rollout.server_python={slow}", "parallel.timeout_s=15", "eval.every=0", "checkpoint.every=0")
    (step,) = step_records(run_dir)
    assert step["rollout/servers"] == 1 and step["sync/probe_abs_diff_mean"] < 1e-4


@pytest.mark.slow
@pytest.mark.sglang
def test_one_step_with_a_fleet_of_two_sglang_servers_at_tp2_dp2(tmp_path):
    """The whole path with a fleet: two launched servers, the driver's process streaming groups to
    both (one group in flight each), 4 ranks (TP=2 x DP=2) receiving their replica's rows; the
    push exported by replica 0 and broadcast once to both servers over one group (the bytes that
    left rank 0 are the model's, not twice), the probe check on both."""
    run_dir = tmp_path / "sglang"
    out = megadiv_train(run_dir, "grpo.steps=1", "rollout.engine=sglang", "rollout.sync_method=distributed",
                        "rollout.num_servers=2", "rollout.max_inflight_groups=1", "eval.every=0",
                        "eval.data.max_items=8", "parallel.tensor_parallel=2", "grpo.micro_batch_size=4",
                        nproc=4, timeout_s=1500)
    (step,) = step_records(run_dir)
    assert step["sync/probe_abs_diff_mean"] < 1e-4, out[-3000:]  # the worst of the two servers
    assert step["rollout/servers"] == 2 and step["rollout/dropped_servers"] == 0
    assert step["sync/bytes_sent"] == sum(t.numel() * t.element_size() for t in hf_weights(run_dir).values())
