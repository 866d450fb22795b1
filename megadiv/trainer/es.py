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
(the centre as a ``loss.mirror_map.params`` file), ``DIR/es.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from megadiv.config import ConfigError, load_config, split_config_args
from megadiv.divergence.mirror_map import INIT_SCALE, NUM_PARAMETERS, save_vector
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

    def __init__(self, args: argparse.Namespace):
        self.out = Path(args.out)
        self.config_args = list(args.args)
        self.settings = ESSettings(args.population, args.generations, args.sigma, args.sigma_decay, args.lr,
                                   args.elite_frac, args.seed, args.init, args.projection)
        self.nproc, self.launcher, self.slurm_options = args.nproc, args.launcher, args.slurm_options
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
        for i in todo:
            if self.launcher == "local":
                print(f"es generation {g + 1} candidate {i + 1}/{len(params)}: training {names[i]}", flush=True)
                run_local(commands[i], self.out / "runs" / f"{names[i]}.log")
            self._record(g, i, names[i], files[i], params[i])
        return [self.history[(g, i)]["fitness"] for i in range(len(params))]

    def _train_command(self, name: str, params_file: Path) -> list[str]:
        return [sys.executable, "-m", "megadiv.cli", "train", *self.config_args,
                f"run.output_dir={self.out / 'runs'}", f"run.name={name}",
                f"loss.mirror_map.params={params_file}", "--nproc", str(self.nproc),
                *(["loss.mirror_map.allow_nonconvex=true"] if self.settings.projection == "none" else [])]

    def _record(self, g: int, i: int, name: str, params_file: Path, params: torch.Tensor) -> None:
        """Read the candidate's held-out pass@1 (0 when the run failed: the authors' convention)
        and append its line to history.jsonl."""
        summary = self.out / "runs" / name / "summary.json"
        accuracy = json.loads(summary.read_text()).get("accuracy_after") if summary.is_file() else None
        record = {"generation": g, "index": i, "fitness": float(accuracy or 0.0), "failed": accuracy is None,
                  "params": str(params_file), "params_sha": _digest(params), "run_dir": str(summary.parent)}
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


def run_local(command: list[str], log: Path) -> int:
    """Run one candidate, output to ``log``. It stays in this process group, so a signal to the ES
    (Ctrl-C, or a kill of the group) ends the candidate too; nothing trains on in the background."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.call(command, stdout=fh, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def submit_slurm_array(out: Path, g: int, commands: dict[int, list[str]], options: str) -> None:
    """One SLURM job array for the candidates of generation g that have no fitness yet, submitted
    with ``sbatch --wait`` (returns when every task has ended). Each task runs ``megadiv train``
    on one node; ``--slurm-options`` carries partition, GPUs, time, account."""
    script = out / "slurm" / f"generation_{g:03d}.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    cases = "\n".join(f"  {i}) exec {shlex.join(cmd)} ;;" for i, cmd in commands.items())
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name=megadiv-es-g{g:03d}\n"
                      f"#SBATCH --array={','.join(map(str, commands))}\n"
                      f"#SBATCH --output={out / 'runs'}/g{g:03d}-c%3a.log\n"
                      f"cd {shlex.quote(os.getcwd())}\nexport OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}\n"
                      f"case $SLURM_ARRAY_TASK_ID in\n{cases}\nesac\n")
    (out / "runs").mkdir(exist_ok=True)
    cmd = ["sbatch", "--wait", *shlex.split(options), str(script)]
    print(f"es generation {g + 1}: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=False)


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


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ESSettings()
    parser.add_argument("args", nargs="+", metavar="CONFIG|key=value",
                        help="the training config of every candidate: YAML files, then key.sub=value overrides")
    parser.add_argument("--population", type=int, default=d.population, help="candidates per generation (even)")
    parser.add_argument("--generations", type=int, default=d.generations, help="ES generations (meta-iterations)")
    parser.add_argument("--sigma", type=float, default=d.sigma, help="perturbation scale of the first generation")
    parser.add_argument("--sigma-decay", type=float, default=d.sigma_decay, help="sigma factor per generation")
    parser.add_argument("--lr", type=float, default=d.lr, help="ES step size alpha")
    parser.add_argument("--elite-frac", type=float, default=d.elite_frac,
                        help="fraction of a rejected generation kept as elites")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="perturbations of generation g: RandomState(seed + g); --init authors: RandomState(seed)")
    parser.add_argument("--init", choices=("config", "authors"), default=d.init,
                        help="first centre: the config's loss.mirror_map (ours) or RandomState(seed).randn(380) * 0.01 "
                             "(the authors')")
    parser.add_argument("--projection", choices=("orthant", "none"), default=d.projection,
                        help="orthant: candidates and centre clamped >= 0, h convex (ours); none: the authors' "
                             "unconstrained update (candidates train with loss.mirror_map.allow_nonconvex)")
    parser.add_argument("--out", required=True, help="ES directory (history.jsonl, best.json, es.png, runs/)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per candidate run (megadiv train --nproc)")
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local",
                        help="local: candidates one after another here; slurm: one job array per generation")
    parser.add_argument("--slurm-options", default="", help="extra sbatch options, e.g. '-p gpu --gres=gpu:8'")


def run(args: argparse.Namespace) -> int:
    try:
        es = ESRun(args)
    except (ConfigError, OSError, ValueError) as e:
        print(f"megadiv: invalid ES: {e}", file=sys.stderr)
        return 2
    state = es.run()
    print(f"best mean fitness {state.best_mean:.4f}; centre in {es.out / 'best_mirror_map.json'}", flush=True)
    return 0
