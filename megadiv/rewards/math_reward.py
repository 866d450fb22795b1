"""The math reward: math-verify in a pool of worker processes, with per-item timeouts.

Each worker is ``math_worker.py`` in its own process group, fed chunks of (response, gold) pairs
over a pipe. The pool survives what a worker can do wrong:

- a worker that dies (killed, out of memory, a crash in native code): it is restarted and its
  chunk is re-run one item at a time in fresh workers; an item that kills a worker on its own is
  scored 0 with reason ``crashed``;
- an item that hangs past math-verify's own alarm (stuck in native code): the chunk's deadline
  kills the worker, same recovery, reason ``timeout``.

So a batch always returns, with a reason per item, and the pool is whole again afterwards.
"""
from __future__ import annotations

import atexit
import collections
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megadiv.rewards.base import RewardResult

WORKER = str(Path(__file__).resolve().parent / "math_worker.py")


@dataclass(frozen=True)
class Grade:
    correct: bool
    formatted: bool
    """The response gave its answer in the required format (\\boxed{} or ####)."""
    reason: str
    """correct, wrong, unparsable, timeout or crashed."""


class _Worker:
    """One worker process, its partial output line, and the chunk it is grading."""

    def __init__(self, start_timeout_s: float):
        # -P: the script's directory (megadiv/rewards, which holds math_reward.py) must not shadow
        # anything on sys.path.
        self.proc = subprocess.Popen([sys.executable, "-P", WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.buf = bytearray()
        self.ready = False  # the worker has imported math-verify and said so
        self.items: list[int] = []  # indices of the chunk in flight
        self.isolated = False  # that chunk is one item re-run on its own
        self.deadline = time.monotonic() + start_timeout_s  # to start up, then to finish the chunk

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, items: list[int], isolated: bool, request: dict, deadline: float) -> None:
        self.items, self.isolated, self.deadline = items, isolated, deadline
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def read_lines(self) -> Optional[list[bytes]]:
        """Complete lines available now; None at end of file (the worker died)."""
        data = os.read(self.fd, 1 << 20)
        if not data:
            return None
        self.buf += data
        *lines, rest = bytes(self.buf).split(b"\n")
        self.buf = bytearray(rest)
        return lines

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # unsent bytes for a dead worker
                pass


class MathVerifyPool:
    """``workers`` math-verify processes; :meth:`grade` scores a batch, never hangs, never raises
    for anything a response contains."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, chunk_size: int = 16,
                 start_timeout_s: float = 120.0):
        if workers < 1 or chunk_size < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1, chunk_size >= 1, timeout_s > 0 (got {workers}, {chunk_size}, "
                             f"{timeout_s})")
        self.timeout_s = max(1, math.ceil(timeout_s))  # signal.alarm counts whole seconds
        self.chunk_size, self.start_timeout_s = chunk_size, start_timeout_s
        self.restarts = 0
        self._lock = threading.Lock()
        self._workers = [_Worker(start_timeout_s) for _ in range(workers)]
        for _ in self._run(None, collections.deque(), None):  # wait until all are up: fail fast if they cannot
            pass

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def grade(self, responses: Sequence[str], golds: Sequence[str], answer_format: str = "auto") -> list[Grade]:
        """Grade ``responses[i]`` against ``golds[i]``; answer_format: auto, boxed or hash."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        if answer_format not in ("auto", "boxed", "hash"):
            raise ValueError(f"answer_format must be auto, boxed or hash, got {answer_format!r}")
        n = len(responses)
        results: list[Optional[Grade]] = [None] * n
        queue = collections.deque((list(range(i, min(i + self.chunk_size, n))), False)
                                  for i in range(0, n, self.chunk_size))

        def fail(w: _Worker, reason: str) -> None:
            if w.isolated:  # this item alone broke a worker
                results[w.items[0]] = Grade(False, False, reason)
            else:  # find the culprit: re-run each item of the chunk on its own
                queue.extend(([i], True) for i in w.items)

        def request(items: list[int]) -> dict:
            return {"items": [[str(responses[i]), str(golds[i])] for i in items], "answer_format": answer_format,
                    "timeout_s": self.timeout_s}

        with self._lock:
            for indices, grades in self._run(request, queue, fail):
                for i, (correct, formatted, reason) in zip(indices, grades):
                    results[i] = Grade(bool(correct), bool(formatted), reason)
        return results

    def _run(self, request, queue: collections.deque, fail):
        """Dispatch ``queue``'s chunks to ready workers and yield (indices, results) as they come back,
        until the queue is empty, no chunk is in flight and every worker is ready. A worker that dies
        or overruns its deadline is replaced and ``fail(worker, reason)`` decides about its chunk."""
        # Worst case per item: gold parse, answer parse and up to 4 comparisons, each under an alarm.
        budget = lambda n: 10.0 + n * 6 * self.timeout_s  # noqa: E731
        while True:
            for w in list(self._workers):
                if w.ready and not w.items and queue:
                    items, isolated = queue.popleft()
                    try:
                        w.send(items, isolated, request(items), time.monotonic() + budget(len(items)))
                    except OSError:  # it died while idle
                        self._replace(w, fail, "crashed")
            busy = [w for w in self._workers if w.items or not w.ready]
            if not busy and not queue:
                return
            with selectors.DefaultSelector() as sel:
                for w in busy:
                    sel.register(w.fd, selectors.EVENT_READ, w)
                ready = sel.select(max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            for key, _ in ready:
                w = key.data
                lines = w.read_lines()
                if lines is None:
                    self._replace(w, fail, "crashed")
                    continue
                for line in lines:
                    if not w.ready:
                        w.ready, w.deadline = True, math.inf  # the start-up line
                    elif w.items:
                        yield w.items, json.loads(line)["results"]
                        w.items, w.deadline = [], math.inf
            for w in list(self._workers):
                if time.monotonic() > w.deadline:
                    self._replace(w, fail, "timeout")

    def _replace(self, w: _Worker, fail, reason: str) -> None:
        """Kill ``w``, hand its chunk to ``fail`` and start a fresh worker in its place."""
        if not w.ready:
            self.close()
            why = f"did not start within {self.start_timeout_s} s" if reason == "timeout" else "exited during start-up"
            raise RuntimeError(f"math-verify worker {why} (is math-verify installed?)")
        if w.items:
            fail(w, reason)
        w.kill()
        self.restarts += 1
        self._workers[self._workers.index(w)] = _Worker(self.start_timeout_s)


_default_pool: Optional[MathVerifyPool] = None
_default_lock = threading.Lock()


def default_pool() -> MathVerifyPool:
    """The process-wide pool behind :func:`math_scores` (min(2, cores) workers), started on first use."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = MathVerifyPool(workers=min(2, os.cpu_count() or 1))
            atexit.register(_default_pool.close)
        return _default_pool


def math_scores(responses: list[str], golds: list[str]) -> list[float]:
    """1.0 where the response's final answer equals the gold answer (math-verify), else 0.0.

    The answer is read from the last ``\\boxed{}``, else after the last ``####``, else wherever
    math-verify finds one. Golds are bare answers (``72``, ``\\frac{14}{3}``).
    """
    return [float(g.correct) for g in default_pool().grade(responses, golds)]


class MathReward:
    """score = correct + format_weight * formatted, graded by a :class:`MathVerifyPool`."""

    def __init__(self, workers: int, timeout_s: float, answer_format: str, format_weight: float):
        self.answer_format, self.format_weight = answer_format, format_weight
        self.pool = MathVerifyPool(workers=workers, timeout_s=timeout_s)

    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult:
        if any(r.answer is None for r in records):
            raise ValueError("the math reward needs records with an answer (is this a code dataset?)")
        grades = self.pool.grade(responses, [r.answer for r in records], self.answer_format)
        return RewardResult([float(g.correct) + self.format_weight * g.formatted for g in grades],
                            [g.reason for g in grades])

    def close(self) -> None:
        self.pool.close()
