"""Per-step statistics of a policy update, as 0-dim tensors (no host synchronisation).

Keys (each a mask-weighted mean over tokens unless it says otherwise):

    ratio/mean, ratio/min, ratio/max       w = pi_theta / pi_old (min/max over masked tokens)
    old/<measure>                          D(logp, logp_old) for every token measure: for k1/k2/k3
                                           the KL(pi_old || pi_theta) estimates of the update
    ref/<measure>                          D(logp_ref, logp): for k1/k2/k3 the KL(pi_theta || pi_ref) estimates
    mismatch/<measure>                     D(logp_old, logp_rollout): KL(pi_rollout || pi_old) estimates
    mismatch/abs_log_ratio_max             max |logp_old - logp_rollout|
    entropy                                the entropy passed in (e.g. from vocab_parallel)

The loss adds clip/frac_low, clip/frac_high (clip/frac_dual), tis/weight_mean, tis/truncated_frac
and the loss terms.
"""
from __future__ import annotations

import torch

from megadiv.divergence.registry import DIVERGENCES, TokenDivergence, names_of_kind


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * x) / sum(mask); 0 when the mask is empty. ``mask`` may hold float weights."""
    return (x * mask).sum() / mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max of x over tokens with mask > 0; -inf when the mask is empty."""
    return torch.where(mask > 0, x, float("-inf")).max()


@torch.no_grad()
def divergence_means(prefix: str, logp: torch.Tensor, logp_base: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{prefix}/{name}``: masked mean of D(logp, logp_base) for every registered token measure
    without parameters (stacked, so one reduction serves them all); a mirror-map measure depends on
    the run's map and is logged as the loss term it is (loss/regularizer)."""
    names = [n for n in names_of_kind(TokenDivergence) if not DIVERGENCES[n].uses_mirror_map]
    values = torch.stack([DIVERGENCES[name]()(logp, logp_base) for name in names])  # [measures, B, T]
    means = (values * mask).flatten(1).sum(-1) / mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)
    return {f"{prefix}/{name}": mean for name, mean in zip(names, means.unbind())}


@torch.no_grad()
def policy_metrics(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor,
                   logp_ref: torch.Tensor | None = None, logp_rollout: torch.Tensor | None = None,
                   entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The statistics listed in the module docstring; all inputs [B, T] (``mask`` float)."""
    logp = logp.detach()
    w = torch.exp(logp - logp_old)
    out = {"ratio/mean": masked_mean(w, mask), "ratio/min": -masked_max(-w, mask),
           "ratio/max": masked_max(w, mask)}
    out |= divergence_means("old", logp, logp_old, mask)
    if logp_ref is not None:
        out |= divergence_means("ref", logp_ref, logp, mask)
    if logp_rollout is not None:
        out |= divergence_means("mismatch", logp_old, logp_rollout, mask)
        out["mismatch/abs_log_ratio_max"] = masked_max((logp_old - logp_rollout).abs(), mask)
    if entropy is not None:
        out["entropy"] = masked_mean(entropy.detach(), mask)
    return out
