"""Acceptance over whole datasets: gold solutions score 1, altered ones 0; MBPP references pass.

Slow-marked (about a minute each on 2 busy cores) but part of the CI suite. Timings are printed
(`pytest -s`), never asserted.
"""
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from megadiv.data import DataConfig, load_dataset
from megadiv.rewards import SandboxLimits, math_scores, run_sandboxed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_gsm8k_gold_solutions_score_one_and_changed_final_numbers_score_zero():
    ds = load_dataset(DataConfig(name="gsm8k", split="test"))
    golds = [r.answer for r in ds]
    changed = [r.solution[:r.solution.rindex("####")] + f"#### {Decimal(r.answer) + 1}" for r in ds]
    start = time.perf_counter()
    scores = math_scores([r.solution for r in ds], golds)
    wrong = math_scores(changed, golds)
    elapsed = time.perf_counter() - start
    print(f"\nGSM8K test: {2 * len(ds)} verifications in {elapsed:.1f} s ({2 * len(ds) / elapsed:.0f}/s)")
    assert len(scores) == 1319 and [i for i, s in enumerate(scores) if s != 1.0] == []
    assert [i for i, s in enumerate(wrong) if s != 0.0] == []


@pytest.mark.parametrize("name", ["math500", "aime24", "aime25"])
def test_boxed_gold_answers_score_one(name):
    ds = load_dataset(DataConfig(name=name, split="test"))
    scores = math_scores([f"So the final answer is $\\boxed{{{r.answer}}}$." for r in ds], [r.answer for r in ds])
    assert [ds[i].answer for i, s in enumerate(scores) if s != 1.0] == []


@pytest.mark.parametrize("isolation", ["auto", "unsafe"])
@pytest.mark.parametrize("name", ["mbpp", "mbpp_sanitized"])
def test_mbpp_reference_solutions_pass_their_tests_in_the_sandbox(name, isolation):
    """Every reference of every split passes every test in both modes, graded outside the program
    (the sandbox evaluates the calls into the program, the grader's interpreter the rest)."""
    if isolation == "auto" and not (sys.platform == "linux" and os.geteuid() == 0):
        pytest.skip("auto needs root on Linux")
    ds = load_dataset(DataConfig(name=name, split="all"))
    limits = SandboxLimits(isolation=isolation)
    start = time.perf_counter()
    # 60 s: mbpp/123 (amicable numbers below 9999, quadratic) needs several CPU seconds on its own.
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda r: run_sandboxed(r.solution, r.tests, 60.0, setup=r.test_setup,
                                                       program_names=r.program_names, limits=limits), ds))
    elapsed = time.perf_counter() - start
    slowest = max(zip(results, ds), key=lambda x: x[0].elapsed_s)
    print(f"\n{name} all, {isolation}: {len(ds)} programs in {elapsed:.1f} s ({len(ds) / elapsed:.1f}/s), isolation "
          f"{Counter(r.isolation for r in results)}, slowest {slowest[1].id} {slowest[0].elapsed_s:.1f} s")
    failures = {r.id: (res.status, res.detail) for r, res in zip(ds, results) if res.status != "passed"}
    assert failures == {}
    assert all(res.passed == res.total == len(r.tests) for r, res in zip(ds, results))
