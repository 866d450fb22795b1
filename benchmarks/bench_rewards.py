"""Reward throughput: math verifications/s and sandboxed MBPP programs/s with 1 and 2 workers.

    .venv/bin/python benchmarks/bench_rewards.py [--math-items 1000] [--mbpp-items 100]
    .venv/bin/python benchmarks/bench_rewards.py --baseline main [--mbpp-items 500] [--rounds 3]

Math: GSM8K test gold solutions graded against their answers by a MathVerifyPool (worker start-up
excluded and reported apart). Code: MBPP test-split reference programs with their tests, each in
its own sandbox, ``workers`` sandboxes at a time (task ids from 11 on: the first 100 leave out
mbpp/123, which alone needs seconds of CPU).

``--baseline REV``: the code reward only, this tree's sandbox against the sandbox of git revision
REV in the same process (REV's ``megadiv/rewards`` loaded as the package ``megadiv_baseline``),
in alternating rounds (the order flips each round), so both see the same machine load; prints
programs/s per round, the ratio this tree / REV per round and the median ratio.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import inspect
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megadiv.data import DataConfig, load_dataset
from megadiv.rewards import MathVerifyPool, SandboxLimits, run_sandboxed

REPO = Path(__file__).resolve().parents[1]


def bench_math(workers: int, n: int) -> tuple[float, float]:
    ds = load_dataset(DataConfig(name="gsm8k", split="test"))
    records = [ds[i % len(ds)] for i in range(n)]
    start = time.perf_counter()
    with MathVerifyPool(workers=workers) as pool:
        started = time.perf_counter()
        grades = pool.grade([r.solution for r in records], [r.answer for r in records])
        rate = n / (time.perf_counter() - started)
    assert all(g.correct for g in grades)
    return rate, started - start


def bench_code(workers: int, n: int, isolation: str) -> tuple[float, str]:
    ds = load_dataset(DataConfig(name="mbpp", split="test", max_items=n))
    limits = SandboxLimits(isolation=isolation)
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda r: run_sandboxed(r.solution, r.tests, 30.0, setup=r.test_setup,
                                                       program_names=r.program_names, limits=limits), ds))
    rate = n / (time.perf_counter() - start)
    assert all(r.status == "passed" for r in results), [r.detail for r in results if r.status != "passed"]
    return rate, results[0].isolation


def load_baseline(rev: str):
    """``run_sandboxed`` and ``SandboxLimits`` of git revision ``rev``, as ``megadiv_baseline.rewards.sandbox``."""
    root = Path(tempfile.mkdtemp(prefix="megadiv-baseline-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    # the sandbox and the test splitter it imports (standard library only; data/__init__ would pull in the rest)
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "megadiv/rewards", "megadiv/data/code_tests.py"],
                           cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout
        dest = root / name.replace("megadiv/", "megadiv_baseline/", 1)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(re.sub(r"\bmegadiv\.", "megadiv_baseline.", text) if name.endswith(".py") else text)
    for package in ("", "data"):
        (root / "megadiv_baseline" / package).mkdir(parents=True, exist_ok=True)
        (root / "megadiv_baseline" / package / "__init__.py").touch()
    sys.path.insert(0, str(root))
    return importlib.import_module("megadiv_baseline.rewards.sandbox")


def compare_code(rev: str, workers: int, n: int, rounds: int, isolation: str) -> None:
    """This tree's sandbox against ``rev``'s on the first ``n`` MBPP test references, alternating."""
    baseline = load_baseline(rev)
    takes_names = "program_names" in inspect.signature(baseline.run_sandboxed).parameters  # since issue 26
    ds = load_dataset(DataConfig(name="mbpp", split="test", max_items=n))
    variants = {
        "this tree": lambda r: run_sandboxed(r.solution, r.tests, 60.0, setup=r.test_setup,
                                             program_names=r.program_names, limits=SandboxLimits(isolation=isolation)),
        rev: lambda r: baseline.run_sandboxed(r.solution, r.tests, 60.0, setup=r.test_setup,
                                              limits=baseline.SandboxLimits(isolation=isolation),
                                              **({"program_names": r.program_names} if takes_names else {})),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(rounds):
        for name in (list(variants) if k % 2 == 0 else list(variants)[::-1]):
            start = time.perf_counter()
            with ThreadPoolExecutor(workers) as ex:
                results = list(ex.map(variants[name], ds))
            rates[name].append(n / (time.perf_counter() - start))
            failed = [r.id for r, res in zip(ds, results) if res.status != "passed"]
            assert not failed, (name, failed)
        ratio = rates["this tree"][-1] / rates[rev][-1]
        print(f"round {k + 1}: this tree {rates['this tree'][-1]:.2f}/s, {rev} {rates[rev][-1]:.2f}/s, ratio {ratio:.3f}",
              flush=True)
    ratios = [a / b for a, b in zip(rates["this tree"], rates[rev])]
    print(f"{n} MBPP references, {workers} workers, {isolation}: median programs/s this tree "
          f"{statistics.median(rates['this tree']):.2f}, {rev} {statistics.median(rates[rev]):.2f}; "
          f"median ratio {statistics.median(ratios):.3f} (per round {', '.join(f'{r:.3f}' for r in ratios)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--math-items", type=int, default=1000)
    ap.add_argument("--mbpp-items", type=int, default=100)
    ap.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "unsafe"])
    ap.add_argument("--baseline", help="git revision whose sandbox to compare with (code reward only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="with --baseline: sandboxes at a time")
    args = ap.parse_args()
    if args.baseline:
        compare_code(args.baseline, args.workers, args.mbpp_items, args.rounds, args.isolation)
        return
    print(f"{'reward':<34}{'workers':>8}{'items/s':>10}   note")
    for workers in (1, 2):
        rate, startup = bench_math(workers, args.math_items)
        print(f"{'math (GSM8K gold solutions)':<34}{workers:>8}{rate:>10.0f}   pool start-up {startup:.1f} s, "
              f"{args.math_items} items")
    for workers in (1, 2):
        rate, isolation = bench_code(workers, args.mbpp_items, args.isolation)
        print(f"{'code (MBPP reference programs)':<34}{workers:>8}{rate:>10.1f}   isolation {isolation}, "
              f"{args.mbpp_items} programs")


if __name__ == "__main__":
    main()
