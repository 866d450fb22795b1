"""ratio_bounds and lambert_w against independent references: scipy.special.lambertw, 40-digit
mpmath, and the reference values of ../shared/notes/methods.md.

scipy's branch -1 is itself inaccurate next to the branch point (relative error up to ~1e-4 for
x within ~1e-8 of -1/e, i.e. k3 with delta below ~1e-8), so the scipy comparison covers
delta >= 1e-7 and mpmath covers the rest."""
import math

import mpmath
import numpy as np
import pytest
import torch
from scipy.special import lambertw as scipy_lambertw

from megadiv.divergence import equivalent_deltas, get_divergence, lambert_w, ratio_bounds

mpmath.mp.dps = 40
DELTAS = [float(d) for d in np.logspace(-7, 1.5, 60)]


def _exact_k3(delta: float) -> tuple[float, float]:
    x = -mpmath.exp(-1 - mpmath.mpf(delta))
    return float(-mpmath.lambertw(x, 0).real), float(-mpmath.lambertw(x, -1).real)


def test_k3_bounds_match_scipy_lambertw():
    for delta in DELTAS:
        x = -math.exp(-1.0 - delta)
        low, high = ratio_bounds("k3", delta)
        assert abs(low + scipy_lambertw(x, 0).real) <= 1e-10, delta
        assert abs(high + scipy_lambertw(x, -1).real) <= 1e-10, delta


@pytest.mark.parametrize("delta", [1e-300, 1e-30, 1e-16, 1e-12, 1e-9, 1e-4, 0.02, 1.0, 30.0, 200.0])
def test_k3_bounds_match_40_digit_reference(delta):
    """Down to delta = 1e-300, where x = -e^(-1-delta) rounds to -1/e: the Newton polish on
    k3(w) = delta restores full precision."""
    for got, want in zip(ratio_bounds("k3", delta), _exact_k3(delta)):
        assert math.isclose(got, want, rel_tol=4e-15), (delta, got, want)


@pytest.mark.parametrize("delta, low, high", [(0.01, 0.8652, 1.1482), (0.02314, 0.8000, 1.2308),
                                              (0.05, 0.7162, 1.3504), (0.1, 0.6168, 1.5162)])
def test_k3_methods_reference_values(delta, low, high):
    got_low, got_high = ratio_bounds("k3", delta)
    assert abs(got_low - low) < 5e-5 and abs(got_high - high) < 5e-5


def test_k3_dapo_correspondence_and_round_trip():
    """methods.md: DAPO's [0.8, 1.28] is k3 with delta 0.0231 (low side) and 0.0331 (high side)."""
    d_low, d_high = equivalent_deltas("k3", 0.2, 0.28)
    assert abs(d_low - 0.0231) < 5e-5 and abs(d_high - 0.0331) < 5e-5
    assert math.isclose(ratio_bounds("k3", d_low)[0], 0.8, rel_tol=1e-14)
    assert math.isclose(ratio_bounds("k3", d_high)[1], 1.28, rel_tol=1e-14)


def test_k3_expansion_and_adaptive_clip_higher():
    """l, u = 1 -/+ s + 2 delta / 3 + O(delta^(3/2)), s = sqrt(2 delta); the upper side is always wider."""
    for delta in (1e-6, 1e-4, 1e-3):
        s = math.sqrt(2 * delta)
        low, high = ratio_bounds("k3", delta)
        assert abs(low - (1 - s + 2 * delta / 3)) < delta ** 1.5
        assert abs(high - (1 + s + 2 * delta / 3)) < delta ** 1.5
    for delta in DELTAS:
        low, high = ratio_bounds("k3", delta)
        assert high - 1 > 1 - low


def test_closed_forms_of_other_measures():
    for delta in (1e-5, 0.02, 0.5, 3.0):
        s = math.sqrt(2 * delta)
        assert ratio_bounds("k2", delta) == (math.exp(-s), math.exp(s))
        assert ratio_bounds("k1", delta) == (math.exp(-delta), math.inf)
        assert ratio_bounds("ratio", delta) == (max(0.0, 1 - delta), 1 + delta)
        low, high = ratio_bounds("k3", delta)
        r_low, r_high = ratio_bounds("reverse_k3", delta)
        assert math.isclose(r_low, 1 / high, rel_tol=1e-15) and math.isclose(r_high, 1 / low, rel_tol=1e-15)


