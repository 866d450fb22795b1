"""Grading outside the program: the program controls the values of its own calls and nothing else.

Each probe is one test shape run twice, in ``auto`` and ``unsafe`` mode: with a wrong program that
attacks the grading (a patched module, shadowed builtins, operator overloading, results whose
methods lie, the ``type``/``isinstance`` of its results) it must score 0; with a correct program it
must score 1. Tests that cannot be split are refused before anything runs, naming the record.
"""
import json
import os
import shutil
import sys

import pytest

from megadiv.data import DataConfig, load_dataset
from megadiv.data.datasets import FILES, DatasetError
from megadiv.rewards import SandboxLimits, run_sandboxed

ROOT_LINUX = sys.platform == "linux" and os.geteuid() == 0
MODES = [pytest.param("auto", marks=pytest.mark.skipif(not ROOT_LINUX, reason="auto needs root on Linux")), "unsafe"]

pytestmark = pytest.mark.timeout(600)

# name: (test, a wrong program that attacks the grading, a correct program)
PROBES = {
    "patched_sys_getsizeof": (  # MBPP task 596's test shape
        'assert tuple_size(("A", 1, "B", 2, "C", 3)) == sys.getsizeof(("A", 1, "B", 2, "C", 3))',
        "import sys\nsys.getsizeof = lambda o, *a: 0\ndef tuple_size(t):\n    return 0",
        "import sys\ndef tuple_size(t):\n    return sys.getsizeof(t)"),
    "patched_math_isclose": (
        "assert math.isclose(area(2), 12.566370614359172, rel_tol=1e-9)",
        "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0.0",
        "import math\ndef area(r):\n    return math.pi * r * r"),
    "patched_builtins_module": (
        "assert len(evens(6)) == 3 and sorted(evens(6)) == [0, 2, 4]",
        "import builtins\nbuiltins.len = lambda x: 3\nbuiltins.sorted = lambda x: [0, 2, 4]\n"
        "def evens(n):\n    return []",
        "def evens(n):\n    return [k for k in range(n) if k % 2 == 0]"),
    "operator_overloading_object": (
        "assert abs(area(2) - 12.566370614359172) < 1e-6",
        "class Zero:\n    def __sub__(self, other):\n        return 0.0\n    __rsub__ = __sub__\n"
        "def area(r):\n    return Zero()",
        "import math\ndef area(r):\n    return math.pi * r * r"),
    "operator_overloading_float_subclass": (
        "assert abs(area(2) - 12.566370614359172) < 1e-6",
        "class F(float):\n    def __sub__(self, other):\n        return 0.0\n    def __abs__(self):\n        return 0.0\n"
        "def area(r):\n    return F(1.0)",
        "import math\ndef area(r):\n    return math.pi * r * r"),
    "methods_of_an_object": (
        "assert greet('bob').startswith('Hello') and greet('bob').endswith('bob')",
        "class Yes:\n    def __getattr__(self, name):\n        return lambda *a, **k: True\n"
        "def greet(name):\n    return Yes()",
        "def greet(name):\n    return 'Hello, ' + name"),
    "methods_of_a_str_subclass": (
        "assert greet('bob').startswith('Hello') and greet('bob').endswith('bob')",
        "class S(str):\n    def startswith(self, *a):\n        return True\n    def endswith(self, *a):\n        return True\n"
        "def greet(name):\n    return S('nope')",
        "def greet(name):\n    return 'Hello, ' + name"),
    "shadowed_all": (
        "assert all([sq(1) == 1, sq(2) == 4, sq(3) == 9])",
        "def all(xs):\n    return True\ndef sq(x):\n    return 0",
        "def sq(x):\n    return x * x"),
    "shadowed_isinstance": (
        "assert isinstance(sq(3), int) and sq(3) == 9",
        "def isinstance(a, b):\n    return True\nclass N:\n    def __eq__(self, o):\n        return True\n"
        "def sq(x):\n    return N()",
        "def sq(x):\n    return x * x"),
    "shadowed_type_and_int": (  # a correct program used to fail this: bare `int` became opaque
        "assert type(sq(3)) == int",
        "int = str\ndef type(x):\n    return str\ndef sq(x):\n    return str(x * x)",
        "def sq(x):\n    return x * x"),
    "shadowed_len_sorted_set": (
        "assert len(uniq([3, 1, 3])) == 2 and set(uniq([3, 1, 3])) == {1, 3}",
        "def len(x):\n    return 2\ndef set(x):\n    return {1, 3}\ndef uniq(xs):\n    return []",
        "def uniq(xs):\n    return sorted(set(xs))"),
}


def score(program: str, test: str, mode: str) -> tuple[str, int]:
    r = run_sandboxed(program, [test], 20.0, limits=SandboxLimits(isolation=mode))
    return r.status, r.passed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_wrong_program_scores_zero_and_correct_program_scores_one(probe, mode):
    test, wrong, correct = PROBES[probe]
    assert score(wrong, test, mode) == ("failed", 0), probe
    assert score(correct, test, mode) == ("passed", 1), probe


