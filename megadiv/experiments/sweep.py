"""``megadiv sweep``: one ``megadiv train`` per grid cell x seed, then a significance-tested table.

    megadiv sweep CONFIG... [key=value ...] --grid KEY=V1,V2[,...] [--grid ...] --seeds 1,2,3 --out DIR
                  [--nproc N] [--parallel K] [--slurm [SBATCH_OPTIONS]] [--baseline KEY=VALUE] [--metric KEY]

The cells are the product of the grid keys' values (in the order given). Every run of a cell
trains the base config with the cell's ``KEY=VALUE`` overrides and ``run.seed`` set to the seed;
every other key is identical, so within a seed the cells differ only in the grid (the same seed
gives the same random model, warm start and prompt order). The grid key ``config`` is special:
its values are YAML overlays composed after the base files, for cells that differ in several keys
at once (GRPO vs DAPO vs ATR-GRPO). A model the config makes (``warm_start.make_model``) is made in
each run's own directory (``model.hf_dir`` = RUN_DIR/init), so parallel runs never share one.

Runs go one after another here (the default), ``--parallel K`` at a time, or as one SLURM job array
(``--slurm``, throttled to K with ``--parallel``), through the runner ``megadiv es`` uses. Each
run's metric is a key of its ``summary.json`` (``--metric``, default ``accuracy_after``: the final
held-out accuracy; ``eval_after.KEY`` reaches a final eval metric). significance.py computes the
per-cell statistics and the paired test of each cell against its baseline cell: the cell with
``--baseline KEY=VALUE`` (default: the first grid key's first value) and the same values of the other
grid keys.

Outputs in DIR: ``sweep.json`` (what was swept; a rerun with another grid or base config is
refused), ``runs/`` (one run directory each), ``logs/``, ``results.json`` (runs and cells),
``table.md``, ``sweep.png`` (per-cell points and intervals; learning curves per cell). Rerunning
the same command resumes: a run with a ``summary.json`` is not trained again, an interrupted one
resumes from its checkpoints (``megadiv train``'s own resume). The verb's arguments are in
megadiv/cli/sweep.py.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from megadiv.config import ConfigError, load_config, split_config_args, to_dict, valid_keys
from megadiv.experiments import significance
from megadiv.experiments.runner import run_parallel, run_summary, slurm_array, train_command
from megadiv.progress import Progress
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.metrics import read_records

OVERLAY_KEY = "config"                                  # grid values are YAML overlay files
SET_BY_SWEEP = ("run.seed", "run.name", "run.output_dir")


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its (key, value) pairs in grid order."""

    index: int
    values: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values)

    @property
    def overlays(self) -> list[str]:
        return [v for k, v in self.values if k == OVERLAY_KEY]

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values if k != OVERLAY_KEY]

    def run_name(self, seed: int) -> str:
        slug = "_".join(f"{k.rsplit('.', 1)[-1]}-{Path(v).stem if k == OVERLAY_KEY else v}" for k, v in self.values)
        return f"c{self.index:02d}-{re.sub(r'[^A-Za-z0-9._-]+', '_', slug)[:60]}-s{seed}"


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["loss.delta=0.01,0.05", ...]`` -> [(key, [values])]; keys are config keys or ``config``."""
    grid, known = [], set(valid_keys(TrainConfig))
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(vals):
            raise ConfigError(f"--grid {item!r} is not of the form KEY=V1,V2[,...]")
        if key in SET_BY_SWEEP:
            raise ConfigError(f"--grid {key}: the sweep sets {key} itself (use --seeds for seeds)")
        if key != OVERLAY_KEY and key not in known:
            raise ConfigError(f"--grid {key}: not a config key (or 'config' for YAML overlays)")
        if len(set(vals)) != len(vals) or key in (k for k, _ in grid):
            raise ConfigError(f"--grid {item!r}: a key and its values may appear once")
        grid.append((key, vals))
    if not grid:
        raise ConfigError("need at least one --grid KEY=V1,V2[,...]")
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text!r} is not a comma-separated list of integers") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: each seed once")
    return seeds


class Sweep:
    """One sweep directory: the grid, the seeds, how runs are launched, and their results."""

    def __init__(self, config_args: list[str], grid: list[tuple[str, list[str]]], seeds: list[int], out: Path,
                 nproc: int = 1, parallel: int = 1, slurm: str | None = None, baseline: str | None = None,
                 metric: str = "accuracy_after"):
        self.config_args, self.grid, self.seeds, self.out = list(config_args), grid, seeds, Path(out)
        self.nproc, self.parallel, self.slurm, self.metric = nproc, parallel, slurm, metric
        if parallel < 1 or nproc < 1:
            raise ConfigError("--parallel and --nproc must be >= 1")
        self.cells = [Cell(i, tuple(zip([k for k, _ in grid], vals)))
                      for i, vals in enumerate(itertools.product(*[v for _, v in grid]))]
        self.baseline_key, self.baseline_value = self._parse_baseline(baseline)
        paths, overrides = split_config_args(self.config_args)
        base = load_config(TrainConfig, paths, overrides)
        for cell in self.cells:                              # every cell must be a valid config, before any run
            try:
                load_config(TrainConfig, paths + cell.overlays, overrides + cell.overrides)
            except ConfigError as e:
                raise ConfigError(f"cell {cell.label}: {e}") from None
        self.makes_model = base.warm_start.make_model != "none"
        self._check_same_sweep({"config_args": self.config_args, "grid": [[k, v] for k, v in grid],
                                "base_config": to_dict(base)})

    def _parse_baseline(self, text: str | None) -> tuple[str, str]:
        if text is None:
            return self.grid[0][0], self.grid[0][1][0]
        key, _, value = text.partition("=")
        values = dict(self.grid).get(key.strip())
        if values is None or value.strip() not in values:
            raise ConfigError(f"--baseline {text!r} must be KEY=VALUE with a grid key and one of its values")
        return key.strip(), value.strip()

    def _check_same_sweep(self, spec: dict) -> None:
        """DIR/sweep.json records the grid and the resolved base config; another one is refused."""
        path = self.out / "sweep.json"
        spec = json.loads(json.dumps(spec))                  # as it reads back (tuples -> lists)
        if path.is_file():
            old = json.loads(path.read_text())
            for what, key in (("grid", "grid"), ("base config", "base_config"), ("config arguments", "config_args")):
                if old.get(key) != spec[key]:
                    raise ConfigError(f"{self.out} holds a sweep with a different {what}; rerun it with the same "
                                      f"config and grid, or use another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1) + "\n")

    # ------------------------------------------------------------------ running

    def runs(self) -> list[tuple[Cell, int]]:
        """Seed-major, so that an interrupted sweep has complete seeds (pairs) first."""
        return [(cell, seed) for seed in self.seeds for cell in self.cells]

    def command(self, cell: Cell, seed: int) -> list[str]:
        name = cell.run_name(seed)
        made = [f"model.hf_dir={self.out / 'runs' / name / 'init'}"] if self.makes_model else []
        return train_command(self.config_args + cell.overlays, self.out / "runs", name,
                             [*cell.overrides, f"run.seed={seed}", *made], self.nproc)

    def train(self) -> None:
        """Train every run without a summary.json (none are retrained)."""
        todo = [(c, s) for c, s in self.runs() if run_summary(self.out / "runs" / c.run_name(s)) is None]
        print(f"sweep: {len(self.cells)} cells x {len(self.seeds)} seeds; {len(todo)} run(s) to train", flush=True)
        if not todo:
            return
        if self.slurm is not None:
            index = {c.run_name(s): i for i, (c, s) in enumerate(self.runs())}
            slurm_array(self.out / "slurm" / "sweep.sbatch", "megadiv-sweep", str(self.out / "logs" / "run-%a.log"),
                        {index[c.run_name(s)]: self.command(c, s) for c, s in todo}, self.slurm, "sweep",
                        max_running=self.parallel if self.parallel > 1 else None)
            return
        with Progress("sweep runs", total=len(todo), unit="run") as bar:
            run_parallel([(self.command(c, s), self.out / "logs" / f"{c.run_name(s)}.log") for c, s in todo],
                         self.parallel, label="sweep", progress=bar)

    # ------------------------------------------------------------------ results

    def value(self, summary: dict | None) -> float | None:
        """The metric of one run's summary (``eval_after.KEY`` reaches into the final eval)."""
        if summary is None:
            return None
        if self.metric in summary:
            v = summary[self.metric]
        else:
            head, _, rest = self.metric.partition(".")
            v = summary[head].get(rest) if isinstance(summary.get(head), dict) else None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    def results(self) -> dict:
        runs, per_cell = [], {c.index: {} for c in self.cells}
        for cell, seed in self.runs():
            run_dir = self.out / "runs" / cell.run_name(seed)
            summary = run_summary(run_dir)
            value = self.value(summary)
            # unfinished: started, no summary.json (interrupted, failed or still running; see logs/)
            status = ("finished" if summary is not None else
                      "unfinished" if (run_dir / "metrics.jsonl").is_file() else "not started")
            if value is not None:
                per_cell[cell.index][seed] = value
            runs.append({"name": cell.run_name(seed), "cell": cell.index, "overrides": dict(cell.values), "seed": seed,
                         "run_dir": str(run_dir), "status": status, "metric": value, "summary": summary})
        cells = []
        for cell in self.cells:
            values = per_cell[cell.index]
            base = self.baseline_of(cell)
            entry = {"index": cell.index, "label": cell.label, "overrides": dict(cell.values),
                     **significance.summarise([values[s] for s in sorted(values)]),
                     "values": {str(s): v for s, v in sorted(values.items())},
                     "baseline_cell": base.index, "is_baseline": base.index == cell.index}
            entry["test"] = None if entry["is_baseline"] else significance.paired_test(values, per_cell[base.index])
            entry["p_value"] = None if entry["test"] is None else entry["test"]["p_value"]
            cells.append(entry)
        return {"metric": self.metric, "seeds": self.seeds, "grid": [[k, v] for k, v in self.grid],
                "baseline": {self.baseline_key: self.baseline_value}, "test": significance.TEST_NAME,
                "runs": runs, "cells": cells}

    def baseline_of(self, cell: Cell) -> Cell:
        want = tuple((k, self.baseline_value if k == self.baseline_key else v) for k, v in cell.values)
        return next(c for c in self.cells if c.values == want)

    def write(self) -> dict:
        results = self.results()
        (self.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (self.out / "table.md").write_text(table(results))
        plot(results, self.out / "sweep.png")
        return results


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    """Markdown: one row per cell (n, mean, sd, 95% interval, paired difference and p), then per seed."""
    base = ", ".join(f"{k}={v}" for k, v in results["baseline"].items())
    lines = [f"metric `{results['metric']}`; seeds {', '.join(map(str, results['seeds']))}; each cell against "
             f"the cell with {base} (same other grid values): {results['test']}", "",
             "| cell | n | mean | std | 95% interval | difference vs baseline (95% interval) | p |",
             "|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        ci = "-" if c["ci95"] is None else f"[{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
        if c["test"] is None:
            diff, p = "baseline", "-"
        else:
            t = c["test"]
            dci = "" if t["diff_ci95"] is None else f" ([{t['diff_ci95'][0]:+.3f}, {t['diff_ci95'][1]:+.3f}])"
            diff = f"{_fmt(t['mean_diff'], '+.3f')}{dci}"
            p = _fmt(t["p_value"], ".3g") if t["p_value"] is not None else f"- ({t['n_pairs']} pair(s))"
        lines.append(f"| {c['label']} | {c['n']} | {_fmt(c['mean'])} | {_fmt(c['std'])} | {ci} | {diff} | {p} |")
    lines += ["", "| cell | " + " | ".join(f"seed {s}" for s in results["seeds"]) + " |",
              "|---|" + "---|" * len(results["seeds"])]
    for c in results["cells"]:
        lines.append(f"| {c['label']} | " + " | ".join(_fmt(c["values"].get(str(s))) for s in results["seeds"]) + " |")
    return "\n".join(lines) + "\n"


def curve(run_dir: Path) -> tuple[str, list[tuple[int, float]]] | None:
    """A run's learning curve: held-out accuracy by step when it was evaluated, else mean reward."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    records = read_records(path)
    for key in ("eval/accuracy", "reward/mean"):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if len(pts) > 1:
            return key, pts
    return None


def plot(results: dict, path: Path) -> None:
    """Left: every seed's value per cell, the cell mean and its 95% interval. Right: the mean
    learning curve of each cell over its runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in cells:
        ys = list(c["values"].values())
        left.scatter([c["index"] + 0.08 * (k - (len(ys) - 1) / 2) for k in range(len(ys))], ys, s=14, alpha=0.6,
                     color="C0")
        if c["mean"] is not None:
            lo, hi = c["ci95"] or (c["mean"], c["mean"])
            left.errorbar([c["index"]], [c["mean"]], yerr=[[c["mean"] - lo], [hi - c["mean"]]], fmt="o", color="C1",
                          capsize=4)
    left.set_xticks([c["index"] for c in cells], [c["label"] for c in cells], rotation=20, ha="right", fontsize=7)
    left.set(ylabel=results["metric"], title="per seed (dots), mean and 95% interval")
    keys = set()
    for c in cells:
        by_step: dict[int, list[float]] = {}
        for r in results["runs"]:
            got = curve(Path(r["run_dir"])) if r["cell"] == c["index"] else None
            if got is not None:
                keys.add(got[0])
                for step, v in got[1]:
                    by_step.setdefault(step, []).append(v)
        if by_step:
            steps = sorted(by_step)
            right.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], marker=".", label=c["label"])
    right.set(xlabel="step", ylabel=" / ".join(sorted(keys)) or "-", title="learning curves (mean over seeds)")
    if keys:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
