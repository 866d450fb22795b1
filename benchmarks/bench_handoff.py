"""Bytes each rank receives per step, and the host memory it holds of the batch: the pickled batch
broadcast to every rank (before) against each replica's packed rows through the driver's store
(megadiv/trainer/handoff.py), in one launch of 4 gloo ranks on the same batch.

    .venv/bin/python benchmarks/bench_handoff.py                       # DP=4, and TP=2 x DP=2
    .venv/bin/python benchmarks/bench_handoff.py --prompts 64 --samples 16 --prompt-len 300 --response-len 2000

The batch: ``--prompts`` groups of ``--samples`` rows, prompt and response lengths drawn
uniformly up to twice the given means, token ids up to 150k (Qwen's vocabulary), float log-probs.
Before, rank 0 pickled the whole Experience and every rank unpickled it (trainer/grpo.py's
broadcast_object_list); now the driver writes one payload per replica and the replica's first rank
takes it and broadcasts it inside the replica. Printed per layout: bytes received per rank (the
mean over ranks), the bytes rank 0 / the driver sends in all, and the resident memory a rank
holds of the batch (RSS growth while it holds the received object, after gc; the packed rows
are measured first, on a heap the unpickled batch has not grown), each before, after
and their ratio. No defaults of the trainer are changed (nothing here is a config key).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def batch(args):
    import torch

    from megadiv.trainer.experience import Experience

    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.samples
    prompt_lens = torch.randint(1, 2 * args.prompt_len, (args.prompts,), generator=g).repeat_interleave(args.samples)
    response_lens = torch.randint(1, 2 * args.response_len, (rows,), generator=g)
    prompts = [torch.randint(0, 150_000, (int(n),), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, 150_000, (int(n),), generator=g).tolist() for n in response_lens]
    logprobs = [(-torch.rand(int(n), generator=g, dtype=torch.float64)).tolist() for n in response_lens]
    return Experience(prompts, responses, logprobs, torch.rand(rows), torch.randn(rows), torch.ones(rows), {})


def rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def rank_body(args) -> dict:
    import torch.distributed as dist

    from megadiv.config import ParallelConfig
    from megadiv.parallel import initialize
    from megadiv.trainer.handoff import Handoff, ReplicaRows, assign_rows, replica_group

    info = initialize(ParallelConfig(tensor_parallel=args.tp), seed=1)
    exp = batch(args) if info.rank == 0 else None
    out = {}
    # after (measured first, on a heap the before phase has not grown): each replica's packed rows
    # through the driver's store
    address = [None]
    if info.rank == 0:
        store, port = Handoff.host(600)
        address = [("127.0.0.1", port)]
        store.publish_batch(1, exp, info.dp_size, mini_batches=1)
        lengths = [len(p) + len(r) for p, r in zip(exp.prompts, exp.responses)]
        out["driver_bytes"] = sum(len(ReplicaRows.from_experience(exp, rows).encode())
                                  for rows in assign_rows(lengths, info.dp_size, 1))
    dist.broadcast_object_list(address, src=0)
    handoff = Handoff.connect(*address[0], 600)
    replica, source = replica_group(info, 600)
    handoff.wait("batch/1")
    base = rss()
    data = handoff.receive(f"batch/1/{info.dp_rank}", replica, source)
    rows = ReplicaRows.decode(data)
    out["after_bytes"] = len(data)
    out["after_rss"] = rss() - base if info.rank else None  # rank 0 made the batch: not a receiver's figure
    del rows, data
    # before: the whole batch, pickled, to every rank
    base = rss()
    box = [exp]
    dist.broadcast_object_list(box, src=0)
    out["before_bytes"] = len(pickle.dumps(box[0]))
    out["before_rss"] = rss() - base if info.rank else None
    del box
    dist.barrier()
    return out


def launch(args, tp: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               __file__, "--rank-body", tmp, "--tp", str(tp), "--prompts", str(args.prompts), "--samples",
               str(args.samples), "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(cmd, env=env, timeout=args.timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode:
            sys.exit(f"bench_handoff: the {tp=} launch failed:\n{done.stderr[-4000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--response-len", type=int, default=600)
    ap.add_argument("--layouts", nargs="+", default=["dp4", "tp2dp2"], choices=["dp4", "tp2dp2"])
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank-body", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_body:
        out = rank_body(args)
        Path(args.rank_body, f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))
        return
    rows = args.prompts * args.samples
    print(f"batch: {args.prompts} prompts x {args.samples} samples = {rows} rows, mean prompt {args.prompt_len} "
          f"and response {args.response_len} tokens; 4 ranks")
    for layout in args.layouts:
        ranks = launch(args, tp=2 if layout == "tp2dp2" else 1)
        def mean(key: str, ranks=ranks) -> float:
            values = [r[key] for r in ranks if r[key] is not None]
            return sum(values) / len(values)

        before, after = mean("before_bytes"), mean("after_bytes")
        sent_before, sent_after = before * 3, ranks[0]["driver_bytes"]  # rank 0's own copy is not sent
        rss_before, rss_after = mean("before_rss"), mean("after_rss")
        print(f"{layout}: bytes received per rank {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB "
              f"({before / after:.1f}x fewer); sent by rank 0 / the driver {sent_before / 1e6:.1f} MB -> "
              f"{sent_after / 1e6:.1f} MB; host memory held per rank {rss_before / 1e6:.1f} MB -> "
              f"{rss_after / 1e6:.1f} MB ({rss_before / max(rss_after, 1):.1f}x)", flush=True)


if __name__ == "__main__":
    main()
