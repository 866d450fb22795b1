"""The unified clipping rule (arXiv 2602.05494; docs/divergences.md section 2).

Surrogate J = E[min(w A, clip_C(w) A)] with a per-token trust region C. Its gradient is PPO's
rule, stated for any region: a token stops contributing gradient when it is outside the region
AND the advantage pushes it further out,

    clipped = (D > delta) and sign(A) (w - 1) > 0,

and keeps it otherwise (outside but moving back, or inside). With C = {1 - eps_low <= w <=
1 + eps_high} this is exactly PPO/GRPO/DAPO clipping; with C = {k3(w) <= delta} it is ATR-GRPO.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Clipped:
    loss: torch.Tensor
    """Per-token surrogate loss -min(w A, clip_C(w) A), [B, T]."""
    low: torch.Tensor
    """Bool [B, T]: clipped on the w < 1 side (A < 0 pushing w down)."""
    high: torch.Tensor
    """Bool [B, T]: clipped on the w > 1 side (A > 0 pushing w up)."""
    dual: torch.Tensor | None
    """Bool [B, T]: capped by dual-clip (A < 0 and w > c), or None without dual-clip."""


def clip_surrogate(w: torch.Tensor, adv: torch.Tensor, outside: torch.Tensor,
                   w_low: float | torch.Tensor, w_high: float | torch.Tensor,
                   dual_clip_c: float | None = None) -> Clipped:
    """Apply the unified rule to ratios ``w`` [B, T] (carrying the gradient) with advantages
    ``adv`` [B, T] and the bool mask ``outside`` [B, T] of tokens outside the trust region.

    A clipped token's loss is -A * w_low (w < 1 side) or -A * w_high (w > 1 side), a constant:
    the boundary of the region when it is a ratio interval, which gives PPO's loss value
    exactly. Where the region is not a ratio interval, pass ``w.detach()``: same zero gradient,
    value frozen at the token's own ratio.

    Dual-clip (Ye et al. 2020): for A < 0 the loss is also capped at -c A, so a token with
    w > c and a negative advantage cannot dominate the batch.
    """
    push_out = torch.sign(adv) * (w.detach() - 1) > 0
    clipped = outside & push_out
    high = clipped & (w.detach() > 1)
    low = clipped & (w.detach() < 1)
    w_eff = torch.where(high, w_high, torch.where(low, w_low, w))  # clipped tokens: constant, no gradient
    loss = -adv * w_eff
    dual = None
    if dual_clip_c is not None:
        dual = (adv < 0) & (w.detach() > dual_clip_c)
        loss = torch.where(dual, -adv * dual_clip_c, loss)
    return Clipped(loss, low, high, dual)
