"""Grading in the caller: a test's expected values never enter the sandbox, its verdict never leaves it.

A test is one ``assert`` statement. ``plan_test`` splits its expression into the part the caller
evaluates itself (comparisons, ``and``/``or``/``not``, literals, and a few pure builtins such as
``set``, ``sorted``, ``math.isclose``) and the operands it cannot (calls into the program, e.g.
``f(3)``): only those "leaves" are sent to the sandbox. The sandbox sends back their values as plain
data (tagged JSON of builtin types, ``sandbox_child.make_encoder``); ``judge_test`` decodes them and
evaluates the assert here. So a program can change what its own functions return, and nothing else:
not the comparison (an object whose ``__eq__`` is always true is not data), not the expected side,
not the count of tests.

    assert set(f([1, 2])) == {1, 2}   ->  leaves ["f([1, 2])"],  here: set(_v0) == {1, 2}
"""
from __future__ import annotations

import ast
import builtins
import math
import types
from dataclasses import dataclass
from typing import Any

# Pure builtins the caller applies to decoded values (a program's own function of the same name is
# not seen by the test: MBPP tests that call the program's `sum` keep it a leaf because sum is not here).
SAFE_CALLS = {name: getattr(builtins, name) for name in ("abs", "bool", "float", "frozenset", "int", "len", "list",
                                                      "round", "set", "sorted", "str", "tuple")}
_MATH = types.SimpleNamespace(isclose=math.isclose)
_LEAF = "_v"


@dataclass(frozen=True)
class TestPlan:
    source: str
    leaves: tuple[str, ...]
    """Source of each operand the sandbox evaluates, in Python's evaluation order."""
    code: types.CodeType
    """The assert's expression with each leaf replaced by the name _v<k>; evaluated by the caller."""


class _Splitter(ast.NodeTransformer):
    """Keeps the nodes the caller can evaluate on plain data and turns every other subtree into a leaf."""

    def __init__(self):
        self.leaves: list[str] = []

    def leaf(self, node: ast.expr) -> ast.Name:
        self.leaves.append(ast.unparse(node))
        return ast.copy_location(ast.Name(id=f"{_LEAF}{len(self.leaves) - 1}", ctx=ast.Load()), node)

    def visit(self, node):
        if isinstance(node, (ast.Compare, ast.BoolOp)) or isinstance(node, ast.Constant):
            return self.generic_visit(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            return self.generic_visit(node)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return self.generic_visit(node)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return self.generic_visit(node)
        if isinstance(node, ast.Call) and _safe_callee(node.func) and not any(
                isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords):
            node.args = [self.visit(a) for a in node.args]
            for k in node.keywords:
                k.value = self.visit(k.value)
            return node
        if isinstance(node, (ast.expr_context, ast.cmpop, ast.boolop, ast.unaryop, ast.keyword)):
            return node
        return self.leaf(node)


def _safe_callee(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id in SAFE_CALLS) or (
        isinstance(func, ast.Attribute) and func.attr == "isclose" and isinstance(func.value, ast.Name)
        and func.value.id == "math")


def plan_test(source: str) -> TestPlan:
    """Split one test (a single ``assert`` statement) into leaves and the caller's expression.
    Raises ValueError for anything else: a test that is not an assert cannot be graded here."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"test is not valid Python: {source!r} ({e.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"a test must be one assert statement, got {source!r}")
    splitter = _Splitter()
    expr = splitter.visit(tree.body[0].test)
    code = compile(ast.fix_missing_locations(ast.Expression(expr)), "<test>", "eval")
    return TestPlan(source, tuple(splitter.leaves), code)


class Opaque:
    """A value that was not plain data: it has the truth value the sandbox reported and equals nothing."""

    def __init__(self, truth: bool):
        self.truth = truth

    def __bool__(self):
        return self.truth

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = object.__hash__


def decode(obj: Any) -> Any:
    """Inverse of the sandbox's encoder (raises on anything malformed; recursion is bounded by the
    caller's line-length cap and the encoder's depth cap)."""
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"not plain data: {type(obj).__name__}")
    tag, v = obj["T"], obj["v"]
    if tag == "int":
        return int(v, 16)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "object":
        return Opaque(v is True)
    items = [decode(x) for x in v]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict":
        return dict(zip(items[::2], items[1::2]))
    raise ValueError(f"unknown tag {tag!r}")


def judge_test(plan: TestPlan, encoded: Any) -> tuple[bool, str]:
    """(passed, why not) for one test from its leaves' encoded values. Never raises."""
    try:
        if not isinstance(encoded, list) or len(encoded) != len(plan.leaves):
            return False, "malformed test values"
        names = {f"{_LEAF}{k}": decode(v) for k, v in enumerate(encoded)}
        names.update(SAFE_CALLS, math=_MATH, __builtins__={})
        if eval(plan.code, names):  # only comparisons, literals and SAFE_CALLS on plain data
            return True, ""
        return False, f"AssertionError: {plan.source}"[:300]
    except Exception as e:  # noqa: BLE001 - e.g. comparing int with str, set() of lists: the test fails
        return False, f"{type(e).__name__} while judging {plan.source}"[:300]
