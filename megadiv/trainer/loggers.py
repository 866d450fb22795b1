"""Where step metrics go: one small class per backend of ``run.loggers``, registered in :data:`LOGGERS`.

Every backend is built with the run directory, the ``run`` section, the resolved config and the
step a resume starts from, and then takes ``log(step, metrics)`` for each record, ``summary(dict)``
once at the end and ``close(failed)``. ``MetricsLogger`` (metrics.py) fans each call out to the backends
the run lists, so the loop never knows which are on.

- ``jsonl``: metrics.jsonl (one JSON object per record) and summary.json; always on.
- ``tensorboard``: event files in run_dir/tensorboard.
- ``wandb``: one Weights & Biases run per run directory, its id kept in run_dir/wandb so that a
  resume continues it; files under run_dir/wandb (``WANDB_MODE=offline`` keeps them there).

A resumed run keeps the records of steps up to its checkpoint and drops later ones (written by the
interrupted launch after its last checkpoint) from metrics.jsonl and TensorBoard; W&B's history only
grows, so it keeps its copies of those steps, which a resume reproduces exactly (docs/training.md).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from megadiv.config import ConfigError, RunConfig


class JsonlLogger:
    """metrics.jsonl and summary.json (the files summary readers, curves.png and ES read)."""

    def __init__(self, run_dir: Path, run: RunConfig, config: dict, resumed_step: int | None):
        self.path, self.summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
        truncate_records(self.path, -1 if resumed_step is None else resumed_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def summary(self, summary: dict) -> None:
        self.summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    def close(self, failed: bool) -> None:
        pass


class TensorBoardLogger:
    """Scalars to run_dir/tensorboard; events after the resumed step are purged."""

    def __init__(self, run_dir: Path, run: RunConfig, config: dict, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        keep_through = -1 if resumed_step is None else resumed_step
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=keep_through + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def summary(self, summary: dict) -> None:
        pass  # the scalars are all there already

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run named run.name in run.wandb_project, with the resolved config as its
    config and summary.json as its summary. Its id is written to run_dir/wandb/megadiv_run_id; a
    resumed launch continues that run, a fresh start makes a new one."""

    def __init__(self, run_dir: Path, run: RunConfig, config: dict, resumed_step: int | None):
        wandb = import_wandb()
        id_file = run_dir / "wandb" / "megadiv_run_id"
        run_id = id_file.read_text().strip() if resumed_step is not None and id_file.is_file() else None
        id_file.parent.mkdir(parents=True, exist_ok=True)
        # console="off": W&B leaves stdout alone (the progress lines stay as they are in logs)
        self.run = wandb.init(project=run.wandb_project, entity=run.wandb_entity, name=run.name,
                              tags=list(run.wandb_tags), config=config, dir=str(run_dir), id=run_id,
                              resume="allow" if run_id else None, settings=wandb.Settings(console="off"))
        id_file.write_text(self.run.id + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def summary(self, summary: dict) -> None:
        self.run.summary.update(summary)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # W&B shows a failed run as such


LOGGERS: dict[str, type] = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}
"""run.loggers name -> backend (the names megadiv.config.LoggerName accepts)."""


def import_wandb():
    """The wandb module, or a ConfigError saying how to get it (W&B is an optional dependency)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("run.loggers includes wandb, but the wandb package is not installed "
                          "(pip install wandb)") from None
    return wandb


def read_records(path: Path) -> list[dict]:
    """The records of metrics.jsonl; a line that does not parse (torn by a kill mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def truncate_records(path: Path, keep_through: int) -> None:
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
