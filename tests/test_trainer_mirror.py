"""The run's mirror map in real training (``megadiv train``, sampled_mirror regulariser): pinned
by loss.mirror_map.seed or .params, written to mirror_map.json, identical on both ranks of a TP=2
run and at every step, kept on resume (a different map on resume is refused)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megadiv.divergence.mirror_map import MirrorMapConfig, fingerprint, save_vector
from tests.test_trainer import CONFIG, REPO, TINY, megadiv_train, step_records


def test_pinned_map_is_identical_across_ranks_and_steps_and_the_check_bites(tmp_path):
    """Two ranks with different global RNG states build the same map (its own generator), write
    it once, and pass the per-step check; a rank-dependent value or a map changed mid-run fails."""
    from tests.torchrun import run_torchrun

    ranks = run_torchrun("tests.dist.mirror_map:pinned_map", 2, timeout_s=300, args={"run_dir": str(tmp_path)})
    want = fingerprint(MirrorMapConfig(seed=5).vector())
    assert [r["pinned"] for r in ranks] == [want, want]
    assert all(r["per_step"] == [want] * 3 for r in ranks)
    assert all("a test value differs between ranks" in r["caught"] for r in ranks)
    assert all("changed during the run" in r["changed"] for r in ranks)
    assert torch.equal(saved_map(tmp_path), MirrorMapConfig(seed=5).vector())


# overlong shaping: rewards that vary with the length, so the first step moves the policy off the reference
MIRROR = ["loss.regularizer=sampled_mirror", "loss.regularizer_coef=1e-2", "eval.every=0", "eval.samples=0",
          "grpo.steps=2", "grpo.mini_batches=1", "grpo.overlong_buffer=3"]


def saved_map(run_dir) -> torch.Tensor:
    return torch.tensor(json.loads((run_dir / "mirror_map.json").read_text()), dtype=torch.float64)


@pytest.mark.slow
def test_mirror_map_is_pinned_per_run(tmp_path):
    tp2, tp1, given = tmp_path / "tp2", tmp_path / "tp1", tmp_path / "given"
    megadiv_train(tp2, *MIRROR, "loss.mirror_map.seed=5", "parallel.tensor_parallel=2", nproc=2)
    megadiv_train(tp1, *MIRROR, "loss.mirror_map.seed=5", "parallel.tensor_parallel=1", nproc=1)
    # same seed -> the same 380 floats, bit for bit, whatever the layout (and the seed's own generator)
    assert torch.equal(saved_map(tp2), saved_map(tp1))
    assert torch.equal(saved_map(tp2), MirrorMapConfig(seed=5).vector())
    # every step of the TP=2 run used that map on both ranks (the trainer all-reduces the check)
    for run in (tp2, tp1):
        steps = step_records(run)
        assert [r["step"] for r in steps] == [1, 2]
        assert all(r["mirror_map/fingerprint"] == fingerprint(saved_map(run)) for r in steps)
        # D_h(pi || pi_ref) is exactly 0 while pi = pi_ref (step 1), then positive
        assert steps[0]["loss/regularizer"] == 0.0 and steps[1]["loss/regularizer"] > 0

    # params=F: the run writes F's values
    f = torch.rand(380, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 0.05
    save_vector(f, tmp_path / "F.json")
    megadiv_train(given, *MIRROR, f"loss.mirror_map.params={tmp_path / 'F.json'}", "parallel.tensor_parallel=1",
                  nproc=1)
    assert torch.equal(saved_map(given), f)

    # resuming with another map is refused before anything trains; the run directory is untouched
    cmd = [sys.executable, "-m", "megadiv.cli", "train", str(CONFIG), f"run.output_dir={tmp_path}", "run.name=tp1",
           f"model.hf_dir={tp1}/init", *TINY, *MIRROR, "grpo.steps=3", "loss.mirror_map.seed=6",
           "parallel.tensor_parallel=1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "differs from loss.mirror_map" in proc.stderr
    assert torch.equal(saved_map(tp1), MirrorMapConfig(seed=5).vector())