@pytest.mark.parametrize("mode", MODES)
def test_values_that_are_not_data_fail_unless_only_their_truth_is_used(mode):
    program = "import re\ndef match(text):\n    return re.search('^a', text)\n"
    tests = ["assert match('abc')", "assert not match('bc')", "assert match('abc') and not match('b')",
             "assert match('abc') != 1", "assert match('abc').group(0) == 'a'"]
    r = run_sandboxed(program, tests, 20.0, limits=SandboxLimits(isolation=mode))
    assert (r.status, r.passed) == ("failed", 3), r  # the truth value crosses; the object does not


@pytest.mark.parametrize("mode", MODES)
def test_program_objects_are_arguments_inside_the_sandbox(mode):
    """MBPP 601 passes Pair objects of the program to the program; MBPP 126 defines its own `sum`."""
    program = ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
               "def longest(pairs, n):\n    return max(p.b - p.a for p in pairs[:n])\n"
               "def sum(a, b):\n    return a + b + 1\n")
    tests = ["assert longest([Pair(5, 24), Pair(15, 25)], 2) == 19", "assert sum(1, 2) == 4"]
    r = run_sandboxed(program, tests, 20.0, program_names=("sum",), limits=SandboxLimits(isolation=mode))
    assert (r.status, r.passed) == ("passed", 2), r
    # Without the record saying so, `sum` is Python's: the test calls nothing of the program and is refused.
    with pytest.raises(ValueError, match="makes no call into the program"):
        run_sandboxed(program, tests, 20.0, limits=SandboxLimits(isolation=mode))


def test_unsplittable_tests_are_refused_before_running(tmp_path):
    for test, why in (("assert all(sq(i) == i * i for i in range(10))", "the test's own variable `i`"),
                      ("assert list(map(lambda x: sq(x), [1])) == [1]", "the test's own variable `x`"),
                      ("assert sq(float('inf')) == 1", "neither a constant nor a value of the program"),
                      ("assert Stack.size == 0", "reads an attribute of the program's `Stack`")):
        with pytest.raises(ValueError, match=why):
            run_sandboxed("def sq(x):\n    return x * x", [test], 5.0, limits=SandboxLimits(isolation="unsafe"))
        data = tmp_path / "tasks.jsonl"
        data.write_text(json.dumps({"id": "task-7", "prompt": "square", "tests": ["assert sq(2) == 4", test]}) + "\n")
        with pytest.raises(DatasetError, match=rf"task-7: test 1 cannot be graded: .*{why}"):
            load_dataset(DataConfig(name="jsonl", path=str(data), split="train", tests_field="tests", id_field="id",
                                    answer_field=None))


@pytest.mark.parametrize("mode", MODES)
def test_grading_runs_under_the_runs_deadline(mode):
    """150,000 distinct ints that all hash to 0, turned into a set by the test: quadratic for whoever
    builds the set. The grader's interpreter does, under the run's deadline: the run times out and
    the caller never hashes a returned value."""
    program = "def f(x):\n    return [k * (2 ** 61 - 1) for k in range(1, 150_001)]"
    limits = SandboxLimits(isolation=mode, line_bytes=16 << 20, results_bytes=16 << 20)
    r = run_sandboxed(program, ["assert set(f(1)) == {1, 2}"], 8.0, limits=limits)
    assert (r.status, r.passed) == ("timeout", 0), r
    assert "grader ran out of time" in r.detail, r


MBPP_FIELDS = dict(name="hf", prompt_field="text", answer_field=None, tests_field="test_list", id_field="task_id",
                   solution_field="code", test_setup_field="test_setup_code")


