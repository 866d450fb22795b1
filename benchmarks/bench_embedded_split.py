"""Embedded generation on one rank vs split over every rank, and what TP-sharded generation would add.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        benchmarks/bench_embedded_split.py [HF_DIR]   # default: the tiny test model, made in a temp dir

Interleaved trials in one pair of processes (gloo): ``one``, rank 0 generates every prompt while the
other ranks wait (the engine before issue 30); ``split``, RankSplitEngine, every rank a slice
(megadiv.rollout.embedded); ``ar_decode`` / ``ar_prefill``, one gloo all-reduce of a decode step's
/ a prefill's activations ([rows, hidden] / [rows * 10, hidden] float32), the collective a
TP-sharded generate needs about twice per layer and forward. Prints the medians (s) and the load
average before and after. Shape: 64 prompts x 8 samples x 4 new tokens (the arithmetic workload).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megadiv.rollout import SamplingParams
from megadiv.rollout.embedded import EmbeddedEngine, RankSplitEngine

TRIALS, WARMUP = 20, 2


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    hf_dir = sys.argv[1] if len(sys.argv) > 1 else _tiny_model()
    engine = EmbeddedEngine(hf_dir)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    # ordinary tokens only (ids 0-2: pad, bos, eos of the tiny models), as in a real prompt
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(6, 10, (64,), generator=g)]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=4)
    split = RankSplitEngine(engine, group) if rank == 0 else None
    hidden = engine.model.config.hidden_size
    activations = {"ar_decode": torch.randn(512, hidden), "ar_prefill": torch.randn(512 * 10, hidden)}
    times: dict[str, list[float]] = {"one": [], "split": [], "ar_decode": [], "ar_prefill": []}
    load = os.getloadavg()
    for _ in range(TRIALS):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            engine.generate(prompts, params)
        dist.barrier()
        times["one"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            split.generate(prompts, params)
            split.release()
        else:
            engine.serve(group)
        times["split"].append(time.perf_counter() - t)
        for key, x in activations.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x)
            times[key].append((time.perf_counter() - t) / 10)
    if rank == 0:
        medians = {k: round(statistics.median(v[WARMUP:]), 5) for k, v in times.items()}
        print(f"{dist.get_world_size()} ranks, medians of {TRIALS - WARMUP} trials (s): {medians}; "
              f"one / split = {medians['one'] / medians['split']:.2f}x; load average {load} -> {os.getloadavg()}")
    dist.destroy_process_group(group)
    dist.destroy_process_group()


def _tiny_model() -> str:
    from megadiv.models.tiny import make_tiny_model

    path = os.path.join(tempfile.gettempdir(), f"megadiv-bench-split-{os.getppid()}", "tiny")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        make_tiny_model(path, "qwen2")
    dist.barrier()
    return path


if __name__ == "__main__":
    main()
