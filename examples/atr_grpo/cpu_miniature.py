"""The ATR-GRPO comparison in miniature on CPU: GRPO vs DAPO vs ATR-GRPO (single-delta KL3 clipping)
on the tiny adder of examples/tiny, three seeds each, reported as measured.

    OMP_NUM_THREADS=1 python examples/atr_grpo/cpu_miniature.py [--steps 60] [--seeds 1 2 3] [--out runs/atr-miniature]

Per seed, the GRPO run makes the random model and its supervised warm start (run_dir/sft); DAPO and
ATR-GRPO start from that same warm-started checkpoint, so the three differ only in the algorithm.
Every run is one process (TP=1), greedy pass@1 on the 500 held-out problems before and after.
A finished run (summary.json present) is not run again, so a killed sweep resumes. Prints a
markdown table and writes OUT/results.json.

All values are ours (the paper trains Qwen3 on maths; this is a smoke-scale analogue):
  shared   examples/tiny/grpo.yaml (64 prompts x 8 samples, lr 1e-4, 2 mini-batches), no KL,
           --steps GRPO steps (the demo runs 200; most of its gain comes in the first 50)
  GRPO     ratio clip [0.8, 1.2], per-sequence token mean
  DAPO     clip-higher [0.8, 1.28], token mean, dynamic sampling (3 extra rounds); no overlong
           shaping (answers are at most 4 tokens)
  ATR-GRPO GRPO with the clip replaced by k3(w) <= delta, one delta on both sides (--delta, 0.05:
           w in [0.716, 1.350], `megadiv bounds --delta 0.05`)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny" / "grpo.yaml"

ALGORITHMS = {
    "GRPO": ["loss.policy_loss=clip", "loss.eps_low=0.2", "loss.eps_high=0.2",
             "loss.loss_agg=seq-mean-token-mean"],
    "DAPO": ["loss.policy_loss=clip", "loss.eps_low=0.2", "loss.eps_high=0.28", "loss.loss_agg=token-mean",
             "grpo.dynamic_sampling=true", "grpo.max_resample_rounds=3"],
    "ATR-GRPO": ["loss.policy_loss=divergence_clip", "loss.measure=k3", "loss.delta={delta}", "loss.delta_high=null",
                 "loss.loss_agg=seq-mean-token-mean"],
}


def run_one(out: Path, algo: str, seed: int, steps: int, delta: float, timeout_s: float) -> dict:
    name = f"{algo.lower()}-s{seed}"
    summary = out / name / "summary.json"
    if not summary.is_file():
        common = [f"run.output_dir={out}", f"run.name={name}", f"run.seed={seed}", f"grpo.steps={steps}",
                  "parallel.tensor_parallel=1", "eval.every=0", "eval.samples=0", "checkpoint.every=0",
                  "checkpoint.export_hf=false", "loss.kl_coef=0.0"]
        if algo == "GRPO":  # makes the model and the warm start the others reuse
            start = [f"model.hf_dir={out}/init-s{seed}"]
        else:
            start = [f"model.hf_dir={out}/grpo-s{seed}/sft", "warm_start.make_model=none", "warm_start.sft_steps=0"]
        overrides = common + start + [o.format(delta=delta) for o in ALGORITHMS[algo]]
        cmd = [sys.executable, "-m", "megadiv.cli", "train", str(BASE), *overrides]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[3:])}", flush=True)
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {time.time() - t0:.0f} s", flush=True)
    s = json.loads(summary.read_text())
    steps = [r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "clip/frac_low" in r]
    clipped = statistics.mean(r["clip/frac_low"] + r["clip/frac_high"] for r in steps)  # how often the rule binds
    return {"algorithm": algo, "seed": seed, "before": s["accuracy_before"], "after": s["accuracy_after"],
            "clipped_frac": clipped}


def table(rows: list[dict]) -> str:
    lines = ["| algorithm | seed | before | after | gain | tokens clipped (mean over steps) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['algorithm']} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
                     f"{r['after'] - r['before']:+.3f} | {r['clipped_frac']:.4f} |")
    lines += ["", "| algorithm | after (mean +- sd over seeds) | gain (mean +- sd) |", "|---|---|---|"]
    for algo in ALGORITHMS:
        after = [r["after"] for r in rows if r["algorithm"] == algo]
        gain = [r["after"] - r["before"] for r in rows if r["algorithm"] == algo]
        if len(after) > 1:
            lines.append(f"| {algo} | {statistics.mean(after):.3f} +- {statistics.stdev(after):.3f} | "
                         f"{statistics.mean(gain):+.3f} +- {statistics.stdev(gain):.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--out", default="runs/atr-miniature")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit of one training run")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_one(out, algo, seed, args.steps, args.delta, args.timeout_s)
            for seed in args.seeds for algo in ALGORITHMS]
    (out / "results.json").write_text(json.dumps({"steps": args.steps, "delta": args.delta, "runs": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
