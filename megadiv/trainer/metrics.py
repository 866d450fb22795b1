"""What a run leaves behind: a progress line per step, the records of run.loggers (``metrics.jsonl``
and ``summary.json`` always; TensorBoard events, a W&B run: loggers.py) and a PNG of the main
curves. Only global rank 0 writes; the others hold a logger that does nothing, so the loop never
branches on the rank."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path

from megadiv.config import RunConfig
from megadiv.trainer.lifecycle import writing
from megadiv.trainer.loggers import LOGGERS, read_records

# The progress line: (metric key, label, format). Missing keys are left out of the line.
PROGRESS_FIELDS = [
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("clip/frac_low", "clip_lo", "{:.3f}"),
    ("clip/frac_high", "clip_hi", "{:.3f}"),
    ("entropy", "ent", "{:.3f}"),
    ("ref/k3", "kl_ref", "{:.4f}"),
    ("old/k3", "kl_old", "{:.4f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("loss/total", "loss", "{:+.4f}"),
    ("checkpoint/blocking_s", "blocked_s", "{:.2f}"),
    ("checkpoint/write_s", "write_s", "{:.2f}"),
    ("checkpoint/total_s", "total_s", "{:.2f}"),
]
TIME_FIELDS = ("rollout", "reward", "rollout_wait", "train", "sync", "step")


class StepTimer:
    """Wall-clock seconds per phase of one step: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def as_metrics(self, total: bool = True) -> dict[str, float]:
        """time/<phase> per phase and, with ``total``, time/step: the seconds since the timer was made."""
        elapsed = {"step": time.perf_counter() - self.start} if total else {}
        return {f"time/{k}": v for k, v in (self.seconds | elapsed).items()}


class MetricsLogger:
    """Sends each record to the backends of run.loggers (loggers.py; metrics.jsonl always) and
    prints the progress line. ``enabled=False`` (ranks other than 0) makes every call a no-op."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, run: RunConfig, config: dict,
                 resumed_step: int | None = None):
        """``config``: the resolved run config (W&B's run config). ``resumed_step``: the checkpoint's
        step, whose records (and earlier ones) are kept; later ones, written by the interrupted
        launch after its last checkpoint, are dropped. None (a fresh start) drops every record."""
        self.run_dir, self.enabled, self.total_steps = run_dir, enabled, total_steps
        names = ["jsonl", *(name for name in run.loggers if name != "jsonl")]
        self.backends = [LOGGERS[name](run_dir, run, config, resumed_step) for name in names] if enabled else []

    def log(self, step: int, metrics: dict[str, float], prefix: str = "step") -> None:
        if not self.enabled:
            return
        with writing(self.run_dir, "metrics in"):  # a full disk: one line naming the run directory and the space
            for backend in self.backends:
                backend.log(step, metrics)
        print(self.progress_line(step, metrics, prefix), flush=True)

    def progress_line(self, step: int, metrics: dict[str, float], prefix: str = "step") -> str:
        parts = [f"{prefix} {step}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in PROGRESS_FIELDS if key in metrics]
        times = [f"{k} {metrics['time/' + k]:.1f}" for k in TIME_FIELDS if f"time/{k}" in metrics]
        if times:
            parts.append("time[s] " + " ".join(times))
        return " | ".join(parts)

    def write_summary(self, summary: dict) -> None:
        for backend in self.backends:
            backend.summary(summary)

    def close(self, failed: bool = False) -> None:
        """Close every backend, ``failed`` when the run stops on an error or a signal (idempotent:
        the loop closes on every way out)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(failed)


def plot_curves(run_dir: Path, keys=("reward/mean", "eval/accuracy", "entropy", "ref/k3",
                                     "clip/frac_low", "clip/frac_high", "response/length_mean")) -> Path | None:
    """A PNG grid of the main curves from metrics.jsonl (``curves.png``)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(path)
    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        return None
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
