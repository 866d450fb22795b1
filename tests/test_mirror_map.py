"""The neural mirror map: 380 parameters, closed-form antiderivatives, h' and h'' by autograd,
convexity (D >= 0), and the special cases h = y^2 (ProbL2) and h = y log y - y (KL)."""
import math

import pytest
import torch

from megadiv.divergence.full_vocab import FullKL, FullMirrorBregman, FullProbL2
from megadiv.divergence.mirror_map import (
    GROUPS,
    LOG_EPS,
    NEURONS_PER_GROUP,
    NUM_PARAMETERS,
    NeuralMirrorMap,
    _act,
    _mean_act,
)

F64 = torch.float64


def mirror(seed: int, scale: float = 0.01) -> NeuralMirrorMap:
    return NeuralMirrorMap(init_scale=scale, generator=torch.Generator().manual_seed(seed))


def only(**values) -> NeuralMirrorMap:
    """A mirror map with every parameter 0 except the named scalars (a, c)."""
    vec = torch.zeros(NUM_PARAMETERS, dtype=F64)
    vec[-2], vec[-1] = values.get("a", 0.0), values.get("c", 0.0)
    return NeuralMirrorMap().from_vector(vec)


def test_parameter_count_and_vector_round_trip():
    m = mirror(0)
    assert NUM_PARAMETERS == 380 == sum(p.numel() for p in m.parameters())
    assert len(GROUPS) * NEURONS_PER_GROUP == 126
    vec = torch.rand(380, dtype=F64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mirror(2).from_vector(vec).to_vector(), vec)
    vec[[0, 200, 379]] = -1.0                         # outside the convex (nonnegative) orthant: refused
    with pytest.raises(ValueError, match=r"negative parameters at indices \[0, 200, 379\]"):
        mirror(2).from_vector(vec)
    vec[[0, 200, 379]] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        mirror(2).from_vector(vec)
    with pytest.raises(ValueError, match="380"):
        m.from_vector(torch.zeros(379))


# G with G' = act, the textbook antiderivatives: an independent reference for H = (G(u) - G(b)) / w.
ANTIDERIVATIVES = {
    "cube": lambda u: u ** 4 / 4,
    "square": lambda u: u ** 3 / 3,
    "sqrt": lambda u: 2 / 3 * u ** 1.5,
    "cbrt": lambda u: 3 / 4 * u ** (4 / 3),
    "log": lambda u: (u + LOG_EPS) * torch.log(u + LOG_EPS) - u,
    "exp": torch.exp,
}


@pytest.mark.parametrize("group", GROUPS)
def test_antiderivative_closed_forms(group):
    g = torch.Generator().manual_seed(3)
    y = torch.rand(200, 1, generator=g, dtype=F64)
    w = 0.1 + 2 * torch.rand(7, generator=g, dtype=F64)
    b = torch.cat([torch.zeros(1, dtype=F64), 2 * torch.rand(6, generator=g, dtype=F64)])
    u = y * w + b                                                     # [200, 7]
    H = y * _mean_act(group, u, b)
    G = ANTIDERIVATIVES[group]
    torch.testing.assert_close(H, (G(u) - G(b)) / w, rtol=1e-12, atol=1e-14)
    # w -> 0 (no division by w in the closed form): H(y) = act(b) y exactly
    zero_w = y * _mean_act(group, torch.zeros(1, dtype=F64) * y + b, b)
    torch.testing.assert_close(zero_w, y * _act(group, b), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_h_prime_and_h_second_are_derivatives(scale):
    m = mirror(4, scale)
    y = torch.cat([torch.logspace(-9, 0, 60, dtype=F64), torch.rand(40, dtype=F64)]).requires_grad_()
    h = m.h(y)
    (dh,) = torch.autograd.grad(h.sum(), y)
    torch.testing.assert_close(dh, m.h_prime(y).detach(), rtol=1e-10, atol=1e-12)
    (d2h,) = torch.autograd.grad(m.h_prime(y).sum(), y)
    torch.testing.assert_close(d2h, m.h_second(y).detach(), rtol=1e-10, atol=1e-12)
    assert (m.h_second(y) > 0).all()                                   # convex


@pytest.mark.parametrize("scale", [0.01, 0.5, 3.0])
def test_bregman_is_nonnegative_and_zero_on_the_diagonal(scale):
    g = torch.Generator().manual_seed(5)
    m = mirror(6, scale)
    p = torch.softmax(4 * torch.randn(64, 50, generator=g, dtype=F64), -1)
    q = torch.softmax(4 * torch.randn(64, 50, generator=g, dtype=F64), -1)
    d = m.bregman(p, q)
    assert d.min() >= -1e-12 * m.h(p).abs().max()
    assert d.sum() > 0
    torch.testing.assert_close(m.bregman(p, p), torch.zeros_like(p), rtol=0, atol=1e-15)


def test_special_cases_prob_l2_and_kl():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(8, 30, generator=g, dtype=F64), -1)
    q = torch.softmax(torch.randn(8, 30, generator=g, dtype=F64), -1)
    torch.testing.assert_close(only(a=2.0).bregman(p, q), (p - q) ** 2, rtol=1e-12, atol=1e-15)
    # h = y log y - y: D = p log(p/q) - p + q, whose sum over a distribution is KL(p || q)
    torch.testing.assert_close(only(c=1.0).bregman(p, q), p * torch.log(p / q) - p + q,
                               rtol=1e-10, atol=1e-15)


