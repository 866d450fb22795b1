"""The test format of code records: one ``assert`` split into calls into the program and the rest.

A code record's test is one ``assert`` statement. Graded programs are adversaries (a policy
optimised for reward), so a test is split before anything runs:

- **calls into the program** ("leaves"): a name the program defines, applied to arguments that are
  constants (literals and arithmetic on them), values the record's setup defines, or themselves
  such calls, e.g. ``f([1, 2], g(3))``, ``max_height(root)``; or a bare name the program defines.
  Only these are evaluated in the sandbox, and only their values come back. A value the setup
  defines is never read by the grader's part (``abs(f(x) - 1) < EPS`` is refused: the program
  runs first and can rebind ``EPS``);
- **everything else** (comparisons, arithmetic, method calls on the returned values, builtins such
  as ``len``/``sorted``/``all``/``isinstance``/``type``, the modules in ``JUDGE_MODULES``, names
  the setup imports, comprehension and lambda variables) is the grader's expression, evaluated
  outside the sandbox on the decoded values (``megadiv.rewards.judge``).

A test that cannot be split that way (a call into the program whose argument is a loop variable of
the test, a method of a value of the program, ...) is refused with the reason: ``load_dataset``
refuses such records, naming the record and the test.

    assert abs(area(2) - 12.566) < 1e-3   ->  leaves ["area(2)"],  grader: abs(_v0 - 12.566) < 1e-3
"""
from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass

# Modules a test may use without importing them (MBPP task 596 uses sys.getsizeof unimported);
# the grader imports them in its own interpreter.
JUDGE_MODULES = ("math", "cmath", "sys", "re", "collections", "itertools", "functools", "operator", "string",
                 "heapq", "fractions", "decimal", "statistics")
BUILTIN_NAMES = frozenset(dir(builtins))
LEAF_PREFIX = "_megadiv_v"


class UnsplittableTest(ValueError):
    """A test the grader cannot split into calls into the program and its own expression."""


@dataclass(frozen=True)
class TestPlan:
    source: str
    leaves: tuple[str, ...]
    """Source of each call into the program, evaluated in the sandbox, in Python's evaluation order."""
    truth_only: tuple[bool, ...]
    """Per leaf: only its truth value is used (``assert f(x)``, ``not``, ``and``/``or``), so the
    sandbox reports ``bool(value)``: a program could have returned that bool itself."""
    expression: str
    """The assert's expression with leaf k replaced by the name ``_megadiv_v<k>``; the grader's part."""
    modules: tuple[str, ...]
    """The JUDGE_MODULES the expression uses (the grader imports those)."""


