#!/usr/bin/env python
"""Write a small random Hugging Face checkpoint with a tokenizer (same as ``megadiv make-tiny-model``).

    python tools/make_tiny_model.py --family qwen2 --out ckpt/tiny-qwen2
"""
import argparse
import sys

from megadiv.cli import make_tiny_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    make_tiny_model.add_arguments(parser)
    sys.exit(make_tiny_model.run(parser.parse_args()))
