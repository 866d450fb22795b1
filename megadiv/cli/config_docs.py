"""Render every key of TrainConfig (default and the attribute's docstring) as Markdown.

``python -m megadiv.cli.config_docs > docs/config_reference.md``; a test checks that the
committed file is current, so the reference cannot drift from the code.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from megadiv.trainer.config import TrainConfig


def attribute_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of ``cls`` (the attribute-docstring convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    return "(section)" if f.default_factory is not dataclasses.MISSING else "required"


def _type_name(tp) -> str:
    text = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("NoneType", "None")


def render() -> str:
    lines = ["# Config reference", "",
             "Every key `megadiv train` accepts, with its default. Generated from the config dataclasses by",
             "`python -m megadiv.cli.config_docs`; do not edit by hand. Set keys in the YAML file or as",
             "`section.key=value` overrides on the command line.", ""]
    hints = typing.get_type_hints(TrainConfig)
    for section in dataclasses.fields(TrainConfig):
        cls = hints[section.name]
        lines += [f"## `{section.name}` ({cls.__module__}.{cls.__name__})", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            lines += [" ".join(cls.__doc__.split()), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|", *_rows(section.name, cls), ""]
    return "\n".join(lines)


def _rows(prefix: str, cls: type) -> list[str]:
    """One table row per field of ``cls``; a field that is itself a section (e.g. loss.mirror_map)
    is followed by the rows of its own fields."""
    rows = []
    docs, field_types = attribute_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meaning = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{prefix}.{f.name}` | `{_type_name(field_types[f.name])}` | `{_default(f)}` | {meaning} |")
        if dataclasses.is_dataclass(field_types[f.name]):
            rows += _rows(f"{prefix}.{f.name}", field_types[f.name])
    return rows


if __name__ == "__main__":
    print(render(), end="")
