"""The registry of divergence measures: one name -> one class.

Three kinds of measure, told apart by their base class:

* :class:`TokenDivergence` sees only the sampled token's log-probabilities under the current
  policy and a base policy (old or reference): ``forward(logp, logp_base) -> [tokens]``
  (elementwise, any shape).
* :class:`RatioDivergence` is a token measure that is a function of the ratio
  w = exp(logp - logp_base) alone. It implements ``of_log_ratio(t)`` with t = log w and gets
  ``forward``, ``of_ratio(w)`` and the exact equivalent ratio interval ``ratio_interval(delta)``
  from it (numerically by default; a closed form where the class gives one).
* :class:`VocabDivergence` sees the whole next-token distribution of both policies, as logits
  sharded along the vocabulary over a tensor-parallel group, and reduces over that group:
  ``forward(logits, logits_base, group, vocab_start, vocab_size) -> [tokens]``.

Convention: ``D(logp, logp_base)`` measures the divergence KL(base || current)-style, i.e. the
tokens are assumed sampled from the base policy. So the trust-region measure is
``D(logp, logp_old)`` and the KL(current || reference) penalty is ``D(logp_ref, logp)``.

Adding a measure is one decorated class; the shared tests iterate over ``DIVERGENCES``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megadiv.divergence.roots import monotone_interval

DIVERGENCES: dict[str, type[nn.Module]] = {}


def register_divergence(name: str):
    def wrap(cls):
        if name in DIVERGENCES:
            raise ValueError(f"divergence '{name}' is already registered by {DIVERGENCES[name].__name__}")
        cls.name = name
        DIVERGENCES[name] = cls
        return cls
    return wrap


def get_divergence(name: str, **kwargs) -> nn.Module:
    if name not in DIVERGENCES:
        raise KeyError(f"unknown divergence '{name}'; registered: {sorted(DIVERGENCES)}")
    return DIVERGENCES[name](**kwargs)


def names_of_kind(kind: type[nn.Module]) -> list[str]:
    """Registered names whose class derives from ``kind`` (e.g. ``RatioDivergence``), sorted."""
    return sorted(name for name, cls in DIVERGENCES.items() if issubclass(cls, kind))


class TokenDivergence(nn.Module):
    """Per-token measure from the sampled token's log-probs: ``[...] x [...] -> [...]``."""

    name: str = ""
    uses_mirror_map: bool = False
    """Whether the constructor takes ``mirror_map`` (GBMPO's neural mirror map; loss.mirror_map)."""

    def forward(self, logp: torch.Tensor, logp_base: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def of_ratio(self, w: torch.Tensor) -> torch.Tensor:
        """The measure as a function of w = p / p_base, for measures that are one; else NotImplementedError."""
        raise NotImplementedError(f"divergence '{self.name}' is not a function of the ratio alone")


class RatioDivergence(TokenDivergence):
    """A token measure f(t) of the log-ratio t = logp - logp_base alone.

    Contract (checked by the shared tests): f(0) = 0 and, for every delta > 0, the set
    {t : f(t) <= delta} is an interval containing 0. Then ``D <= delta`` is the same condition as
    ``w in ratio_interval(delta)``, which is what makes divergence clipping a ratio clipping.
    """

    def of_log_ratio(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, logp: torch.Tensor, logp_base: torch.Tensor) -> torch.Tensor:
        return self.of_log_ratio(logp - logp_base)

    def of_ratio(self, w: torch.Tensor) -> torch.Tensor:
        return self.of_log_ratio(torch.log(w))

    def ratio_interval(self, delta: float) -> tuple[float, float]:
        """[l, u] = {w : D(w) <= delta}; l may be 0 and u may be inf. Float64 bisection on t;
        classes with a closed form override this (the tests compare the two)."""
        def f(t: float) -> float:
            return float(self.of_log_ratio(torch.tensor(t, dtype=torch.float64)))
        t_low, t_high = monotone_interval(f, delta)
        return math.exp(t_low), math.exp(t_high)


class VocabDivergence(nn.Module):
    """Per-token measure over the full next-token distribution, from vocab-parallel logit shards."""

    name: str = ""
    uses_mirror_map: bool = False
    """Whether the constructor takes ``mirror_map`` (GBMPO's neural mirror map; loss.mirror_map)."""

    def forward(self, logits: torch.Tensor, logits_base: torch.Tensor, group=None,
                vocab_start: int = 0, vocab_size: int | None = None) -> torch.Tensor:
        """``logits``/``logits_base``: [tokens, V/TP] shards of this rank, whose first column is
        global vocabulary index ``vocab_start``; columns at or past ``vocab_size`` (the true,
        unpadded vocabulary) are TP padding and carry no probability."""
        raise NotImplementedError
