"""``megadiv check-config [CONFIG ...] [key.sub=value ...]``: validate and print the resolved config."""
from __future__ import annotations

import argparse
import sys

import yaml

from megadiv.config import ConfigError, load_config, split_config_args, to_dict
from megadiv.trainer.config import TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="CONFIG|key=value",
                        help="YAML configs (merged left to right), then key.sub=value overrides")
    parser.add_argument("--world-size", type=int, default=None,
                        help="also check that this many ranks split into TP x PP x CP x DP")


def run(args: argparse.Namespace) -> int:
    try:
        paths, overrides = split_config_args(args.args)
        cfg = load_config(TrainConfig, paths, overrides)
        if args.world_size is not None:
            cfg.parallel.data_parallel_size(args.world_size)
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0
