"""GBMPO's neural mirror map: a learnable convex h whose Bregman divergence regularises the policy.

The mirror map is separable, phi(p) = sum_v h(p_v), with (methods.md section 2)

    h(y)   = sum_j v_j H_j(y) + (a/2) y^2 + c (y log y - y)
    h'(y)  = sum_j v_j act_j(w_j y + b_j) + a y + c log y
    h''(y) = sum_j v_j w_j act_j'(w_j y + b_j) + a + c / y

over 126 neurons j in six activation groups of 21: x^3, x^2, sqrt(x_+), cbrt(x_+),
log(x_+ + 1e-3), e^x. H_j is the antiderivative of y -> act_j(w_j y + b_j) with H_j(0) = 0.
With u = w y + b and G an antiderivative of act, H_j(y) = (G(u) - G(b)) / w = y * m(u, b), where
m(u, b) = (G(u) - G(b)) / (u - b) is G's divided difference (the mean of act over [b, u]).
Written in closed form without the division by w (exact at w = 0, no cancellation for small w):

    x^3             m = (u^3 + u^2 b + u b^2 + b^3) / 4
    x^2             m = (u^2 + u b + b^2) / 3
    sqrt(x)         m = (2/3) (u + sqrt(u b) + b) / (sqrt u + sqrt b)
    cbrt(x)         m = (3/4) (r^3 + r^2 s + r s^2 + s^3) / (r^2 + r s + s^2),  r = u^(1/3), s = b^(1/3)
    log(x + e)      m = log(u + e) - 1 + log1p(t) / t,  t = (u - b) / (b + e)
    e^x             m = e^b expm1(u - b) / (u - b)

h is convex when all parameters are nonnegative: then u >= 0 for y > 0, every act_j is
nondecreasing there, and h'' >= 0 term by term. By default the parameters must lie in that orthant
(``from_vector`` refuses anything else rather than projecting it silently), which is also where
the closed forms above hold (the x_+ of sqrt, cbrt and log never clips). The Bregman divergence is
D(p || q) = h(p) - h(q) - h'(q) (p - q), with probabilities clamped at 1e-10 (log y, c / y).

Maps with negative entries (the GBMPO authors' ES does not constrain the sign; about half of a
learned map is negative) load only with ``loss.mirror_map.allow_nonconvex``. h is then not convex
and D may be negative. Such a map is evaluated as the authors' code does: H_j = (G(u) - G(b)) / w
with G their primitive ((2/3) u_+^{3/2}, (3/4) u_+^{4/3}, u_s log u_s - u_s with u_s = u_+ + 1e-3,
...), a division instead of the closed forms (which need u, b >= 0). Where u < 0 in the log group
their primitive is flat while the activation is log(1e-3); D keeps that, as theirs does.

A run's map is fixed: :class:`MirrorMapConfig` (``loss.mirror_map``) draws it as the authors do
(``torch.manual_seed(seed)``; float32 ``rand(126) * 0.01`` for v, then w, then b, then
``rand(1) * 0.01`` for a, then c; cast to float64 after drawing), here from a generator of its own
seeded the same way (the same stream, the global RNG untouched), or loads it from a file, so that
every rank, every step and a resumed run use the same h.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GROUPS = ("cube", "square", "sqrt", "cbrt", "log", "exp")
NEURONS_PER_GROUP = 21
LOG_EPS = 1e-3
PROB_FLOOR = 1e-10
NUM_PARAMETERS = 3 * len(GROUPS) * NEURONS_PER_GROUP + 2      # v, w, b per neuron; a; c = 380
INIT_SCALE = 0.01                                              # the authors' init: rand * 0.01


def _over(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den for den >= 0 where den = 0 only with num = 0 (the limit there is 0)."""
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)


def _ratio_at_zero_one(fn, t: torch.Tensor) -> torch.Tensor:
    """fn(t) / t for t >= 0 with fn(t) ~ t at 0 (log1p, expm1): the t -> 0 limit 1 comes out of
    evaluating at the smallest normal float instead of 0 (fn(tiny) = tiny exactly)."""
    t = t.clamp_min(torch.finfo(t.dtype).tiny)
    return fn(t) / t


def _act(group: str, u: torch.Tensor) -> torch.Tensor:
    if group == "cube":
        return u * u * u
    if group == "square":
        return u * u
    if group == "sqrt":
        return u.clamp_min(0).sqrt()
    if group == "cbrt":
        return u.clamp_min(0).pow(1.0 / 3.0)
    if group == "log":
        return torch.log(u.clamp_min(0) + LOG_EPS)
    return torch.exp(u)


