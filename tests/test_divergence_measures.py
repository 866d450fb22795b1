"""Every registered token measure against its closed form, its gradient (float64 gradcheck) and
the ratio-measure contract. Parametrised over the registry, so a new measure is picked up
automatically (and fails ``test_every_token_measure_has_a_closed_form`` until its closed form is
written down here). Full-vocabulary measures are tested by tests/test_vocab_parallel*.py."""
import ast
import math
import pathlib

import pytest
import torch

import megadiv.divergence
from megadiv.divergence import (
    DIVERGENCES,
    RatioDivergence,
    TokenDivergence,
    VocabDivergence,
    get_divergence,
    names_of_kind,
    ratio_bounds,
    register_divergence,
)

# Independent closed forms on Python floats: p, q are the probabilities of the sampled token
# under the current and the base policy, w = p / q.
CLOSED_FORMS = {
    "ratio": lambda p, q: abs(p / q - 1),
    "k1": lambda p, q: -math.log(p / q),
    "k2": lambda p, q: math.log(p / q) ** 2 / 2,
    "k3": lambda p, q: (p / q - 1) - math.log(p / q),
    "reverse_k3": lambda p, q: (q / p - 1) - math.log(q / p),
    "sampled_prob_l2": lambda p, q: (p - q) ** 2,
    # D_h(p || q) = integral_q^p h''(t) (p - t) dt for the default map (seed 42), by quadrature
    "sampled_mirror": lambda p, q: mirror_bregman_by_quadrature(default_mirror_vector(), p, q),
}


def default_mirror_vector():
    from megadiv.divergence.mirror_map import MirrorMapConfig
    return MirrorMapConfig().vector().tolist()


