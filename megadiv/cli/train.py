"""``megadiv train CONFIG [CONFIG ...] [key.sub=value ...] [--nproc N]``.

Several YAML files merge left to right (e.g. task, model, algorithm: examples/gsm8k/README.md);
overrides apply last.
The config is loaded and validated (keys, types, combinations, the world size against TP x PP,
and every batch against the DP replicas), then the data, output directory, model directory and
resume checkpoint are checked (preflight.py), all before any process group exists. ``--nproc N``
runs the job under ``torchrun --nproc_per_node N`` on this machine and relays stop signals to it
(launch.py); for several nodes, run examples/launch/multinode.sh on each
(``torchrun --nnodes N ... -m megadiv.cli train``).

Exit codes: 0 done (or stopped by grpo.stop_after), 1 a rank failed (one line on stderr, the
traceback in run_dir/logs/rank<R>.log), 2 invalid config or input, 128+N stopped by signal N.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megadiv.config import ConfigError, load_config, split_config_args
from megadiv.parallel.quiet import ALL_WARNINGS, FILTERED_NOTE
from megadiv.trainer.config import TrainConfig


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("args", nargs="+" if required else "*", metavar="CONFIG|key=value",
                        help="YAML configs (merged left to right), then key.sub=value overrides")


def load_train_config(args: argparse.Namespace, world_size: int | None) -> TrainConfig:
    """The validated config of ``args``; with ``world_size``, also checked against TP x PP and the
    per-replica batch split."""
    paths, overrides = split_config_args(args.args)
    cfg = load_config(TrainConfig, paths, overrides)
    if world_size is not None:
        cfg.check_world_size(world_size)
    return cfg


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--nproc", type=_positive, default=None,
                        help="launch N local ranks with torchrun (default: the current torchrun world, or 1)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the job up to N times after a failure; it resumes from the newest intact "
                             "checkpoint (torchrun's --max-restarts; an attempt that saved nothing is not retried)")


def run(args: argparse.Namespace) -> int:
    from megadiv.cli.preflight import preflight
    from megadiv.trainer.lifecycle import RankFailure, RunInterrupted, RunLock

    under_torchrun = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    launching = not under_torchrun and ((args.nproc or 1) > 1 or args.max_restarts > 0)
    lock = None
    try:
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        cfg = load_train_config(args, int(os.environ.get("WORLD_SIZE", args.nproc or 1)))
        if rank == 0:
            preflight(cfg, checksums=False)  # rank 0 verifies them before loading: one read of the checkpoint
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        if launching:  # held for the job's life, restarts included: a second launch writes nothing here
            lock = RunLock(run_dir)
            lock.acquire()
        elif not under_torchrun:
            RunLock(run_dir).check_free()
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    if launching:
        from megadiv.cli.launch import launch

        try:
            return launch(args.nproc or 1, args.args, run_dir, args.max_restarts)
        finally:
            lock.release()
    import torch

    from megadiv.parallel.threads import threads_per_rank
    from megadiv.trainer.grpo import train

    if cfg.parallel.tensor_parallel > 1:
        # before CUDA starts: one hardware queue, so megatron's asynchronous TP all-reduce / all-gather
        # is scheduled ahead of the backward matmul it overlaps with (tensor_parallel/layers.py)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # a process of its own (no torchrun) or one of torchrun's: the cores shared out over this machine's ranks
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if rank == 0 and os.environ.get(ALL_WARNINGS) != "1":
        print(FILTERED_NOTE, file=sys.stderr, flush=True)
    try:
        train(cfg)
    except ConfigError as e:  # the run directory is locked by another run
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(e, file=sys.stderr, flush=True)
        _exit_now(1)
    except RunInterrupted as e:
        if rank == 0:
            print(f"megadiv train: stopped by {e} at step {e.step}; nothing half-written was kept, the same command "
                  f"resumes from the newest complete checkpoint", file=sys.stderr, flush=True)
        _exit_now(128 + e.signum)
    return 0


def _exit_now(code: int) -> None:
    """Exit without the interpreter's finalization: after an abandoned step, collecting megatron's
    and gloo's objects can block for many seconds (peers are gone), where no thread runs any more."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
