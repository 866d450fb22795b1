"""``megadiv train CONFIG [key.sub=value ...] [--nproc N]``.

The config is loaded and validated (keys, types, combinations, and the world size against
TP x PP x CP) before any process group exists. ``--nproc N`` relaunches this command under
``torchrun --nproc_per_node N`` on this machine; for several nodes, call torchrun yourself:
``torchrun --nnodes 2 --nproc_per_node 8 --rdzv_endpoint HOST:PORT -m megadiv.cli train CONFIG``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megadiv.config import ConfigError, load_config
from megadiv.trainer.config import TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    parser.add_argument("--nproc", type=int, default=None,
                        help="launch N local ranks with torchrun (default: the current torchrun world, or 1)")


def run(args: argparse.Namespace) -> int:
    under_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc or 1))
    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        cfg.parallel.data_parallel_size(world_size)
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    if args.nproc and args.nproc > 1 and not under_torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "megadiv.cli", "train", args.config, *args.overrides]
        return subprocess.call(cmd)
    from megadiv.trainer.grpo import train

    train(cfg)
    return 0
