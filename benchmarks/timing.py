"""Timing of a region on a GPU or CPU: warm-up excluded, several repeats, raw samples kept.

    samples = time_region(step, warmup=1, repeats=5, device=torch.device("cuda"))   # seconds
    summary(samples)  # {"median": ..., "min": ..., "max": ..., "n": 5}

On CUDA each repeat is bracketed by two CUDA events recorded on the current stream, and the
elapsed time is read once all repeats are queued (one synchronisation at the end), so the host
never waits inside the measured regions; work queued before the first event is drained first.
On CPU the host clock (time.perf_counter) brackets each call. ``setup`` runs before each repeat,
outside the measured region (e.g. fresh copies of inputs that the region overwrites).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_region(fn: Callable[..., object], *, warmup: int, repeats: int, device: torch.device,
                setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``fn(setup())`` (``fn()`` without setup) per repeat, after ``warmup`` untimed calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")

    def prepare():
        return None if setup is None else setup()

    def invoke(args):
        return fn() if setup is None else fn(args)

    for _ in range(warmup):
        invoke(prepare())
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            args = prepare()
            start = time.perf_counter()
            invoke(args)
            samples.append(time.perf_counter() - start)
        return samples
    torch.cuda.synchronize(device)
    events = []
    for _ in range(repeats):
        args = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        invoke(args)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]  # elapsed_time is in ms


def summary(samples: list[float]) -> dict:
    """Median (the figure to report), min, max and count of ``samples``."""
    if not samples:
        raise ValueError("no samples")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}