def test_full_mirror_reduces_to_full_prob_l2_and_full_kl():
    """The full-vocabulary measures agree where their mirror maps coincide (moderate logits, so
    no probability reaches the 1e-10 clamp)."""
    g = torch.Generator().manual_seed(8)
    z, zb = (torch.randn(9, 40, generator=g, dtype=F64) for _ in range(2))
    for h, other in ((only(a=2.0), FullProbL2()), (only(c=1.0), FullKL())):
        z1, zb1 = z.clone().requires_grad_(), zb.clone().requires_grad_()
        z2, zb2 = z.clone().requires_grad_(), zb.clone().requires_grad_()
        d1, d2 = FullMirrorBregman(h, chunk_size=4)(z1, zb1), other(z2, zb2)
        torch.testing.assert_close(d1, d2, rtol=1e-10, atol=1e-14)
        d1.sum().backward()
        d2.sum().backward()
        torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-13)
        torch.testing.assert_close(zb1.grad, zb2.grad, rtol=1e-9, atol=1e-13)


def test_vector_is_float64_and_sets_the_measure():
    """An outer search sets the map through from_vector and the measure changes accordingly."""
    h = mirror(9)
    measure = FullMirrorBregman(h)
    z, zb = torch.randn(3, 20, dtype=F64), torch.randn(3, 20, dtype=F64)
    before = measure(z, zb)
    h.from_vector(h.to_vector() * 2)
    assert h.to_vector().dtype == F64
    assert not torch.allclose(before, measure(z, zb))
    assert math.isfinite(float(measure(z.float(), zb.float()).sum()))


# --------------------------------------------------------------------------- the run's fixed map


def test_config_builds_the_same_map_from_its_own_generator(tmp_path):
    from megadiv.divergence.mirror_map import MirrorMapConfig, build_mirror_map, save_vector

    torch.manual_seed(0)
    first = MirrorMapConfig(seed=7).vector()
    build_mirror_map.cache_clear()
    torch.manual_seed(1)                                   # the global RNG plays no part
    assert torch.equal(MirrorMapConfig(seed=7).vector(), first)
    assert torch.equal(first, mirror(7).to_vector())       # rand * 0.01 from Generator(seed)
    assert not torch.equal(MirrorMapConfig(seed=8).vector(), first)
    assert torch.equal(MirrorMapConfig().vector(), mirror(42).to_vector())   # default seed 42
    # params files: JSON list (bit-exact round trip) and torch tensor; params overrides seed
    vec = torch.rand(380, dtype=F64, generator=torch.Generator().manual_seed(3)) * 1e3
    save_vector(vec, tmp_path / "m.json")
    torch.save(vec, tmp_path / "m.pt")
    for name in ("m.json", "m.pt"):
        assert torch.equal(MirrorMapConfig(seed=1, params=str(tmp_path / name)).vector(), vec)


@pytest.mark.parametrize("content, match", [
    ("[1.0, 2.0]", "expected 380 parameters"),
    ("[" + ", ".join(["0.1"] * 379 + ["-0.5"]) + "]", r"negative parameters at indices \[379\]"),
    ('{"v": 1}', "exactly the keys v, w, b, a, c"),
    ('"text"', "expected a list"),
    ("not json", "not JSON"),
])
def test_config_refuses_bad_or_non_convex_params(tmp_path, content, match):
    from megadiv.divergence.mirror_map import MirrorMapConfig

    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        MirrorMapConfig(params=str(path))
    with pytest.raises(ValueError, match="no file"):
        MirrorMapConfig(params=str(tmp_path / "missing.json"))


def _sampled(h, p, q):
    from megadiv.divergence import get_divergence

    return get_divergence("sampled_mirror", mirror_map=h)(p.log(), q.log())


