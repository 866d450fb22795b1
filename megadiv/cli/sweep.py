"""``megadiv sweep CONFIG... [key=value ...] --grid KEY=V1,V2[,...] [--grid ...] --seeds 1,2,3 --out DIR
[--nproc N] [--parallel K] [--slurm [SBATCH_OPTIONS]] [--baseline KEY=VALUE] [--metric KEY]``: the
arguments of megadiv.experiments.sweep (one training per grid cell x seed, a significance-tested table)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megadiv.config import ConfigError
from megadiv.experiments.sweep import Sweep, parse_grid, parse_seeds, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="+", metavar="CONFIG|key=value",
                        help="the base training config: YAML files, then key.sub=value overrides")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="a grid axis (repeat for more); KEY 'config' takes YAML overlay files")
    parser.add_argument("--seeds", required=True, help="comma-separated run.seed values, e.g. 1,2,3")
    parser.add_argument("--out", required=True, help="sweep directory (results.json, table.md, sweep.png, runs/)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (megadiv train --nproc)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (local), or the SLURM array's throttle")
    parser.add_argument("--slurm", nargs="?", const="", default=None, metavar="SBATCH_OPTIONS",
                        help="submit the runs as one SLURM job array (sbatch --wait) with these options")
    parser.add_argument("--baseline", default=None, metavar="KEY=VALUE",
                        help="baseline of the paired tests (default: the first grid key's first value)")
    parser.add_argument("--metric", default="accuracy_after",
                        help="summary.json key compared across cells (eval_after.KEY for a final eval metric)")


def run(args: argparse.Namespace) -> int:
    try:
        sweep = Sweep(args.args, parse_grid(args.grid), parse_seeds(args.seeds), Path(args.out), args.nproc,
                      args.parallel, args.slurm, args.baseline, args.metric)
    except (ConfigError, OSError) as e:
        print(f"megadiv: invalid sweep: {e}", file=sys.stderr)
        return 2
    sweep.train()
    results = sweep.write()
    print(table(results), flush=True)
    print(f"sweep: results in {sweep.out / 'results.json'}, {sweep.out / 'table.md'}, {sweep.out / 'sweep.png'}",
          flush=True)
    missing = [r["name"] for r in results["runs"] if r["metric"] is None]
    if missing:
        print(f"sweep: {len(missing)} run(s) without {args.metric!r} in summary.json: {', '.join(missing[:5])}"
              f"{' ...' if len(missing) > 5 else ''} (see {sweep.out / 'logs'})", file=sys.stderr, flush=True)
        return 1
    return 0