def test_equivalent_deltas_is_the_inverse_of_ratio_bounds():
    for measure in ("ratio", "k2", "k3", "reverse_k3"):
        for eps_low, eps_high in ((0.2, 0.2), (0.2, 0.28), (0.05, 0.5)):
            d_low, d_high = equivalent_deltas(measure, eps_low, eps_high)
            assert math.isclose(ratio_bounds(measure, d_low)[0], 1 - eps_low, rel_tol=1e-13)
            assert math.isclose(ratio_bounds(measure, d_high)[1], 1 + eps_high, rel_tol=1e-13)
    d_low, d_high = equivalent_deltas("k1", 0.2, 0.28)  # k1 bounds only the w < 1 side
    assert math.isclose(d_low, -math.log(0.8)) and d_high < 0


def test_errors():
    for bad in (0.0, -0.1, math.nan, math.inf, "0.1"):
        with pytest.raises(ValueError, match="delta must be"):
            ratio_bounds("k3", bad)
    with pytest.raises(ValueError, match="not a function of the ratio alone"):
        ratio_bounds("sampled_prob_l2", 0.1)
    with pytest.raises(ValueError, match="unknown divergence measure"):
        ratio_bounds("kl4", 0.1)
    with pytest.raises(ValueError, match="eps_low"):
        equivalent_deltas("k3", 1.0, 0.2)


# --------------------------------------------------------------------------- lambert_w


def _mp_w(x: float, branch: int) -> float:
    return float(mpmath.lambertw(mpmath.mpf(x), branch).real)


def test_lambert_w_matches_references_away_from_the_branch_point():
    inv_e = math.exp(-1)
    xs0 = np.concatenate([-inv_e + np.logspace(-3, -0.5, 40), np.linspace(-0.3, 3, 60),
                          np.logspace(-300, 300, 60), -np.logspace(-300, -0.45, 60)])
    xs1 = np.concatenate([-inv_e + np.logspace(-3, -0.5, 40), -np.logspace(-300, -0.44, 60)])
    for branch, xs in ((0, xs0), (-1, xs1)):
        for x in map(float, xs):
            got = lambert_w(x, branch)
            assert abs(got - _mp_w(x, branch)) <= 4e-15 * max(1.0, abs(got)), (branch, x)
            assert abs(got - scipy_lambertw(x, branch).real) <= 1e-12 * max(1.0, abs(got)), (branch, x)


def test_lambert_w_near_the_branch_point():
    """W is ill-conditioned there (dW/dx ~ 1/p, p = sqrt(2 (e x + 1))): error within a few 1e-16 / p."""
    for x in map(float, -math.exp(-1) + np.logspace(-15, -3, 40)):
        p = float(mpmath.sqrt(2 * (mpmath.e * mpmath.mpf(x) + 1)))
        for branch in (0, -1):
            assert abs(lambert_w(x, branch) - _mp_w(x, branch)) <= 5e-16 / p, (branch, x)
    assert lambert_w(-math.exp(-1), 0) == pytest.approx(-1.0, abs=1e-7)
    assert lambert_w(0.0) == 0.0 and lambert_w(math.e) == pytest.approx(1.0, rel=1e-15)


def test_lambert_w_domain_errors():
    with pytest.raises(ValueError, match="outside the real domain"):
        lambert_w(-0.4)
    with pytest.raises(ValueError, match="branch -1 needs"):
        lambert_w(0.5, -1)
    with pytest.raises(ValueError, match="branch must be"):
        lambert_w(0.5, 1)


def test_bounds_define_the_clip_set():
    """w inside [l, u] <=> D(w) <= delta, on a dense grid, for every ratio measure (closed forms
    tested against a condition the measure computes itself)."""
    w = torch.exp(torch.linspace(-3, 3, 20001, dtype=torch.float64))
    for measure in ("ratio", "k1", "k2", "k3", "reverse_k3"):
        for delta in (0.01, 0.05, 0.3):
            low, high = ratio_bounds(measure, delta)
            inside = (w >= low) & (w <= high)
            assert torch.equal(inside, get_divergence(measure).of_ratio(w) <= delta), (measure, delta)
