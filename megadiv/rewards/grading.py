"""Grading outside the program: a test's expected values never enter the sandbox, its verdict never
leaves the grader.

``megadiv.data.code_tests.plan_test`` splits each assert into the calls into the program (the only
thing the sandbox evaluates) and the grader's expression. The sandbox sends back the calls' values
as plain data; ``Judge`` evaluates each expression on them in its own interpreter (``judge.py``,
a clean ``python -S -I`` the program never touched), bounded in memory and killed at the run's
deadline. So a program can change what its own functions return, and nothing else: not the
comparison, not ``sys.getsizeof`` or ``isinstance``, not the methods of its results (a ``str``
subclass arrives as a ``str``), not the expected side, not the count of tests.

    assert set(f([1, 2])) == {1, 2}   ->  sandbox: f([1, 2]);  grader: set(_megadiv_v0) == {1, 2}
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megadiv.data.code_tests import LEAF_PREFIX, TestPlan, setup_imports

JUDGE = str(Path(__file__).resolve().parent / "judge.py")


class Judge:
    """The grader's interpreter for one run. Started when the run starts (its start-up overlaps the
    sandbox's), given the values at the end, killed at the run's deadline."""

    def __init__(self):
        # -I: no environment, no user site, the script's directory not on sys.path; -S: no site.
        self.proc = subprocess.Popen([sys.executable, "-S", "-I", "-B", JUDGE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={}, cwd="/")

    def verdicts(self, plans: Sequence[TestPlan], values: Sequence[Optional[list]], setup: str, deadline: float,
                 memory_mb: int) -> Optional[list[tuple[bool, str]]]:
        """(passed, why not) per test whose values are not None (the others are not sent); None when
        the grader ran past ``deadline`` (a monotonic time)."""
        sent = [(plan, v) for plan, v in zip(plans, values) if v is not None]
        if not sent:
            return []
        payload = {
            "imports": setup_imports(setup)[0], "memory_mb": memory_mb,
            "modules": sorted({m for plan, _ in sent for m in plan.modules}),
            "cpu_s": max(1, math.ceil(deadline - time.monotonic())),
            "tests": [{"expression": plan.expression, "values": {f"{LEAF_PREFIX}{k}": x for k, x in enumerate(v)}}
                      for plan, v in sent],
        }
        try:
            out, _ = self.proc.communicate(json.dumps(payload).encode(), timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            return None
        lines = out.decode("utf-8", "replace").splitlines()
        verdicts = []
        for k in range(len(sent)):
            try:
                v = json.loads(lines[k])
                verdicts.append((v["ok"] is True, str(v["why"])[:300]))
            except (IndexError, ValueError, KeyError, TypeError):  # the grader died (its memory limit)
                verdicts.append((False, "the grader ran out of memory or time on this test's values"))
        return verdicts

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def judge_results(plans: Sequence[TestPlan], events: Sequence[dict], judge: Judge, setup: str, deadline: float,
                  memory_mb: int) -> tuple[str, int, str]:
    """(status, passed, detail) from the sandbox's test events (one per plan, in order, checked)."""
    values = [ev["v"] if "v" in ev and isinstance(ev["v"], list) and len(ev["v"]) == len(plan.leaves) else None
              for plan, ev in zip(plans, events)]
    verdicts = judge.verdicts(plans, values, setup, deadline, memory_mb)
    if verdicts is None:
        return "timeout", 0, "the grader ran out of time (the run's deadline) on the returned values"
    verdicts = iter(verdicts)
    passed, first_bad, limit = 0, "", None
    for plan, ev, value in zip(plans, events, values):
        if value is not None:
            ok, why = next(verdicts)
            why = why and f"{why} in {plan.source}"[:300]
        else:
            ok, why = False, str(ev.get("msg", "malformed test values"))[:300]
            limit = limit or (why if ev.get("kind") == "limit" else None)
        passed += ok
        first_bad = first_bad or why
    if limit:
        return "limit", 0, limit
    if passed == len(plans):
        return "passed", passed, ""
    return "failed", passed, first_bad


def small_object(pairs: list[tuple[str, Any]]) -> dict:
    """json object_pairs_hook for the untrusted results stream: the caller never builds a large
    dict from it (string keys colliding under a known hash seed would cost quadratic time here)."""
    if len(pairs) > 8:
        raise ValueError("a results object with more than 8 keys")
    return dict(pairs)
