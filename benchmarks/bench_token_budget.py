"""Trained tokens/s of token-budget micro-batches against the padded path, on a skewed batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_token_budget.py [--rows 32] [--max-response 240]

One process (a world of one, gloo), a random Qwen2 checkpoint (megadiv make-tiny-model; --hidden,
--layers, --ffn, --vocab set its size) as the GRPO actor with SGD. The batch: --rows rows of a
--prompt-token prompt plus a response whose length varies 10x, from --max-response / 10 to
--max-response, drawn two ways: uniformly, and log-uniformly (most responses short, a long tail,
as in RL rollouts). Per batch, both paths train the same rows from the same weights:

- padded: micro-batches of --micro-batch-size rows in batch order, every row padded to the
  batch's longest (``group_by_length=False``: what the interleaved schedule runs, and the only
  path before rows were grouped by default);
- token budget: ``max_tokens_per_micro_batch`` = --micro-batch-size x the longest row (the padded
  path's micro-batch size in tokens, so the peak activation memory is the same), rows sorted by
  length, each micro-batch padded to its own longest row. With this budget the groups are runs of
  --micro-batch-size sorted rows: exactly what the default (no budget) now feeds.

A timed step is ``Policy.train_step`` (forward, backward, optimizer step) after one warm-up step,
median of --repeats, the two paths alternating. Trained tokens = the rows' real tokens (prompt +
response); tokens/s = trained tokens / step time, by the wall clock and by the process's CPU time
(one thread: on a shared machine CPU time is the steadier figure, wall time also counts the
time the process waited for a core). Prints one line per batch with both paths, their ratios, and
the tokens each path fed to the model.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
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
from megadiv.policy.batches import (
    SequenceBatch,  # noqa: E402
    row_lengths,  # noqa: E402
)
from megadiv.policy.megatron import Policy  # noqa: E402
from megadiv.policy.objectives import grpo_objective  # noqa: E402


def response_lengths(rows: int, longest: int, spread: str, seed: int = 0) -> list[int]:
    """``rows`` lengths in [longest / 10, longest], both ends present (a 10x spread)."""
    g = torch.Generator().manual_seed(seed)
    low = longest // 10
    u = torch.rand(rows, generator=g)
    if spread == "uniform":
        lengths = low + u * (longest - low)
    else:  # log-uniform
        lengths = torch.exp(math.log(low) + u * (math.log(longest) - math.log(low)))
    lengths = lengths.round().long().clamp(low, longest).tolist()
    lengths[0], lengths[1] = low, longest
    return lengths


def skewed_batch(rows: int, prompt: int, longest: int, spread: str, vocab: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(1)
    lengths = response_lengths(rows, longest, spread)
    return SequenceBatch.pack([torch.randint(1, vocab, (prompt,), generator=g).tolist() for _ in range(rows)],
                              [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths], pad_id=0,
                              advantages=torch.randn(rows, generator=g))


def fed_tokens(batch: SequenceBatch, budget: int | None) -> int:
    """Tokens (padding included) the model reads for ``batch`` on each path."""
    if budget is None:
        return batch.tokens.numel()
    parts, _ = batch.by_token_budget(budget, max_rows=len(batch))
    return sum(len(p) * int(row_lengths(p.loss_mask)[0]) for p in parts)  # longest row first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=240)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    initialize(ParallelConfig(), seed=1)
    with tempfile.TemporaryDirectory(prefix="bench-token-budget-") as tmp:
        hf_dir = make_tiny_model(Path(tmp) / "qwen2", "qwen2", tokenizer="bpe", vocab=args.vocab,
                                 hidden=args.hidden, heads=8, kv_heads=4, ffn=args.ffn, layers=args.layers)
        longest_row = args.prompt_tokens + args.max_response
        budget = args.micro_batch_size * longest_row
        actors = {path: Policy(ModelConfig(hf_dir=str(hf_dir)), ParallelConfig(), "actor",
                               OptimConfig(optimizer="sgd", lr=1e-4, clip_grad=1.0), total_steps=1,
                               **micro)
                  for path, micro in (("padded", dict(group_by_length=False)),
                                      ("budget", dict(max_tokens_per_micro_batch=budget)))}
        loss = grpo_objective(PolicyLossConfig())
        print(f"model hidden {args.hidden} x {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}; "
              f"{args.rows} rows of {args.prompt_tokens} prompt + {args.max_response // 10}..{args.max_response} "
              f"response tokens; padded: {args.micro_batch_size} rows per micro-batch; budget: "
              f"{budget} tokens per micro-batch; median of {args.repeats} steps", flush=True)
        for spread in ("uniform", "log-uniform"):
            batch = skewed_batch(args.rows, args.prompt_tokens, args.max_response, spread, args.vocab)
            trained = int(row_lengths(batch.loss_mask).sum())
            seconds = {(path, clock): [] for path in actors for clock in ("wall", "cpu")}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for path, actor in actors.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    metrics = actor.train_step(batch, loss, args.micro_batch_size if path == "padded" else len(batch))
                    if repeat:
                        seconds[path, "wall"].append(time.perf_counter() - wall)
                        seconds[path, "cpu"].append(time.process_time() - cpu)
                    assert metrics["skipped"] == 0.0
            rate = {key: trained / statistics.median(s) for key, s in seconds.items()}
            fed = {path: fed_tokens(batch, budget if path == "budget" else None) for path in actors}
            print(f"{spread:>11}: trained tokens {trained}; fed tokens padded {fed['padded']}, budget {fed['budget']} "
                  f"(ratio {fed['padded'] / fed['budget']:.2f}); load average {os.getloadavg()[0]:.1f}")
            for clock in ("wall", "cpu"):
                print(f"{'':>13}{clock:>4} tokens/s: padded {rate['padded', clock]:.0f}, budget "
                      f"{rate['budget', clock]:.0f}, ratio {rate['budget', clock] / rate['padded', clock]:.2f}x  "
                      f"(step s padded {[round(s, 2) for s in seconds['padded', clock]]}, budget "
                      f"{[round(s, 2) for s in seconds['budget', clock]]})", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
