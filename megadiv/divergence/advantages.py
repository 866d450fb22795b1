"""Outcome advantages from per-response rewards, grouped by prompt (G responses per prompt).

    grpo                   (r - mean_g) / (std_g + eps)        std_g unbiased (as verl, TRL)
    dr_grpo                r - mean_g                          (Dr. GRPO: no std scaling)
    rloo                   r - mean of the other G-1 = G/(G-1) (r - mean_g)
    reinforce_pp_baseline  a = r - mean_g, then whitened over the whole batch: (a - mean) / (std + eps)
                           (REINFORCE++-baseline; whitening over responses, where verl weights
                           each response by its token count)

The same advantage applies to every token of a response; the loss broadcasts [B] over [B, T].
A KL-in-reward penalty (penalties.kl_reward_penalty) is subtracted from the rewards first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# name -> (fn(cfg, rewards [n_groups, G]) -> [n_groups, G], smallest group size it accepts)
ADVANTAGES: dict[str, tuple[Callable[["AdvantageConfig", torch.Tensor], torch.Tensor], int]] = {}


def register_advantage(name: str, min_group_size: int = 1):
    def wrap(fn):
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator '{name}' is already registered")
        ADVANTAGES[name] = (fn, min_group_size)
        return fn
    return wrap


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"
    """Registered estimator: grpo, dr_grpo, rloo, reinforce_pp_baseline."""
    group_size: int = 8
    """Responses per prompt, G; rewards come as [n_groups * G] (prompt-major) or [n_groups, G]."""
    eps: float = 1e-6
    """Added to standard deviations before dividing (groups with equal rewards get advantage 0)."""

    def __post_init__(self):
        if self.estimator not in ADVANTAGES:
            raise ValueError(f"estimator must be one of {sorted(ADVANTAGES)}, got {self.estimator!r}")
        if self.group_size < ADVANTAGES[self.estimator][1]:
            raise ValueError(f"group_size must be >= {ADVANTAGES[self.estimator][1]} for estimator "
                             f"'{self.estimator}', got {self.group_size}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def compute_advantages(cfg: AdvantageConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Advantages with the shape of ``rewards`` ([n_groups * G] or [n_groups, G]), no gradient."""
    r = rewards.detach()
    if r.dim() == 1:
        if r.numel() % cfg.group_size:
            raise ValueError(f"{r.numel()} rewards do not split into groups of group_size={cfg.group_size}")
        grouped = r.view(-1, cfg.group_size)
    elif r.dim() == 2 and r.shape[1] == cfg.group_size:
        grouped = r
    else:
        raise ValueError(f"rewards must be [n_groups * {cfg.group_size}] or [n_groups, {cfg.group_size}], "
                         f"got {tuple(r.shape)}")
    fn, _ = ADVANTAGES[cfg.estimator]
    return fn(cfg, grouped.to(torch.promote_types(r.dtype, torch.float32))).reshape(r.shape)


@register_advantage("grpo", min_group_size=2)
def grpo(cfg, r):
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + cfg.eps)


@register_advantage("dr_grpo")
def dr_grpo(cfg, r):
    return r - r.mean(-1, keepdim=True)


@register_advantage("rloo", min_group_size=2)
def rloo(cfg, r):
    g = r.shape[-1]
    return (r - r.mean(-1, keepdim=True)) * (g / (g - 1))


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(cfg, r):
    a = r - r.mean(-1, keepdim=True)
    if a.numel() < 2:
        raise ValueError("reinforce_pp_baseline whitens over the batch: it needs at least 2 responses")
    return (a - a.mean()) / (a.std() + cfg.eps)
