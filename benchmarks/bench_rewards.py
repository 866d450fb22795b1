"""Reward throughput: math verifications/s and sandboxed MBPP programs/s with 1 and 2 workers.

    .venv/bin/python benchmarks/bench_rewards.py [--math-items 1000] [--mbpp-items 100]

Math: GSM8K test gold solutions graded against their answers by a MathVerifyPool (worker start-up
excluded and reported apart). Code: MBPP test-split reference programs with their tests, each in
its own sandbox, ``workers`` sandboxes at a time (task ids from 11 on: the first 100 leave out
mbpp/123, which alone needs seconds of CPU).
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from megadiv.data import DataConfig, load_dataset
from megadiv.rewards import MathVerifyPool, SandboxLimits, run_sandboxed


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
        results = list(ex.map(lambda r: run_sandboxed(r.solution, r.tests, 30.0, setup=r.test_setup, limits=limits),
                              ds))
    rate = n / (time.perf_counter() - start)
    assert all(r.status == "passed" for r in results), [r.detail for r in results if r.status != "passed"]
    return rate, results[0].isolation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--math-items", type=int, default=1000)
    ap.add_argument("--mbpp-items", type=int, default=100)
    ap.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "unsafe"])
    args = ap.parse_args()
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
