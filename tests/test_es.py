"""``megadiv es``: the authors' ES update against a hand computation, elitism, the antithetic
population, and (slow) a real ES over two generations of tiny training runs, killed and resumed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megadiv.experiments.es import ESSettings, ESState, antithetic, es_gradient, next_state
from tests._drivers import kill_group_when
from tests.torchrun import cpu_tier_env

REPO = Path(__file__).resolve().parents[1]
F64 = torch.float64


def test_update_matches_a_hand_computation():
    """P = 4 in 2 dimensions, sigma 0.5, lr 0.1; the candidate with fitness 0 is a failed run and
    is left out: grad = (0.6 e1 + 0.2 e2 + 0.4 e4) / (3 * 0.5)."""
    eps = [torch.tensor(v, dtype=F64) for v in ([1.0, 2.0], [-1.0, -2.0], [0.5, -3.0], [-0.5, 3.0])]
    fitness = [0.6, 0.2, 0.0, 0.4]
    # by hand: 0.6*(1,2) + 0.2*(-1,-2) + 0.4*(-0.5,3) = (0.6-0.2-0.2, 1.2-0.4+1.2) = (0.2, 2.0); / 1.5
    want_grad = torch.tensor([0.2 / 1.5, 2.0 / 1.5], dtype=F64)
    torch.testing.assert_close(es_gradient(eps, fitness, 0.5), want_grad, rtol=1e-15, atol=0)
    settings = ESSettings(population=4, lr=0.1)
    state, accepted = next_state(ESState(torch.tensor([1.0, 1.0], dtype=F64), best_mean=0.2), eps, fitness, 0.5,
                                 settings)
    assert accepted and state.best_mean == pytest.approx(0.3, abs=1e-16) and state.elites == []
    torch.testing.assert_close(state.centre, torch.tensor([1.0 + 0.02 / 1.5, 1.0 + 0.2 / 1.5], dtype=F64),
                               rtol=1e-15, atol=0)
    assert torch.equal(es_gradient(eps, [0.0] * 4, 0.5), torch.zeros(2, dtype=F64))   # all failed: no step


def test_rejection_keeps_the_centre_and_the_top_quarter_as_elites():
    eps = [torch.full((3,), float(i), dtype=F64) for i in range(10)]
    fitness = [0.1, 0.5, 0.3, 0.9, 0.2, 0.8, 0.0, 0.4, 0.6, 0.7]
    centre = torch.ones(3, dtype=F64)
    state, accepted = next_state(ESState(centre, best_mean=0.6), eps, fitness, 0.01, ESSettings())
    assert not accepted and torch.equal(state.centre, centre) and state.best_mean == 0.6
    # the authors' max(2, even(10 // 4)) = 2 best: fitness 0.8 (index 5) and 0.9 (index 3)
    assert sorted(f for _, f in state.elites) == [0.8, 0.9]
    assert {int(e[0]) for e, _ in state.elites} == {3, 5}
    assert ESSettings(population=2).elites_on_reject == 0          # capped: someone is always trained
    assert ESSettings(population=16).elites_on_reject == 4


def test_update_stays_in_the_convex_orthant_and_pairs_are_antithetic():
    eps = antithetic(6, seed=3)
    assert len(eps) == 6 and all(torch.equal(eps[k], -eps[k + 1]) for k in (0, 2, 4))
    assert all(torch.equal(a, b) for a, b in zip(eps, antithetic(6, seed=3)))
    state, _ = next_state(ESState(torch.zeros(380, dtype=F64)), eps, [1.0, 0.0, 0.5, 0.2, 0.3, 0.1], 0.01,
                          ESSettings(population=6, lr=1.0))
    assert (state.centre >= 0).all() and (state.centre > 0).any()


def _es_run(tmp_path: Path, init: str = "config", projection: str = "orthant"):
    from megadiv.experiments.es import ESRun

    return ESRun(tmp_path / "es", [str(REPO / "examples/tiny/grpo.yaml"), "loss.regularizer=sampled_mirror",
                                   "loss.regularizer_coef=1e-4"], ESSettings(init=init, projection=projection))


def test_authors_init_perturbations_and_unconstrained_update(tmp_path):
    """--init authors starts at numpy's RandomState(42).randn(380) * 0.01 (their
    initialize_es_state); perturbations are rows of RandomState(seed + g).randn (their
    sample_perturbations); --projection none keeps negative entries and trains candidates with
    allow_nonconvex, the default projects (ours)."""
    import numpy as np

    want = np.random.RandomState(42).randn(380) * 0.01
    es = _es_run(tmp_path / "a", "authors", "none")
    assert torch.equal(es.start(), torch.from_numpy(want)) and (es.start() < 0).sum() > 150
    rows = np.random.RandomState(42 + 3).randn(2, 380)
    eps = antithetic(4, 42 + 3)
    for k in range(2):
        assert torch.equal(eps[2 * k], torch.from_numpy(rows[k])) and torch.equal(eps[2 * k + 1], -torch.from_numpy(rows[k]))
    cmd = es._train_command("g000-c000", tmp_path / "p.json")
    assert "loss.mirror_map.allow_nonconvex=true" in cmd
    state, _ = next_state(ESState(es.start()), eps, [0.5, 0.1, 0.2, 0.3], 0.01, es.settings)
    assert (state.centre < 0).any()                       # unconstrained, as the authors' update
    default = _es_run(tmp_path / "b", "authors")
    assert torch.equal(default.start(), torch.from_numpy(want).clamp_min(0))
    assert not any("allow_nonconvex" in a for a in default._train_command("x", tmp_path / "p.json"))
    from megadiv.divergence.mirror_map import MirrorMapConfig
    assert torch.equal(_es_run(tmp_path / "c").start(), MirrorMapConfig().vector())   # --init config: ours


def test_es_refuses_a_config_without_a_mirror_map(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megadiv.cli", "es", str(REPO / "examples/tiny/grpo.yaml"),
                           "--out", str(tmp_path / "es")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "set loss.regularizer" in proc.stderr


# The tiny demo shrunk to seconds per candidate: TP=1, 2 GRPO steps, 4 prompts x 4 samples.
TINY_ES = ["parallel.tensor_parallel=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
           "warm_start.sft_steps=5", "warm_start.sft_batch_size=16", "grpo.steps=2", "grpo.prompts_per_step=4",
           "rollout.n_samples=4", "advantage.group_size=4", "grpo.micro_batch_size=8", "grpo.mini_batches=1",
           "eval.data.max_items=20", "eval.every=0", "eval.samples=0", "checkpoint.every=1",
           "loss.regularizer=sampled_mirror", "loss.regularizer_coef=1e-4"]


def _es_command(tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "megadiv.cli", "es", str(REPO / "examples/tiny/grpo.yaml"), *TINY_ES,
            f"model.hf_dir={tmp_path}/init", "--population", "2", "--generations", "2", "--sigma", "0.01",
            "--out", str(tmp_path / "es")]


@pytest.mark.slow
def test_es_end_to_end_killed_and_resumed(tmp_path):
    """Kill the ES (and its candidate) once the first candidate is in history.jsonl; the same
    command resumes at the second candidate and finishes 2 generations x 2 candidates."""
    history = tmp_path / "es" / "history.jsonl"
    env = cpu_tier_env(OMP_NUM_THREADS="1")   # candidates run --nproc ranks: gloo, even on a GPU machine
    proc = subprocess.Popen(_es_command(tmp_path), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    kill_group_when(proc, lambda: history.is_file() and history.read_text().count("\n") >= 1, 600,
                    "the first candidate")
    first = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(first) == 1 and (first[0]["generation"], first[0]["index"]) == (0, 0)

    out = subprocess.run(_es_command(tmp_path), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["generation"], r["index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert records[0] == first[0]                       # the finished candidate was not retrained
    assert not any(r["failed"] for r in records)
    assert all(0 <= r["fitness"] <= 1 for r in records)
    best = json.loads((tmp_path / "es" / "best.json").read_text())
    assert len(best["params"]) == 380 and min(best["params"]) >= 0
    assert (tmp_path / "es" / "es.png").stat().st_size > 0
    # every candidate trained with exactly its params file (mirror_map.json in its run directory)
    for r in records:
        used = json.loads(Path(r["run_dir"], "mirror_map.json").read_text())
        assert used == json.loads(Path(r["params"]).read_text())
    # antithetic: the two candidates of generation 0 sit symmetrically about the starting centre
    # (loss.mirror_map's seed-42 map) wherever the projection onto the orthant left them alone
    from megadiv.divergence.mirror_map import MirrorMapConfig
    p0, p1 = (torch.tensor(json.loads(Path(r["params"]).read_text()), dtype=F64) for r in records[:2])
    free = (p0 > 0) & (p1 > 0)
    assert free.sum() > 100
    torch.testing.assert_close(((p0 + p1) / 2)[free], MirrorMapConfig().vector()[free], rtol=0, atol=1e-17)


def test_gbmpo_mirror_recipes_validate(tmp_path):
    """The mirror-map overlays validate on the tiny recipe here, and on the MBPP task recipe when it
    is present (examples/gbmpo/mbpp.yaml comes with the MBPP reproduction work)."""
    from megadiv.config import load_config
    from megadiv.trainer.config import TrainConfig

    gbmpo = REPO / "examples" / "gbmpo"
    cfg = load_config(TrainConfig, [REPO / "examples/tiny/grpo.yaml", gbmpo / "neural_mirror.yaml"])
    assert cfg.loss.regularizer == "sampled_mirror" and cfg.loss.regularizer_coef == 1e-4
    assert cfg.loss.mirror_map.seed == 42 and cfg.loss.uses_mirror_map
    if not (gbmpo / "mbpp.yaml").is_file():
        pytest.skip("examples/gbmpo/mbpp.yaml is not on this branch")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "num_hidden_layers": 36}))
    files = [gbmpo / "mbpp.yaml", gbmpo / "neural_mirror.yaml", gbmpo / "mirror_es.yaml"]
    es = load_config(TrainConfig, files, [f"model.hf_dir={tmp_path}"])
    assert es.data.split == "gbmpo_train" and es.eval.data.split == "gbmpo_validation" and es.grpo.steps == 100
    assert es.loss.uses_mirror_map and es.advantage.estimator == "dr_grpo"
    files = [gbmpo / "gsm8k.yaml", gbmpo / "neural_mirror.yaml", gbmpo / "mirror_es_gsm8k.yaml"]
    es = load_config(TrainConfig, files, [f"model.hf_dir={tmp_path}"])   # GSM8K: disjoint inner-train / validation
    assert (es.data.name, es.data.split, es.eval.data.name, es.eval.data.split) == (
        "gsm8k", "gbmpo_train", "gsm8k", "gbmpo_validation") and es.grpo.steps == 100


def test_slurm_array_script_runs_each_candidate(tmp_path, monkeypatch):
    """--launcher slurm: one array over the untrained candidates, submitted with sbatch --wait and the
    user's options; each task index runs exactly its candidate's command (sbatch stubbed on PATH)."""
    from megadiv.experiments.es import submit_slurm_array

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/sbatch_args\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "es"
    commands = {1: ["sh", "-c", f"echo one > {tmp_path}/ran1"], 3: ["sh", "-c", f"echo 'three x' > {tmp_path}/ran3"]}
    submit_slurm_array(out, 2, commands, "-p gpu --gres=gpu:8")
    script = out / "slurm" / "generation_002.sbatch"
    assert (tmp_path / "sbatch_args").read_text().split() == ["--wait", "-p", "gpu", "--gres=gpu:8", str(script)]
    text = script.read_text()
    assert "#SBATCH --array=1,3" in text and f"#SBATCH --output={out / 'runs'}/g002-c%3a.log" in text
    for task, want in ((1, "one"), (3, "three x")):
        subprocess.run(["bash", str(script)], env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task)}, check=True,
                       timeout=30)
        assert (tmp_path / f"ran{task}").read_text().strip() == want
    assert not (tmp_path / "ran0").exists()
