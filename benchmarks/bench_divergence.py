"""Time and peak memory of the divergence library's vocab-parallel losses against megatron-core's
vocab-parallel cross entropy, forward + backward, same run, same shapes: on CPU with TP=2 (gloo),
or on CUDA (NCCL; TP = the number of processes, one GPU each).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 \
        benchmarks/bench_divergence.py [--tokens 4096] [--vocab-per-rank 32000] \
        [--dtype float32] [--trials 7] [--divergence-chunk ROWS] [--rows KEY,...] [--json FILE]
    torchrun --nproc_per_node=1 benchmarks/bench_divergence.py --device cuda \
        --tokens 16384 --vocab-per-rank 151936 --dtype bfloat16        # what tools/gpu_check.py runs

Both C-allocator settings, each run as its own torchrun (the setting is read once, at process
start), alternately for ``--rounds`` rounds, medians of the per-run ratios printed side by side:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_divergence.py --allocators glibc,mmap64k \
        --rounds 3 [--rows ce,logp_entropy_grads,prob_l2_consume] [same options as above]

``glibc`` is glibc's default (a dynamic mmap threshold that rises to the largest block freed, so
chunk-sized blocks are recycled from the heap); ``mmap64k`` is ``MALLOC_MMAP_THRESHOLD_=65536``,
which fixes the threshold: every block of 64 KiB or more is mmap'ed on allocation and unmapped
on free, so each fresh allocation costs a page fault per 4 KiB touched. A kernel that allocates
per chunk pays that per chunk; one that reuses a workspace pays it once per call.

Rows (each rank holds logits [tokens, vocab/TP]; loss reduced to a scalar, then backward):
  (a) megatron-core vocab_parallel_cross_entropy(logits, target).sum()
  (b) megadiv log_probs_and_entropy (in-place backward, like (a)) + divergence_clip on k3 via
      compute_policy_loss (entropy logged); "gradients through log-prob and entropy" puts H in
      the loss as well (an entropy bonus); "out of place" keeps the logits intact and allocates
      the gradient
  (c) megadiv full-vocabulary ProbL2 regulariser sum_v (p_v - q_v)^2 against a reference
      (reference logits detached); "in the reference's storage" uses consume_base=True (the
      reference logits serve nothing else, so their memory takes the gradient, the way (a)
      reuses its input); full KL alongside for comparison
CPU times: wall clock and process CPU time, median over ``--trials`` after one warm-up, each
trial the larger of the two ranks'; the trials interleave the rows so that load changes on a
shared machine hit every row alike. On a loaded machine CPU time is the steadier figure (waiting
for a descheduled peer rank shows in wall time only); the load average is printed.
CUDA times: CUDA events around each forward + backward (benchmarks/timing.py), one warm-up per
row excluded, median over ``--trials``, each sample the largest over the ranks.
Peak memory on CPU: torch.profiler(profile_memory=True) records every CPU-allocator allocation
and free with a timestamp; the peak is the largest running sum of those during forward +
backward, plus the bytes of the inputs that exist before it (logits, reference logits). This
counts temporaries inside kernels too, and is exact and repeatable, unlike process RSS. On CUDA
the same quantity is read from the caching allocator: max_memory_allocated() during the step
minus what was allocated before it, plus the inputs. Ratios are to (a). ``--json`` writes every
row's median, raw samples and peak (rank 0; with ``--allocators``, every run's report).
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
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.timing import summary, time_region
from megadiv.divergence import vocab_parallel as vp
from megadiv.divergence.losses import PolicyLossConfig, compute_policy_loss
from megadiv.divergence.registry import get_divergence


def peak_allocated_bytes(step) -> int:
    """Largest running sum of CPU allocations minus frees while ``step()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def backward(loss_fn, *inputs) -> None:
    loss_fn(*inputs).backward()


