"""GBMPO's comparison in miniature on CPU: Dr. GRPO vs ProbL2 (sampled_prob_l2) vs the neural
mirror map (sampled_mirror, random init), on the tiny adder of examples/tiny, over seeds.

    OMP_NUM_THREADS=1 python benchmarks/gbmpo_miniature.py --out runs/gbmpo-mini [--seeds 1 2 3]

Per seed, one warm start (``--sft-steps`` supervised steps; the demo uses 250) is shared by the
three methods, so they differ only in the loss. Each method then runs ``--steps`` GRPO steps of
64 prompts x 8 samples on one process (TP=1). Finished runs are reused when the script is run again (resumable). The
table gives the held-out greedy accuracy on 500 problems before -> after per seed, and means over
seeds of the gain, of the regulariser's last value and of the k3 estimate of KL to the reference
at the last step; it is printed as Markdown and written to OUT/table.md (OUT/table-coefC.md for
another ``--coef``).

The loss settings are the authors' (Dr. GRPO advantages, PPO clip 0.2, sum / (B * L) with L the
4-token completion limit, no KL, regulariser coefficient 1e-4); the task, model, step count and
learning rate are ours (examples/tiny, methods.md section 5).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "grpo.yaml"

# Authors' loss (methods.md section 2); L = rollout.max_new_tokens of the tiny task (4).
DR_GRPO = ["advantage.estimator=dr_grpo", "loss.policy_loss=clip", "loss.eps_low=0.2", "loss.eps_high=0.2",
           "loss.kl_coef=0.0", "loss.loss_agg=seq-mean-token-sum-norm", "loss.loss_norm_len=4"]


def methods(coef: float) -> dict[str, list[str]]:
    """The three rows; ``coef`` is the regulariser weight (the authors': 1e-4)."""
    return {"Dr. GRPO": DR_GRPO,
            "ProbL2": DR_GRPO + ["loss.regularizer=sampled_prob_l2", f"loss.regularizer_coef={coef}"],
            "neural mirror map": DR_GRPO + ["loss.regularizer=sampled_mirror", f"loss.regularizer_coef={coef}",
                                            "loss.mirror_map.seed=42"]}


# Ours: one process, fewer steps than the demo (200), held-out greedy accuracy only.
COMMON = ["parallel.tensor_parallel=1", "eval.every=0", "eval.samples=0", "checkpoint.every=0",
          "checkpoint.export_hf=false", "grpo.check_mismatch_every=0"]


def train(out: Path, name: str, overrides: list[str]) -> dict:
    """One ``megadiv train`` run (skipped when its summary.json exists); returns the summary."""
    run_dir = out / name
    summary = run_dir / "summary.json"
    if not summary.is_file():
        cmd = [sys.executable, "-m", "megadiv.cli", "train", str(CONFIG), f"run.output_dir={out}", f"run.name={name}",
               *COMMON, *overrides]
        start = time.time()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if rc != 0:
            raise SystemExit(f"{name} failed ({rc}); see {out / f'{name}.log'}")
        print(f"  {name}: {time.time() - start:.0f} s", flush=True)
    result = json.loads(summary.read_text())
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in last if "loss/total" in r]
    result["regularizer_last"] = steps[-1].get("loss/regularizer") if steps else None
    result["ref_k3_last"] = steps[-1].get("ref/k3") if steps else None      # k3 estimate of KL to pi_ref
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/gbmpo-mini")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run (ours; the demo runs 200)")
    parser.add_argument("--sft-steps", type=int, default=150, help="warm-start steps per seed (ours; the demo: 250)")
    parser.add_argument("--coef", type=float, default=1e-4, help="regulariser weight (the authors': 1e-4)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = methods(args.coef)
    tag = "" if args.coef == 1e-4 else f"-coef{args.coef:g}"      # other weights: other run directories
    results: dict[str, list[dict]] = {m: [] for m in rows}
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        base = f"seed{seed}-dr_grpo"
        for k, (method, overrides) in enumerate(rows.items()):
            name = base if k == 0 else f"seed{seed}-{method.split()[-1].lower()}{tag}"
            start = ([f"model.hf_dir={out}/seed{seed}-init", f"run.seed={seed}",
                      f"warm_start.sft_steps={args.sft_steps}"] if k == 0 else
                     [f"model.hf_dir={out / base / 'sft'}", "warm_start.make_model=none", "warm_start.sft_steps=0",
                      f"run.seed={seed}"])
            results[method].append(train(out, name, [*start, f"grpo.steps={args.steps}", *overrides]))
    table = render(results, args)
    (out / f"table{tag}.md").write_text(table)
    print(table)
    return 0


def render(results: dict[str, list[dict]], args) -> str:
    seeds = " ".join(map(str, args.seeds))
    lines = [f"regulariser weight {args.coef:g}; warm start: {args.sft_steps} steps, GRPO steps: {args.steps}, "
             f"seeds: {seeds}; held-out greedy accuracy "
             f"(500 problems) before -> after", "",
             "| method | " + " | ".join(f"seed {s}" for s in args.seeds)
             + " | mean gain | last regulariser | last KL to reference (k3) |",
             "|---|" + "---|" * (len(args.seeds) + 3)]
    for method, runs in results.items():
        cells = [f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}" for r in runs]
        gain = statistics.mean(r["accuracy_after"] - r["accuracy_before"] for r in runs)
        regs = [r["regularizer_last"] for r in runs if r["regularizer_last"] is not None]
        reg = f"{statistics.mean(regs):.2e}" if regs else "-"
        kls = [r["ref_k3_last"] for r in runs if r["ref_k3_last"] is not None]
        kl = f"{statistics.mean(kls):.3f}" if kls else "- (no reference model)"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {gain:+.3f} | {reg} | {kl} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
