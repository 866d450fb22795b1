"""megatron's distributed optimizer against its plain one at one data-parallel rank, 1 and 2 threads.

    .venv/bin/python benchmarks/bench_optimizer_threads.py [--repeats 3]

One process (a world of one, gloo), a random Qwen2 checkpoint shaped like the demo's tiny model
(hidden 128, 2 layers, ffn 512, character tokenizer), and the issue-30 workload's train step: 512
rows of a 6-8 token prompt and a 4-token response, micro-batches of 64, Adam. Two actors from the
same weights, ``optim.distributed_optimizer`` true and false (the default at DP = 1 since issue 41),
each in its own process
(the second OpenMP pool is process-wide: it slows every later step of the process, whatever its
optimizer), the two processes run alternately --rounds times; in each, threads 1 and 2 alternate
--repeats times after one warm-up step each. Prints the
median s/step and the voluntary context switches per step: at 2 threads the distributed
optimizer's gloo collectives start a second OpenMP pool, whose throttled spin-wait shows as
thousands of context switches per step (docs/performance.md).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megadiv.divergence import PolicyLossConfig  # noqa: E402
from megadiv.models.tiny import make_tiny_model  # noqa: E402
from megadiv.parallel import initialize, shutdown  # noqa: E402
from megadiv.policy.batches import SequenceBatch  # noqa: E402
from megadiv.policy.megatron import Policy  # noqa: E402
from megadiv.policy.objectives import grpo_objective  # noqa: E402

ROWS, MICRO_BATCH = 512, 64


def time_one_optimizer(name: str, repeats: int) -> dict:
    """In this process: the train step of one optimizer at 1 and 2 threads -> {threads: [(s, switches)]}."""
    initialize(ParallelConfig(), seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 16, (int(n),), generator=g).tolist() for n in torch.randint(6, 9, (ROWS,), generator=g)]
    responses = [torch.randint(3, 16, (4,), generator=g).tolist() for _ in range(ROWS)]
    batch = SequenceBatch.pack(prompts, responses, pad_id=0, advantages=torch.randn(ROWS, generator=g))
    loss = grpo_objective(PolicyLossConfig(policy_loss="clip", eps_low=0.2, eps_high=0.2, kl_coef=0.0,
                                           loss_agg="token-mean"))
    with tempfile.TemporaryDirectory(prefix="bench-optimizer-threads-") as tmp:
        hf_dir = make_tiny_model(Path(tmp) / "qwen2", "qwen2", hidden=128, heads=4, kv_heads=4, ffn=512, layers=2,
                                 max_positions=64)
        actor = Policy(ModelConfig(hf_dir=str(hf_dir)), ParallelConfig(), "actor",
                       OptimConfig(lr=1e-4, clip_grad=1.0, distributed_optimizer=name == "distributed"),
                       total_steps=1000)
        timings = {1: [], 2: []}
        for repeat in range(repeats + 1):  # the first round warms up
            for threads in (1, 2) if repeat % 2 == 0 else (2, 1):
                torch.set_num_threads(threads)
                switches, wall = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw, time.perf_counter()
                actor.train_step(batch, loss, MICRO_BATCH)
                if repeat:
                    timings[threads].append((time.perf_counter() - wall,
                                             resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches))
    shutdown()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=("plain", "distributed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(time_one_optimizer(args.child, args.repeats)))
        return

    load_before = os.getloadavg()[0]
    timings = {(name, threads): [] for name in ("plain", "distributed") for threads in (1, 2)}
    for r in range(args.rounds):
        for name in ("plain", "distributed") if r % 2 == 0 else ("distributed", "plain"):
            out = subprocess.run([sys.executable, __file__, "--child", name, "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, timeout=900, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "2"})
            for threads, rows in json.loads(out.stdout.strip().splitlines()[-1]).items():
                timings[name, int(threads)] += rows
    print(f"{ROWS} rows, micro-batches of {MICRO_BATCH}, Adam; median of {args.rounds} processes x {args.repeats}")
    for (name, threads), rows in timings.items():
        print(f"{name:>11} optimizer, {threads} thread(s): {statistics.median(r[0] for r in rows):.3f} s/step, "
              f"{statistics.median(r[1] for r in rows):.0f} voluntary context switches/step")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
