"""Checking a recipe before its weights are on disk (``check-config`` and ``plan``).

The architecture comes from ``--hf-config FILE`` or, when ``model.hf_dir`` holds no config.json
yet, from ``examples/hf_configs/<name>/config.json`` for a model directory named ``<name>`` (the
public configs of the recipe models: ``/checkpoints/Qwen3-8B`` -> ``examples/hf_configs/Qwen3-8B``).
It is copied into a temporary directory that stands in for ``model.hf_dir`` while the config is
checked; the note returned says so, and that the weights are not checked.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from megadiv.config import merged_config, split_config_args

HF_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "hf_configs"


def add_hf_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-config", default=None,
                        help="a Hugging Face config.json to check the architecture with instead of model.hf_dir's "
                             "(default when model.hf_dir holds none: examples/hf_configs/<its name>/config.json)")


@contextmanager
def hf_config_stand_in(args: argparse.Namespace):
    """Within: ``args.args`` points model.hf_dir at a directory holding only the stand-in
    config.json, when there is one. Yields (the note for the user, the configured model.hf_dir),
    or (None, None) when model.hf_dir is used as it is."""
    source, note, configured = _stand_in(args)
    if source is None:
        yield None, None
        return
    original = args.args
    tmp = Path(tempfile.mkdtemp(prefix="megadiv-hf-config-"))
    try:
        shutil.copy(source, tmp / "config.json")
        args.args = [*original, f"model.hf_dir={tmp}"]
        yield note, configured
    finally:
        args.args = original
        shutil.rmtree(tmp, ignore_errors=True)


def _stand_in(args: argparse.Namespace) -> tuple[Path | None, str | None, str | None]:
    raw = merged_config(*split_config_args(args.args))
    configured = (raw.get("model") or {}).get("hf_dir")
    if args.hf_config:
        return (Path(args.hf_config), f"checking the architecture of {args.hf_config} (--hf-config) in place of "
                f"model.hf_dir={configured}; its weights are not checked", configured)
    creates = (raw.get("warm_start") or {}).get("make_model", "none") != "none"
    if configured is None or creates or (Path(configured) / "config.json").is_file():
        return None, None, None
    public = HF_CONFIGS / Path(configured).name / "config.json"
    if not public.is_file():
        return None, None, None
    return (public, f"model.hf_dir={configured} holds no config.json yet; checking the architecture of {public} "
            f"(the public config of {Path(configured).name}) in its place; the weights are not checked", configured)
