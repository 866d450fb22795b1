"""KL penalties against the reference policy, in the loss or in the reward.

Tokens are sampled from pi_theta (pi_old, in practice), so with the registry's convention
(``D(logp, logp_base)`` assumes samples from the base) the estimator of KL(pi_theta || pi_ref) is
``D(logp_ref, logp)``, i.e. k(w) with w = pi_ref / pi_theta: k1 = logp - logp_ref,
k3 = (w - 1) - log w (GRPO's penalty).

Where the estimator goes decides which gradient you get ("A Comedy of Estimators", Dec 2025;
checked exactly by tests/test_divergence_losses.py::test_kl_placement_gradients):

    k1 in the reward   unbiased gradient of reverse KL(pi_theta || pi_ref)
    k2 in the loss     same gradient as k1 in the reward (unbiased reverse KL)
    k3 in the loss     gradient of the FORWARD KL(pi_ref || pi_theta) (GRPO's default)
    k1 in the loss     zero gradient in expectation (E[grad log pi] = 0): a no-op plus noise
    k3 in the reward   biased; neither KL's gradient
"""
from __future__ import annotations

import torch

from megadiv.divergence.registry import get_divergence


def kl_penalty(estimator: str, logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), [B, T]; differentiable in ``logp`` (the loss placement)."""
    return get_divergence(estimator)(logp_ref.detach(), logp)


@torch.no_grad()
def kl_reward_penalty(estimator: str, coef: float, logp_old: torch.Tensor, logp_ref: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """coef * sum_t mask * k_t per sequence, [B]: subtract it from the sequence rewards before
    computing advantages (the reward placement; no gradient flows through it)."""
    return coef * (kl_penalty(estimator, logp_old, logp_ref) * mask).sum(-1)
