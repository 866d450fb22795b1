"""``megadiv es CONFIG... [key=value ...] --population P --generations G --sigma S --sigma-decay D
--lr A --elite-frac E --out DIR [--init config|authors] [--projection orthant|none] [--nproc N]
[--launcher local|slurm]``: the arguments of
megadiv.experiments.es (evolution-strategies search of GBMPO's mirror map)."""
from __future__ import annotations

import argparse
import sys

from megadiv.config import ConfigError
from megadiv.experiments.es import ESRun, ESSettings


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
        settings = ESSettings(args.population, args.generations, args.sigma, args.sigma_decay, args.lr,
                              args.elite_frac, args.seed, args.init, args.projection)
        es = ESRun(args.out, args.args, settings, args.nproc, args.launcher, args.slurm_options)
    except (ConfigError, OSError, ValueError) as e:
        print(f"megadiv: invalid ES: {e}", file=sys.stderr)
        return 2
    state = es.run()
    print(f"best mean fitness {state.best_mean:.4f}; centre in {es.out / 'best_mirror_map.json'}", flush=True)
    return 0
