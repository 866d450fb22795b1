"""The grader's interpreter: ``python -S -I -B judge.py MEMORY_MB``, started by ``megadiv.rewards.grading``.

A clean interpreter the program never touched (standard library only, no site, no environment)
evaluates each test's expression on the values the sandbox returned, decoded here into builtin
data: comparisons, arithmetic, methods of the returned values, ``len``/``sorted``/``all``/
``isinstance``/``type``, the modules of ``JUDGE_MODULES`` and the setup's imports are all Python's
own. Its memory is capped (RLIMIT_AS) and the caller kills it at the run's deadline, so a value
built to be expensive here (a list of ints that all hash to 0 turned into a set) costs the run its
time, never the caller's. It serves one run after another (each in a fresh namespace) until its
stdin closes or it is killed.

stdin: one JSON line per run {"imports", "modules", "tests": [{"expression", "values": {name:
encoded value}}]}; stdout: one line {"ok": bool, "why": str} per test, in order.
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


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def judge(p: dict):
    """(ok, why) per test of one run."""
    scope = {"__builtins__": builtins}
    scope.update((name, importlib.import_module(name)) for name in p["modules"])
    try:
        exec(p["imports"], scope)
    except Exception as e:  # noqa: BLE001 - an import the grader's interpreter lacks: every test fails
        yield from ((False, f"test setup imports: {describe(e)}") for _ in p["tests"])
        return
    for test in p["tests"]:
        try:
            names = dict(scope)
            names.update((name, decode(v)) for name, v in test["values"].items())
            ok = bool(eval(test["expression"], names))
            yield ok, "" if ok else "AssertionError"
        except BaseException as e:  # MemoryError, RecursionError, comparing int with str: the test fails
            yield False, describe(e)


def main() -> None:
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a test's print() must not reach the verdicts
    memory = int(sys.argv[1]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    sys.setrecursionlimit(10_000)  # decode() of deep values (the sandbox's encoder caps depth at 64)
    for line in sys.stdin.buffer:
        for ok, why in judge(json.loads(line)):
            verdicts.write(json.dumps({"ok": ok, "why": why}) + "\n")
        verdicts.flush()


if __name__ == "__main__":
    main()
