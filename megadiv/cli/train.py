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


def run(args: argparse.Namespace) -> int:
    from megadiv.cli.preflight import preflight
    from megadiv.trainer.lifecycle import RankFailure, RunInterrupted, RunLock

    under_torchrun = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_train_config(args, int(os.environ.get("WORLD_SIZE", args.nproc or 1)))
        if rank == 0:
            preflight(cfg)
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        if not under_torchrun:
            RunLock(run_dir).check_free()
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    if args.nproc and args.nproc > 1 and not under_torchrun:
        from megadiv.cli.launch import launch

        return launch(args.nproc, args.args, run_dir)
    from megadiv.trainer.grpo import train

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
