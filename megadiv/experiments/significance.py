"""Per-cell statistics of a sweep over seeds: mean, spread, a 95% interval, and a paired test.

Each cell of a sweep is trained once per seed; the same seed gives every cell the same random
model, warm start and prompt order, so cells are compared seed by seed. For a cell x and the
baseline y over the seeds s both finished, d_s = x_s - y_s, and the test is the paired t-test:

    t = mean(d) / (sd(d) / sqrt(n)),   sd with n - 1 degrees of freedom,
    p = 2 * (1 - F_{t, n-1}(|t|))      (two-sided)

Why this test: pairing removes what seeds share (on the CPU miniatures the warm start alone moves
the starting accuracy by 0.2 between seeds, far more than the methods differ), and at 3-5 seeds
the t-test is the only common paired test that can reject at all: the exact Wilcoxon signed-rank
test cannot give p < 0.25 with 3 pairs or p < 0.0625 with 5 (two-sided). Its assumption, roughly
normal differences, cannot be checked with so few seeds; read small p-values with that in mind.

Edge cases, exactly: fewer than 2 pairs -> no test (p_value None, reason given); every d_s equal
(sd(d) = 0): p = 1.0 when they are all 0 (no seed differs), p = 0.0 otherwise (the limit of t ->
infinity; every seed moved by the same amount). The 95% interval of a cell's mean is
mean +- t_{0.975, n-1} sd / sqrt(n); None for n < 2.
"""
from __future__ import annotations

import math

from scipy import stats

TEST_NAME = "paired t-test on seed-matched differences (two-sided)"


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); (None, None) for no values, sd None for one."""
    n = len(values)
    if n == 0:
        return None, None
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


def interval95(values: list[float]) -> list[float] | None:
    """[low, high] of the 95% t-interval of the mean; None for fewer than 2 values."""
    mean, sd = mean_sd(values)
    if sd is None:
        return None
    half = float(stats.t.ppf(0.975, len(values) - 1)) * sd / math.sqrt(len(values))
    return [mean - half, mean + half]


def summarise(values: list[float]) -> dict:
    """n, mean, std, ci95 of one cell's per-seed values."""
    mean, sd = mean_sd(values)
    return {"n": len(values), "mean": mean, "std": sd, "ci95": interval95(values)}


def paired_test(cell: dict[int, float], baseline: dict[int, float]) -> dict:
    """The paired t-test of ``cell`` against ``baseline``, both {seed: value}, over their common
    seeds: n pairs, the mean difference and its 95% interval, t, p_value (module docstring)."""
    seeds = sorted(set(cell) & set(baseline))
    diffs = [cell[s] - baseline[s] for s in seeds]
    n = len(diffs)
    out = {"test": TEST_NAME, "seeds": seeds, "n_pairs": n, "mean_diff": mean_sd(diffs)[0],
           "diff_ci95": interval95(diffs), "t": None, "p_value": None}
    if n < 2:
        return {**out, "reason": f"{n} seed-matched pair(s): a paired test needs 2 or more"}
    mean, sd = mean_sd(diffs)
    if sd == 0:
        no_change = all(d == 0 for d in diffs)
        return {**out, "t": 0.0 if no_change else math.copysign(math.inf, mean), "p_value": 1.0 if no_change else 0.0,
                "reason": "every seed differs by the same amount (zero variance of the differences)"}
    t = mean / (sd / math.sqrt(n))
    return {**out, "t": t, "p_value": float(2 * stats.t.sf(abs(t), n - 1))}
