"""Exact equivalence between a divergence bound and a ratio interval, both ways.

``ratio_bounds(measure, delta)``: the interval [l, u] of ratios w = pi_theta / pi_old with
D(w) <= delta, for every measure that is a function of the ratio alone. ``equivalent_deltas``
goes the other way: the (delta_low, delta_high) that reproduce a PPO/DAPO interval
[1 - eps_low, 1 + eps_high]. E.g. k3 with delta = 0.05 clips at [0.7162, 1.3504], and DAPO's
[0.8, 1.28] is k3 with delta_low = 0.0231, delta_high = 0.0331.
"""
from __future__ import annotations

import functools
import math

import torch

from megadiv.divergence.registry import DIVERGENCES, RatioDivergence, names_of_kind


def ratio_measure(measure: str) -> RatioDivergence:
    """The registered measure ``measure``, which must be a function of the ratio alone (ValueError otherwise)."""
    if measure not in DIVERGENCES:
        raise ValueError(f"unknown divergence measure '{measure}'; registered: {sorted(DIVERGENCES)}")
    if not issubclass(DIVERGENCES[measure], RatioDivergence):
        raise ValueError(f"divergence measure '{measure}' is not a function of the ratio alone, so it has "
                         f"no equivalent ratio interval; measures that have one: {names_of_kind(RatioDivergence)}")
    return DIVERGENCES[measure]()


@functools.lru_cache(maxsize=1024)
def ratio_bounds(measure: str, delta: float) -> tuple[float, float]:
    """[l, u] with D(w) <= delta <=> l <= w <= u; l may be 0.0 and u may be inf (k1 is one-sided).
    Accurate to a few ulp (the tests hold k3 to 1e-13 of a 40-digit reference)."""
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"delta must be a finite number > 0, got {delta!r}")
    return ratio_measure(measure).ratio_interval(float(delta))


def equivalent_deltas(measure: str, eps_low: float, eps_high: float) -> tuple[float, float]:
    """(D(1 - eps_low), D(1 + eps_high)): the divergence bounds whose ratio interval is
    [1 - eps_low, 1 + eps_high] (for measures that grow away from w = 1 on both sides)."""
    if not (0 < eps_low < 1 and eps_high > 0):
        raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high}")
    m = ratio_measure(measure)
    w = torch.tensor([1.0 - eps_low, 1.0 + eps_high], dtype=torch.float64)
    delta_low, delta_high = m.of_ratio(w).tolist()
    return delta_low, delta_high