@functools.lru_cache(maxsize=8192)
def plan_test(source: str, setup: str = "", program_names: tuple[str, ...] = ()) -> TestPlan:
    """Split one test (a single ``assert``). ``setup``: the record's setup code, whose imports
    the grader repeats (its other names belong to the program); ``program_names``: functions of
    the program the test calls although Python has a builtin of that name (MBPP 126's ``sum``).
    Raises UnsplittableTest (a ValueError) with the reason."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise UnsplittableTest(f"test is not valid Python: {source!r} ({e.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise UnsplittableTest(f"a test must be one assert statement, got {source!r}")
    grader_names = (BUILTIN_NAMES | set(JUDGE_MODULES) | setup_imports(setup)[1]) - set(program_names)
    splitter = _Splitter(grader_names, _bound_names(tree), setup_names(setup))
    expr = splitter.visit_expr(tree.body[0].test, truth=True)
    if not splitter.leaves:  # its verdict would not depend on the program: every program would pass (or fail)
        raise UnsplittableTest(f"{source!r} makes no call into the program (a builtin of the same name is "
                               "Python's unless the record's program_names says the program defines it)")
    modules = sorted({n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in JUDGE_MODULES})
    return TestPlan(source, tuple(splitter.leaves), tuple(splitter.truth), ast.unparse(expr), tuple(modules))


def setup_imports(setup: str) -> tuple[str, set[str]]:
    """(source of the setup's top-level import statements, the names they bind). The grader runs
    the imports; the rest of the setup (e.g. building a tree of the program's nodes) runs in the sandbox."""
    if not setup.strip():
        return "", set()
    try:
        body = ast.parse(setup).body
    except SyntaxError as e:
        raise UnsplittableTest(f"test setup is not valid Python ({e.msg})") from None
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {(a.asname or a.name).split(".")[0] for node in imports for a in node.names if a.name != "*"}
    return "\n".join(ast.unparse(node) for node in imports), names


def setup_names(setup: str) -> frozenset[str]:
    """Names the setup's other statements (not its imports) bind at its top level. They are
    evaluated in the sandbox, after the program ran: a program can rebind them (a tolerance, an
    expected value) before the test reads them."""
    if not setup.strip():
        return frozenset()
    names: set[str] = set()
    todo = [node for node in ast.parse(setup).body if not isinstance(node, (ast.Import, ast.ImportFrom))]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)  # its body binds its own locals, not the setup's
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif not isinstance(node, ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return frozenset(names)


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the test binds itself (comprehension targets, lambda arguments, :=)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


class _Splitter:
    """Replaces each call into the program by a leaf name; checks what may not be split."""

    def __init__(self, grader_names: set[str], bound: set[str], from_setup: frozenset[str]):
        self.grader_names, self.bound, self.from_setup = grader_names, bound, from_setup
        self.leaves: list[str] = []
        self.truth: list[bool] = []

    def is_program_name(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id not in self.grader_names and node.id not in self.bound

    def visit_expr(self, node: ast.expr, truth: bool = False) -> ast.expr:
        if self.is_program_name(node) or (isinstance(node, ast.Call) and self.is_program_name(node.func)):
            head = node.func.id if isinstance(node, ast.Call) else node.id
            if head in self.from_setup:
                raise UnsplittableTest(f"`{ast.unparse(node)}` reads `{head}`, which the test setup defines: it is "
                                       "evaluated after the program ran, which can rebind it (only values passed to "
                                       "the program's functions may come from the setup)")
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    self.check_argument(arg, node.func.id)
            self.leaves.append(ast.unparse(node))
            self.truth.append(truth)
            return ast.copy_location(ast.Name(id=f"{LEAF_PREFIX}{len(self.leaves) - 1}", ctx=ast.Load()), node)
        if isinstance(node, ast.Attribute) and self.is_program_name(node.value):
            raise UnsplittableTest(f"`{ast.unparse(node)}` reads an attribute of the program's "
                                   f"`{node.value.id}`: only calls into the program can be graded")
        keep_truth = isinstance(node, ast.BoolOp) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not))
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, self.visit_expr(value, truth and keep_truth))
            elif isinstance(value, list):
                setattr(node, field, [self.visit_expr(v, truth and keep_truth) if isinstance(v, ast.expr)
                                      else self.visit_inner(v) for v in value])
            elif isinstance(value, ast.AST):
                self.visit_inner(value)
        return node

    def visit_inner(self, node: ast.AST) -> ast.AST:
        """Non-expression children (keywords, comprehensions, lambda arguments): their expressions."""
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, self.visit_expr(value))
            elif isinstance(value, list):
                setattr(node, field, [self.visit_expr(v) if isinstance(v, ast.expr) else self.visit_inner(v)
                                      if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                self.visit_inner(value)
        return node

    def check_argument(self, arg: ast.expr, callee: str) -> None:
        """An argument of a call into the program is a constant (literals, builtin names, containers
        and arithmetic of them) or a value of the program (a call into it or a name it defines).
        It only feeds the program's own function, whose value the program controls anyway."""
        if isinstance(arg, ast.Starred):
            return self.check_argument(arg.value, callee)
        if isinstance(arg, ast.Constant):
            return None
        if isinstance(arg, ast.Name) and arg.id in self.bound:
            raise UnsplittableTest(f"the program's `{callee}` is called with the test's own variable "
                                   f"`{arg.id}`: its arguments must be constants or values of the program")
        if self.is_program_name(arg) or (isinstance(arg, ast.Name) and arg.id in BUILTIN_NAMES):
            return None  # a builtin passed as a value (MBPP 533: remove_datatype(..., int)) only feeds the program
        if isinstance(arg, ast.Call) and self.is_program_name(arg.func):
            for inner in [*arg.args, *(k.value for k in arg.keywords)]:
                self.check_argument(inner, arg.func.id)
            return None
        if isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
            return [self.check_argument(e, callee) for e in arg.elts] and None
        if isinstance(arg, ast.Dict) and None not in arg.keys:
            return [self.check_argument(e, callee) for e in [*arg.keys, *arg.values]] and None
        if isinstance(arg, ast.UnaryOp):
            return self.check_argument(arg.operand, callee)
        if isinstance(arg, ast.BinOp):
            self.check_argument(arg.left, callee)
            return self.check_argument(arg.right, callee)
        raise UnsplittableTest(f"argument `{ast.unparse(arg)}` of the program's `{callee}` is neither a constant "
                               "nor a value of the program")
