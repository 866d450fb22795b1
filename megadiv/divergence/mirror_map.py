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
nondecreasing there, and h'' >= 0 term by term. The parameters are therefore kept in the
nonnegative orthant (``from_vector`` projects onto it), which is also where the closed forms above
hold (the x_+ of sqrt, cbrt and log never clips). The Bregman divergence is
D(p || q) = h(p) - h(q) - h'(q) (p - q), with probabilities clamped at 1e-10 (log y, c / y).
"""
from __future__ import annotations

import torch
from torch import nn

GROUPS = ("cube", "square", "sqrt", "cbrt", "log", "exp")
NEURONS_PER_GROUP = 21
LOG_EPS = 1e-3
PROB_FLOOR = 1e-10
NUM_PARAMETERS = 3 * len(GROUPS) * NEURONS_PER_GROUP + 2      # v, w, b per neuron; a; c = 380


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
    """act'(u) for u >= 0; at u = 0 the sqrt/cbrt slopes are infinite and reported as 0 (only
    reached when w = b = 0, where the neuron's w-weighted contribution vanishes anyway)."""
    if group == "cube":
        return 3 * u * u
    if group == "square":
        return 2 * u
    if group == "sqrt":
        return _over(torch.ones_like(u), 2 * u.sqrt()).masked_fill_(u == 0, 0)
    if group == "cbrt":
        return _over(torch.ones_like(u), 3 * u.pow(2.0 / 3.0)).masked_fill_(u == 0, 0)
    if group == "log":
        return 1 / (u.clamp_min(0) + LOG_EPS)
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


class NeuralMirrorMap(nn.Module):
    """The 380-parameter separable convex mirror map; parameters are set by an outer search
    (evolution strategies) through ``to_vector`` / ``from_vector``, not by gradient descent.

    ``v``, ``w``, ``b``: [6, 21] (group-major, groups in ``GROUPS`` order); ``a``, ``c``: scalars.
    """

    def __init__(self, init_scale: float = 0.01, generator: torch.Generator | None = None):
        super().__init__()
        shape = (len(GROUPS), NEURONS_PER_GROUP)

        def param(*size):
            return nn.Parameter(torch.rand(*size, generator=generator, dtype=torch.float64)
                                * init_scale, requires_grad=False)
        self.v, self.w, self.b = param(*shape), param(*shape), param(*shape)
        self.a, self.c = param(()), param(())

    def to_vector(self) -> torch.Tensor:
        """[380] float64: v, w, b (each flattened group-major), a, c."""
        return torch.cat([self.v.flatten(), self.w.flatten(), self.b.flatten(),
                          self.a.reshape(1), self.c.reshape(1)]).detach().clone()

    def from_vector(self, vec: torch.Tensor) -> "NeuralMirrorMap":
        """Set all parameters from a [380] vector (``to_vector`` order), projected onto the
        nonnegative orthant (negative entries become 0) so that h stays convex."""
        vec = torch.as_tensor(vec, dtype=torch.float64).flatten()
        if vec.numel() != NUM_PARAMETERS:
            raise ValueError(f"expected {NUM_PARAMETERS} parameters, got {vec.numel()}")
        vec = vec.clamp_min(0)
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
        for k, group in enumerate(GROUPS):
            v, w, b = (p[k].to(y.dtype) for p in (self.v, self.w, self.b))
            u = y.unsqueeze(-1) * w + b
            if value:
                h = h + y * (_mean_act(group, u, b) @ v)
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
