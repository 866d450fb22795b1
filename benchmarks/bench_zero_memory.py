"""Per-rank peak memory of one GRPO train step under DeepSpeed ZeRO-0/1/2/3, same model and batch,
data parallelism 2 on CPU (gloo); each stage runs in its own pair of processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero_memory.py [--stages 0 1 2 3] \
        [--family olmo2 --hidden 256 --layers 4 --ffn 1024] [--rows 2 --seq 64] [--json FILE]

The step is the trainer's own: ``DeepSpeedPolicy.train_step`` (megadiv/policy/deepspeed.py)
with the GRPO objective, i.e. forward of a Hugging Face causal LM (a random tiny ``--family``
model from megadiv.models.tiny, by default olmo2, which has no Megatron mapping), log-probs and
entropy from the divergence library (whole vocabulary, group=None), the policy loss
(divergence_clip on k3, token-mean), backward, the AdamW step. One warm-up step (Adam's moments
are allocated lazily at the first step), then the measured one. DeepSpeed's bucket sizes are
set to the model through ``deepspeed.config`` (raw_zero_keys).

What is measured: live bytes of torch's CPU allocator. torch.profiler(profile_memory=True) runs
from before the model is loaded to the end, recording every allocation and free; the live bytes
at any instant are the running sum of those events, and the figure is the largest running sum
inside the measured step (state + everything transient: activations, gradients, reduction
buffers, optimizer temporaries, gathered ZeRO-3 parameters), overall and per phase (forward with
the loss, backward, optimizer step). "state" is the running sum when the step starts: what a rank
keeps between steps. Process RSS is not used: it adds the interpreter and libraries (~0.5 GiB,
the same for every stage), glibc keeps freed heap memory resident, and its high-water mark would
include start-up transients (ZeRO-3 holds the whole model before partitioning it). Each figure is
the larger of the two ranks'; ratios are to ZeRO-0.

Theory (fp32 on CPU, Psi parameters, N data-parallel ranks): weights 4, Adam's two moments 8
bytes per parameter, gradients 4 (freed after each step); ZeRO-1/2/3 also keep an fp32 master
copy of the partition (DeepSpeed clones it even when the weights are fp32), and ZeRO-3 keeps its
flat buffer of gradient partitions allocated. Kept between steps: ZeRO-0 4+8 = 12, ZeRO-1 and
ZeRO-2 4+12/N, ZeRO-3 20/N, plus bucket-sized buffers and, at ZeRO-3, parameters DeepSpeed keeps
gathered for reuse; at the optimizer step the gradients add 4 (ZeRO-0/1) or 4/N (ZeRO-2).
docs/deepspeed.md has the bf16 (GPU) forms.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20
STATE_BYTES_PER_PARAM = {0: lambda n: 12, 1: lambda n: 4 + 12 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 20 / n}
"""fp32 on CPU: bytes per parameter kept between steps at data-parallel size n (module docstring)."""


def raw_zero_keys(stage: int, bucket: int) -> dict:
    """deepspeed.config of one stage. Buckets are sized to the model (DeepSpeed's defaults, 5e8
    elements, would dominate a small model); stage3_param_persistence_threshold 0 partitions every
    parameter (by default those under 1e5 elements stay whole on every rank)."""
    if stage == 0:
        return {}
    zero = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket, "overlap_comm": False,
            "contiguous_gradients": True}
    if stage == 3:
        zero |= {"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                 "stage3_max_live_parameters": bucket, "stage3_max_reuse_distance": bucket}
    return {"zero_optimization": zero}


# --------------------------------------------------------------------------- one rank


PHASES = ("forward", "backward", "optimizer")


def phase_windows(events, step: str) -> dict[str, tuple[int, int]]:
    """[start, end) in ns of the last ``step`` region and of its phases: forward (with the loss)
    up to the first autograd node, backward (with DeepSpeed's gradient reduction and norm) up to
    the optimizer's own step (torch.optim's ``Optimizer.step#...`` region), optimizer to the end
    (the step, and ZeRO's copy back and all-gather of the updated partitions)."""
    region = max((e for e in events if e.name() == step), key=lambda e: e.start_ns())
    start, end = region.start_ns(), region.start_ns() + region.duration_ns()
    inside = [e for e in events if start <= e.start_ns() < end]
    backward = min(e.start_ns() for e in inside if e.name().startswith("autograd::engine::evaluate_function"))
    optimizer = max(e.start_ns() for e in inside if e.name().startswith("Optimizer.step#"))
    return {step: (start, end), "forward": (start, backward), "backward": (backward, optimizer),
            "optimizer": (optimizer, end)}


def live_bytes(events, windows: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """{window: (live bytes when it starts, largest live bytes inside it)} from the profiler's
    allocation events (a free is an event with negative bytes)."""
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    out = {}
    for name, (start, end) in windows.items():
        live = at_start = peak = 0
        for t, nbytes in memory:
            if t >= end:
                break
            live += nbytes
            if t < start:
                at_start = live
            else:
                peak = max(peak, live)
        out[name] = (at_start, max(peak, at_start))
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from megadiv import parallel
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.policy.batches import SequenceBatch
    from megadiv.policy.deepspeed import DeepSpeedPolicy
    from megadiv.policy.deepspeed_config import DeepSpeedConfig
    from megadiv.policy.objectives import grpo_objective

    rank = parallel.initialize(ParallelConfig(timeout_s=300)).rank  # gloo, as the trainer's ranks
    loss_fn = grpo_objective(PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.0231,
                                              delta_high=0.0331))
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own rows, as data parallelism has
    vocab = json.loads((Path(args.hf_dir) / "config.json").read_text())["vocab_size"]
    mask = (torch.rand(args.rows, args.seq, generator=g) < 0.8).float()
    mask[:, -1] = 0  # the last position predicts nothing
    batch = SequenceBatch(tokens=torch.randint(0, vocab, (args.rows, args.seq), generator=g), loss_mask=mask,
                          advantages=torch.randn(args.rows, generator=g))  # on-policy rows: logp_old = logp

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        policy = DeepSpeedPolicy(ModelConfig(hf_dir=args.hf_dir, backend="deepspeed"),
                                 DeepSpeedConfig(zero_stage=args.stage, config=raw_zero_keys(args.stage, args.bucket)),
                                 "actor", OptimConfig(lr=1e-4, clip_grad=1.0))
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in policy.module.parameters())
        print(f"rank {rank}: ZeRO-{args.stage} engine ready, {params} parameters", flush=True)
        policy.train_step(batch, loss_fn, args.rows)  # warm-up: Adam's moments appear at the first step
        print(f"rank {rank}: warm-up step done", flush=True)
        with record_function("measured_step"):
            metrics = policy.train_step(batch, loss_fn, args.rows)
    events = list(prof.profiler.kineto_results.events())
    phases = live_bytes(events, phase_windows(events, "measured_step"))
    state, peak = phases.pop("measured_step")
    Path(args.out).write_text(json.dumps({"rank": rank, "params": params, "state": state, "peak": peak,
                                          "phase_peak": {k: v[1] for k, v in phases.items()},
                                          "loss": metrics["loss/total"]}))


# --------------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stage(stage: int, hf_dir: Path, work: Path, args: argparse.Namespace, world: int = 2) -> list[dict]:
    """Both ranks of one stage as fresh processes (own process group, killed on timeout)."""
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        out = work / f"zero{stage}-rank{rank}.json"
        env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", "--stage", str(stage), "--hf-dir", str(hf_dir),
               "--out", str(out), "--rows", str(args.rows), "--seq", str(args.seq), "--bucket", str(args.bucket)]
        log = open(work / f"zero{stage}-rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        outs.append(out)
    try:
        for p in procs:
            p.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not outs[r].is_file()]
    if failed:
        tail = (work / f"zero{stage}-rank{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"ZeRO-{stage} rank {failed[0]} failed (exit {procs[failed[0]].returncode}):\n{tail}")
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--family", default="olmo2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--bucket", type=int, default=1 << 18, help="ZeRO bucket sizes, elements")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per stage")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from megadiv.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        work = Path(tmp)
        hf_dir = make_tiny_model(work / args.family, args.family, hidden=args.hidden, layers=args.layers,
                                 heads=args.heads, kv_heads=args.heads, ffn=args.ffn, max_positions=args.seq + 1)
        results = {}
        for stage in args.stages:
            print(f"ZeRO-{stage}: 2 ranks ...", flush=True)
            results[stage] = run_stage(stage, hf_dir, work, args)
    params = results[args.stages[0]][0]["params"]
    print(f"\n{args.family} hidden {args.hidden} x {args.layers} layers, {params / 1e6:.2f} M parameters; "
          f"{args.rows} x {args.seq} tokens per rank, DP=2, fp32, gloo")
    print(f"{'stage':>5} {'state MiB':>10} {'B/param':>8} {'theory':>7} {'peak MiB':>9} {'/ ZeRO-0':>9} "
          + " ".join(f"{p + ' MiB':>14}" for p in PHASES) + f" {'loss':>10}")
    base = max(r["peak"] for r in results[0]) if 0 in results else None
    rows = []
    for stage, ranks in results.items():  # each figure the larger of the two ranks'
        state, peak = max(r["state"] for r in ranks), max(r["peak"] for r in ranks)
        phase = {p: max(r["phase_peak"][p] for r in ranks) for p in PHASES}
        theory = STATE_BYTES_PER_PARAM[stage](2)
        ratio = f"{peak / base:.3f}" if base else "-"
        print(f"{stage:>5} {state / MiB:>10.1f} {state / params:>8.2f} {theory:>7.2f} {peak / MiB:>9.1f} {ratio:>9} "
              + " ".join(f"{phase[p] / MiB:>14.1f}" for p in PHASES) + f" {ranks[0]['loss']:>10.5f}")
        rows.append({"stage": stage, "ranks": ranks, "peak_ratio": peak / base if base else None,
                     "state_bytes_per_param": state / params, "theory_bytes_per_param": theory})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "params": params, "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
