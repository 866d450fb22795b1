"""Progress of a long phase (warm start, evaluation, checkpoint save/load, GGUF import, ES and sweep
candidates), in one style: a tqdm bar with rate and ETA on a terminal, and periodic plain lines when
stdout is not one (CI logs, ``rank0.log``, a pipe). Only rank 0 prints::

    with Progress("warm start", total=250, unit="step") as bar:
        for step in range(250):
            ...
            bar.update()

A plain line reads ``warm start: 50/250 step (20%) | 2.10 step/s | elapsed 0:24 | eta 1:35``; one
is printed at the first update, then at most every ``MEGADIV_PROGRESS_INTERVAL_S`` seconds (default
30; 0: every update), and a last one when the phase ends (``done`` or ``stopped``), so a log shows
how far a phase that died got. ``MEGADIV_PROGRESS=off`` silences both styles.

The rank is torch.distributed's when a process group is up, else torchrun's ``RANK`` (0 without one).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Self, TextIO

DEFAULT_INTERVAL_S = 30.0


class Progress:
    """A progress report of ``total`` units (None: unknown, shown as a count and a rate)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", *, file: TextIO | None = None,
                 interval_s: float | None = None):
        self.desc, self.total, self.unit, self.n = desc, total, unit, 0
        self._file = sys.stdout if file is None else file
        self._interval_s = _interval_s() if interval_s is None else interval_s
        self._start = self._last_line = time.monotonic()
        self._printed = False
        self._closed = False
        self._bar = None
        self._enabled = _is_rank_zero() and os.environ.get("MEGADIV_PROGRESS", "on") != "off"
        if self._enabled and _isatty(self._file):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._file)

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.n == self.total:  # close() prints the last line
            return
        if not self._printed or now - self._last_line >= self._interval_s:
            self._line(now)

    def close(self, failed: bool = False) -> None:
        """The last line: ``done`` (or ``stopped`` when the phase raised)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            self._line(time.monotonic(), "stopped" if failed else "done")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def _line(self, now: float, end: str = "") -> None:
        elapsed = now - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"
        if self.total:
            count += f" ({100 * self.n / self.total:.0f}%)"
        parts = [f"{self.desc}: {count}", f"{rate:.2f} {self.unit}/s", f"elapsed {_clock(elapsed)}"]
        if end:
            parts.append(end)
        elif self.total is not None and rate > 0:
            parts.append(f"eta {_clock((self.total - self.n) / rate)}")  # remaining units / mean rate so far
        print(" | ".join(parts), file=self._file, flush=True)
        self._printed, self._last_line = True, now


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _interval_s() -> float:
    raw = os.environ.get("MEGADIV_PROGRESS_INTERVAL_S")
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MEGADIV_PROGRESS_INTERVAL_S must be a number of seconds, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"MEGADIV_PROGRESS_INTERVAL_S must be >= 0, got {raw!r}")
    return value


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _is_rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"
