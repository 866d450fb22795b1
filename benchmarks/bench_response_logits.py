"""Logits at the response positions only against the output layer at every position, long prompts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_response_logits.py [--prompt-tokens 512] [--vocab 32000]

One process (a world of one, gloo), a random Qwen2 checkpoint (megadiv make-tiny-model; --hidden,
--layers, --ffn, --vocab set its size) as the GRPO actor with SGD, and --rows rows of a
--prompt-tokens prompt plus a --response-tokens response. Two actors from the same weights:

- response: megadiv's Policy, whose output layer, log-probs and entropy see the positions that
  predict response tokens only;
- full: the output layer at every position and the response positions picked afterwards (what the
  policy did before; tests/dist/response_logits.py's FullLogitsPolicy, the tests' reference).

Timed, the two alternating, after one warm-up round: ``log_probs`` (the reference / old-policy
forward) and ``train_step`` (forward, backward, optimizer step); median of --repeats, by the wall
clock and by the process's CPU time (one thread: on a shared machine CPU time is the steadier
figure). Prints the medians and the ratio full / response for each.
"""
from __future__ import annotations

import argparse
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
from megadiv.policy.batches import SequenceBatch  # noqa: E402
from megadiv.policy.megatron import Policy  # noqa: E402
from megadiv.policy.objectives import grpo_objective  # noqa: E402
from tests.dist.response_logits import FullLogitsPolicy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    initialize(ParallelConfig(), seed=1)
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(1, args.vocab, (n,), generator=g).tolist()  # noqa: E731
    batch = SequenceBatch.pack([draw(args.prompt_tokens) for _ in range(args.rows)],
                               [draw(args.response_tokens) for _ in range(args.rows)], pad_id=0,
                               advantages=torch.randn(args.rows, generator=g))
    loss = grpo_objective(PolicyLossConfig())
    with tempfile.TemporaryDirectory(prefix="bench-response-logits-") as tmp:
        hf_dir = make_tiny_model(Path(tmp) / "qwen2", "qwen2", tokenizer="bpe", vocab=args.vocab,
                                 hidden=args.hidden, heads=8, kv_heads=4, ffn=args.ffn, layers=args.layers,
                                 max_positions=args.prompt_tokens + args.response_tokens)
        actors = {path: cls(ModelConfig(hf_dir=str(hf_dir)), ParallelConfig(), "actor",
                            OptimConfig(optimizer="sgd", lr=1e-4, clip_grad=1.0), total_steps=1)
                  for path, cls in (("response", Policy), ("full", FullLogitsPolicy))}
        calls = {"log_probs": lambda actor: actor.log_probs(batch, args.micro_batch_size),
                 "train_step": lambda actor: actor.train_step(batch, loss, args.micro_batch_size)}
        print(f"model hidden {args.hidden} x {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}; "
              f"{args.rows} rows of {args.prompt_tokens} prompt + {args.response_tokens} response tokens, "
              f"{args.micro_batch_size} rows per micro-batch; median of {args.repeats}", flush=True)
        seconds = {(call, path, clock): [] for call in calls for path in actors for clock in ("wall", "cpu")}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for call, fn in calls.items():
                for path, actor in actors.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    fn(actor)
                    if repeat:
                        seconds[call, path, "wall"].append(time.perf_counter() - wall)
                        seconds[call, path, "cpu"].append(time.process_time() - cpu)
        for call in calls:
            for clock in ("wall", "cpu"):
                full, response = (statistics.median(seconds[call, path, clock]) for path in ("full", "response"))
                print(f"{call:>10} {clock:>4}: full {full:.3f} s, response {response:.3f} s, "
                      f"ratio full / response {full / response:.2f}x", flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
    shutdown()


if __name__ == "__main__":
    main()
