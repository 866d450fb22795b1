"""Deterministic shuffling and data-parallel sharding of prompt indices.

The prompt stream is the concatenation of epoch permutations: epoch ``e`` is a permutation of
``range(n)`` fixed by ``(seed, e)``, so stream position ``q`` holds item ``perm(q // n)[q % n]``.
A step takes the next ``global_batch`` positions of the stream, and data-parallel rank ``r`` takes
the ``r``-th contiguous slice of ``global_batch // world`` of them. Hence, for every step, the
ranks' slices are disjoint and together form the global batch; every epoch visits each item
exactly once; nothing is dropped at epoch ends (a batch may straddle two epochs); and the state
is one integer, so a resumed run continues the same stream.
"""
from __future__ import annotations

import random
from typing import Sequence, TypeVar

T = TypeVar("T")


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Order of ``range(n)`` in ``epoch``: the same for every rank and every run with this seed."""
    order = list(range(n))
    if shuffle:
        # String seeds hash with SHA-512 in CPython: stable across versions and platforms.
        random.Random(f"megadiv-data:{seed}:{epoch}").shuffle(order)
    return order


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank ``rank``'s strided share of ``items`` (evaluation): shares are disjoint, their union is
    ``items``, and their sizes differ by at most one."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    return list(items[rank::world])


class PromptSampler:
    """This rank's prompt indices, one step at a time (see the module docstring)."""

    def __init__(self, num_items: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 1234,
                 shuffle: bool = True):
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        if global_batch < 1 or global_batch % world:
            raise ValueError(f"global_batch {global_batch} must be >= 1 and divisible by the {world} "
                             "data-parallel ranks")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside [0, {world})")
        self.num_items, self.global_batch, self.rank, self.world = num_items, global_batch, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.position = 0  # stream positions consumed by all ranks together
        self._perm_epoch, self._perm = -1, []

    @property
    def epoch(self) -> int:
        """Epoch of the next stream position."""
        return self.position // self.num_items

    def _item(self, q: int) -> int:
        epoch = q // self.num_items
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, epoch_permutation(self.num_items, self.seed, epoch, self.shuffle)
        return self._perm[q % self.num_items]

    def next_batch(self) -> list[int]:
        """Indices for this rank's ``global_batch // world`` prompts of the next step."""
        per_rank = self.global_batch // self.world
        start = self.position + self.rank * per_rank
        out = [self._item(q) for q in range(start, start + per_rank)]
        self.position += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_items": self.num_items,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_items", "global_batch"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler {getattr(self, key)}")
        self.position = int(state["position"])