def test_sampled_mirror_closed_forms():
    """a = 1 alone: h = y^2 / 2, D = (p - q)^2 / 2; c = 1 alone: h = y log y - y,
    D = p log(p/q) - p + q; both to 1e-12 in float64 (the observed error is ~1e-17)."""
    g = torch.Generator().manual_seed(11)
    p, q = (torch.rand(500, generator=g, dtype=F64) * 0.999 + 1e-3 for _ in range(2))
    torch.testing.assert_close(_sampled(only(a=1.0), p, q), (p - q) ** 2 / 2, rtol=0, atol=1e-12)
    torch.testing.assert_close(_sampled(only(c=1.0), p, q), p * torch.log(p / q) - p + q, rtol=0, atol=1e-12)


def test_sampled_mirror_general_h_by_quadrature_and_its_gradient():
    """A map with every neuron active (scale 1) against integral_q^p h''(t) (p - t) dt in mpmath,
    and the gradient against dD/dlogp = p (h'(p) - h'(q)), dD/dlogq = -q h''(q) (p - q)."""
    from tests.test_divergence_measures import mirror_bregman_by_quadrature

    h = mirror(12, scale=1.0)
    p = torch.tensor([0.9, 0.05, 0.4, 1e-4], dtype=F64)
    q = torch.tensor([0.2, 0.6, 0.41, 0.3], dtype=F64)
    want = torch.tensor([mirror_bregman_by_quadrature(h.to_vector().tolist(), a, b)
                         for a, b in zip(p.tolist(), q.tolist())], dtype=F64)
    logp, logq = p.log().requires_grad_(), q.log().requires_grad_()
    from megadiv.divergence import get_divergence
    d = get_divergence("sampled_mirror", mirror_map=h)(logp, logq)
    torch.testing.assert_close(d.detach(), want, rtol=1e-12, atol=1e-15)
    d.sum().backward()
    torch.testing.assert_close(logp.grad, p * (h.h_prime(p) - h.h_prime(q)), rtol=1e-13, atol=0)
    torch.testing.assert_close(logq.grad, -q * h.h_second(q) * (p - q), rtol=1e-13, atol=0)


def test_mirror_measures_take_the_loss_configs_map(tmp_path):
    """loss.mirror_map reaches sampled_mirror (regularizer and clip measure) and full_mirror; it is
    rejected when no mirror measure is configured."""
    from megadiv.divergence import PolicyLossConfig
    from megadiv.divergence.mirror_map import MirrorMapConfig, save_vector

    vec = torch.zeros(380, dtype=F64)
    vec[-2] = 1.0                                            # h = y^2 / 2
    save_vector(vec, tmp_path / "a.json")
    mm = MirrorMapConfig(params=str(tmp_path / "a.json"))
    for reg in ("sampled_mirror", "full_mirror"):
        cfg = PolicyLossConfig(regularizer=reg, regularizer_coef=1e-4, mirror_map=mm)
        assert torch.equal(cfg.divergence(reg).mirror_map.to_vector(), vec)
    clip = PolicyLossConfig(policy_loss="divergence_clip", measure="sampled_mirror", mirror_map=mm)
    assert torch.equal(clip.divergence("sampled_mirror").mirror_map.to_vector(), vec)
    with pytest.raises(ValueError, match="mirror_map is set but neither"):
        PolicyLossConfig(regularizer="sampled_prob_l2", regularizer_coef=1e-4, mirror_map=MirrorMapConfig(seed=1))


# --------------------------------------------------------------------------- the authors' map, draw for draw


