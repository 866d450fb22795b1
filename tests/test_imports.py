"""The package's import graph, read from the source (no module is imported): no circles, arrows
pointing one way (docs/architecture.md), and argument parsing only in megadiv/cli/.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import
still ties two modules together, it only hides the circle until a caller takes that path.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megadiv"

# top to bottom; a module may import from its own room and the rooms below it, never above
LAYERS = ("cli", "experiments", "trainer", "policy")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def package_modules() -> dict[str, Path]:
    """megadiv's modules by dotted name; rollout/sglang_cpu/ holds stand-ins for SGLang's server
    process, which are never imported as part of megadiv."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "sglang_cpu" not in p.parts}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The megadiv modules ``path`` imports (``from pkg import name`` counts as pkg.name when that
    is a module, else as pkg)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
    return {m for m in found if m in modules}


@cache
def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_imports_point_down_the_layers():
    """cli -> experiments -> trainer -> policy -> everything else; the divergence library imports
    nothing from the rest of megadiv."""
    upward = []
    for module, imported in import_graph().items():
        here = room(module)
        for target in imported:
            there = room(target)
            if there in LAYERS and (here not in LAYERS or LAYERS.index(there) < LAYERS.index(here)):
                upward.append(f"{module} -> {target}")
            if here == "divergence" and there != "divergence":
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_only_the_cli_parses_arguments():
    parsing = [name for name, path in package_modules().items()
               if room(name) != "cli" and "argparse" in imports_of_stdlib(path)]
    assert parsing == []


def imports_of_stdlib(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_every_verb_is_a_cli_module_with_a_parser_and_run():
    """Each ``megadiv`` verb maps to megadiv/cli/<module>.py, whose parser builds (what ``megadiv VERB
    --help`` prints) and which has a ``run``."""
    import argparse
    import importlib

    from megadiv.cli import COMMANDS

    for verb, (module_name, _) in COMMANDS.items():
        assert module_name.startswith("megadiv.cli."), verb
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"megadiv {verb}")
        module.add_arguments(parser)
        assert parser.format_help().startswith(f"usage: megadiv {verb}") and callable(module.run), verb