def mirror_bregman_by_quadrature(vec, p, q, dps=20):
    """D_h(p || q) from h'' written out in mpmath (activations' derivatives by hand: an independent
    reference for the closed-form antiderivatives): v, w, b = vec[0:126], [126:252], [252:378]."""
    import mpmath
    with mpmath.workdps(dps):
        v, w, b = vec[0:126], vec[126:252], vec[252:378]
        a, c = mpmath.mpf(vec[378]), mpmath.mpf(vec[379])
        slopes = (lambda u: 3 * u * u, lambda u: 2 * u, lambda u: 1 / (2 * mpmath.sqrt(u)),
                  lambda u: 1 / (3 * mpmath.cbrt(u) ** 2), lambda u: 1 / (u + mpmath.mpf("1e-3")), mpmath.exp)
        terms = [(mpmath.mpf(v[j]) * mpmath.mpf(w[j]), mpmath.mpf(w[j]), mpmath.mpf(b[j]), slopes[j // 21])
                 for j in range(126) if v[j] * w[j] != 0]

        def h2(t):
            return a + c / t + sum(vw * act1(wj * t + bj) for vw, wj, bj, act1 in terms)
        p, q = mpmath.mpf(p), mpmath.mpf(q)
        return float(mpmath.quad(lambda t: h2(t) * (p - t), [q, p]))


TOKEN = names_of_kind(TokenDivergence)
RATIO = names_of_kind(RatioDivergence)


def _logps(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    logp_base = torch.log(torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    return logp, logp_base


def test_registry_kinds_and_duplicates():
    assert {"ratio", "k1", "k2", "k3", "reverse_k3"} <= set(RATIO)
    assert "sampled_prob_l2" in TOKEN and "sampled_prob_l2" not in RATIO
    for name, cls in DIVERGENCES.items():
        assert cls.name == name and issubclass(cls, (TokenDivergence, VocabDivergence))
    with pytest.raises(ValueError, match="already registered"):
        register_divergence("k3")(type("Again", (RatioDivergence,), {}))
    with pytest.raises(KeyError, match="unknown divergence"):
        get_divergence("no_such_measure")


def test_every_token_measure_has_a_closed_form():
    missing = set(TOKEN) - set(CLOSED_FORMS)
    assert not missing, f"add the closed form of {sorted(missing)} to CLOSED_FORMS"


@pytest.mark.parametrize("name", TOKEN)
def test_closed_form(name):
    n = 16 if DIVERGENCES[name].uses_mirror_map else 64   # the mirror reference is a quadrature (~1 s each)
    logp, logp_base = _logps(n)
    got = get_divergence(name)(logp, logp_base)
    want = torch.tensor([CLOSED_FORMS[name](math.exp(a), math.exp(b))
                         for a, b in zip(logp.tolist(), logp_base.tolist())], dtype=torch.float64)
    assert got.shape == logp.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # elementwise on any shape, and float32 in -> float32 out
    got2d = get_divergence(name)(logp.view(4, -1).float(), logp_base.view(4, -1).float())
    assert got2d.dtype == torch.float32
    torch.testing.assert_close(got2d, want.view(4, -1).float(), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", TOKEN)
def test_zero_between_equal_policies(name):
    logp, _ = _logps()
    assert torch.equal(get_divergence(name)(logp, logp), torch.zeros_like(logp))


@pytest.mark.parametrize("name", TOKEN)
def test_gradcheck(name):
    logp, logp_base = _logps(12)
    m = get_divergence(name)
    assert torch.autograd.gradcheck(m, (logp.requires_grad_(), logp_base.requires_grad_()))
    if not m.uses_mirror_map:  # the mirror measures define exact first derivatives only (no Hessian)
        assert torch.autograd.gradgradcheck(m, (logp, logp_base))


def test_small_log_ratio_accuracy():
    """Near t = 0 the expm1 forms keep the absolute error at a few ulp of t (not of 1):
    k3(t) = e^t - 1 - t = sum_{n>=2} t^n / n!, and reverse_k3(t) = k3(-t)."""
    t = torch.tensor([1e-8, -1e-8, 1e-5, -1e-5, 1e-3], dtype=torch.float64)

    def k3_series(t):
        return sum(t ** n / math.factorial(n) for n in range(2, 7))
    for name, want in (("k3", k3_series(t)), ("reverse_k3", k3_series(-t))):
        err = (get_divergence(name).of_log_ratio(t) - want).abs()
        assert bool((err <= 4e-16 * t.abs()).all()), (name, err / t.abs())


@pytest.mark.parametrize("name", RATIO)
def test_of_ratio_matches_forward(name):
    logp, logp_base = _logps()
    m = get_divergence(name)
    torch.testing.assert_close(m.of_ratio(torch.exp(logp - logp_base)), m(logp, logp_base), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", RATIO)
def test_ratio_contract_sublevel_sets_are_intervals(name):
    """f(0) = 0 and max(f, 0) never decreases moving away from t = 0 on either side, i.e. every
    {t : f(t) <= delta} is an interval around 0 (what makes D <= delta a ratio interval)."""
    m = get_divergence(name)
    assert float(m.of_log_ratio(torch.zeros((), dtype=torch.float64))) == 0.0
    out = torch.linspace(0, 30, 3001, dtype=torch.float64)
    for side in (out, -out):
        f = m.of_log_ratio(side).clamp(min=0)
        assert bool((f[1:] >= f[:-1]).all()), f"{name}: sublevel sets are not intervals"


@pytest.mark.parametrize("name", RATIO)
@pytest.mark.parametrize("delta", [1e-6, 0.01, 0.0231, 0.05, 0.3, 1.0, 5.0])
def test_ratio_interval_closed_form_matches_bisection(name, delta):
    """The class's closed form (if any) against the generic float64 bisection on of_log_ratio."""
    m = get_divergence(name)
    closed = m.ratio_interval(delta)
    numeric = RatioDivergence.ratio_interval(m, delta)
    for c, n in zip(closed, numeric):
        assert c == n or math.isclose(c, n, rel_tol=1e-13, abs_tol=1e-15), (closed, numeric)


@pytest.mark.parametrize("name", RATIO)
@pytest.mark.parametrize("delta", [1e-4, 0.02, 0.2, 2.0])
def test_ratio_interval_edges(name, delta):
    """D = delta at each finite, nonzero edge; D <= delta just inside, D > delta just outside."""
    low, high = ratio_bounds(name, delta)
    m = get_divergence(name)
    assert 0 <= low < 1 < high
    for edge, inward in ((low, 1 + 1e-9), (high, 1 - 1e-9)):
        if edge in (0.0, math.inf):
            continue
        w = torch.tensor([edge, edge * inward, edge / inward], dtype=torch.float64)
        d = m.of_ratio(w)
        assert math.isclose(float(d[0]), delta, rel_tol=1e-9)
        assert float(d[1]) <= delta < float(d[2])


@pytest.fixture
def scratch_measure():
    """A measure registered only for one test: |log w|, whose interval is [e^-delta, e^delta]."""
    @register_divergence("scratch_abs_log")
    class AbsLog(RatioDivergence):
        def of_log_ratio(self, t):
            return t.abs()
    yield "scratch_abs_log"
    del DIVERGENCES["scratch_abs_log"]
    ratio_bounds.cache_clear()


def test_new_measure_is_one_class(scratch_measure):
    """A registered class gets forward, of_ratio and exact ratio bounds with no more code."""
    low, high = ratio_bounds(scratch_measure, 0.3)
    assert math.isclose(low, math.exp(-0.3), rel_tol=1e-15) and math.isclose(high, math.exp(0.3), rel_tol=1e-15)
    logp, logp_base = _logps()
    torch.testing.assert_close(get_divergence(scratch_measure)(logp, logp_base), (logp - logp_base).abs())



def test_divergence_imports_nothing_else_from_megadiv():
    """The library is pure torch: no module of megadiv/divergence imports another megadiv package."""
    root = pathlib.Path(megadiv.divergence.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] != "megadiv" or name.startswith("megadiv.divergence"), (path.name, name)