def _authors_draws(seed: int, init_scale: float = 0.01) -> torch.Tensor:
    """The GBMPO authors' NeuralMirrorModule init (neural_mirror_grpo.py), on the global RNG as
    they do it: manual_seed, float32 rand(126) * scale for v, w, b, rand(1) * scale for a, c."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        v, w, b = (torch.rand(126) * init_scale for _ in range(3))
        a, c = (torch.rand(1) * init_scale for _ in range(2))
    return torch.cat([v, w, b, a, c]).to(F64)


def test_seed_42_is_the_authors_float32_draws():
    from megadiv.divergence.mirror_map import MirrorMapConfig, build_mirror_map

    build_mirror_map.cache_clear()
    want = _authors_draws(42)
    got = MirrorMapConfig(seed=42).vector()
    assert torch.equal(got, want)                        # bit for bit: float32 draws, float32 product, then float64
    assert float(got[0]) == float(torch.tensor(want[0].item(), dtype=torch.float32))
    assert torch.equal(MirrorMapConfig(seed=7).vector(), _authors_draws(7))
    assert torch.equal(NeuralMirrorMap(init_scale=0.5, generator=torch.Generator().manual_seed(3)).to_vector(),
                       _authors_draws(3, 0.5))


def _authors_dict(vec: torch.Tensor) -> dict:
    """Their es_utils.phi_to_mirror_params: float32 tensors v[126], w[126], b[126], a[1], c[1]."""
    return {"v": vec[:126].float(), "w": vec[126:252].float(), "b": vec[252:378].float(),
            "a": vec[378:379].float(), "c": vec[379:380].float()}


def test_authors_dict_file_loads(tmp_path):
    import json

    from megadiv.divergence.mirror_map import MirrorMapConfig

    vec = _authors_draws(5)                               # float32 values: the dict holds them exactly
    torch.save(_authors_dict(vec), tmp_path / "best_mirror_map_params.pt")
    assert torch.equal(MirrorMapConfig(params=str(tmp_path / "best_mirror_map_params.pt")).vector(), vec)
    (tmp_path / "m.json").write_text(json.dumps({k: t.tolist() for k, t in _authors_dict(vec).items()}))
    assert torch.equal(MirrorMapConfig(params=str(tmp_path / "m.json")).vector(), vec)
    bad = _authors_dict(vec)
    bad["a"] = torch.zeros(2)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="entry 'a' has 2 numbers, expected 1"):
        MirrorMapConfig(params=str(tmp_path / "bad.pt"))


def _authors_bregman(vec: list[float], y: float, y0: float) -> float:
    """Their NeuralMirrorModule.bregman_divergence, neuron by neuron, in plain float64 Python
    (an independent reference: primitive with the 1/w division and the |w| < 1e-12 case)."""
    v, w, b, a, c = vec[:126], vec[126:252], vec[252:378], vec[378], vec[379]
    eps = 1e-3

    def act(j, x):
        u = w[j] * x + b[j]
        up = max(u, 0.0)
        return [u ** 3, u ** 2, up ** 0.5, up ** (1 / 3), math.log(up + eps), math.exp(u)][j // 21]

    def prim(j, x):
        if abs(w[j]) < 1e-12:
            return act(j, x) * x
        u = w[j] * x + b[j]
        up, us = max(u, 0.0), max(u, 0.0) + eps
        return [u ** 4 / 4, u ** 3 / 3, 2 / 3 * up ** 1.5, 3 / 4 * up ** (4 / 3), us * math.log(us) - us,
                math.exp(u)][j // 21] / w[j]

    d = sum(v[j] * (prim(j, y) - prim(j, y0) - act(j, y0) * (y - y0)) for j in range(126))
    return d + a / 2 * (y - y0) ** 2 + c * (y * math.log(y / y0) - (y - y0))


def test_nonconvex_maps_load_only_when_allowed_and_match_the_authors_divergence(tmp_path):
    """An ES-learned map of theirs is about half negative: refused by default; with
    allow_nonconvex it loads (with a warning) and D equals their bregman_divergence, negative values
    included."""
    import numpy as np

    from megadiv.divergence.mirror_map import MirrorMapConfig, build_mirror_map
    vec = torch.from_numpy(np.random.RandomState(42).randn(380) * 0.5)   # their ES start's shape, scaled up
    torch.save(_authors_dict(vec), tmp_path / "learned.pt")
    vec = vec.float().to(F64)
    with pytest.raises(ValueError, match="negative parameters .*allow_nonconvex"):
        MirrorMapConfig(params=str(tmp_path / "learned.pt"))
    with pytest.warns(UserWarning, match="D may be negative"):
        cfg = MirrorMapConfig(params=str(tmp_path / "learned.pt"), allow_nonconvex=True)
    build_mirror_map.cache_clear()
    h = build_mirror_map(cfg)
    assert torch.equal(h.to_vector(), vec) and not h.convex
    p = torch.tensor([0.9, 0.05, 0.4, 1e-4, 0.7, 0.3], dtype=F64)
    q = torch.tensor([0.2, 0.6, 0.41, 0.3, 0.69, 0.9], dtype=F64)
    want = torch.tensor([_authors_bregman(vec.tolist(), a, b) for a, b in zip(p.tolist(), q.tolist())], dtype=F64)
    got = h.bregman(p, q)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)   # 5.7e-14 relative observed (division by w)
    assert (got < 0).any()                                          # not a divergence any more
    with pytest.raises(ValueError, match="allow_nonconvex needs loss.mirror_map.params"):
        MirrorMapConfig(allow_nonconvex=True)