def cuda_peak_allocated_bytes(step) -> int:
    """Largest CUDA caching-allocator allocation above the bytes already allocated, during ``step()``."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


REPO = Path(__file__).resolve().parents[1]
# C-allocator settings compared by --allocators: environment of each run's processes
ALLOCATORS = {"glibc": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
ROW_KEYS = ("ce", "logp_entropy", "logp_entropy_grads", "logp_entropy_out_of_place", "prob_l2",
            "prob_l2_consume", "kl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab-per-rank", type=int, default=32000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--divergence-chunk", type=int, default=None,
                        help="token rows per chunk of the full-vocabulary measures (default: library's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: NCCL, one GPU per rank, CUDA-event timing")
    parser.add_argument("--json", default=None, help="write figures and raw samples to this file (rank 0)")
    parser.add_argument("--rows", default=",".join(ROW_KEYS),
                        help=f"comma-separated rows to run, of {','.join(ROW_KEYS)} (ce always runs)")
    parser.add_argument("--allocators", default=None,
                        help=f"launch one torchrun per setting of {','.join(ALLOCATORS)} (CPU) and "
                             "print their ratios side by side")
    parser.add_argument("--rounds", type=int, default=3, help="with --allocators: runs per setting")
    parser.add_argument("--nproc", type=int, default=2, help="with --allocators: ranks (TP) per run")
    parser.add_argument("--timeout", type=float, default=1800, help="with --allocators: seconds per run")
    args, _ = parser.parse_known_args()
    unknown = set(args.rows.split(",")) - set(ROW_KEYS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(ROW_KEYS)}")
    if args.allocators:
        compare_allocators(args, parser)
    else:
        parser.parse_args()   # a worker takes no launcher-only surprises
        run_rows(args)


def run_rows(args) -> None:
    """One torchrun rank: every selected row, timed and measured against (a) in this process."""

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    group = parallel_state.get_tensor_model_parallel_group()
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    tokens, width, dtype = args.tokens, args.vocab_per_rank, getattr(torch, args.dtype)
    vocab = width * tp
    g = torch.Generator(device).manual_seed(rank)     # logits drawn where they live (GBs on a GPU)
    logits0 = (3 * torch.randn(tokens, width, generator=g, device=device)).to(dtype)
    ref_logits = (logits0.float() + 0.1 * torch.randn(tokens, width, generator=g, device=device)).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(7)).to(device)
    seqs = max(1, tokens // 512)                      # [seqs, tokens / seqs] for the policy loss
    shape = (seqs, tokens // seqs)
    advantages = torch.randn(seqs, generator=torch.Generator().manual_seed(8)).to(device)
    mask = torch.ones(shape, device=device)
    cfg = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.02)
    shard = dict(group=group, vocab_start=rank * width, vocab_size=vocab)
    logp_old = None

    def megatron_ce(z, _):
        # megatron's layout is [seq, batch, vocab/TP]; it overwrites z with softmax, then grad
        return vocab_parallel_cross_entropy(z.view(*shape[::-1], width), target.view(*shape[::-1])).sum()

    def megadiv_k3(entropy_bonus: float, inplace: bool):
        def loss(z, _):
            lp, ent = vp.log_probs_and_entropy(z, target, **shard, inplace_backward=inplace)
            lp, ent = lp.view(shape), ent.view(shape)
            value, _ = compute_policy_loss(cfg, lp, logp_old, advantages, mask, entropy=ent.detach())
            return value - entropy_bonus * ent.mean() if entropy_bonus else value
        return loss

    def regulariser(name: str, consume_base: bool = False):
        measure = get_divergence(name, chunk_size=args.divergence_chunk, consume_base=consume_base)
        return lambda z, ref: measure(z, ref, **shard).mean()

    with torch.no_grad():     # logp_old: the policy before the update, a little off the current one
        logp_old = (vp.log_probs(logits0, target, **shard) + 0.01).view(shape)

    every_row = {
        "ce": ("(a) megatron vocab_parallel_cross_entropy", megatron_ce, 1),
        "logp_entropy": ("(b) megadiv log-prob + entropy + k3-clip", megadiv_k3(0.0, True), 1),
        "logp_entropy_grads": ("    ... gradients through log-prob and entropy", megadiv_k3(1e-3, True), 1),
        "logp_entropy_out_of_place": ("    ... out of place (logits kept)", megadiv_k3(0.0, False), 1),
        "prob_l2": ("(c) megadiv full-vocab ProbL2 regulariser", regulariser("full_prob_l2"), 2),
        "prob_l2_consume": ("    ... gradient in the reference's storage", regulariser("full_prob_l2", True), 2),
        "kl": ("    full-vocab KL(pi || ref) regulariser", regulariser("full_kl"), 2),
    }
    wanted = {"ce", *args.rows.split(",")}
    keys = [key for key in every_row if key in wanted]
    rows = [every_row[key] for key in keys]

    def one_step(loss_fn):
        """(wall, cpu) seconds of forward + backward, each the larger of the two ranks'."""
        # fresh copies: (a), in-place (b) and consume_base (c) overwrite them
        z, ref = logits0.clone().requires_grad_(), ref_logits.clone()
        dist.barrier(group)
        wall, cpu = time.perf_counter(), time.process_time()
        loss_fn(z, ref).backward()
        elapsed = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu],
                               dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        return elapsed.tolist()

    def cuda_samples(loss_fn) -> list[float]:
        """Seconds of forward + backward per trial (CUDA events), each the largest over the ranks."""
        dist.barrier(group)
        fresh = lambda: (logits0.clone().requires_grad_(), ref_logits.clone())  # noqa: E731
        samples = torch.tensor(time_region(lambda inputs: loss_fn(*inputs).backward(), warmup=1,
                                           repeats=args.trials, device=device, setup=fresh),
                               dtype=torch.float64, device=device)
        dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=group)
        return samples.tolist()

    times = {label: [] for label, _, _ in rows}
    if cuda:
        for label, loss_fn, _ in rows:
            times[label] = [(s, float("nan")) for s in cuda_samples(loss_fn)]  # no CPU time on a GPU
    else:  # trials interleave the rows, so that a load change on a shared machine hits all alike
        for trial in range(args.trials + 1):                # trial 0 is the warm-up
            for label, loss_fn, _ in rows:
                elapsed = one_step(loss_fn)
                if trial:
                    times[label].append(elapsed)
    measure_peak = cuda_peak_allocated_bytes if cuda else peak_allocated_bytes
    results = []
    for label, loss_fn, n_inputs in rows:
        inputs = logits0.clone().requires_grad_(), ref_logits.clone()
        peak = n_inputs * inputs[0].nbytes + measure_peak(partial(backward, loss_fn, *inputs))
        del inputs
        wall, cpu = (statistics.median(t[i] for t in times[label]) for i in (0, 1))
        results.append((label, wall, cpu, peak))

    if rank == 0 and args.json:
        report = {"device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None, "tp": tp,
                  "tokens": tokens, "vocab_per_rank": width, "vocab": vocab, "dtype": args.dtype,
                  "trials": args.trials, "baseline": results[0][0],
                  "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                  "load_average": os.getloadavg()[0],
                  "rows": [{"key": key, "label": label.strip(), "time_s": summary([s for s, _ in times[label]]),
                            "time_x_baseline": wall / results[0][1],
                            "cpu_s": None if cuda else cpu,
                            "cpu_x_baseline": None if cuda else cpu / results[0][2],
                            "peak_bytes": peak, "peak_x_baseline": peak / results[0][3],
                            "samples_s": [s for s, _ in times[label]]}
                           for key, (label, wall, cpu, peak) in zip(keys, results)]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if rank == 0 and cuda:
        _, base_t, _, base_m = results[0]
        print(f"TP={tp} on {torch.cuda.get_device_name()}, {tokens} tokens x {width} vocab per rank "
              f"({vocab} in all), {args.dtype} logits, median of {args.trials} trials (CUDA events)")
        print(f"{'':44s} {'ms':>8s} {'x (a)':>6s} {'peak MiB':>9s} {'x (a)':>6s}")
        for label, t, _, m in results:
            print(f"{label:44s} {t * 1e3:8.2f} {t / base_t:6.2f} {m / 2**20:9.0f} {m / base_m:6.2f}")
    elif rank == 0:
        _, base_w, base_c, base_m = results[0]
        print(f"TP={tp}, {tokens} tokens x {width} vocab per rank ({vocab} in all), {args.dtype} "
              f"logits, median of {args.trials} trials, 1 thread per rank, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'':44s} {'wall s':>7s} {'x (a)':>6s} {'cpu s':>7s} {'x (a)':>6s} "
              f"{'peak MiB':>9s} {'x (a)':>6s}")
        for label, w, c, m in results:
            print(f"{label:44s} {w:7.3f} {w / base_w:6.2f} {c:7.3f} {c / base_c:6.2f} "
                  f"{m / 2**20:9.0f} {m / base_m:6.2f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def compare_allocators(args, parser) -> None:
    """One torchrun per allocator setting and round (settings alternate, so load changes on a
    shared machine hit both alike); prints, per row and setting, the median over rounds of the
    ratios each run measured against (a) in its own processes."""
    settings = args.allocators.split(",")
    if set(settings) - set(ALLOCATORS):
        parser.error(f"unknown allocator settings {settings}; known: {', '.join(ALLOCATORS)}")
    if args.device != "cpu":
        parser.error("--allocators compares glibc settings: CPU only")
    worker = sys.argv[1:]
    for flag in ("--allocators", "--rounds", "--nproc", "--timeout", "--json"):  # launcher-only
        worker = _drop_option(worker, flag)
    reports = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="bench-divergence-") as tmp:
        for round_ in range(args.rounds):
            for name in settings:
                out = Path(tmp) / f"{name}-{round_}.json"
                env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                env.update(ALLOCATORS[name], OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={args.nproc}", __file__, *worker, "--json", str(out)]
                print(f"round {round_ + 1}/{args.rounds}, {name}: load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                _run_bounded(cmd, env, args.timeout)
                reports[name].append(json.loads(out.read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    first = reports[settings[0]][0]
    print(f"TP={first['tp']}, {first['tokens']} tokens x {first['vocab_per_rank']} vocab per rank "
          f"({first['vocab']} in all), {first['dtype']} logits; per setting the median over "
          f"{args.rounds} runs of each run's ratio to (a) (each run: median of {first['trials']} "
          f"trials); load average {min(r['load_average'] for rs in reports.values() for r in rs):.1f}-"
          f"{max(r['load_average'] for rs in reports.values() for r in rs):.1f} on {os.cpu_count()} CPUs")
    head = "".join(f" | {name:^29s}" for name in settings)
    print(f"{'':44s}{head}")
    print(f"{'':44s}" + " | (a) wall s  wall x  cpu x  mem x" * len(settings))
    for i, row in enumerate(first["rows"]):
        line = f"{row['label']:44s}"
        for name in settings:
            runs = [r["rows"][i] for r in reports[name]]
            base = statistics.median(r["rows"][0]["time_s"]["median"] for r in reports[name])
            line += (f" | {base:9.3f} {statistics.median(r['time_x_baseline'] for r in runs):7.2f}"
                     f" {statistics.median(r['cpu_x_baseline'] for r in runs):6.2f}"
                     f" {statistics.median(r['peak_x_baseline'] for r in runs):6.2f}")
        print(line)



def _drop_option(argv: list[str], flag: str) -> list[str]:
    """argv without ``flag VALUE`` / ``flag=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _run_bounded(cmd: list[str], env: dict, timeout: float) -> None:
    """Run ``cmd`` (torchrun) in its own process group; whatever happens, end the group: SIGTERM
    first (torchrun passes it on to its ranks, which live in sessions of their own), then
    SIGKILL; raise unless it exited 0 within ``timeout``."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=10)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)}: " + ("timed out" if rc is None else f"exit {rc}"))


if __name__ == "__main__":
    main()
