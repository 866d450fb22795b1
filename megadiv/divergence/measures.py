"""Per-token divergence measures of the sampled token (see docs/divergences.md).

With t = logp - logp_base = log w (w = p / p_base, tokens sampled from the base policy), the
ratio measures are Schulman's estimators of KL(base || current) and the plain ratio deviation:

    ratio       |w - 1|                 PPO's trust region is |w - 1| <= eps
    k1          -log w                  unbiased, high variance, can be negative
    k2          (log w)^2 / 2           symmetric in log space
    k3          (w - 1) - log w         unbiased, >= 0, low variance ("low_var_kl")
    reverse_k3  (1/w - 1) + log w       k3 of 1/w (unbiased for KL(current || base) only when
                                        the tokens come from the current policy)

All are written in t with expm1, which keeps the absolute error at a few ulp of |t| as t -> 0
(where w - 1 and log w cancel) and the gradient (expm1(t) for k3) exact to rounding.
``sampled_prob_l2`` is GBMPO's published per-token Bregman term (p - p_base)^2, and
``sampled_mirror`` the same with the neural mirror map h: D_h(p || p_base) of the sampled token's
probabilities. Both depend on p_base as well as on w.
"""
from __future__ import annotations

import math

import torch

from megadiv.divergence.mirror_map import PROB_FLOOR, MirrorMapConfig, NeuralMirrorMap, as_mirror_map
from megadiv.divergence.registry import RatioDivergence, TokenDivergence, register_divergence
from megadiv.divergence.roots import lambert_w


@register_divergence("ratio")
class Ratio(RatioDivergence):
    """|w - 1|: with delta = eps this is PPO's clip range [1 - eps, 1 + eps]."""

    def of_log_ratio(self, t):
        return torch.expm1(t).abs()

    def ratio_interval(self, delta):
        return max(0.0, 1.0 - delta), 1.0 + delta


@register_divergence("k1")
class K1(RatioDivergence):
    """-log w. One-sided as a trust region: -log w <= delta <=> w >= e^-delta."""

    def of_log_ratio(self, t):
        return -t

    def ratio_interval(self, delta):
        return math.exp(-delta), math.inf


@register_divergence("k2")
class K2(RatioDivergence):
    """(log w)^2 / 2 <= delta <=> |log w| <= s = sqrt(2 delta) <=> w in [e^-s, e^s]."""

    def of_log_ratio(self, t):
        return 0.5 * t * t

    def ratio_interval(self, delta):
        s = math.sqrt(2.0 * delta)
        return math.exp(-s), math.exp(s)


@register_divergence("k3")
class K3(RatioDivergence):
    """(w - 1) - log w = expm1(t) - t.

    k3(w) = delta <=> log w - w = -1 - delta <=> (-w) e^(-w) = -e^(-1-delta), so the two roots are
    w = -W_0(-e^(-1-delta)) < 1 and w = -W_-1(-e^(-1-delta)) > 1 (Lambert W branches 0 and -1).
    """

    def of_log_ratio(self, t):
        return torch.expm1(t) - t

    def ratio_interval(self, delta):
        x = -math.exp(-1.0 - delta)
        if x == 0.0:  # e^(-1-delta) underflows (delta > ~700): no Lambert W argument to give
            return super().ratio_interval(delta)
        return _polish(-lambert_w(x, 0), delta, -1.0), _polish(-lambert_w(x, -1), delta, 1.0)


def _polish(w: float, delta: float, side: float) -> float:
    """Newton steps on k3 = expm1(t) - t = delta in t = log w, on ``side`` (sign of t). Rounding
    x = -e^(-1-delta) costs W an error ~1e-16 / sqrt(2 delta) (W is ill-conditioned near the
    branch point -1/e; below delta ~ 1e-16, x rounds to -1/e and W to -1); the steps use delta
    itself, and converge quadratically (g is convex, so from the second step on monotonically)."""
    if w == 0.0 or math.isinf(w):
        return w
    t = math.log(w)
    if t * side <= 0:  # x rounded onto the branch point: start from k3 ~ t^2 / 2
        t = side * math.sqrt(2.0 * delta)
    for _ in range(60):
        step = (math.expm1(t) - t - delta) / math.expm1(t)
        t -= step
        if abs(step) <= 1e-16 * abs(t):
            break
    return math.exp(t)


@register_divergence("reverse_k3")
class ReverseK3(RatioDivergence):
    """k3(1/w) = (1/w - 1) + log w = expm1(-t) + t; interval [1/u, 1/l] from k3's [l, u]."""

    def of_log_ratio(self, t):
        return torch.expm1(-t) + t

    def ratio_interval(self, delta):
        low, high = K3().ratio_interval(delta)
        return 1.0 / high, 1.0 / low


@register_divergence("sampled_prob_l2")
class SampledProbL2(TokenDivergence):
    """(p - p_base)^2 of the sampled token, p = exp(logp): the Bregman divergence of phi(p) = p^2
    restricted to one coordinate, as GBMPO's code applies it (coefficient ~1e-4 against the
    reference). Not a function of w alone: (p - p_base)^2 = p_base^2 (w - 1)^2."""

    def forward(self, logp, logp_base):
        return (torch.exp(logp) - torch.exp(logp_base)).square()


@register_divergence("sampled_mirror")
class SampledMirror(TokenDivergence):
    """D_h(p || p_base) = h(p) - h(p_base) - h'(p_base) (p - p_base) of the sampled token,
    p = exp(logp), with GBMPO's neural mirror map h (``loss.mirror_map``): the form the authors
    trained with, at coefficient ~1e-4 against the reference. a = 1 alone gives (p - q)^2 / 2,
    c = 1 alone p log(p/q) - p + q.

    Gradients are the exact derivatives, not autograd through the neuron sums:
    dD/dp = h'(p) - h'(q) and dD/dq = -h''(q) (p - q), zero where p (q) is below the 1e-10 floor.
    """

    uses_mirror_map = True

    def __init__(self, mirror_map: NeuralMirrorMap | MirrorMapConfig | None = None):
        super().__init__()
        self.mirror_map = as_mirror_map(mirror_map)

    def forward(self, logp, logp_base):
        p, q = torch.exp(logp), torch.exp(logp_base)
        p_c, q_c = p.clamp_min(PROB_FLOOR), q.clamp_min(PROB_FLOOR)
        with torch.no_grad():
            h_p, slope_p, _ = self.mirror_map.terms(p_c, curvature=False)
            h_q, slope_q, curv_q = self.mirror_map.terms(q_c, curvature=q.requires_grad)
            value = h_p - h_q - slope_q * (p_c - q_c)
        # value + g_p (p - sg p) + g_q (q - sg q): the value above, the gradients g_p, g_q
        out = value
        if p.requires_grad:
            out = out + torch.where(p > PROB_FLOOR, slope_p - slope_q, 0.0) * (p - p.detach())
        if q.requires_grad:
            out = out + torch.where(q > PROB_FLOOR, -curv_q * (p_c - q_c), 0.0) * (q - q.detach())
        return out
