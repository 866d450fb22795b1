"""Export a sharded Megatron model as Hugging Face tensors, bucket by bucket.

Shared by checkpoint conversion (megatron -> HF safetensors) and the rollout weight sync::

    for bucket in iter_hf_weight_buckets(model, bucket_bytes=512 << 20):
        engine.update_weights(bucket)      # [(hf_name, tensor), ...]

Collective: call it on every rank of one data-parallel replica's TP x PP grid, each with its
MegatronModel (megadiv.models.build_model). Every rank yields the same buckets, in the same
order (the family table's order: embedding, layer 0, layer 1, ..., final norm, lm_head), of full,
unpadded, HF-named tensors on the model's device in the parameters' dtype. Per HF tensor group
(one Megatron parameter: q/k/v, gate/up or a single tensor):

1. the PP stage owning it all-gathers its TP shards in the TP group (an expert's in the
   expert-tensor-parallel group) and undoes the fusion and the vocabulary padding
   (megadiv.models.sharding.unshard);
2. an expert's tensors (mixture-of-experts models) are held by one expert-parallel rank of that
   stage, expert g by EP rank g // local_experts: it broadcasts them over the EP group;
3. that stage broadcasts each HF tensor to the other stages over the PP group.

A rank holds at most one bucket of gathered tensors (plus one parameter's TP shards while
gathering); a single parameter larger than ``bucket_bytes`` forms a bucket of its own. Yielded
tensors are fresh (never views of parameters), so the consumer may keep or modify them.
"""
from __future__ import annotations

import math
from itertools import groupby
from typing import Iterator

import torch
import torch.distributed as dist

from megadiv.models.families import PlannedTensor, plan
from megadiv.models.loading import megatron_params
from megadiv.models.sharding import Layout, unshard


def iter_hf_weight_buckets(model, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (hf_name, full tensor), each list about ``bucket_bytes`` (see module doc)."""
    from megatron.core import parallel_state

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_ranks = dist.get_process_group_ranks(ep_group)
    local_experts = model.arch.num_experts // len(ep_ranks)
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group()
    local = dict(megatron_params(model))
    on_stage = _names_on_stage(local, ep_group)
    owner = _owner_stages(on_stage, pp_group)
    dtype = model.config.params_dtype
    device = next(iter(local.values())).device
    element = dtype.itemsize

    for bucket in _buckets(plan(model.arch), bucket_bytes, element):
        out = []
        for _, group in groupby(bucket, key=lambda t: t.megatron_name):
            group = list(group)
            name = group[0].megatron_name
            if name not in owner:
                raise RuntimeError(f"no pipeline stage holds {name}")
            expert = group[0].expert
            if name in local:  # this rank holds it: gather TP shards, undo fusion and padding
                hf = _gather_unshard(local[name], group[0].rule.layout, tp_group if expert is None else expert_tp_group,
                                     model.arch)
                tensors = [hf[t.index].to(dtype) for t in group]
            else:
                tensors = [torch.empty(t.shape, dtype=dtype, device=device) for t in group]
            if name in on_stage and expert is not None and len(ep_ranks) > 1:
                for t in tensors:
                    dist.broadcast(t, src=ep_ranks[expert // local_experts], group=ep_group)
            if len(pp_ranks) > 1:
                for t in tensors:
                    dist.broadcast(t, src=pp_ranks[owner[name]], group=pp_group)
            out += [(t.hf_name, x) for t, x in zip(group, tensors)]
        yield out


def _gather_unshard(param: torch.Tensor, layout: Layout, tp_group, arch) -> list[torch.Tensor]:
    local = param.detach()
    tp = dist.get_world_size(tp_group)
    if tp == 1 or layout is Layout.REPLICATED:
        shards = [local]
    else:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
    hf = unshard(layout, shards, arch)
    # from one shard unshard returns views where it can: copy those, so that yielded tensors never
    # alias parameters
    return [t.clone() if _aliases(t, local) else t for t in hf]


def _aliases(t: torch.Tensor, param: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


def hf_weight_views(model) -> list[tuple[str, torch.Tensor]]:
    """Every HF tensor of a model this rank holds whole (TP = PP = 1), from its megatron parameter
    without communication: a view of the parameter wherever the layout allows (norms, o/down
    projections, the embedding's first V rows, the gate and up halves of linear_fc1, q/k/v of a
    single query group), a fresh copy otherwise (q/k/v of several query groups interleave in
    linear_qkv: one copy of those weights per call). For the embedded engine, which serves the
    views as its own weights (update_weights(..., share=True))."""
    from megatron.core import parallel_state

    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1
            or parallel_state.get_expert_model_parallel_world_size() != 1):
        raise ValueError("hf_weight_views needs the whole model on this rank (TP = PP = EP = 1)")
    local = dict(megatron_params(model))
    out = []
    for name, group in groupby(plan(model.arch), key=lambda t: t.megatron_name):
        group = list(group)
        hf = unshard(group[0].rule.layout, [local[name].detach()], model.arch)
        out += [(t.hf_name, hf[t.index]) for t in group]
    return out


def _names_on_stage(local: dict, ep_group) -> set[str]:
    """The names some rank of this pipeline stage's expert-parallel group holds: each rank's own
    parameters plus the other EP ranks' experts (everything else is the same on all of them)."""
    if dist.get_world_size(ep_group) == 1:
        return set(local)
    held = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(held, sorted(local), group=ep_group)
    return set().union(*held)


def _owner_stages(on_stage: set[str], pp_group) -> dict[str, int]:
    """Canonical megatron name -> pipeline rank holding it (first holder: with tied embeddings
    the last stage also holds a copy of the embedding as output_layer.weight, never exported)."""
    held = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(held, sorted(on_stage), group=pp_group)
    owner = {}
    for stage, names in enumerate(held):
        for name in names:
            owner.setdefault(name, stage)
    return owner


def _buckets(planned: list[PlannedTensor], bucket_bytes: int, element: int) -> Iterator[list[PlannedTensor]]:
    """Group the plan into buckets of <= bucket_bytes, never splitting one megatron parameter's
    HF tensors (q/k/v, gate/up) across buckets."""
    bucket, size = [], 0
    for _, group in groupby(planned, key=lambda t: t.megatron_name):
        group = list(group)
        nbytes = sum(element * math.prod(t.shape) for t in group)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += group
        size += nbytes
    if bucket:
        yield bucket


def bucket_count(model, bucket_bytes: int) -> int:
    """How many buckets iter_hf_weight_buckets(model, bucket_bytes) yields (no communication)."""
    element = model.config.params_dtype.itemsize
    return sum(1 for _ in _buckets(plan(model.arch), bucket_bytes, element))
