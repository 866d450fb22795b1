"""``megadiv train CONFIG [CONFIG ...] [key.sub=value ...] [--nproc N]``.

Several YAML files merge left to right (e.g. task, model, algorithm: examples/gsm8k/README.md);
overrides apply last.
The config is loaded and validated (keys, types, combinations, the world size against TP x PP,
and every batch against the DP replicas) before any process group exists. ``--nproc N``
relaunches this command under ``torchrun --nproc_per_node N`` on this machine; for several
nodes, run examples/launch/multinode.sh on each (``torchrun --nnodes N ... -m megadiv.cli train``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--nproc", type=int, default=None,
                        help="launch N local ranks with torchrun (default: the current torchrun world, or 1)")


def run(args: argparse.Namespace) -> int:
    under_torchrun = "LOCAL_RANK" in os.environ
    try:
        cfg = load_train_config(args, int(os.environ.get("WORLD_SIZE", args.nproc or 1)))
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    if args.nproc and args.nproc > 1 and not under_torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "megadiv.cli", "train", *args.args]
        return subprocess.call(cmd)
    from megadiv.trainer.grpo import train

    try:
        train(cfg)
    except ConfigError as e:  # found only once the checkpoint or data is read
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    return 0
