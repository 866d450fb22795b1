"""What a run leaves behind: a progress line per step, ``metrics.jsonl``, TensorBoard events,
``summary.json`` and a PNG of the main curves. Only global rank 0 writes; the others hold a
logger that does nothing, so the loop never branches on the rank."""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

from megadiv.trainer.lifecycle import writing

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
    """Appends one JSON object per step to ``metrics.jsonl``, mirrors scalars to TensorBoard and
    prints the progress line. ``enabled=False`` (ranks other than 0) makes every call a no-op."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, resumed_step: int | None = None):
        """``resumed_step``: the checkpoint's step, whose records (and earlier ones) are kept; later
        ones, written by the interrupted launch after its last checkpoint, are dropped from
        metrics.jsonl and TensorBoard. None (a fresh start) drops every record."""
        self.run_dir, self.enabled, self.total_steps = run_dir, enabled, total_steps
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            keep_through = -1 if resumed_step is None else resumed_step
            _truncate_records(run_dir / "metrics.jsonl", keep_through)
            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=keep_through + 1)

    def log(self, step: int, metrics: dict[str, float], prefix: str = "step") -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        with writing(self.run_dir / "metrics.jsonl", "metrics"), open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        with writing(self.run_dir / "tensorboard", "TensorBoard events"):
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        print(self.progress_line(step, metrics, prefix), flush=True)

    def progress_line(self, step: int, metrics: dict[str, float], prefix: str = "step") -> str:
        parts = [f"{prefix} {step}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in PROGRESS_FIELDS if key in metrics]
        times = [f"{k} {metrics['time/' + k]:.1f}" for k in TIME_FIELDS if f"time/{k}" in metrics]
        if times:
            parts.append("time[s] " + " ".join(times))
        return " | ".join(parts)

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


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


def read_records(path: Path) -> list[dict]:
    """The records of metrics.jsonl; a line that does not parse (torn by a kill mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _truncate_records(path: Path, keep_through: int) -> None:
    """Rewrite ``path`` (atomically) with the records of steps <= ``keep_through``."""
    if not path.exists():
        return
    kept = [r for r in read_records(path) if r.get("step", 0) <= keep_through]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.rename(path)


def _json_number(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v
