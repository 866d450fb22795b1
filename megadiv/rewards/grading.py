"""Grading outside the program: a test's expected values never enter the sandbox, its verdict never
leaves the grader.

``megadiv.data.code_tests.plan_test`` splits each assert into the calls into the program (the only
thing the sandbox evaluates) and the grader's expression. The sandbox sends back the calls' values
as plain data; ``Judge`` evaluates each expression on them in its own interpreter (``judge.py``,
a clean ``python -S -I`` the program never touched, reused run after run), bounded in memory and
killed at the run's deadline. So a program can change what its own functions return, and nothing else: not the
comparison, not ``sys.getsizeof`` or ``isinstance``, not the methods of its results (a ``str``
subclass arrives as a ``str``), not the expected side, not the count of tests.

    assert set(f([1, 2])) == {1, 2}   ->  sandbox: f([1, 2]);  grader: set(_megadiv_v0) == {1, 2}
"""
from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megadiv.data.code_tests import LEAF_PREFIX, TestPlan, setup_imports

JUDGE = str(Path(__file__).resolve().parent / "judge.py")


class Judge:
    """One grader's interpreter, taken from an idle pool for one run (``acquire``: a new one starts
    while the sandbox does when none is idle) and given back after it (``release``). A grader that
    ran past a deadline, or died, is killed instead of given back."""

    _idle: dict[int, list[Judge]] = {}
    _lock = threading.Lock()

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        # -I: no environment, no user site, the script's directory not on sys.path; -S: no site.
        self.proc = subprocess.Popen([sys.executable, "-S", "-I", "-B", JUDGE, str(memory_mb)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={}, cwd="/")
        self.healthy = True

    @classmethod
    def acquire(cls, memory_mb: int) -> Judge:
        with cls._lock:
            idle = cls._idle.setdefault(memory_mb, [])
            while idle:
                judge = idle.pop()
                if judge.proc.poll() is None:
                    return judge
        return cls(memory_mb)

    @classmethod
    def close_idle(cls) -> None:
        """End every idle grader (at exit; they would end anyway when their stdin closes)."""
        with cls._lock:
            idle = [judge for judges in cls._idle.values() for judge in judges]
            cls._idle.clear()
        for judge in idle:
            judge.healthy = False
            judge.release()

    def release(self) -> None:
        if self.healthy and self.proc.poll() is None:
            with self._lock:
                self._idle[self.memory_mb].append(self)
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

    def verdicts(self, plans: Sequence[TestPlan], values: Sequence[Optional[bytes]], setup: str,
                 deadline: float) -> Optional[list[tuple[bool, str, bool]]]:
        """(passed, why not, forged) per test whose values (the JSON text the sandbox sent, never
        parsed by the caller) are not None (the others are not sent); None when the grader ran
        past ``deadline`` (a monotonic time). ``forged``: values the harness cannot have sent."""
        sent = [(plan, v) for plan, v in zip(plans, values) if v is not None]
        if not sent:
            return []
        payload = {"imports": setup_imports(setup)[0], "modules": sorted({m for plan, _ in sent for m in plan.modules}),
                   "tests": [{"expression": plan.expression, "values": v.decode("latin-1"),
                             "names": [f"{LEAF_PREFIX}{k}" for k in range(len(plan.leaves))]} for plan, v in sent]}
        lines = self._exchange(json.dumps(payload).encode() + b"\n", len(sent), deadline)
        if lines is None:
            self.healthy = False
            return None
        verdicts = []
        for line in lines:
            try:
                v = json.loads(line)
                verdicts.append((v["ok"] is True, str(v["why"])[:300], v["forged"] is True))
            except (ValueError, KeyError, TypeError):
                verdicts.append((False, "the grader failed on this test's values", False))
        if len(verdicts) < len(sent):  # it died (its memory limit): the tests it did not judge fail
            self.healthy = False
            verdicts += [(False, "the grader ran out of memory on this test's values", False)] * (len(sent) - len(verdicts))
        return verdicts

    def _exchange(self, request: bytes, n_lines: int, deadline: float) -> Optional[list[bytes]]:
        """Write ``request``, read ``n_lines`` lines (fewer if the grader dies); None past the deadline."""
        out, sel = bytearray(), selectors.DefaultSelector()
        stdin, stdout = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(stdin, False)
        sel.register(stdin, selectors.EVENT_WRITE)
        sel.register(stdout, selectors.EVENT_READ)
        view = memoryview(request)
        try:
            while out.count(b"\n") < n_lines:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                for key, _ in sel.select(remaining):
                    if key.fd == stdin:
                        try:
                            view = view[os.write(stdin, view[:1 << 16]):]
                        except BrokenPipeError:
                            view = view[:0]
                        if not view:
                            sel.unregister(stdin)
                    else:
                        data = os.read(stdout, 1 << 16)
                        if not data:
                            return out.splitlines()
                        out += data
        finally:
            sel.close()
        return out.splitlines()


atexit.register(Judge.close_idle)


def judge_results(plans: Sequence[TestPlan], events: Sequence[dict], judge: Judge, setup: str,
                  deadline: float) -> tuple[str, int, str]:
    """(status, passed, detail) from the sandbox's test events (one per plan, in order, checked);
    a test's values arrive as their JSON text (``v_json``), decoded only by the grader."""
    values = [ev.get("v_json") for ev in events]
    verdicts = judge.verdicts(plans, values, setup, deadline)
    if verdicts is None:
        return "timeout", 0, "the grader ran out of time (the run's deadline) on the returned values"
    forged = next((why for _, why, bad in verdicts if bad), None)
    if forged is not None:
        return "crashed", 0, f"results stream forged or corrupt ({forged})"
    verdicts = iter(verdicts)
    passed, first_bad, limit = 0, "", None
    for plan, ev, value in zip(plans, events, values):
        if value is not None:
            ok, why, _ = next(verdicts)
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
