"""``megadiv make-tiny-model --family F --out DIR [...]``: the arguments of megadiv.models.tiny
(small random Hugging Face checkpoints with a tokenizer, offline)."""
from __future__ import annotations

import argparse
import sys

from megadiv.models.tiny import DEFAULT_CHARS, FAMILIES, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--out", required=True, help="output directory (must not exist, unless --force)")
    parser.add_argument("--force", dest="replace", action="store_true", help="replace an existing --out")
    parser.add_argument("--tokenizer", choices=("char", "bpe"), default="char")
    parser.add_argument("--chars", default=DEFAULT_CHARS, help="alphabet of the char tokenizer")
    parser.add_argument("--vocab", type=int, default=None,
                        help="embedding rows (>= tokenizer size; bpe: also the BPE target size)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None, help="per-head width (qwen3 may differ from hidden/heads)")
    parser.add_argument("--ffn", type=int, default=128, help="MLP width (MoE: of each routed expert)")
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                        help="tie embeddings and lm_head (default: the family's, tied for qwen2/qwen3)")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--llama3-rope-factor", type=float, default=8.0,
                        help="llama only: Llama-3 RoPE scaling factor (0 disables)")
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--init-std", type=float, default=0.05)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-shard-size", default=None,
                        help="split the safetensors into files of this size (e.g. 200KB) to exercise sharded loading")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=4, help="qwen3_moe, qwen2_moe only: routed experts per layer")
    parser.add_argument("--experts-per-token", type=int, default=2, help="qwen3_moe, qwen2_moe only: experts each token uses")


def run(args: argparse.Namespace) -> int:
    try:
        out = make_tiny_model(**vars(args))
    except (FileExistsError, ValueError) as e:  # --out exists; a tokenizer or size that cannot be built
        print(f"megadiv make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.family} model to {out}")
    return 0


