"""``megadiv check-config [CONFIG ...] [key.sub=value ...]``: validate and print the resolved config.

Checks what ``megadiv train`` checks before launching (megadiv.cli.preflight): keys, types and
combinations; YAML syntax (file, line and column); the data files (present, parseable, not empty);
that the run directory can be written; the model directory (config.json, complete safetensors
holding every tensor of that model); and the checkpoint a resume would start from (its TP/PP
layout included). Notes (where a resume starts, checkpoints skipped) go to stderr.
"""
from __future__ import annotations

import argparse
import sys

import yaml

from megadiv.cli.preflight import preflight, sync_method_note
from megadiv.cli.stand_in import add_hf_config_argument, hf_config_stand_in
from megadiv.cli.train import add_config_arguments, load_train_config
from megadiv.config import ConfigError, to_dict
from megadiv.models.fp8 import check_fp8_here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=False)
    add_hf_config_argument(parser)
    parser.add_argument("--world-size", type=int, default=None,
                        help="also check that this many ranks split into TP x PP x DP and that every batch "
                             "splits exactly over the DP replicas")


def run(args: argparse.Namespace) -> int:
    try:
        with hf_config_stand_in(args) as (stand_in, configured_hf_dir):
            cfg = load_train_config(args, args.world_size)
            check_fp8_here(cfg.model.fp8)  # with the TE and GPU this machine has, if any
            notes = ([stand_in] if stand_in else []) + preflight(cfg, check_weights=stand_in is None)
            notes += [note for note in [sync_method_note(cfg)] if note]
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"megadiv: {note}", file=sys.stderr)
    resolved = to_dict(cfg)
    if stand_in:  # print the configured directory, not the stand-in's
        resolved["model"]["hf_dir"] = configured_hf_dir
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0
