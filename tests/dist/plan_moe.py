"""Rank bodies for tests/test_plan_moe.py: what megatron-core allocates on CPU for megadiv's
mixture-of-experts actor at EP=1 and EP=2, and what one micro-batch saves for backward, to compare
with megadiv.models.plan."""
from __future__ import annotations

import torch

from megadiv.config import ParallelConfig
from megadiv.parallel import initialize, shutdown
from tests.dist.plan import _saved_activation_bytes, allocated_bytes, stepped_actor


def allocations(ctx) -> list[dict]:
    """For each (TP, PP, EP, optimizer, ETP) of ``ctx.args["layouts"]`` (ETP None: TP; sequence
    parallelism at TP > 1): this rank's parameter list (with megatron's ``allreduce`` flag: False
    for an expert parameter under EP > 1), the bytes megatron allocated for weights, gradients, fp32
    main params and optimizer state after one step, and at TP = PP = 1 the bytes one forward saves."""
    from megatron.core import parallel_state

    out = []
    for tp, pp, ep, optimizer, etp in ctx.args["layouts"]:
        shutdown(keep_default_group=True)
        cfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, sequence_parallel=tp > 1,
                             expert_tensor_parallel=etp)
        initialize(cfg, seed=3)
        actor = stepped_actor(ctx.args["hf_dir"], cfg, optimizer)
        gpt = actor.model.gpt_models[0]
        record = {
            "opt": optimizer, "tp": tp, "pp": pp, "ep": ep, "etp": etp,
            "dp": parallel_state.get_data_parallel_world_size(),
            "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "expert_dp_rank": parallel_state.get_expert_data_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "params": [(n, p.numel(), getattr(p, "allreduce", True)) for n, p in gpt.named_parameters()],
        } | allocated_bytes(actor)
        if tp == pp == 1 and optimizer == "adam":
            g = torch.Generator().manual_seed(record["dp_rank"])  # rows of their own per DP rank
            tokens = torch.randint(0, 90, (ctx.args["micro_batch"], ctx.args["seq_len"]), generator=g)
            record["saved_activations"] = _saved_activation_bytes(actor.chunks[0], tokens)
        out.append(record)
        del actor
    return out
