"""The per-micro-batch objectives the actor optimises, in the form megatron's per-token loss mode
wants: ``loss_fn(mb, logp, entropy, vocab_divergence) -> (numerator, denominator, metrics)``.

Megatron sums numerators and denominators over micro-batches and data-parallel ranks and divides
once (megatron.py), so ``numerator / denominator`` summed that way is exactly the configured
aggregation over the whole batch. All tensors are [b, s] aligned with the predicting position.
The denominator depends on the micro-batch (its loss mask) alone, never on the log-probs: the
DeepSpeed policy (deepspeed.py) evaluates it before the forward pass to scale each
micro-batch's backward by the global one.
"""
from __future__ import annotations

from typing import Callable

import torch

from megadiv.divergence import PolicyLossConfig, compute_policy_loss
from megadiv.divergence.losses import aggregation_denominator
from megadiv.policy.batches import SequenceBatch

LossFn = Callable[[SequenceBatch, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                  tuple[torch.Tensor, "torch.Tensor | int", dict[str, torch.Tensor]]]


def grpo_objective(cfg: PolicyLossConfig) -> LossFn:
    """The policy loss of the divergence library. Rows without ``logp_old`` are on-policy: the old
    log-probs are the current ones, detached (ratio 1, the gradient of the unclipped surrogate)."""
    def loss_fn(mb: SequenceBatch, logp, entropy, vocab_divergence):
        logp_old = logp.detach() if mb.logp_old is None else mb.logp_old
        numerator, metrics = compute_policy_loss(
            cfg, logp, logp_old, mb.advantages, mb.loss_mask, logp_ref=mb.logp_ref, logp_rollout=mb.logp_rollout,
            vocab_divergence=vocab_divergence, entropy=entropy, denominator=1.0)
        return numerator, aggregation_denominator(mb.loss_mask, cfg.loss_agg, cfg.loss_norm_len), metrics
    return loss_fn


def sft_objective(mb: SequenceBatch, logp, entropy, vocab_divergence):
    """Supervised warm start: token-mean negative log-likelihood of the target tokens."""
    tokens = mb.loss_mask.sum()
    nll = -(logp * mb.loss_mask).sum()
    return nll, tokens, {"loss/nll": nll.detach(), "entropy": (entropy * mb.loss_mask).sum() / tokens}
