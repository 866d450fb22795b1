"""Divergences between the full next-token distributions of two policies, per token position.

Each is separable, D(p || q) = sum_v f(p_v, q_v) over the vocabulary, with p = softmax(logits)
the current policy and q = softmax(logits_base) the base (usually the reference) policy, and is
computed from vocab-parallel shards by :func:`megadiv.divergence.vocab_parallel.separable_divergence`,
for which a measure only writes f and its partial derivatives in a = log p and b = log q; ProbL2,
the regulariser the trainer runs on every token, has its own closed-form pass
(:func:`megadiv.divergence.vocab_parallel.prob_l2_divergence`):

    full_kl         KL(p || q) = sum_v p_v (log p_v - log q_v)     (current || base)
    full_prob_l2    sum_v (p_v - q_v)^2                            (Bregman, phi = sum p^2)
    full_mirror     sum_v h(p_v) - h(q_v) - h'(q_v)(p_v - q_v)     (Bregman, neural mirror map h)

Gradients flow to both logits; callers detach the reference, which skips the base's gradient.
"""
from __future__ import annotations

import torch

from megadiv.divergence.mirror_map import NEURONS_PER_GROUP, PROB_FLOOR, MirrorMapConfig, NeuralMirrorMap, as_mirror_map
from megadiv.divergence.registry import VocabDivergence, register_divergence
from megadiv.divergence.vocab_parallel import CHUNK_ELEMENTS, prob_l2_divergence, separable_divergence


class SeparableVocabDivergence(VocabDivergence):
    """Base of the full-vocabulary measures: subclasses implement ``pointwise`` (or, like
    ``full_prob_l2``, ``forward`` with a pass of their own).

    ``chunk_size``: token rows per chunk (None: the device's byte budget, see vocab_parallel);
    each chunk costs two collectives and holds 2 x chunk x V/TP floats of buffers (p, q).
    ``consume_base``: write the gradient into the base logits' storage, destroying them (see
    ``separable_divergence``).
    """

    uses_log_probs = False
    """Whether ``pointwise`` reads a = log p and b = log q (else both are None)."""
    tile_elements = CHUNK_ELEMENTS
    """Logits per ``pointwise`` call (its temporaries should stay in cache)."""

    def __init__(self, chunk_size: int | None = None, consume_base: bool = False):
        super().__init__()
        self.chunk_size, self.consume_base = chunk_size, consume_base

    def pointwise(self, a, b, p, q, out_a, out_b, ws):
        """f elementwise, a = log p, b = log q, on tiles [rows, V_valid], returned; df/da written
        into ``out_a``, df/db into ``out_b`` (each None when not wanted). Temporaries come from
        the workspace ``ws.take(name, rows)``, reused by every tile (vocab_parallel.Workspace);
        a and b may be overwritten."""
        raise NotImplementedError

    def forward(self, logits, logits_base, group=None, vocab_start=0, vocab_size=None):
        return separable_divergence(self, logits, logits_base, group, vocab_start, vocab_size,
                                    self.chunk_size, self.consume_base)


@register_divergence("full_kl")
class FullKL(SeparableVocabDivergence):
    """KL(p || q) = sum_v p_v (a_v - b_v): f = p (a - b), df/da = p (a - b + 1), df/db = -p."""

    uses_log_probs = True

    def pointwise(self, a, b, p, q, out_a, out_b, ws):
        f = torch.sub(a, b, out=a).mul_(p)
        if out_a is not None:
            torch.add(f, p, out=out_a)
        if out_b is not None:
            torch.neg(p, out=out_b)
        return f


@register_divergence("full_prob_l2")
class FullProbL2(SeparableVocabDivergence):
    """sum_v (p_v - q_v)^2, by a closed-form pass (``vocab_parallel._prob_l2_pass``): the sums
    P2 = sum p^2, PQ = sum p q, Q2 = sum q^2 give D = P2 - 2 PQ + Q2 and the gradient
    dD/dz_j = 2 p_j ((p_j - q_j) - (P2 - PQ)) with one collective per chunk and without forming
    p or q (docs/performance.md, "Full-vocabulary ProbL2 in closed form")."""

    def forward(self, logits, logits_base, group=None, vocab_start=0, vocab_size=None):
        return prob_l2_divergence(logits, logits_base, group, vocab_start, vocab_size, self.chunk_size,
                                  self.consume_base, self.tile_elements)


@register_divergence("full_mirror")
class FullMirrorBregman(SeparableVocabDivergence):
    """sum_v D_h(p_v || q_v) with GBMPO's neural mirror map h (``mirror_map.NeuralMirrorMap``).

    With p~ = max(p, 1e-10) (likewise q~): f = h(p~) - h(q~) - h'(q~)(p~ - q~),
    df/da = p [p > 1e-10] (h'(p~) - h'(q~)),  df/db = -q [q > 1e-10] h''(q~) (p~ - q~).
    Every vocabulary entry evaluates the 126 neurons, so this costs far more than full_prob_l2;
    its tiles are 42x smaller to bound the [rows, V, 21] neuron temporaries.
    """

    tile_elements = CHUNK_ELEMENTS // (2 * NEURONS_PER_GROUP)
    uses_mirror_map = True

    def __init__(self, mirror_map: NeuralMirrorMap | MirrorMapConfig | None = None, chunk_size: int | None = None,
                 consume_base: bool = False):
        super().__init__(chunk_size, consume_base)
        self.mirror_map = as_mirror_map(mirror_map)

    def pointwise(self, a, b, p, q, out_a, out_b, ws):
        # the 126-neuron sweep allocates [rows, V, 21] temporaries of its own (mirror_map.terms):
        # it costs ~80x full_prob_l2 in arithmetic, next to which allocation does not count
        p_c, q_c = p.clamp_min(PROB_FLOOR), q.clamp_min(PROB_FLOOR)
        h_p, slope_p, _ = self.mirror_map.terms(p_c, slope=out_a is not None, curvature=False)
        h_q, slope_q, curv_q = self.mirror_map.terms(q_c, curvature=out_b is not None)
        diff = p_c - q_c
        if out_a is not None:
            torch.mul(p, slope_p - slope_q, out=out_a).masked_fill_(~(p > PROB_FLOOR), 0.0)
        if out_b is not None:
            torch.mul(-q * curv_q, diff, out=out_b).masked_fill_(~(q > PROB_FLOOR), 0.0)
        return h_p - h_q - slope_q * diff
