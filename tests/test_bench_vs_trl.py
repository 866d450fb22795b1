"""benchmarks/bench_vs_trl.py: its summary arithmetic, and its quickest form end to end (megadiv's
side of workload (a), a 2-step warm start, 2 GRPO steps; no TRL venv, no network) so that the
script cannot rot unseen."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_vs_trl.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_of(step_times, gen=0.25, before=0.5, after=0.6):
    return {"steps": [{"step": i + 1, "step_s": t, "gen_s": gen} for i, t in enumerate(step_times)],
            "accuracy_before": before, "accuracy_after": after}


def test_trl_side_grades_with_the_math_verify_worker():
    """Workload (b)'s reward on TRL's side: megadiv's math-verify worker in its own process, read past
    its ready line; closing ends it."""
    bench = load_bench()
    grade, close = bench._grader({"reward": "math",
                                  "math_worker": [sys.executable, str(REPO / "megadiv/rewards/math_worker.py")]})
    try:
        assert grade(["So the answer is \\boxed{42}.", "#### 41", "I think 42"], ["42", "42", "42"]) == [1.0, 0.0, 1.0]
    finally:
        close()


def test_summary_pools_steps_after_the_first_and_sets_megadiv_against_trl_on_the_same_cores():
    bench = load_bench()
    megadiv = bench.summarize("megadiv", "tp2", [run_of([9.0, 1.0, 2.0]), run_of([9.0, 3.0, 4.0], after=0.7)])
    assert (megadiv["steps_timed"], megadiv["median_s"], megadiv["min_s"], megadiv["max_s"]) == (4, 2.5, 1.0, 4.0)
    assert (megadiv["q1_s"], megadiv["q3_s"]) == (1.75, 3.25)  # step 1 (9 s, warm-up) of each run left out
    assert megadiv["train_s"] == 2.25 and megadiv["accuracy_after"] == pytest.approx(0.65)
    trl = bench.summarize("trl", "1x2", [run_of([7.0, 5.0])])
    one_step = bench.summarize("trl", "1x1", [run_of([6.0])])  # a single step is all there is to time
    assert one_step["median_s"] == 6.0
    text = bench.table([megadiv, trl, one_step])
    assert "| megadiv | tp2 | 2.500 | 1.750-3.250 | 1.000-4.000 | 0.250 / 2.250 | 0.500 -> 0.650 | 0.50 (vs TRL 1x2) |" \
        in text
    assert megadiv["ratio_vs_trl"] == 0.5 and trl["ratio_vs_trl"] is None


def test_each_megadiv_layout_brings_its_trl_counterpart_once():
    bench = load_bench()
    both = ["megadiv", "trl"]
    assert bench.planned_runs("b", ["1x1-sglang", "pp2"], both) == [
        ("megadiv", "1x1-sglang"), ("trl", "1x1"), ("megadiv", "pp2"), ("trl", "1x2")]
    assert bench.planned_runs("a", ["1x1", "1x2", "tp2", "pp2", "1x1-sglang"], both) == [
        ("megadiv", "1x1"), ("trl", "1x1"), ("megadiv", "1x2"), ("trl", "1x2"), ("megadiv", "tp2")]
    assert bench.planned_runs("b", ["pp2"], ["trl"]) == [("trl", "1x2")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quickest_form_runs_megadiv_on_workload_a(tmp_path, monkeypatch):
    env = {**os.environ, "MEGADIV_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--systems", "megadiv", "--layouts", "1x1,tp2",
                           "--steps", "2", "--sft-steps", "2", "--held-out", "0", "--json", str(out),
                           "--timeout", "900"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| megadiv | 1x1 |" in proc.stdout and "| megadiv | tp2 |" in proc.stdout
    result = json.loads(out.read_text())["workloads"]["a"]
    assert [(r["system"], r["layout"], r["steps_timed"]) for r in result["rows"]] == [("megadiv", "1x1", 1),
                                                                                     ("megadiv", "tp2", 1)]
    assert all(r["median_s"] > 0 and r["accuracy_after"] is None for r in result["rows"])
    assert not (tmp_path / "cache" / "bench-trl-venv").exists()  # TRL's side was not asked for

    # what TRL would be given: megadiv's own first two batches, rendered and tokenised as megadiv does
    monkeypatch.setenv("MEGADIV_CACHE", str(tmp_path / "cache"))  # the warm start just made, reused
    bench = load_bench()
    wl = bench.workload("a", argparse.Namespace(sft_steps=2, timeout=60, steps=2, held_out=5))
    from megadiv.data import DataConfig, PromptSampler, load_dataset

    train = load_dataset(DataConfig(name="arithmetic", split="train", template="raw"))
    sampler = PromptSampler(len(train), 64, seed=DataConfig().seed)
    order = [train[i] for _ in range(2) for i in sampler.next_batch()]
    trl = wl["trl"]
    assert trl["train_prompts"] == [r.prompt for r in order] and trl["train_answers"] == [r.answer for r in order]
    assert all(sum(map(int, p[:-1].split("+"))) == int(a) for p, a in zip(trl["train_prompts"], trl["train_answers"]))
    assert len(trl["eval_prompts"]) == 500 and wl["megadiv"]["eval"]["data"]["split"] == "test"
