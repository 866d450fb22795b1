"""Policy losses: one registry of per-token surrogates, plus penalties, regularisers, truncated
importance sampling and loss aggregation, combined by :func:`compute_policy_loss`.

All tensors are [B, T] (sequences x response tokens) with a float ``mask`` [B, T] (1 on response
tokens; fractional weights are allowed). The loss is

    loss = agg(tis * pg_t) + kl_coef * agg(k_t) + regularizer_coef * agg(D_t)

where pg_t is the registered surrogate, tis = min(pi_old / pi_rollout, tis_cap) corrects the
rollout/trainer mismatch, k_t estimates KL(pi_theta || pi_ref) (penalties.py) and D_t is a
divergence from the reference (a token measure, or a full-vocabulary one computed by the caller
with the vocab-parallel primitives and passed in as ``vocab_divergence``).
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from megadiv.divergence.bounds import ratio_bounds
from megadiv.divergence.clipping import Clipped, clip_surrogate
from megadiv.divergence.metrics import masked_mean, policy_metrics
from megadiv.divergence.mirror_map import MirrorMapConfig
from megadiv.divergence.penalties import kl_penalty
from megadiv.divergence.registry import DIVERGENCES, RatioDivergence, VocabDivergence

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

LOG_RATIO_CLAMP = 20.0
"""|log w| is clamped here before exp (e^20 ~ 5e8): a token that far out is clipped or capped
anyway, and an overflowing exp would turn its zero gradient into NaN (0 * inf)."""

# name -> fn(cfg, logp, logp_old, adv, mask, clip_divergence) -> (per-token loss [B, T], metrics)
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
_DUAL_CLIP_LOSSES: set[str] = set()


def register_policy_loss(name: str, dual_clip: bool = False):
    """Register ``fn(cfg, logp, logp_old, adv, mask, clip_divergence)`` returning the per-token
    loss [B, T] and its own metrics; ``dual_clip`` says whether it honours ``cfg.dual_clip_c``."""
    def wrap(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss '{name}' is already registered")
        POLICY_LOSSES[name] = fn
        if dual_clip:
            _DUAL_CLIP_LOSSES.add(name)
        return fn
    return wrap


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy objective. Defaults: GRPO's PPO clip at 0.2, token-mean, no KL."""

    policy_loss: str = "clip"
    """Registered surrogate: clip (PPO/GRPO/DAPO), divergence_clip, gspo, sapo."""
    eps_low: float = 0.2
    """clip, gspo: lower clip range, w >= 1 - eps_low."""
    eps_high: float = 0.2
    """clip, gspo: upper clip range, w <= 1 + eps_high (DAPO clip-higher: 0.28; GSPO: 4e-4)."""
    dual_clip_c: float | None = None
    """clip, divergence_clip, gspo: dual-clip cap c > 1 on the loss of negative-advantage tokens (~3)."""
    measure: str = "k3"
    """divergence_clip: the divergence D(pi_theta, pi_old) that defines the trust region D <= delta."""
    delta: float = 0.05
    """divergence_clip: bound on D (on the w < 1 side when delta_high is set)."""
    delta_high: float | None = None
    """divergence_clip: bound on D on the w > 1 side; None means delta."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for negative advantages."""
    kl_coef: float = 0.0
    """Weight of the KL(pi_theta || pi_ref) penalty; 0 disables (DAPO, Dr. GRPO)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL penalty (see penalties.py for which gradient each placement gives)."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """loss: added here; reward: the trainer subtracts penalties.kl_reward_penalty from the rewards."""
    regularizer: str | None = None
    """Divergence D(pi_theta, pi_ref) added to the loss (GBMPO): sampled_prob_l2, sampled_mirror, or a
    full-vocabulary measure whose per-token values the caller passes as ``vocab_divergence``."""
    regularizer_coef: float = 0.0
    """Weight of the regulariser (GBMPO's ProbL2: 1e-4)."""
    mirror_map: MirrorMapConfig = field(default_factory=MirrorMapConfig)
    """The neural mirror map h of sampled_mirror / full_mirror (regularizer or measure), fixed for the run."""
    loss_agg: LossAggregation = "token-mean"
    """How per-token losses become one number (see aggregate_loss)."""
    loss_norm_len: int | None = None
    """seq-mean-token-sum-norm: the constant length L in sum / (B * L) (Dr. GRPO); None: the padded T."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight each token's policy loss by min(pi_old / pi_rollout,
    tis_cap) (needs rollout log-probs); None disables."""

    def __post_init__(self):
        def fail(key, why):
            raise ValueError(f"{key} {why}, got {getattr(self, key)!r}")
        if self.policy_loss not in POLICY_LOSSES:
            fail("policy_loss", f"must be one of {sorted(POLICY_LOSSES)}")
        if not 0 < self.eps_low < 1:
            fail("eps_low", "must lie in (0, 1)")
        if not self.eps_high > 0:
            fail("eps_high", "must be > 0")
        if self.dual_clip_c is not None:
            if not self.dual_clip_c > 1:
                fail("dual_clip_c", "must be > 1 (or None)")
            if self.policy_loss not in _DUAL_CLIP_LOSSES:
                fail("dual_clip_c", f"is not supported by policy_loss '{self.policy_loss}' "
                                    f"(only by {sorted(_DUAL_CLIP_LOSSES)})")
        if self.measure not in DIVERGENCES:
            fail("measure", f"must be a registered divergence {sorted(DIVERGENCES)}")
        if not (math.isfinite(self.delta) and self.delta > 0):
            fail("delta", "must be a finite number > 0")
        if self.delta_high is not None and not (math.isfinite(self.delta_high) and self.delta_high > 0):
            fail("delta_high", "must be a finite number > 0 (or None)")
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            fail("tau_pos" if self.tau_pos <= 0 else "tau_neg", "must be > 0")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            fail("kl_estimator", "must be one of k1, k2, k3")
        if self.kl_placement not in ("loss", "reward"):
            fail("kl_placement", "must be 'loss' or 'reward'")
        if not self.kl_coef >= 0:
            fail("kl_coef", "must be >= 0")
        if self.regularizer is not None and self.regularizer not in DIVERGENCES:
            fail("regularizer", f"must be None or a registered divergence {sorted(DIVERGENCES)}")
        if not self.regularizer_coef >= 0:
            fail("regularizer_coef", "must be >= 0")
        if self.mirror_map != MirrorMapConfig() and not self.uses_mirror_map:
            fail("mirror_map", "is set but neither regularizer nor the divergence_clip measure is a mirror-map "
                               "measure (sampled_mirror, full_mirror)")
        if self.regularizer_coef > 0 and self.regularizer is None:
            fail("regularizer_coef", "is set but regularizer is None")
        if self.loss_agg not in typing.get_args(LossAggregation):
            fail("loss_agg", f"must be one of {list(typing.get_args(LossAggregation))}")
        if self.loss_norm_len is not None and not self.loss_norm_len > 0:
            fail("loss_norm_len", "must be > 0 (or None)")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            fail("tis_cap", "must be >= 1 (or None)")

    @property
    def uses_mirror_map(self) -> bool:
        names = [self.regularizer] + ([self.measure] if self.policy_loss == "divergence_clip" else [])
        return any(n is not None and DIVERGENCES[n].uses_mirror_map for n in names)

    def divergence(self, name: str, **kwargs):
        """The registered measure ``name``, given this config's mirror map when it takes one."""
        if DIVERGENCES[name].uses_mirror_map:
            kwargs["mirror_map"] = self.mirror_map
        return DIVERGENCES[name](**kwargs)


def compute_policy_loss(cfg: PolicyLossConfig, logp: torch.Tensor, logp_old: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor,
                        logp_ref: torch.Tensor | None = None, logp_rollout: torch.Tensor | None = None,
                        vocab_divergence: torch.Tensor | None = None, *,
                        clip_divergence: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                        denominator: float | torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss and its metrics (0-dim tensors, computed on the device, no host sync).

    logp [B, T]: log pi_theta of the sampled tokens (the only input that carries gradient, with
    vocab_divergence/clip_divergence). logp_old, logp_ref, logp_rollout [B, T]: the behaviour,
    reference and rollout-engine log-probs (treated as constants). advantages: [B, T] or [B].
    vocab_divergence [B, T]: per-token full-vocabulary D(pi_theta, pi_ref) when cfg.regularizer is
    a VocabDivergence. clip_divergence [B, T]: per-token D(pi_theta, pi_old) when cfg.measure of
    divergence_clip is a VocabDivergence. entropy [B, T]: logged only. denominator: see
    aggregate_loss (global token/sequence count when the batch is split into micro-batches).
    """
    adv = advantages.detach()
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    for name, t in (("logp_old", logp_old), ("advantages", adv), ("mask", mask), ("logp_ref", logp_ref),
                    ("logp_rollout", logp_rollout), ("vocab_divergence", vocab_divergence),
                    ("clip_divergence", clip_divergence), ("entropy", entropy)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)}")
    logp_old = logp_old.detach()
    logp_ref = None if logp_ref is None else logp_ref.detach()
    mask = mask.to(logp.dtype)
    agg = dict(mode=cfg.loss_agg, norm_len=cfg.loss_norm_len, denominator=denominator)

    pg_tok, metrics = POLICY_LOSSES[cfg.policy_loss](cfg, logp, logp_old, adv, mask, clip_divergence)
    if cfg.tis_cap is not None:
        if logp_rollout is None:
            raise ValueError("tis_cap is set but no logp_rollout was given")
        log_w = logp_old - logp_rollout.detach()  # log(pi_old / pi_rollout), [B, T]
        tis = torch.exp(log_w.clamp(max=math.log(cfg.tis_cap)))
        pg_tok = pg_tok * tis
        metrics["tis/weight_mean"] = masked_mean(tis, mask)
        metrics["tis/truncated_frac"] = masked_mean((log_w > math.log(cfg.tis_cap)).to(mask.dtype), mask)
    loss = aggregate_loss(pg_tok, mask, **agg)
    metrics["loss/policy"] = loss.detach()

    if cfg.kl_coef > 0 and cfg.kl_placement == "loss":
        if logp_ref is None:
            raise ValueError("kl_coef > 0 with kl_placement 'loss' needs logp_ref")
        kl = aggregate_loss(kl_penalty(cfg.kl_estimator, logp, logp_ref), mask, **agg)
        loss = loss + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.detach()

    is_vocab = cfg.regularizer is not None and issubclass(DIVERGENCES[cfg.regularizer], VocabDivergence)
    if vocab_divergence is not None and not is_vocab:
        raise ValueError(f"vocab_divergence was given but regularizer {cfg.regularizer!r} is not a "
                         f"full-vocabulary measure")
    if cfg.regularizer is not None:
        if is_vocab and vocab_divergence is None:
            raise ValueError(f"regularizer '{cfg.regularizer}' is a full-vocabulary measure: pass its "
                             f"per-token values as vocab_divergence")
        if not is_vocab and logp_ref is None:
            raise ValueError(f"regularizer '{cfg.regularizer}' needs logp_ref")
        reg_tok = vocab_divergence if is_vocab else cfg.divergence(cfg.regularizer)(logp, logp_ref)
        reg = aggregate_loss(reg_tok, mask, **agg)
        loss = loss + cfg.regularizer_coef * reg
        metrics["loss/regularizer"] = reg.detach()

    metrics["loss/total"] = loss.detach()
    metrics |= policy_metrics(logp, logp_old, mask, logp_ref, logp_rollout, entropy)
    return loss, metrics


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, mode: LossAggregation = "token-mean",
                   norm_len: int | None = None, denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """Per-token losses [B, T] -> scalar, as numerator / denominator:

        token-mean               sum(mask * l) / sum(mask)                    (DAPO)
        seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / #seqs  (GRPO, GSPO)
        seq-mean-token-sum       sum(mask * l) / #seqs
        seq-mean-token-sum-norm  sum(mask * l) / (B * L), L = norm_len or T    (Dr. GRPO, GBMPO)

    #seqs counts rows with at least one masked token (all-padding rows are not sequences).
    ``denominator`` replaces the local one (aggregation_denominator), so that micro-batches of
    one global batch, each aggregated with the global count, sum to the global mean.
    """
    tiny = torch.finfo(loss_tok.dtype).tiny
    if mode == "seq-mean-token-mean":
        seq_tokens = mask.sum(-1)  # [B]
        numerator = ((loss_tok * mask).sum(-1) / seq_tokens.clamp(min=tiny)).sum()
    else:
        numerator = (loss_tok * mask).sum()
    if denominator is None:
        denominator = aggregation_denominator(mask, mode, norm_len)
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(loss_tok.dtype).clamp(min=tiny)
    return numerator / max(float(denominator), tiny)  # a Python number: no device tensor, no copy


def aggregation_denominator(mask: torch.Tensor, mode: LossAggregation = "token-mean",
                            norm_len: int | None = None) -> torch.Tensor | int:
    """The denominator aggregate_loss divides by for ``mask`` [B, T]: the token count
    (token-mean), the count of non-empty rows (seq-mean-*), or the constant B * L (sum-norm, an
    int). Sum it over micro-batches / data-parallel ranks to get the global one."""
    if mode == "token-mean":
        return mask.sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (mask.sum(-1) > 0).sum()
    if mode == "seq-mean-token-sum-norm":
        return mask.shape[0] * (norm_len or mask.shape[-1])
    raise ValueError(f"unknown loss aggregation '{mode}'; one of {list(typing.get_args(LossAggregation))}")


# --------------------------------------------------------------------------- surrogates


def _ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    return torch.exp((logp - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _with_clip_metrics(c: Clipped, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    metrics = {"clip/frac_low": masked_mean(c.low.to(mask.dtype), mask),
               "clip/frac_high": masked_mean(c.high.to(mask.dtype), mask)}
    if c.dual is not None:
        metrics["clip/frac_dual"] = masked_mean(c.dual.to(mask.dtype), mask)
    return c.loss, metrics


@register_policy_loss("clip", dual_clip=True)
def clip_loss(cfg, logp, logp_old, adv, mask, clip_divergence=None):
    """PPO/GRPO: -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A); DAPO with eps_high = 0.28."""
    w = _ratio(logp, logp_old)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    outside = (w.detach() < low) | (w.detach() > high)
    return _with_clip_metrics(clip_surrogate(w, adv, outside, low, high, cfg.dual_clip_c), mask)


@register_policy_loss("divergence_clip", dual_clip=True)
def divergence_clip_loss(cfg, logp, logp_old, adv, mask, clip_divergence=None):
    """Unified clipping with the trust region D(pi_theta, pi_old) <= delta (delta_high on the w > 1
    side). A ratio measure clips exactly like PPO with the interval ratio_bounds(measure, delta)."""
    w = _ratio(logp, logp_old)
    measure = DIVERGENCES[cfg.measure]
    delta_high = cfg.delta if cfg.delta_high is None else cfg.delta_high
    if issubclass(measure, VocabDivergence):
        if clip_divergence is None:
            raise ValueError(f"measure '{cfg.measure}' is a full-vocabulary measure: pass D(pi_theta, pi_old) "
                             f"per token as clip_divergence")
        div = clip_divergence.detach()
    else:
        div = cfg.divergence(cfg.measure)(logp.detach(), logp_old)  # [B, T], only compared with delta: no gradient
    outside = torch.where(w.detach() > 1, div > delta_high, div > cfg.delta)
    if issubclass(measure, RatioDivergence):  # the region is a ratio interval: clipped value at its edge
        w_low, w_high = ratio_bounds(cfg.measure, cfg.delta)[0], ratio_bounds(cfg.measure, delta_high)[1]
    else:
        w_low = w_high = w.detach()
    return _with_clip_metrics(clip_surrogate(w, adv, outside, w_low, w_high, cfg.dual_clip_c), mask)


@register_policy_loss("gspo", dual_clip=True)
def gspo_loss(cfg, logp, logp_old, adv, mask, clip_divergence=None):
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio
    s_i = exp(sum_t mask (logp - logp_old) / sum_t mask), in its token form
    s_it = sg[s_i] * pi_t / sg[pi_t] (value s_i, d s_it / d logp_t = s_i). With
    loss_agg seq-mean-token-mean this is the sequence-level GSPO objective exactly."""
    seq_tokens = mask.sum(-1).clamp(min=torch.finfo(mask.dtype).tiny)
    seq_log_ratio = (((logp - logp_old) * mask).sum(-1) / seq_tokens).detach()  # [B]
    s = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None] + logp - logp.detach())
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    outside = (s.detach() < low) | (s.detach() > high)
    return _with_clip_metrics(clip_surrogate(s, adv, outside, low, high, cfg.dual_clip_c), mask)


@register_policy_loss("sapo")
def sapo_loss(cfg, logp, logp_old, adv, mask, clip_divergence=None):
    """SAPO: soft gate instead of a hard clip, -A * sigmoid(tau (w - 1)) * 4 / tau, tau = tau_pos
    for A > 0 and tau_neg otherwise; its slope is 1 at w = 1 and decays smoothly away from it."""
    w = _ratio(logp, logp_old)
    tau = torch.where(adv > 0, cfg.tau_pos, cfg.tau_neg).to(w.dtype)
    sig = torch.sigmoid(tau * (w - 1))
    # d gate / d w = 4 sig (1 - sig): 1 at w = 1, the soft counterpart of "not clipped"
    slope = (4 * sig * (1 - sig)).detach()
    return -adv * sig * (4.0 / tau), {"sapo/slope_mean": masked_mean(slope, mask)}
