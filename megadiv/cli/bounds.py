"""``megadiv bounds``: the ratio interval equivalent to a divergence bound, and back.

    megadiv bounds --measure k3 --delta 0.02             interval of k3(w) <= 0.02
    megadiv bounds --measure k3 --eps-low 0.2 --eps-high 0.28    deltas that give DAPO's [0.8, 1.28]
    megadiv bounds --table [--measure ...] [--delta ...]  intervals for several measures and deltas,
                                                          and the deltas matching PPO and DAPO
"""
from __future__ import annotations

import argparse
import sys

from megadiv.divergence.bounds import equivalent_deltas, ratio_bounds
from megadiv.divergence.registry import RatioDivergence, names_of_kind

TABLE_DELTAS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
REFERENCE_CLIPS = (("PPO", 0.2, 0.2), ("DAPO", 0.2, 0.28))  # (name, eps_low, eps_high)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    measures = names_of_kind(RatioDivergence)
    parser.add_argument("--measure", nargs="+", metavar="MEASURE",
                        help=f"divergence measure(s), a function of the ratio: {', '.join(measures)} "
                             f"(default: k3; with --table: all)")
    parser.add_argument("--delta", nargs="+", type=float, help="divergence bound(s) delta > 0")
    parser.add_argument("--eps-low", type=float, help="print the deltas whose interval is [1 - eps_low, 1 + eps_high]")
    parser.add_argument("--eps-high", type=float, help="upper clip range for --eps-low (default: eps-low)")
    parser.add_argument("--table", action="store_true",
                        help=f"table over measures and deltas (default {', '.join(map(str, TABLE_DELTAS))}) and "
                             f"the deltas equivalent to PPO [0.8, 1.2] and DAPO [0.8, 1.28]")


def run(args: argparse.Namespace) -> int:
    try:
        if args.delta and args.eps_low is not None and not args.table:
            raise ValueError("give either --delta or --eps-low, not both")
        if args.table:
            print(table(args.measure or names_of_kind(RatioDivergence), args.delta or TABLE_DELTAS))
        elif args.eps_low is not None:
            eps_high = args.eps_low if args.eps_high is None else args.eps_high
            for m in args.measure or ["k3"]:
                d_low, d_high = equivalent_deltas(m, args.eps_low, eps_high)
                print(f"{m}: w in [{1 - args.eps_low:.10g}, {1 + eps_high:.10g}]  <=>  "
                      f"delta_low {_delta(d_low)} (w < 1 side), delta_high {_delta(d_high)} (w > 1 side)")
        elif args.delta:
            for m in args.measure or ["k3"]:
                for delta in args.delta:
                    low, high = ratio_bounds(m, delta)
                    print(f"{m}(w) <= {delta:g}  <=>  w in [{low:.10f}, {high:.10f}]  "
                          f"(eps_low {1 - low:.6f}, eps_high {high - 1:.6f})")
        else:
            print("megadiv bounds: error: give --delta, --eps-low or --table", file=sys.stderr)
            return 2
    except ValueError as e:
        print(f"megadiv bounds: error: {e}", file=sys.stderr)
        return 2
    return 0


def table(measures: list[str], deltas: list[float]) -> str:
    lines = ["Ratio interval [l, u] = {w : D(w) <= delta}, w = pi_theta / pi_old", "",
             f"{'measure':<12}{'delta':>8}{'l':>12}{'u':>12}{'1 - l':>10}{'u - 1':>10}"]
    for m in measures:
        for delta in deltas:
            low, high = ratio_bounds(m, delta)
            lines.append(f"{m:<12}{delta:>8g}{low:>12.6f}{high:>12.6f}{1 - low:>10.4f}{high - 1:>10.4f}")
    lines += ["", "Deltas equivalent to ratio clipping: delta_low = D(1 - eps_low), delta_high = D(1 + eps_high)",
              "('-': the measure cannot bound that side)", "",
              f"{'':<12}" + "".join(f"{f'{n} [{1 - lo:g}, {1 + hi:g}]':<26}" for n, lo, hi in REFERENCE_CLIPS),
              f"{'measure':<12}" + f"{'delta_low':<13}{'delta_high':<13}" * len(REFERENCE_CLIPS)]
    for m in measures:
        row = f"{m:<12}"
        for _, lo, hi in REFERENCE_CLIPS:
            d_low, d_high = equivalent_deltas(m, lo, hi)
            row += f"{_delta(d_low):<13}{_delta(d_high):<13}"
        lines.append(row)
    return "\n".join(line.rstrip() for line in lines)


def _delta(d: float) -> str:
    """A bound on a side where the measure is <= 0 bounds nothing (k1 on w > 1)."""
    return f"{d:.6f}" if d > 0 else "-"
