"""Steps/s of ``megadiv train`` with and without ``grpo.overlap`` (one-step off-policy), one run each.

    .venv/bin/python benchmarks/bench_overlap.py                      # SGLang server (own process), then embedded
    .venv/bin/python benchmarks/bench_overlap.py --engines sglang --steps 12

Each row is the real loop (``megadiv train`` under torchrun, 1 rank, TP=1) on the tiny arithmetic
task with a random model (no warm start, no evaluation), launched twice: serial, then with
``grpo.overlap=true``; both with ``loss.tis_cap=2`` (the overlapped loss needs it). The figure is
the median of ``time/step`` (a step's wall clock, generation exposed + train + sync) over steps
2.., step 1 being serial in both runs. ``--prompts``, ``--samples``, ``--new-tokens`` set the
generation's size and ``--hidden``/``--layers`` the model's: the default shape makes generation
(time/rollout) and training (time/train) take similar times on 2 CPU cores, printed with the
result so that the balance is visible. The machine's load average is printed before and after.

What can overlap: with the SGLang server, generation runs in the server's processes while the
rank trains, so on 2 cores (1 rank + 1 server) a step can approach max(rollout, train) instead of
their sum. The embedded engine generates in a thread of the rank's own process: the GIL and the
one core the rank uses are shared, so on CPU that row shows the semantics' cost, not a gain.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "grpo.yaml"


def run_train(run_dir: Path, overrides: list[str], timeout_s: float) -> list[dict]:
    """One ``megadiv train`` launch; its per-step records (metrics.jsonl)."""
    cmd = [sys.executable, "-m", "megadiv.cli", "train", str(CONFIG), f"run.output_dir={run_dir.parent}",
           f"run.name={run_dir.name}", f"model.hf_dir={run_dir}/init", *overrides, "--nproc", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, the rank and the server it launched
        out, _ = proc.communicate()
        raise SystemExit(f"megadiv train timed out after {timeout_s:.0f}s:\n{out[-4000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"megadiv train failed ({proc.returncode}):\n{out[-6000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step" in r]


def median_of(records: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records[1:])  # step 1 is serial in both runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["sglang", "embedded"], choices=["sglang", "embedded"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    args = ap.parse_args()

    rows = args.prompts * args.samples
    shape = [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={4 * args.hidden}",
             f"model.num_layers={args.layers}", "parallel.tensor_parallel=1", "warm_start.sft_steps=0",
             "eval.data=null", "eval.every=0", "checkpoint.every=0", "checkpoint.export_hf=false",
             f"grpo.steps={args.steps}", f"grpo.prompts_per_step={args.prompts}", f"rollout.n_samples={args.samples}",
             f"advantage.group_size={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
             "grpo.mini_batches=1", f"grpo.micro_batch_size={rows}", "loss.tis_cap=2.0"]
    print(f"shape: {args.prompts} prompts x {args.samples} samples x <= {args.new_tokens} new tokens, model hidden "
          f"{args.hidden} x {args.layers} layers, 1 rank (TP=1), {args.steps} steps; medians over steps "
          f"2..{args.steps}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="megadiv-bench-overlap-") as tmp:
        for engine in args.engines:
            engine_args = [f"rollout.engine={engine}"] + (["rollout.sync_method=distributed"] if engine == "sglang"
                                                          else [])
            result = {}
            for overlap in (False, True):
                records = run_train(Path(tmp) / f"{engine}-{int(overlap)}",
                                    shape + engine_args + [f"grpo.overlap={str(overlap).lower()}"], args.timeout)
                assert [r["step"] for r in records] == list(range(1, args.steps + 1))
                assert all(r["rollout/staleness"] == (min(r["step"] - 1, 1) if overlap else 0) for r in records)
                result[overlap] = {k: median_of(records, f"time/{k}") for k in
                                   ("step", "rollout", "reward", "rollout_wait", "train", "sync")}
                t = result[overlap]
                print(f"{engine:8s} overlap={str(overlap):5s}: {1 / t['step']:.3f} steps/s "
                      f"(median step {t['step']:.2f} s:"
                      f" rollout {t['rollout']:.2f}, reward {t['reward']:.2f}, waited for it {t['rollout_wait']:.2f},"
                      f" train {t['train']:.2f}, sync {t['sync']:.2f})", flush=True)
            print(f"{engine:8s} overlap speed-up: {result[False]['step'] / result[True]['step']:.2f}x steps/s",
                  flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
