"""Divergences between the full next-token distributions of two policies, per token position.

Each is separable, D(p || q) = sum_v f(p_v, q_v) over the vocabulary, with p = softmax(logits)
the current policy and q = softmax(logits_base) the base (usually the reference) policy, and is
computed by :func:`megadiv.divergence.vocab_parallel.separable_divergence` from vocab-parallel
shards. A measure only writes f and its partial derivatives in a = log p and b = log q:

    full_kl         KL(p || q) = sum_v p_v (log p_v - log q_v)     (current || base)
    full_prob_l2    sum_v (p_v - q_v)^2                            (Bregman, phi = sum p^2)
    full_mirror     sum_v h(p_v) - h(q_v) - h'(q_v)(p_v - q_v)     (Bregman, neural mirror map h)

Gradients flow to both logits; callers detach the reference, which skips the base's gradient.
"""
from __future__ import annotations

import torch

from megadiv.divergence.mirror_map import NEURONS_PER_GROUP, PROB_FLOOR, NeuralMirrorMap
from megadiv.divergence.registry import VocabDivergence, register_divergence
from megadiv.divergence.vocab_parallel import CHUNK_ELEMENTS, separable_divergence


class SeparableVocabDivergence(VocabDivergence):
    """Base of the full-vocabulary measures: subclasses implement ``pointwise``.

    ``chunk_size``: token rows per chunk (None: about 2^19 logits per chunk).
    """

    def __init__(self, chunk_size: int | None = None):
        super().__init__()
        self.chunk_size = chunk_size

    def pointwise(self, a, b, p, q, value: bool, base_grad: bool):
        """(f or None, df/da, df/db or None) elementwise, a = log p, b = log q; chunks
        [rows, V_valid]; f only with ``value``, df/db only with ``base_grad``."""
        raise NotImplementedError

    def forward(self, logits, logits_base, group=None, vocab_start=0, vocab_size=None):
        return separable_divergence(self.pointwise, logits, logits_base, group, vocab_start,
                                    vocab_size, self.chunk_size)


@register_divergence("full_kl")
class FullKL(SeparableVocabDivergence):
    """KL(p || q) = sum_v p_v (a_v - b_v): f = p (a - b), df/da = p (a - b + 1), df/db = -p."""

    def pointwise(self, a, b, p, q, value, base_grad):
        f = p * (a - b)
        return f, f + p, (-p if base_grad else None)


@register_divergence("full_prob_l2")
class FullProbL2(SeparableVocabDivergence):
    """sum_v (p_v - q_v)^2: f = (p - q)^2, df/da = 2 (p - q) p, df/db = -2 (p - q) q."""

    def pointwise(self, a, b, p, q, value, base_grad):
        diff = p - q
        two_diff = 2 * diff
        return (diff * diff if value else None), two_diff * p, (-two_diff * q if base_grad else None)


@register_divergence("full_mirror")
class FullMirrorBregman(SeparableVocabDivergence):
    """sum_v D_h(p_v || q_v) with GBMPO's neural mirror map h (``mirror_map.NeuralMirrorMap``).

    With p~ = max(p, 1e-10) (likewise q~): f = h(p~) - h(q~) - h'(q~)(p~ - q~),
    df/da = p [p > 1e-10] (h'(p~) - h'(q~)),  df/db = -q [q > 1e-10] h''(q~) (p~ - q~).
    Every vocabulary entry evaluates the 126 neurons, so this costs far more than full_prob_l2;
    the default chunk is 21x smaller to bound the [rows, V, 21] neuron temporaries.
    """

    def __init__(self, mirror_map: NeuralMirrorMap | None = None, chunk_size: int | None = None):
        super().__init__(chunk_size)
        self.mirror_map = mirror_map if mirror_map is not None else NeuralMirrorMap()

    def pointwise(self, a, b, p, q, value, base_grad):
        p_c, q_c = p.clamp_min(PROB_FLOOR), q.clamp_min(PROB_FLOOR)
        h_p, slope_p, _ = self.mirror_map.terms(p_c, value=value, curvature=False)
        h_q, slope_q, curv_q = self.mirror_map.terms(q_c, value=value, curvature=base_grad)
        diff = p_c - q_c
        f = h_p - h_q - slope_q * diff if value else None
        f_a = torch.where(p > PROB_FLOOR, p * (slope_p - slope_q), 0.0)
        f_b = torch.where(q > PROB_FLOOR, -q * curv_q * diff, 0.0) if base_grad else None
        return f, f_a, f_b

    def forward(self, logits, logits_base, group=None, vocab_start=0, vocab_size=None):
        chunk = self.chunk_size
        if chunk is None:
            chunk = max(1, CHUNK_ELEMENTS // (NEURONS_PER_GROUP * logits.shape[-1]))
        return separable_divergence(self.pointwise, logits, logits_base, group, vocab_start,
                                    vocab_size, chunk)
