"""``megadiv convert hf-to-megatron|megatron-to-hf ...``: the arguments of megadiv.models.convert.

Several ranks (TP x PP x EP > 1) run it under torchrun: ``torchrun --nproc-per-node N -m megadiv.cli convert ...``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megadiv.config import ConfigError
from megadiv.models.checkpoint import CheckpointError
from megadiv.models.convert import DTYPES, hf_to_megatron, megatron_to_hf, parse_size
from megadiv.models.loading import WeightMismatchError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron distributed checkpoint")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to create")
    to_mcore.add_argument("--stage-layers", default=None,
                          help="layers per pipeline stage, comma-separated (default: even, or uneven ends)")
    to_mcore.add_argument("--overwrite", action="store_true")
    to_hf = sub.add_parser("megatron-to-hf", help="megatron distributed checkpoint -> HF safetensors")
    to_hf.add_argument("--ckpt-dir", required=True)
    to_hf.add_argument("--hf-template", required=True, help="HF directory giving config.json and tokenizer files")
    to_hf.add_argument("--out", required=True, help="HF directory to create")
    to_hf.add_argument("--shard-size", default="2GB", help="bytes per safetensors file (e.g. 500MB, 2GB)")
    for p in (to_mcore, to_hf):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (world size must be tp*pp)")
        p.add_argument("--pp", type=int, default=1, help="pipeline stages")
        p.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks of a mixture-of-experts model, each with 1/EP of the experts "
                            "(world size tp*pp*ep); the checkpoint loads at any EP")
        p.add_argument("--dtype", choices=DTYPES, default=None, help="default: the source checkpoint's dtype")


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megadiv.parallel import shutdown

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    owns_groups = not dist.is_initialized()  # called from a running job: leave its groups alone
    try:
        if args.direction == "hf-to-megatron":
            stage_layers = [int(n) for n in args.stage_layers.split(",")] if args.stage_layers else None
            hf_to_megatron(args.hf_dir, args.out, args.tp, args.pp, args.dtype, stage_layers, args.overwrite, args.ep)
        else:
            megatron_to_hf(args.ckpt_dir, args.hf_template, args.out, args.tp, args.pp, args.dtype,
                           parse_size(args.shard_size), args.ep)
    except (ConfigError, WeightMismatchError, CheckpointError, FileExistsError) as e:
        print(f"megadiv convert {args.direction}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if owns_groups and dist.is_initialized():
            shutdown()
    return 0