def _act_derivative(group: str, u: torch.Tensor) -> torch.Tensor:
    """act'(u); 0 where the x_+ clamp of sqrt, cbrt and log is active (u < 0, nonconvex maps only).
    At u = 0 the sqrt/cbrt slopes are infinite and reported as 0 (only reached when w = b = 0,
    where the neuron's w-weighted contribution vanishes anyway)."""
    if group == "cube":
        return 3 * u * u
    if group == "square":
        return 2 * u
    up = u.clamp_min(0)
    if group == "sqrt":
        return _over(torch.ones_like(u), 2 * up.sqrt()).masked_fill_(u <= 0, 0)
    if group == "cbrt":
        return _over(torch.ones_like(u), 3 * up.pow(2.0 / 3.0)).masked_fill_(u <= 0, 0)
    if group == "log":
        return (1 / (up + LOG_EPS)).masked_fill_(u < 0, 0)
    return torch.exp(u)


def _mean_act(group: str, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(G(u) - G(b)) / (u - b), G' = act, for u >= b >= 0 (see the module docstring)."""
    if group == "cube":
        return (u + b) * (u * u + b * b) / 4              # u^3 + u^2 b + u b^2 + b^3 factored
    if group == "square":
        return (u * u + u * b + b * b) / 3
    if group == "sqrt":
        ru, rb = u.sqrt(), b.sqrt()
        return _over(2 * (u + ru * rb + b), 3 * (ru + rb))
    if group == "cbrt":
        r, s = u.pow(1.0 / 3.0), b.pow(1.0 / 3.0)
        return _over(3 * (r + s) * (r * r + s * s), 4 * (r * r + r * s + s * s))
    if group == "log":
        return torch.log(u + LOG_EPS) - 1 + _ratio_at_zero_one(torch.log1p, (u - b) / (b + LOG_EPS))
    return torch.exp(b) * _ratio_at_zero_one(torch.expm1, u - b)


def _authors_primitive(group: str, u: torch.Tensor) -> torch.Tensor:
    """The GBMPO authors' G(u) (their ``primitive`` times w), defined for any sign of u."""
    up = u.clamp_min(0)
    if group == "cube":
        return u ** 4 / 4
    if group == "square":
        return u ** 3 / 3
    if group == "sqrt":
        return (2.0 / 3.0) * up.pow(1.5)
    if group == "cbrt":
        return 0.75 * up.pow(4.0 / 3.0)
    if group == "log":
        us = up + LOG_EPS
        return us * torch.log(us) - us
    return torch.exp(u)


def _mean_act_any_sign(group: str, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(G(u) - G(b)) / (u - b) for parameters of any sign (nonconvex maps), by division as the
    authors compute it; act(b) where u = b (their w = 0 case)."""
    d = u - b
    same = d == 0
    return torch.where(same, _act(group, b),
                       (_authors_primitive(group, u) - _authors_primitive(group, b)) / torch.where(same, 1, d))


class NeuralMirrorMap(nn.Module):
    """The 380-parameter separable convex mirror map; parameters are set by an outer search
    (evolution strategies) through ``to_vector`` / ``from_vector``, not by gradient descent.

    ``v``, ``w``, ``b``: [6, 21] (group-major, groups in ``GROUPS`` order, the authors' neuron
    order 0-125); ``a``, ``c``: scalars. Drawn as the authors draw them: float32 ``rand(126) *
    init_scale`` for v, then w, then b, float32 ``rand(1) * init_scale`` for a, then c (the product
    taken in float32), then cast to float64.
    """

    def __init__(self, init_scale: float = INIT_SCALE, generator: torch.Generator | None = None):
        super().__init__()
        shape = (len(GROUPS), NEURONS_PER_GROUP)

        def param(n: int, shape: tuple[int, ...]):
            drawn = torch.rand(n, generator=generator, dtype=torch.float32) * init_scale
            return nn.Parameter(drawn.to(torch.float64).reshape(shape), requires_grad=False)
        n = len(GROUPS) * NEURONS_PER_GROUP
        self.v, self.w, self.b = param(n, shape), param(n, shape), param(n, shape)
        self.a, self.c = param(1, ()), param(1, ())
        self.convex = True

    def to_vector(self) -> torch.Tensor:
        """[380] float64: v, w, b (each flattened group-major), a, c."""
        return torch.cat([self.v.flatten(), self.w.flatten(), self.b.flatten(),
                          self.a.reshape(1), self.c.reshape(1)]).detach().clone()

    def from_vector(self, vec: torch.Tensor, allow_nonconvex: bool = False) -> "NeuralMirrorMap":
        """Set all parameters from a [380] vector (``to_vector`` order); see ``check_vector``."""
        vec = check_vector(vec, allow_nonconvex=allow_nonconvex)
        self.convex = bool((vec >= 0).all())
        n = self.v.numel()
        with torch.no_grad():
            for i, p in enumerate((self.v, self.w, self.b)):
                p.copy_(vec[i * n:(i + 1) * n].view_as(p))
            self.a.copy_(vec[3 * n])
            self.c.copy_(vec[3 * n + 1])
        return self

    def terms(self, y: torch.Tensor, value: bool = True, slope: bool = True,
              curvature: bool = True) -> tuple[torch.Tensor | None, ...]:
        """(h(y), h'(y), h''(y)) elementwise, each None unless asked for; y clamped at 1e-10.
        One sweep over the neurons (u = w y + b: [..., 21] per group) serves all three."""
        y = y.clamp_min(PROB_FLOOR)
        a, c = self.a.to(y.dtype), self.c.to(y.dtype)
        log_y = torch.log(y)
        h = 0.5 * a * y * y + c * (y * log_y - y) if value else None
        h1 = a * y + c * log_y if slope else None
        h2 = a + c / y if curvature else None
        mean_act = _mean_act if self.convex else _mean_act_any_sign
        for k, group in enumerate(GROUPS):
            v, w, b = (p[k].to(y.dtype) for p in (self.v, self.w, self.b))
            u = y.unsqueeze(-1) * w + b
            if value:
                h = h + y * (mean_act(group, u, b) @ v)
            if slope:
                h1 = h1 + _act(group, u) @ v
            if curvature:
                h2 = h2 + _act_derivative(group, u) @ (v * w)
        return h, h1, h2

    def h(self, y: torch.Tensor) -> torch.Tensor:
        return self.terms(y, slope=False, curvature=False)[0]

    def h_prime(self, y: torch.Tensor) -> torch.Tensor:
        return self.terms(y, value=False, curvature=False)[1]

    def h_second(self, y: torch.Tensor) -> torch.Tensor:
        return self.terms(y, value=False, slope=False)[2]

    def bregman(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Elementwise D(p || q) = h(p) - h(q) - h'(q) (p - q) of probabilities (clamped at 1e-10);
        differentiable by autograd (GBMPO's sampled-token form applies it to p_t, p_ref,t)."""
        p, q = p.clamp_min(PROB_FLOOR), q.clamp_min(PROB_FLOOR)
        h_q, slope_q, _ = self.terms(q, curvature=False)
        return self.h(p) - h_q - slope_q * (p - q)


def check_vector(vec, source: str = "mirror map", allow_nonconvex: bool = False) -> torch.Tensor:
    """``vec`` as a [380] float64 tensor, or ValueError: wrong length, a non-finite entry, or
    (unless ``allow_nonconvex``) a negative one (h would not be convex, D_h not a divergence;
    nothing is projected silently)."""
    vec = torch.as_tensor(vec, dtype=torch.float64).flatten()
    if vec.numel() != NUM_PARAMETERS:
        raise ValueError(f"{source}: expected {NUM_PARAMETERS} parameters (v, w, b, a, c), got {vec.numel()}")
    if not torch.isfinite(vec).all():
        raise ValueError(f"{source}: non-finite parameters at indices {_indices(~torch.isfinite(vec))}")
    if (vec < 0).any() and not allow_nonconvex:
        raise ValueError(f"{source}: negative parameters at indices {_indices(vec < 0)} (min {float(vec.min()):.3g}); "
                         f"h is convex only for v, w, b, a, c >= 0 (loss.mirror_map.allow_nonconvex=true loads it "
                         f"anyway, as the authors' code does)")
    return vec


def _indices(flags: torch.Tensor) -> str:
    idx = flags.nonzero().flatten().tolist()
    return f"{idx[:8]}{' ...' if len(idx) > 8 else ''} ({len(idx)} in all)"


AUTHORS_KEYS = {"v": 126, "w": 126, "b": 126, "a": 1, "c": 1}   # their parameter file, in to_vector order


def _from_authors_dict(data: dict, path: Path) -> torch.Tensor:
    """The GBMPO authors' parameter file (``best_mirror_map_params.pt``, ``mirror_map_params.pt``):
    a dict {v: [126], w: [126], b: [126], a: [1], c: [1]} of float32 tensors, joined in that order."""
    if set(data) != set(AUTHORS_KEYS):
        raise ValueError(f"{path}: a parameter dict must have exactly the keys v, w, b, a, c, got {sorted(data)}")
    parts = []
    for key, n in AUTHORS_KEYS.items():
        try:
            part = torch.as_tensor(data[key], dtype=torch.float64).flatten()
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: entry {key!r} is not a list of numbers ({e})") from e
        if part.numel() != n:
            raise ValueError(f"{path}: entry {key!r} has {part.numel()} numbers, expected {n}")
        parts.append(part)
    return torch.cat(parts)


def load_vector(path: str | Path, allow_nonconvex: bool = False) -> torch.Tensor:
    """The checked [380] vector in file ``path``: a JSON list of numbers (``mirror_map.json``), a
    torch file holding a tensor or list, or the authors' dict {v, w, b, a, c} (torch or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"mirror map parameters: no file {path}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
    else:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a file that is not its format
            raise ValueError(f"{path}: not a torch file ({type(e).__name__}: {str(e)[:120]})") from e
    if isinstance(data, dict):
        vec = _from_authors_dict(data, path)
    elif isinstance(data, (list, tuple, torch.Tensor)):
        try:
            vec = torch.as_tensor(data, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: expected a list of {NUM_PARAMETERS} numbers ({e})") from e
    else:
        raise ValueError(f"{path}: expected a list of {NUM_PARAMETERS} numbers or a dict {{v, w, b, a, c}}, "
                         f"got {type(data).__name__}")
    return check_vector(vec, str(path), allow_nonconvex)


def save_vector(vec: torch.Tensor, path: str | Path) -> None:
    """Write a [380] vector as a JSON list; Python's float repr round-trips float64 exactly. The
    sign is checked where the file is loaded (``allow_nonconvex``), not here."""
    Path(path).write_text(json.dumps([float(x) for x in check_vector(vec, allow_nonconvex=True)]) + "\n")


def fingerprint(vec: torch.Tensor) -> float:
    """One float64 that differs between maps that differ (a position-weighted sum): for checking
    that ranks or steps agree without moving 380 numbers."""
    vec = torch.as_tensor(vec, dtype=torch.float64)
    return float((vec * torch.arange(1, vec.numel() + 1, dtype=torch.float64).sqrt()).sum())


@dataclass(frozen=True)
class MirrorMapConfig:
    """The neural mirror map of ``sampled_mirror`` / ``full_mirror`` (GBMPO), fixed for the run."""

    seed: int = 42
    """The authors' init and default seed, draw for draw: torch.manual_seed(seed), then float32
    rand(126) * 0.01 for v, w, b and rand(1) * 0.01 for a, c, cast to float64 (from a generator of
    the map's own, seeded the same way: the global RNG is untouched)."""
    params: str | None = None
    """A file with the 380 parameters, overriding seed: a JSON list in NeuralMirrorMap.to_vector()
    order (v, w, b, a, c; e.g. a run's mirror_map.json or megadiv es's best_mirror_map.json), a
    torch file holding such a list, or the authors' dict {v, w, b, a, c} (best_mirror_map_params.pt).
    All must be >= 0 unless allow_nonconvex."""
    allow_nonconvex: bool = False
    """Load a map with negative entries (the authors' ES does not constrain the sign). h is then
    not convex and D may be NEGATIVE, so the 'regulariser' can reward moving away from the
    reference; a warning says so at load."""

    def __post_init__(self):
        if self.params is not None:
            vec = load_vector(self.params, self.allow_nonconvex)  # unreadable, wrong length: fail at check-config
            if (vec < 0).any():
                warnings.warn(f"loss.mirror_map.params={self.params}: {int((vec < 0).sum())} of {NUM_PARAMETERS} "
                              f"parameters are negative (allow_nonconvex): h is not convex and the Bregman term D "
                              f"may be negative", stacklevel=2)
        elif self.allow_nonconvex:
            raise ValueError("loss.mirror_map.allow_nonconvex needs loss.mirror_map.params (a drawn map is >= 0)")

    def vector(self) -> torch.Tensor:
        """The [380] float64 parameters (identical on every rank and process)."""
        return build_mirror_map(self).to_vector()


@functools.lru_cache(maxsize=8)
def build_mirror_map(cfg: MirrorMapConfig) -> NeuralMirrorMap:
    """The map of ``cfg``, built once per process (the config is frozen, so the cache is exact)."""
    if cfg.params is not None:
        return NeuralMirrorMap().from_vector(load_vector(cfg.params, cfg.allow_nonconvex), cfg.allow_nonconvex)
    return NeuralMirrorMap(generator=torch.Generator().manual_seed(cfg.seed))


def as_mirror_map(spec: "NeuralMirrorMap | MirrorMapConfig | None") -> NeuralMirrorMap:
    """A measure's ``mirror_map`` argument: a map, a config to build one from, or None (the
    default config, seed 42)."""
    if isinstance(spec, NeuralMirrorMap):
        return spec
    return build_mirror_map(spec if spec is not None else MirrorMapConfig())
