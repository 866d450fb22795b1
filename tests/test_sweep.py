"""``megadiv sweep``: the paired test against hand computations, the grid and its refusals, the
per-cell aggregation, and a real 2-cell x 2-seed sweep of tiny runs, interrupted and resumed."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megadiv.config import ConfigError
from megadiv.experiments import significance
from megadiv.experiments.sweep import Sweep, parse_grid, parse_seeds
from tests._drivers import kill_group_when
from tests.torchrun import cpu_tier_env

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples/tiny/grpo.yaml")


def test_paired_t_test_against_a_hand_computation():
    """3 seeds: d = (0.03, 0.01, 0.05), mean 0.03, sd 0.02, t = 0.03 / (0.02 / sqrt 3) = 1.5 sqrt 3;
    with 2 degrees of freedom the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - t / sqrt(2 + t^2)."""
    base = {1: 0.50, 2: 0.61, 3: 0.70}
    cell = {1: 0.53, 2: 0.62, 3: 0.75, 4: 0.99}                 # seed 4 has no baseline: left out
    got = significance.paired_test(cell, base)
    t = 1.5 * math.sqrt(3)
    assert got["seeds"] == [1, 2, 3] and got["n_pairs"] == 3
    assert got["mean_diff"] == pytest.approx(0.03, rel=1e-13)
    assert got["t"] == pytest.approx(t, rel=1e-12)
    assert got["p_value"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12)   # 0.1835...
    # the 95% interval: t_{0.975, 2} = (2q - 1) / sqrt(2 q (1 - q)) at q = 0.975 (df 2 inverts in closed form)
    q975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    lo, hi = got["diff_ci95"]
    assert lo == pytest.approx(0.03 - q975 * 0.02 / math.sqrt(3), rel=1e-12)
    assert hi == pytest.approx(0.03 + q975 * 0.02 / math.sqrt(3), rel=1e-12)
    s = significance.summarise([0.53, 0.62, 0.75])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.6333333333333333, rel=1e-15)
    assert s["std"] == pytest.approx(math.sqrt(((0.53 - 0.19 / 0.3) ** 2 + (0.62 - 0.19 / 0.3) ** 2
                                                + (0.75 - 0.19 / 0.3) ** 2) / 2), rel=1e-13)


def test_paired_t_test_with_five_seeds_against_quadrature():
    """4 degrees of freedom: p = 2 * integral_|t|^inf of the t density, by mpmath quadrature."""
    import mpmath

    d = [0.012, -0.004, 0.020, 0.008, 0.016]
    got = significance.paired_test({s: 0.5 + x for s, x in enumerate(d)}, {s: 0.5 for s in range(5)})
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    t = mean / (sd / math.sqrt(5))
    nu = 4
    density = lambda x: (mpmath.gamma((nu + 1) / 2) / (mpmath.sqrt(nu * mpmath.pi) * mpmath.gamma(nu / 2))
                         * (1 + x * x / nu) ** (-(nu + 1) / 2))
    want = float(2 * mpmath.quad(density, [abs(t), mpmath.inf]))
    assert got["t"] == pytest.approx(t, rel=1e-9)               # the +0.5 / -0.5 round trip costs ~1e-14
    assert got["p_value"] == pytest.approx(want, rel=1e-9)


def test_paired_test_edge_cases():
    one = significance.paired_test({1: 0.6, 2: 0.7}, {1: 0.5})
    assert one["n_pairs"] == 1 and one["p_value"] is None and "needs 2" in one["reason"]
    same = significance.paired_test({1: 0.5, 2: 0.7}, {1: 0.5, 2: 0.7})
    assert same["p_value"] == 1.0 and same["t"] == 0.0                     # no seed differs
    shift = significance.paired_test({1: 0.75, 2: 0.5}, {1: 0.5, 2: 0.25})
    assert shift["p_value"] == 0.0 and shift["t"] == math.inf              # every seed +0.25 exactly
    assert significance.summarise([]) == {"n": 0, "mean": None, "std": None, "ci95": None}
    assert significance.summarise([0.4])["ci95"] is None


def test_grid_and_seed_parsing_refuse_bad_input():
    assert parse_grid(["loss.eps_high=0.2,0.28", "config=a.yaml,b.yaml"]) == [
        ("loss.eps_high", ["0.2", "0.28"]), ("config", ["a.yaml", "b.yaml"])]
    for bad, match in ((["loss.eps_high"], "KEY=V1"), (["loss.nope=1,2"], "not a config key"),
                       (["run.seed=1,2"], "--seeds"), (["loss.delta=1,1"], "once"), ([], "at least one")):
        with pytest.raises(ConfigError, match=match):
            parse_grid(bad)
    assert parse_seeds("3,1,2") == [3, 1, 2]
    with pytest.raises(ConfigError, match="integers"):
        parse_seeds("1,x")


TINY_RUN = ["parallel.tensor_parallel=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "warm_start.sft_steps=5", "warm_start.sft_batch_size=16", "grpo.steps=2", "grpo.prompts_per_step=4",
            "rollout.n_samples=4", "advantage.group_size=4", "grpo.micro_batch_size=8", "grpo.mini_batches=1",
            "eval.data.max_items=100", "eval.every=0", "eval.samples=0", "checkpoint.every=1"]
GRID = ["loss.eps_high=0.2,0.28"]


def test_a_changed_grid_or_base_config_is_refused(tmp_path):
    Sweep([TINY, *TINY_RUN], parse_grid(GRID), [1, 2], tmp_path / "s")
    for grid, args, what in ((["loss.eps_high=0.2,0.3"], TINY_RUN, "different grid"),
                             (GRID, [*TINY_RUN, "optim.lr=1e-3"], "different base config")):
        with pytest.raises(ConfigError, match=what) as e:
            Sweep([TINY, *args], parse_grid(grid), [1, 2], tmp_path / "s")
        assert "\n" not in str(e.value)
    Sweep([TINY, *TINY_RUN], parse_grid(GRID), [1, 2, 3], tmp_path / "s")     # more seeds: same sweep
    with pytest.raises(ConfigError, match="cell loss.eps_high=-1"):            # every cell validated up front
        Sweep([TINY, *TINY_RUN], parse_grid(["loss.eps_high=0.2,-1"]), [1], tmp_path / "t")
    with pytest.raises(ConfigError, match="--baseline"):
        Sweep([TINY, *TINY_RUN], parse_grid(GRID), [1], tmp_path / "s", baseline="loss.eps_high=0.5")


def test_cells_aggregate_the_runs_summaries_paired_by_seed(tmp_path):
    """2 x 2 grid, 3 seeds; summaries written as finished runs would leave them (one run missing):
    each cell's statistics and test are significance.py's on exactly its seeds' values, against the
    cell with the baseline value and the same other grid value."""
    sweep = Sweep([TINY, *TINY_RUN], parse_grid(["loss.eps_high=0.2,0.28", "optim.lr=1e-4,2e-4"]), [1, 2, 3],
                  tmp_path / "s", baseline="loss.eps_high=0.2")
    value = {(c, s): 0.1 * c + 0.01 * s * s + 0.003 * (c * s % 3) for c in range(4) for s in (1, 2, 3)}
    for cell, seed in sweep.runs():
        if (cell.index, seed) == (3, 2):
            continue                                                           # not started
        run_dir = tmp_path / "s" / "runs" / cell.run_name(seed)
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"accuracy_after": value[(cell.index, seed)]}))
    results = sweep.write()
    assert [c["label"] for c in results["cells"]] == [
        "loss.eps_high=0.2, optim.lr=1e-4", "loss.eps_high=0.2, optim.lr=2e-4",
        "loss.eps_high=0.28, optim.lr=1e-4", "loss.eps_high=0.28, optim.lr=2e-4"]
    assert [c["baseline_cell"] for c in results["cells"]] == [0, 1, 0, 1]
    assert [r["status"] for r in results["runs"]].count("not started") == 1
    for c in results["cells"]:
        seeds = [s for s in (1, 2, 3) if (c["index"], s) != (3, 2)]
        vals = {s: value[(c["index"], s)] for s in seeds}
        assert {k: c[k] for k in ("n", "mean", "std", "ci95")} == significance.summarise([vals[s] for s in seeds])
        if c["is_baseline"]:
            assert c["test"] is None and c["p_value"] is None
        else:
            base = {s: value[(c["baseline_cell"], s)] for s in (1, 2, 3)}
            assert c["test"] == significance.paired_test(vals, base) and c["p_value"] == c["test"]["p_value"]
    assert results["cells"][3]["test"]["n_pairs"] == 2
    table = (tmp_path / "s" / "table.md").read_text()
    assert "| loss.eps_high=0.28, optim.lr=2e-4 | 2 |" in table and significance.TEST_NAME in table
    assert (tmp_path / "s" / "sweep.png").stat().st_size > 0


def _sweep_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "megadiv.cli", "sweep", TINY, *TINY_RUN, "--grid", GRID[0], "--seeds", "1,2",
            "--out", str(out)]


def test_tiny_sweep_interrupted_resumed_and_not_retrained(tmp_path):
    """2 cells x 2 seeds of 2-step tiny runs. The sweep is killed once the second run has a
    checkpoint; the same command resumes that run from it, does not retrain the first, and writes
    results.json (runs, cells, tests), table.md and sweep.png; a third call trains nothing."""
    out = tmp_path / "sweep"
    env = cpu_tier_env(OMP_NUM_THREADS="1")   # the runs use gloo and the CPU path, even on a GPU machine
    proc = subprocess.Popen(_sweep_command(out), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    second = out / "runs" / "c01-eps_high-0.28-s1"
    kill_group_when(proc, (second / "checkpoints" / "latest").is_file, 400,   # a complete checkpoint
                    "a checkpoint of the second run")
    first = out / "runs" / "c00-eps_high-0.2-s1" / "summary.json"
    first_text = first.read_text()
    assert not (second / "summary.json").exists(), "the run finished before the kill: nothing to resume"

    done = subprocess.run(_sweep_command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "3 run(s) to train" in done.stdout
    assert first.read_text() == first_text                                   # not retrained
    assert "resumed from" in (out / "logs" / f"{second.name}.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert [(r["name"], r["status"]) for r in results["runs"]] == [
        ("c00-eps_high-0.2-s1", "finished"), ("c01-eps_high-0.28-s1", "finished"),
        ("c00-eps_high-0.2-s2", "finished"), ("c01-eps_high-0.28-s2", "finished")]
    for r in results["runs"]:
        assert r["metric"] == r["summary"]["accuracy_after"] and r["overrides"]["loss.eps_high"] in ("0.2", "0.28")
        cfg = yaml.safe_load(Path(r["run_dir"], "config.yaml").read_text())   # run.seed set, the grid value applied
        assert cfg["run"]["seed"] == r["seed"] and cfg["loss"]["eps_high"] == float(r["overrides"]["loss.eps_high"])
    base, other = results["cells"]
    assert base["is_baseline"] and base["n"] == 2 and other["test"]["n_pairs"] == 2
    assert other["p_value"] == significance.paired_test(
        {int(s): v for s, v in other["values"].items()}, {int(s): v for s, v in base["values"].items()})["p_value"]
    assert "| loss.eps_high=0.28 | 2 |" in (out / "table.md").read_text()
    assert (out / "sweep.png").stat().st_size > 0

    again = subprocess.run(_sweep_command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 run(s) to train" in again.stdout
    assert first.read_text() == first_text
    changed = subprocess.run([*_sweep_command(out)[:4 + len(TINY_RUN)], "--grid", "loss.eps_high=0.2,0.3",
                              "--seeds", "1,2", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert changed.returncode == 2 and len(changed.stderr.strip().splitlines()) == 1
    assert "different grid" in changed.stderr


def test_runner_runs_k_at_a_time_and_returns_exit_codes(tmp_path):
    """K = 2: the first two jobs wait for each other (each touches a file, then waits until two
    exist), which only ends if they run together; never more than K run at once."""
    from megadiv.experiments.runner import run_parallel
    from megadiv.progress import Progress

    job = ("touch {d}/start_{i}; touch {d}/run_{i}; n=$(ls {d} | grep -c '^run_'); echo $n >> {d}/concurrent; "
           "for k in $(seq 300); do [ $(ls {d} | grep -c '^start_') -ge 2 ] && break; sleep 0.1; done; "
           "[ $(ls {d} | grep -c '^start_') -ge 2 ] && echo paired > {d}/paired_{i}; rm {d}/run_{i}; exit {i}")
    jobs = [(["sh", "-c", job.format(d=tmp_path, i=i)], tmp_path / "logs" / f"{i}.log") for i in range(4)]
    log = io.StringIO()  # not a terminal: the progress prints plain lines
    with Progress("test runs", total=len(jobs), unit="run", file=log, interval_s=0) as bar:
        assert run_parallel(jobs, 2, label="test", progress=bar) == [0, 1, 2, 3]
    assert bar.n == 4 and "test runs: 4/4 run (100%)" in log.getvalue()
    assert (tmp_path / "paired_0").is_file() and (tmp_path / "paired_1").is_file()
    assert max(int(x) for x in (tmp_path / "concurrent").read_text().split()) <= 2


def test_sweep_as_a_slurm_array(tmp_path, monkeypatch):
    """--slurm: one array over the untrained runs, throttled to --parallel, each task index running
    its run's megadiv train command (sbatch stubbed on PATH: it records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/sbatch_args\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    sweep = Sweep([TINY, *TINY_RUN], parse_grid(GRID), [1, 2], tmp_path / "s", parallel=3, slurm="-p gpu -t 1:00:00")
    sweep.train()
    script = tmp_path / "s" / "slurm" / "sweep.sbatch"
    assert (tmp_path / "sbatch_args").read_text().split() == ["--wait", "-p", "gpu", "-t", "1:00:00", str(script)]
    text = script.read_text()
    assert "#SBATCH --array=0,1,2,3%3" in text and f"#SBATCH --output={tmp_path / 's' / 'logs'}/run-%a.log" in text
    cases = {line.split(")")[0].strip(): line for line in text.splitlines() if ") exec " in line}
    for i, (cell, seed) in enumerate(sweep.runs()):
        assert f"run.name={cell.run_name(seed)} " in cases[str(i)] and f"run.seed={seed} " in cases[str(i)]


