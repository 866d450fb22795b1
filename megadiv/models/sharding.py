"""How one Hugging Face tensor group becomes one Megatron tensor-parallel shard, and back.

Every Megatron weight has one of six layouts. With ``tp`` ranks, rank ``r`` holds:

- REPLICATED: the whole tensor (norm weights).
- COLUMN: rows ``[r*n/tp, (r+1)*n/tp)`` (ColumnParallelLinear without fusion).
- ROW: columns ``[r*n/tp, (r+1)*n/tp)`` (RowParallelLinear: o_proj, down_proj).
- VOCAB: rows of the vocabulary padded from V to Vp (a multiple of tp) with zero rows; rank r holds
  rows ``[r*Vp/tp, (r+1)*Vp/tp)``. Padded rows give logit 0 and must be masked by the consumer
  (the divergence library ignores columns >= V); they never reach a Hugging Face checkpoint.
- QKV: megatron's fused ``linear_qkv`` is grouped per query group g (GQA):
  ``[q_g (heads_per_group*d rows); k_g (d rows); v_g (d rows)]`` for g = 0..G-1, so a TP rank
  holding groups ``[r*G/tp, (r+1)*G/tp)`` holds one contiguous slice of it. Biases likewise.
- GATE_UP: megatron's fused ``linear_fc1`` holds ``[gate; up]`` per rank, i.e. rank r holds
  ``[gate_r; up_r]`` with gate_r and up_r the r-th row chunks of gate_proj and up_proj (the
  global tensor is NOT [gate; up] chunked; dist-checkpointing re-splits it, mlp.py
  apply_swiglu_sharded_factory).

:func:`shard` reads only what rank r needs: its inputs may be tensors or safetensors slices
(``safe_open(...).get_slice(name)``), both of which support ``x[a:b]`` and ``x[:, a:b]``.
:func:`unshard` turns the list of all ranks' shards back into the Hugging Face tensors.
"""
from __future__ import annotations

import enum
import math
from typing import Sequence

import torch

from megadiv.models.hf_config import ArchSpec

VOCAB_MULTIPLE = 128
"""Default padding multiple for the vocabulary. 128 keeps the padded size the same for every
power-of-two TP up to 128, so a distributed checkpoint reloads at another TP."""


class Layout(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATE_UP = "gate_up"


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Smallest multiple of lcm(multiple, tp) >= vocab_size (megatron's own rule uses multiple*tp,
    which changes with TP and would make checkpoints TP-specific)."""
    step = math.lcm(multiple, tp)
    return -(-vocab_size // step) * step


def shard(layout: Layout, hf: Sequence, rank: int, tp: int, arch: ArchSpec, padded_vocab: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the megatron tensor built from the HF tensors ``hf`` (in the order
    the family table lists them: q, k, v for QKV; gate, up for GATE_UP)."""
    if layout is Layout.REPLICATED:
        return hf[0][:]
    if layout is Layout.COLUMN:
        n = _dim(hf[0], 0) // tp
        return hf[0][rank * n:(rank + 1) * n]
    if layout is Layout.ROW:
        n = _dim(hf[0], 1) // tp
        return hf[0][:, rank * n:(rank + 1) * n]
    if layout is Layout.VOCAB:
        n = padded_vocab // tp
        start, stop = rank * n, min((rank + 1) * n, arch.vocab_size)
        if stop - start == n:
            return hf[0][start:stop]
        out = torch.zeros(n, arch.hidden_size, dtype=getattr(torch, arch.dtype))  # [Vp/tp, H]: rows >= V stay 0
        if stop > start:
            out[: stop - start] = hf[0][start:stop]
        return out
    if layout is Layout.QKV:
        groups = arch.num_query_groups // tp
        d, hpg = arch.head_dim, arch.heads_per_group
        g0 = rank * groups
        q = hf[0][g0 * hpg * d:(g0 + groups) * hpg * d]  # [groups*hpg*d, ...]
        k = hf[1][g0 * d:(g0 + groups) * d]  # [groups*d, ...]
        v = hf[2][g0 * d:(g0 + groups) * d]
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(groups, hpg * d, *tail), k.reshape(groups, d, *tail),
                           v.reshape(groups, d, *tail)], dim=1)  # [groups, (hpg+2)*d, ...]
        return fused.reshape(groups * (hpg + 2) * d, *tail)
    if layout is Layout.GATE_UP:
        n = _dim(hf[0], 0) // tp
        return torch.cat([hf[0][rank * n:(rank + 1) * n], hf[1][rank * n:(rank + 1) * n]])
    raise ValueError(f"unknown layout {layout}")


def unshard(layout: Layout, shards: Sequence[torch.Tensor], arch: ArchSpec) -> list[torch.Tensor]:
    """The HF tensors (same order as :func:`shard` takes them) from every rank's shard, rank order.
    From one shard (TP = 1) a tensor is a view of it wherever the layout allows (everything but
    q/k/v of several query groups, which interleave): the embedded engine's shared weights."""
    if layout is Layout.REPLICATED:
        return [shards[0]]
    if layout is Layout.COLUMN:
        return [_cat(shards, 0)]
    if layout is Layout.ROW:
        return [_cat(shards, 1)]
    if layout is Layout.VOCAB:
        return [_cat(shards, 0)[: arch.vocab_size]]
    if layout is Layout.QKV:
        d, hpg = arch.head_dim, arch.heads_per_group
        qs, ks, vs = [], [], []
        for s in shards:
            tail = s.shape[1:]
            grouped = s.reshape(-1, (hpg + 2) * d, *tail)  # [groups, (hpg+2)*d, ...]
            q, k, v = grouped.split([hpg * d, d, d], dim=1)
            qs.append(q.reshape(-1, *tail))
            ks.append(k.reshape(-1, *tail))
            vs.append(v.reshape(-1, *tail))
        return [_cat(qs, 0), _cat(ks, 0), _cat(vs, 0)]
    if layout is Layout.GATE_UP:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return [_cat(gates, 0), _cat(ups, 0)]
    raise ValueError(f"unknown layout {layout}")


def _cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that a single part is returned as is (a view, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)


def _dim(x, i: int) -> int:
    shape = x.shape if isinstance(x, torch.Tensor) else x.get_shape()
    return shape[i]


def stage_layer_counts(num_layers: int, pp: int, requested: Sequence[int] | None = None) -> list[int]:
    """Layers per pipeline stage, first to last. ``requested`` is checked and returned as is;
    without it: even when pp divides num_layers, otherwise the middle stages get ceil(L/pp) each
    and the first and last stages (which also hold the embedding and the output layer) share the
    rest, first <= last. Megatron needs equal middle stages and at least one layer per stage."""
    if requested is not None:
        counts = list(requested)
    elif num_layers % pp == 0:
        counts = [num_layers // pp] * pp
    else:
        middle = -(-num_layers // pp)
        rest = num_layers - middle * (pp - 2)
        counts = [rest // 2] + [middle] * (pp - 2) + [rest - rest // 2]
    if (len(counts) != pp or sum(counts) != num_layers or min(counts) < 1
            or len(set(counts[1:-1])) > 1):
        raise ValueError(f"cannot place {num_layers} layers on {pp} pipeline stages as {counts}: megatron "
                         f"needs >= 1 layer per stage and equal middle stages")
    return counts
