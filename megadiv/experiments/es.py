"""``megadiv es``: evolution-strategies meta-learning of GBMPO's 380 mirror-map parameters.

    megadiv es CONFIG... [key=value ...] --population P --generations G --sigma S --sigma-decay D
               --lr A --elite-frac E --out DIR [--init config|authors] [--projection orthant|none]
               [--nproc N] [--launcher local|slurm]

The GBMPO authors' outer loop (methods.md section 2; their public code, folder meta_es), around
a centre phi: the config's ``loss.mirror_map`` (``--init config``, the default: ours) or, as the
authors start, numpy's ``RandomState(seed).randn(380) * 0.01`` (``--init authors``). Generation g:

    sigma_g = sigma * decay^g
    eps     = elites kept from the last rejected generation, then P - #elites fresh antithetic
              pairs +e_1, -e_1, +e_2, ... ~ N(0, I): the authors' stream, numpy's
              RandomState(seed + g).randn(#pairs, 380), row k giving pair k
    f_i     = validation pass@1 of an ordinary ``megadiv train`` run whose mirror map is
              phi + sigma_g e_i (elites are not retrained: their fitness is reused)
    accept  iff mean_i f_i > the best mean so far (the first generation always is); then
              phi <- phi + lr * sum_{f_i > 0} f_i e_i / (N_success * sigma_g)   (failed runs: f = 0)
    reject  keep phi; the top max(2, even(P * elite_frac)) (e_i, f_i) become the next elites

Ours, not the authors': with ``--projection orthant`` (the default) every candidate and the centre
are projected onto the nonnegative orthant, where h is convex (``loss.mirror_map.params`` refuses
anything else); ``--projection none`` follows their unconstrained update and trains candidates with
``loss.mirror_map.allow_nonconvex=true`` (D may then be negative). Elites are capped at P - 2 so
that every generation trains someone. Candidates are handed to training in float64 (the authors
round them to float32 in ``phi_to_mirror_params``).

State is ``DIR/history.jsonl`` alone (one line per trained candidate): a restarted ES replays the
generations from it, which reproduces every centre bit for bit, and continues at the first
candidate without a line; a half-trained candidate resumes from its own checkpoints. Outputs:
``DIR/best.json`` (centre, its mean fitness, the best single candidate), ``DIR/best_mirror_map.json``
(the centre as a ``loss.mirror_map.params`` file), ``DIR/es.png``. Candidates are launched and read
by runner.py; the verb's arguments are in megadiv/cli/es.py.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from megadiv.config import ConfigError, load_config, split_config_args
from megadiv.divergence.mirror_map import INIT_SCALE, NUM_PARAMETERS, save_vector
from megadiv.experiments.runner import run_local, run_summary, slurm_array, train_command
from megadiv.progress import Progress
from megadiv.trainer.config import TrainConfig


@dataclass(frozen=True)
class ESSettings:
    """Defaults are the authors' (population 10, sigma 0.01 x 0.99 per generation, step 0.01,
    15 meta-iterations, top 25% kept, seed 42) except ``init`` and ``projection`` (ours: start at
    the config's convex map and stay in the convex orthant; ``authors`` / ``none`` are theirs)."""

    population: int = 10
    generations: int = 15
    sigma: float = 0.01
    sigma_decay: float = 0.99
    lr: float = 0.01
    elite_frac: float = 0.25
    seed: int = 42
    init: Literal["config", "authors"] = "config"
    projection: Literal["orthant", "none"] = "orthant"

    def __post_init__(self):
        if self.population < 2 or self.population % 2:
            raise ConfigError(f"--population must be even and >= 2 (antithetic pairs), got {self.population}")
        if self.generations < 1 or not self.sigma > 0 or not 0 < self.sigma_decay <= 1 or not self.lr > 0:
            raise ConfigError("need --generations >= 1, --sigma > 0, 0 < --sigma-decay <= 1, --lr > 0")
        if not 0 <= self.elite_frac < 1:
            raise ConfigError(f"--elite-frac must lie in [0, 1), got {self.elite_frac}")

    def project(self, phi: torch.Tensor) -> torch.Tensor:
        """Onto the nonnegative orthant (ours), or unchanged (``--projection none``, the authors')."""
        return phi.clamp_min(0) if self.projection == "orthant" else phi

    @property
    def elites_on_reject(self) -> int:
        """The authors' max(2, even(P / 4)) with P * elite_frac for P / 4; capped at P - 2 (ours)."""
        return min(max(2, int(self.population * self.elite_frac) // 2 * 2), self.population - 2)


@dataclass
class ESState:
    """Between generations: the centre phi [380], the best accepted mean fitness, the elites."""

    centre: torch.Tensor
    best_mean: float = -math.inf
    elites: list[tuple[torch.Tensor, float]] = field(default_factory=list)


def authors_start(seed: int, dim: int = NUM_PARAMETERS) -> torch.Tensor:
    """The authors' starting centre (es_utils.initialize_es_state): RandomState(seed).randn(dim) * 0.01,
    float64; about half of it is negative."""
    return torch.from_numpy(np.random.RandomState(seed).randn(dim) * INIT_SCALE)


def antithetic(n: int, seed: int, dim: int = NUM_PARAMETERS) -> list[torch.Tensor]:
    """[+e_1, -e_1, +e_2, -e_2, ...] as the authors draw them (es_utils.sample_perturbations):
    e_k = row k of RandomState(seed).randn(n // 2, dim), float64."""
    base = torch.from_numpy(np.random.RandomState(seed).randn(n // 2, dim))
    return [s * e for e in base for s in (1.0, -1.0)]


def es_gradient(eps: list[torch.Tensor], fitness: list[float], sigma: float) -> torch.Tensor:
    """The authors' estimate sum_{f_i > 0} f_i e_i / (N_success * sigma) on raw (unnormalised)
    fitness; runs with f = 0 count as failed and are left out; all failed: zero."""
    ok = [(e, f) for e, f in zip(eps, fitness) if f > 0]
    if not ok:
        return torch.zeros_like(eps[0])
    return sum(f * e for e, f in ok) / (len(ok) * sigma)


def next_state(state: ESState, eps: list[torch.Tensor], fitness: list[float], sigma: float,
               settings: ESSettings) -> tuple[ESState, bool]:
    """Accept (update the centre, clear elites) when the mean fitness beats the best so far, else
    keep the centre and the top candidates as elites. Returns (state, accepted)."""
    mean = sum(fitness) / len(fitness)
    if mean > state.best_mean:
        centre = settings.project(state.centre + settings.lr * es_gradient(eps, fitness, sigma))
        return ESState(centre, mean, []), True
    top = sorted(range(len(fitness)), key=lambda i: fitness[i])[-settings.elites_on_reject:]
    return ESState(state.centre, state.best_mean, [(eps[i], fitness[i]) for i in top]), False


# --------------------------------------------------------------------------- the driver


class ESRun:
    """One ES directory: its settings, the history so far, and how candidates are launched."""

    def __init__(self, out: str | Path, config_args: list[str], settings: ESSettings, nproc: int = 1,
                 launcher: str = "local", slurm_options: str = ""):
        self.out = Path(out)
        self.config_args = list(config_args)
        self.settings = settings
        self.nproc, self.launcher, self.slurm_options = nproc, launcher, slurm_options
        paths, overrides = split_config_args(self.config_args)
        self.cfg = load_config(TrainConfig, paths, overrides)
        if not self.cfg.loss.uses_mirror_map:
            raise ConfigError("megadiv es searches the mirror map: set loss.regularizer (or the divergence_clip "
                              "measure) to sampled_mirror or full_mirror")
        if self.cfg.eval.data is None:
            raise ConfigError("megadiv es needs eval.data: a candidate's fitness is its held-out pass@1")
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_same_invocation()
        self.history = self._read_history()

    def _check_same_invocation(self) -> None:
        """DIR/es.json records what the ES was started with; a restart must ask for the same."""
        spec = {"config_args": self.config_args, "settings": asdict(self.settings), "nproc": self.nproc}
        path = self.out / "es.json"
        if path.is_file() and json.loads(path.read_text()) != spec:
            raise ConfigError(f"{path} records a different ES ({path.read_text().strip()}); resume with the same "
                              f"arguments or use another --out")
        path.write_text(json.dumps(spec, indent=1) + "\n")

    def _read_history(self) -> dict[tuple[int, int], dict]:
        path = self.out / "history.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return {(r["generation"], r["index"]): r for r in map(json.loads, filter(None, lines))}

    def run(self) -> ESState:
        s = self.settings
        state = ESState(self.start())
        for g in range(s.generations):
            sigma = s.sigma * s.sigma_decay ** g
            fresh = antithetic(s.population - len(state.elites), s.seed + g)
            params = [s.project(state.centre + sigma * e) for e in fresh]
            fitness = self._evaluate(g, params)
            eps = [e for e, _ in state.elites] + fresh
            state, accepted = next_state(state, eps, [f for _, f in state.elites] + fitness, sigma, s)
            mean = sum(fitness) / len(fitness)
            print(f"es generation {g + 1}/{s.generations} | sigma {sigma:.5f} | trained {len(fitness)} | "
                  f"mean fitness {mean:.4f} | {'accepted' if accepted else 'rejected'} | best mean "
                  f"{state.best_mean:.4f}", flush=True)
            self._write_best(state, g if accepted else None)
        plot_es(self.out)
        return state

    def start(self) -> torch.Tensor:
        """The first centre: the config's map (ours) or the authors' randn start, projected."""
        s = self.settings
        return s.project(authors_start(s.seed) if s.init == "authors" else self.cfg.loss.mirror_map.vector())

    def _evaluate(self, g: int, params: list[torch.Tensor]) -> list[float]:
        """Fitness of each candidate of generation g: from history.jsonl when already trained, else
        by training it (all missing ones of the generation at once under SLURM)."""
        names = [f"g{g:03d}-c{i:03d}" for i in range(len(params))]
        (self.out / "params").mkdir(exist_ok=True)
        files = [self.out / "params" / f"{n}.json" for n in names]
        todo = []
        for i, (p, f) in enumerate(zip(params, files)):
            if (g, i) in self.history:
                if self.history[(g, i)]["params_sha"] != _digest(p):
                    raise RuntimeError(f"replaying {self.out}/history.jsonl gave different parameters for generation "
                                       f"{g} candidate {i}: the history does not belong to these arguments")
                continue
            save_vector(p, f)
            todo.append(i)
        commands = {i: self._train_command(names[i], files[i]) for i in todo}
        if self.launcher == "slurm" and todo:
            submit_slurm_array(self.out, g, commands, self.slurm_options)
        with Progress(f"es generation {g + 1} candidates", total=len(todo), unit="run") as bar:
            for i in todo:
                if self.launcher == "local":
                    bar.write(f"es generation {g + 1} candidate {i + 1}/{len(params)}: training {names[i]}")
                    run_local(commands[i], self.out / "runs" / f"{names[i]}.log")
                self._record(g, i, names[i], files[i], params[i])
                bar.update()
        return [self.history[(g, i)]["fitness"] for i in range(len(params))]

    def _train_command(self, name: str, params_file: Path) -> list[str]:
        return train_command(self.config_args, self.out / "runs", name, [f"loss.mirror_map.params={params_file}",
                             *(["loss.mirror_map.allow_nonconvex=true"] if self.settings.projection == "none" else [])],
                             self.nproc)

    def _record(self, g: int, i: int, name: str, params_file: Path, params: torch.Tensor) -> None:
        """Read the candidate's held-out pass@1 (0 when the run failed: the authors' convention)
        and append its line to history.jsonl."""
        run_dir = self.out / "runs" / name
        accuracy = (run_summary(run_dir) or {}).get("accuracy_after")
        record = {"generation": g, "index": i, "fitness": float(accuracy or 0.0), "failed": accuracy is None,
                  "params": str(params_file), "params_sha": _digest(params), "run_dir": str(run_dir)}
        if accuracy is None:
            print(f"es: {name} produced no summary (failed run, fitness 0); see {self.out / 'runs' / name}.log",
                  file=sys.stderr, flush=True)
        with open(self.out / "history.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.history[(g, i)] = record

    def _write_best(self, state: ESState, accepted_generation: int | None) -> None:
        best = max(self.history.values(), key=lambda r: r["fitness"])
        path = self.out / "best.json"
        previous = json.loads(path.read_text()) if path.is_file() else {}
        record = {"mean_fitness": state.best_mean,
                  "generation": accepted_generation if accepted_generation is not None else previous.get("generation"),
                  "params": state.centre.tolist(), "params_file": str(self.out / "best_mirror_map.json"),
                  "best_candidate": {k: best[k] for k in ("generation", "index", "fitness", "params", "run_dir")}}
        save_vector(state.centre, self.out / "best_mirror_map.json")
        path.write_text(json.dumps(record, indent=1) + "\n")


def _digest(vec: torch.Tensor) -> str:
    """Bit-exact identity of a parameter vector (its float64 bytes)."""
    import hashlib

    return hashlib.sha256(vec.to(torch.float64).contiguous().numpy().tobytes()).hexdigest()[:16]


def submit_slurm_array(out: Path, g: int, commands: dict[int, list[str]], options: str) -> None:
    """One SLURM job array for the candidates of generation g that have no fitness yet (runner.py);
    candidate i logs to ``runs/g<g>-c<i>.log``, as it does when run here."""
    slurm_array(out / "slurm" / f"generation_{g:03d}.sbatch", f"megadiv-es-g{g:03d}",
                f"{out / 'runs'}/g{g:03d}-c%3a.log", commands, options, f"es generation {g + 1}")


def plot_es(out: Path) -> None:
    """DIR/es.png: every candidate's fitness by generation, the generation means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines() if line]
    gens = sorted({r["generation"] for r in records})
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["generation"] + 1 for r in records], [r["fitness"] for r in records], s=12, alpha=0.6,
               label="candidate")
    means = [sum(r["fitness"] for r in records if r["generation"] == g) /
             sum(1 for r in records if r["generation"] == g) for g in gens]
    ax.plot([g + 1 for g in gens], means, "o-", color="C1", label="mean of trained")
    ax.set(xlabel="generation", ylabel="fitness (held-out pass@1)", title="ES over the mirror map")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "es.png", dpi=100)
    plt.close(fig)
