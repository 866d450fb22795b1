"""No config key is accepted and then ignored: every leaf key of TrainConfig is read by megadiv's
code outside the config dataclasses' validation (``__post_init__`` and check methods do not count), or
its docstring says it is informational.

This is a static walk of megadiv/ (attribute reads in the AST): it shows that a key reaches code
outside validation and catches a key that nothing reads; it cannot tell a read that acts from one
that is passed on and dropped (``parallel.context_parallel`` reached megatron's parallel state,
yet nothing split sequences: that key was removed). What each key does is tested next to the
component that reads it. A name read for another key (``seed``, ``name``) also counts here.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from megadiv.cli.config_docs import attribute_docs
from megadiv.trainer.config import TrainConfig

PACKAGE = Path(__file__).resolve().parents[1] / "megadiv"


def _config_classes(cls: type, out: dict[str, type]) -> dict[str, type]:
    out[cls.__name__] = cls
    for tp in typing.get_type_hints(cls).values():
        for arg in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(arg) and arg.__name__ not in out:
                _config_classes(arg, out)
    return out


CLASSES = _config_classes(TrainConfig, {})


def _leaf_keys(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, declaring class, field name) for every leaf of ``cls``."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        section = next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
        keys += _leaf_keys(section, f"{prefix}{f.name}.") if section else [(prefix + f.name, cls, f.name)]
    return keys


VALIDATION = ("__post_init__", "_check", "check", "_fail", "validate")
"""Config methods whose reads are validation, not use."""


def _attribute_reads() -> set[str]:
    """Attribute names read anywhere in megadiv/ outside the validation code of the config
    dataclasses (``__post_init__`` and check*/validate* methods)."""
    reads = set()

    def visit(node, inside_config: bool, in_config_body: bool = False):
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            inside_config = True
        elif in_config_body and isinstance(node, ast.FunctionDef) and not node.name.startswith(VALIDATION):
            inside_config = False  # a config method that serves the code (e.g. RolloutConfig.probe_threshold)
        if not inside_config and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            reads.add(node.attr)
        if not inside_config and isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            reads.add(node.args[1].value)
        for child in ast.iter_child_nodes(node):
            visit(child, inside_config, isinstance(node, ast.ClassDef) and node.name in CLASSES)

    for path in PACKAGE.rglob("*.py"):
        if path.name != "config_docs.py":  # renders every key by reflection
            visit(ast.parse(path.read_text()), False)
    return reads


def test_every_config_key_is_read_or_informational():
    reads = _attribute_reads()
    unread = []
    for key, cls, name in _leaf_keys(TrainConfig):
        informational = "informational" in attribute_docs(cls).get(name, "").lower()
        if name not in reads and not informational:
            unread.append(key)
    assert not unread, f"config keys that no code outside the config classes reads: {unread}"


def test_the_walk_sees_every_key():
    keys = [k for k, _, _ in _leaf_keys(TrainConfig)]
    assert len(keys) > 100 and "parallel.stage_layers" in keys and "model.recompute_num_layers" in keys
    assert "eval.data.name" in keys  # optional sections are walked too