def test_the_papers_comparisons_validate_as_sweeps(tmp_path, monkeypatch):
    """The ATR cells differ from GRPO only in the clip; the GBMPO cells (with an ES result present)
    only in the regulariser: every resolved config equals the base outside loss.{clip keys} /
    loss.{regulariser keys}."""
    import dataclasses

    from megadiv.config import load_config, to_dict
    from megadiv.trainer.config import TrainConfig

    def differing(a, b, prefix=""):
        out = set()
        for k in a:
            if isinstance(a[k], dict) and isinstance(b[k], dict):
                out |= differing(a[k], b[k], f"{prefix}{k}.")
            elif a[k] != b[k]:
                out.add(prefix + k)
        return out

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 8,
                                                      "num_hidden_layers": 28}))
    atr = REPO / "examples" / "atr_grpo"
    base = [REPO / "examples/atr_grpo/task.yaml", REPO / "examples/gsm8k/models/qwen3-1.7b.yaml",
            REPO / "examples/gsm8k/algorithms/grpo.yaml"]
    grpo = to_dict(load_config(TrainConfig, base, [f"model.hf_dir={tmp_path}"]))
    for overlay, keys in (("clip_grpo.yaml", set()), ("clip_dapo.yaml", {"loss.eps_high"}),
                          ("atr_grpo.yaml", {"loss.policy_loss"})):   # delta 0.05 is also the default
        cell = to_dict(load_config(TrainConfig, base + [atr / overlay], [f"model.hf_dir={tmp_path}"]))
        assert differing(cell, grpo) == keys, overlay
    monkeypatch.chdir(tmp_path)                                  # mirror_es_best.yaml's relative ES path
    (tmp_path / "runs" / "gbmpo-es").mkdir(parents=True)
    (tmp_path / "runs" / "gbmpo-es" / "best_mirror_map.json").write_text(json.dumps([0.01] * 380))
    gbmpo = REPO / "examples" / "gbmpo"
    dr = load_config(TrainConfig, [gbmpo / "gsm8k.yaml", gbmpo / "dr_grpo.yaml"], [f"model.hf_dir={tmp_path}"])
    assert dr == load_config(TrainConfig, [gbmpo / "gsm8k.yaml"], [f"model.hf_dir={tmp_path}"])
    for overlay, reg in (("prob_l2.yaml", "sampled_prob_l2"), ("neural_mirror.yaml", "sampled_mirror"),
                         ("mirror_es_best.yaml", "sampled_mirror")):
        cell = load_config(TrainConfig, [gbmpo / "gsm8k.yaml", gbmpo / overlay], [f"model.hf_dir={tmp_path}"])
        assert cell.loss.regularizer == reg and cell.loss.regularizer_coef == 1e-4
        same = dataclasses.replace(cell, loss=dr.loss, run=dr.run)
        assert same == dr, overlay
    assert load_config(TrainConfig, [gbmpo / "gsm8k.yaml", gbmpo / "mirror_es_best.yaml"],
                       [f"model.hf_dir={tmp_path}"]).loss.mirror_map.vector().tolist() == [0.01] * 380
