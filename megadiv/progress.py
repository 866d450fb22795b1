"""Progress of a long phase (weight loading, warm start, evaluation, checkpoint save/load, GGUF
import, ES and sweep candidates), in one style: a tqdm bar with rate and ETA on a terminal, and
periodic plain lines when stdout is not one (CI logs, ``rank0.log``, a pipe). Only rank 0 prints::

    with Progress("warm start", total=250, unit="step") as bar:
        for step in range(250):
            ...
            bar.update()

A plain line reads ``warm start: 50/250 step (20%) | 2.10 step/s | elapsed 0:24 | eta 1:35`` (unit
``"B"`` counts bytes and shows MiB); one
is printed at the first update, then at most every ``MEGADIV_PROGRESS_INTERVAL_S`` seconds (default
30; 0: every update), and a last one when the phase ends (``done`` or ``stopped``), so a log shows
how far a phase that died got. ``MEGADIV_PROGRESS=off`` silences both styles.

The rank is torch.distributed's when a process group is up, else torchrun's ``RANK`` (0 without one).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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

            # bytes as KB, MB, ... (unit_divisor 1024: KiB shown as "kB", tqdm's spelling)
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._file, unit_scale=unit == "B",
                             unit_divisor=1024)

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

    @contextmanager
    def following(self, measure: Callable[[], int], every_s: float = 1.0) -> Iterator[Progress]:
        """For a phase that reports nothing itself (one library call writing or reading files): a
        thread sets the count to ``measure()`` (e.g. the bytes in the directory being written) every
        ``every_s`` seconds, and once more when the block ends. No thread where nothing is printed."""
        if not self._enabled:
            yield self
            return
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(every_s):
                self._set(measure)

        thread = threading.Thread(target=poll, name=f"progress: {self.desc}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self._set(measure)

    def _set(self, measure: Callable[[], int]) -> None:
        try:
            value = measure()
        except OSError:  # a file vanished while it was measured (renamed, pruned): the next poll reads it
            return
        if value > self.n:
            self.update(value - self.n)

    def write(self, line: str) -> None:
        """Print a line of the caller's own (a loss, a status) without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self._file)
        else:
            print(line, file=self._file, flush=True)

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
        unit, scale, digits = ("MiB", 2**20, 1) if self.unit == "B" else (self.unit, 1, 0)
        done = f"{self.n / scale:.{digits}f}"
        count = f"{done}/{self.total / scale:.{digits}f} {unit}" if self.total is not None else f"{done} {unit}"
        if self.total:
            count += f" ({100 * self.n / self.total:.0f}%)"
        parts = [f"{self.desc}: {count}", f"{rate / scale:.2f} {unit}/s", f"elapsed {_clock(elapsed)}"]
        if end:
            parts.append(end)
        elif self.total is not None and rate > 0:
            parts.append(f"eta {_clock((self.total - self.n) / rate)}")  # remaining units / mean rate so far
        print(" | ".join(parts), file=self._file, flush=True)
        self._printed, self._last_line = True, now


def directory_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path`` (0 while it does not exist): a measure for :meth:`Progress.following`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux ``/proc/self/io`` rchar, page
    cache hits included; 0 where it is not readable): a measure for :meth:`Progress.following`."""
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return 0


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
