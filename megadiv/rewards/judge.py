"""The grader's interpreter: ``python -S -I -B judge.py MEMORY_MB``, started by ``megadiv.rewards.grading``.

A clean interpreter the program never touched (standard library only, no site, no environment)
evaluates each test's expression on the values the sandbox returned, decoded here into builtin
data: comparisons, arithmetic, methods of the returned values, ``len``/``sorted``/``all``/
``isinstance``/``type``, the modules of ``JUDGE_MODULES`` and the setup's imports are all Python's
own. Its memory is capped (RLIMIT_AS) and the caller kills it at the run's deadline, so a value
built to be expensive here (a list of ints that all hash to 0 turned into a set) costs the run its
time, never the caller's. It serves one run after another (each in a fresh namespace) until its
stdin closes or it is killed.

stdin: one JSON line per run {"imports", "modules", "tests": [{"expression", "names": the names of
the calls into the program in it, "values": the JSON text the sandbox sent for them}]}; stdout: one line
{"ok": bool, "why": str, "forged": bool} per test, in order. The values are parsed here, not in the
trainer (whose CPU the run's deadline does not bound): ``forged`` when the text is not JSON or is
nested deeper than the harness's encoder writes, which no genuine run sends.
"""
import builtins
import importlib
import json
import os
import resource
import sys


def decode(obj):
    """Inverse of the sandbox's encoder (jail/harness.py). Raises on anything malformed."""
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


# Deepest JSON a test's values hold: the harness's encoder caps values at 64 levels (each at most
# two JSON levels: {"T": ..., "v": [...]}), inside the list of a test's values.
MAX_JSON_DEPTH = 2 * 64 + 2


def json_depth(value) -> int:
    """Nesting depth of parsed JSON (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def values_of(test: dict) -> tuple[dict, str, bool]:
    """({leaf name: value}, why not, forged) of one test's values text."""
    try:
        values = json.loads(test["values"])
    except (ValueError, RecursionError) as e:
        return {}, f"values not JSON ({type(e).__name__})", True
    if json_depth(values) > MAX_JSON_DEPTH:
        return {}, "values nested deeper than the harness's encoder allows", True
    if not isinstance(values, list) or len(values) != len(test["names"]):
        return {}, "malformed test values", False
    return dict(zip(test["names"], map(decode, values))), "", False


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def judge(p: dict):
    """(ok, why, forged) per test of one run."""
    scope = {"__builtins__": builtins}
    scope.update((name, importlib.import_module(name)) for name in p["modules"])
    try:
        exec(p["imports"], scope)
    except Exception as e:  # noqa: BLE001 - an import the grader's interpreter lacks: every test fails
        yield from ((False, f"test setup imports: {describe(e)}", False) for _ in p["tests"])
        return
    for test in p["tests"]:
        try:
            values, why, forged = values_of(test)
            if why:
                yield False, why, forged
                continue
            names = dict(scope)
            names.update(values)
            ok = bool(eval(test["expression"], names))
            yield ok, "" if ok else "AssertionError", False
        except BaseException as e:  # MemoryError, RecursionError, comparing int with str: the test fails
            yield False, describe(e), False


def main() -> None:
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a test's print() must not reach the verdicts
    memory = int(sys.argv[1]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    sys.setrecursionlimit(10_000)  # json.loads of forged deep values raises RecursionError, not a crash
    for line in sys.stdin.buffer:
        for ok, why, forged in judge(json.loads(line)):
            verdicts.write(json.dumps({"ok": ok, "why": why, "forged": forged}) + "\n")
        verdicts.flush()


if __name__ == "__main__":
    main()
