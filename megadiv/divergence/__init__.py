"""megadiv's divergence library: pure torch (plus an optional process group), nothing else from megadiv.

    measures      per-token divergences (ratio, k1, k2, k3, reverse_k3, sampled_prob_l2, sampled_mirror), registered
    bounds        ratio_bounds(measure, delta): the exact ratio interval of D <= delta, and back
    clipping      the unified clipping rule
    losses        PolicyLossConfig + compute_policy_loss: surrogates, KL, regularisers, TIS, aggregation
    advantages    AdvantageConfig + compute_advantages: GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline
    metrics       per-step statistics
    vocab_parallel  log-probs, entropy and separable divergences from vocab-sharded logits
    full_vocab    full-distribution measures (full_kl, full_prob_l2, full_mirror), registered
    mirror_map    the neural mirror map of GBMPO and its run config (loss.mirror_map)

The mathematics is in docs/divergences.md and docs/vocab_parallel.md.
"""
# registration order is the order DIVERGENCES lists (megadiv bounds --table, error messages): token measures first
from megadiv.divergence import measures  # noqa: F401  (registers the token measures)

# isort: split
from megadiv.divergence import full_vocab, mirror_map, vocab_parallel  # noqa: F401  (registers the vocab measures)
from megadiv.divergence.advantages import ADVANTAGES, AdvantageConfig, compute_advantages, register_advantage
from megadiv.divergence.bounds import equivalent_deltas, ratio_bounds
from megadiv.divergence.clipping import clip_surrogate
from megadiv.divergence.losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate_loss,
    aggregation_denominator,
    compute_policy_loss,
    register_policy_loss,
)
from megadiv.divergence.metrics import policy_metrics
from megadiv.divergence.penalties import kl_penalty, kl_reward_penalty
from megadiv.divergence.registry import (
    DIVERGENCES,
    RatioDivergence,
    TokenDivergence,
    VocabDivergence,
    get_divergence,
    names_of_kind,
    register_divergence,
)
from megadiv.divergence.roots import lambert_w

__all__ = [
    "DIVERGENCES", "TokenDivergence", "RatioDivergence", "VocabDivergence", "register_divergence",
    "get_divergence", "names_of_kind", "ratio_bounds", "equivalent_deltas", "lambert_w", "clip_surrogate",
    "PolicyLossConfig", "compute_policy_loss", "aggregate_loss", "aggregation_denominator", "POLICY_LOSSES",
    "register_policy_loss",
    "kl_penalty", "kl_reward_penalty", "AdvantageConfig", "compute_advantages", "ADVANTAGES",
    "register_advantage", "policy_metrics",
]