def test_mbpp_through_hf_loads_and_grades_like_the_builtin_loader(tmp_path):
    """MBPP's own file read as a user's file (``data.name: hf``, the reference in solution_field):
    every record gets the built-in loader's tests, setup and program_names (task 126 defines `sum`),
    and the references and a builtin-calling impostor of 126 grade alike through both."""
    shipped = FILES / "mbpp" / "mbpp.jsonl"
    data = tmp_path / "mbpp.jsonl"
    shutil.copy(shipped, data)
    builtin = load_dataset(DataConfig(name="mbpp", split="all"))
    user = load_dataset(DataConfig(path=str(data), split="train", **MBPP_FIELDS))
    assert [f"mbpp/{r.id}" for r in user] == [r.id for r in builtin]
    for mine, theirs in zip(user, builtin):
        assert (mine.prompt, mine.tests, mine.test_setup, mine.solution, mine.program_names) == \
            (theirs.prompt, theirs.tests, theirs.test_setup, theirs.solution, theirs.program_names), theirs.id
    assert user[125].program_names == ("sum",) and user[366].test_setup.startswith("root = Node(1)")
    # The explicit field names the same functions without a reference solution.
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    names = tmp_path / "names.jsonl"
    names.write_text("".join(json.dumps({**r, "code": None, "own": list(b.program_names)}) + "\n"
                             for r, b in zip(rows, builtin)))
    listed = load_dataset(DataConfig(name="jsonl", path=str(names), solution_field=None, program_names_field="own",
                                     **{k: v for k, v in MBPP_FIELDS.items() if k not in ("name", "solution_field")}))
    assert [r.program_names for r in listed] == [r.program_names for r in builtin]
    impostor = "def sum(a, b):\n    import builtins\n    return builtins.sum(range(a)) % 7"
    verdicts = {}
    for k in (125, 366, 926, 10, 600):  # 126; the two with a test setup; the first test task; a train task
        for which, program in (("reference", builtin[k].solution), ("impostor", impostor)):
            a, b = (run_sandboxed(program, r.tests, 30.0, setup=r.test_setup, program_names=r.program_names,
                                  limits=SandboxLimits(isolation="unsafe")) for r in (user[k], builtin[k]))
            assert (a.status, a.passed, a.total) == (b.status, b.passed, b.total), (builtin[k].id, a, b)
            verdicts[builtin[k].id, which] = a.status, a.passed
    assert {k: v for k, v in verdicts.items() if k[1] == "reference"} == \
        {(builtin[k].id, "reference"): ("passed", len(builtin[k].tests)) for k in (125, 366, 926, 10, 600)}
    assert verdicts["mbpp/126", "impostor"] == ("failed", 0)


def test_setup_values_read_by_the_grader_are_refused(tmp_path):
    """A setup runs after the program, in its namespace: a program can rebind what the setup
    defines (a tolerance, an expected value) before the test reads it. Such tests are refused
    before anything runs; setup values passed to the program's functions stay allowed."""
    wrong = ("def area(r):\n    globals()['EPS'] = 1e9\n    return 0.0\n"
             "def answer():\n    return globals()['expected']\n")
    setup = "import math\nEPS = 1e-6\nexpected = 12.566\ndef close(a, b):\n    return abs(a - b) < EPS\nR = 2"
    for test in ("assert abs(area(2) - 12.566) < EPS", "assert answer() == expected", "assert close(area(2), 12.566)",
                 "assert expected == answer()"):
        with pytest.raises(ValueError, match="which the test setup defines"):
            run_sandboxed(wrong, [test], 5.0, setup=setup, limits=SandboxLimits(isolation="unsafe"))
        data = tmp_path / "tasks.jsonl"
        data.write_text(json.dumps({"id": "circle", "prompt": "area", "tests": [test], "setup": setup}) + "\n")
        with pytest.raises(DatasetError, match="circle: test 0 cannot be graded: .*which the test setup defines"):
            load_dataset(DataConfig(name="jsonl", path=str(data), split="train", tests_field="tests", id_field="id",
                                    answer_field=None, test_setup_field="setup"))
    # a setup value as an argument only feeds the program (MBPP's trees: max_height(root)); math is the grader's
    r = run_sandboxed(wrong, ["assert math.isclose(area(R), 12.566)"], 20.0, setup=setup,
                      limits=SandboxLimits(isolation="unsafe"))
    assert (r.status, r.passed) == ("failed", 0), r


@pytest.mark.parametrize("mode", MODES)
def test_a_reference_helper_named_like_a_builtin_does_not_take_the_graders_builtin(tmp_path, mode):
    """A user record whose reference defines a helper ``abs``: the tests' ``abs(area(2) - ...)`` stays
    the grader's (a call on a value of the program), so a program's own ``abs`` changes nothing.
    MBPP 126's ``sum(10, 15)`` (constants only) stays the program's."""
    reference = "import math\ndef abs(x):\n    return x if x > 0 else -x\ndef area(r):\n    return math.pi * r * r"
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"id": "circle", "prompt": "area", "code": reference,
                                "tests": ["assert abs(area(2) - 12.566) < 1e-3"]}) + "\n")
    record = load_dataset(DataConfig(name="jsonl", path=str(data), split="train", tests_field="tests", id_field="id",
                                     answer_field=None, solution_field="code"))[0]
    assert record.program_names == ()  # abs is called on a value of the program: Python's
    wrong = "def abs(x):\n    return 0\ndef area(r):\n    return 0.0"
    limits = SandboxLimits(isolation=mode)
    r = run_sandboxed(wrong, record.tests, 20.0, program_names=record.program_names, limits=limits)
    assert (r.status, r.passed) == ("failed", 0), r
    r = run_sandboxed(reference, record.tests, 20.0, program_names=record.program_names, limits=limits)
    assert (r.status, r.passed) == ("passed", 1), r
