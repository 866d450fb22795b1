"""Scalar root finding in float64 for the ratio bounds: the real Lambert W function and the
sublevel interval of a measure of the log-ratio.

Plain Python floats: these run once per (measure, delta), never per token.
"""
from __future__ import annotations

import math
from typing import Callable

_INV_E = math.exp(-1.0)


def lambert_w(x: float, branch: int = 0) -> float:
    """Real Lambert W: the solution w of w * e^w = x on ``branch`` 0 (w >= -1, x >= -1/e) or
    -1 (w <= -1, -1/e <= x < 0).

    Halley's iteration on f(w) = w e^w - x, started from the branch-point series
    w = -1 +/- p - p^2/3 +/- 11 p^3 / 72 with p = sqrt(2 (e x + 1)) near x = -1/e, and from the
    asymptotic w ~ L1 - L2 + L2 / L1 (L1 = log|x|, L2 = log|L1|) elsewhere. It converges to a few
    ulp; near x = -1/e, W itself is ill-conditioned (dW/dx ~ 1/p), so the error grows like
    1e-16 / p there.
    """
    if branch not in (0, -1):
        raise ValueError(f"lambert_w: branch must be 0 or -1, got {branch}")
    if math.isnan(x) or x < -_INV_E * (1 + 1e-15):
        raise ValueError(f"lambert_w: x = {x!r} is outside the real domain x >= -1/e")
    if branch == -1 and x >= 0:
        raise ValueError(f"lambert_w: branch -1 needs -1/e <= x < 0, got {x!r}")
    if x == 0:
        return 0.0
    if math.isinf(x):
        return math.inf
    sign = 1.0 if branch == 0 else -1.0
    if x < -0.25:  # near the branch point, where both branches meet at -1
        p = math.sqrt(max(2.0 * (math.e * x + 1.0), 0.0))
        if p == 0.0:
            return -1.0
        w = -1.0 + sign * p - p * p / 3.0 + sign * 11.0 / 72.0 * p ** 3
    elif branch == 0 and x < 3.0:
        w = math.log1p(x)
    else:
        l1 = math.log(abs(x))
        l2 = math.log(abs(l1))
        w = l1 - l2 + l2 / l1
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        wp1 = w + 1.0
        if wp1 == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= 4e-16 * (1.0 + abs(w)):
            break
    return w


def monotone_interval(f: Callable[[float], float], delta: float) -> tuple[float, float]:
    """(t_low, t_high): the sublevel set {t : f(t) <= delta} of a function with f(0) = 0 whose
    sublevel sets are intervals around 0. Ends are -inf / inf when f never exceeds delta on that
    side (searched out to |t| = 1024, i.e. past the float64 range of e^t). Bisection to adjacent
    floats; each end returned is the last point found inside the set."""
    return -_side(lambda x: f(-x), delta), _side(f, delta)


def _side(f: Callable[[float], float], delta: float) -> float:
    """Largest x >= 0 with f(x) <= delta, for f(0) = 0 and {x >= 0 : f(x) <= delta} = [0, x*]."""
    inside, outside = 0.0, 1.0
    while f(outside) <= delta:  # NaN counts as outside, so an overflowing measure ends the search
        inside, outside = outside, 2.0 * outside
        if outside > 1024.0:
            return math.inf
    while True:
        mid = 0.5 * (inside + outside)
        if mid <= inside or mid >= outside:
            return inside
        if f(mid) <= delta:
            inside = mid
        else:
            outside = mid
