"""Rank bodies for tests/test_plan_moe.py: what megatron-core allocates on CPU for megadiv's
mixture-of-experts actor at EP=1 and EP=2, and what one micro-batch saves for backward, to compare
with megadiv.models.plan."""
from __future__ import annotations

import torch

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.parallel import initialize, shutdown
from megadiv.policy.megatron import Policy
from tests.dist.plan import _saved_activation_bytes

def allocations(ctx) -> list[dict]:
    """For each (TP, PP, EP, optimizer) of ``ctx.args["layouts"]``: this rank's parameter list (with megatron's ``allreduce`` flag: False for
    an expert parameter under EP > 1), the bytes megatron allocated for weights, gradients, fp32
    main params and optimizer state after one step, and at PP=1 the bytes one forward saves."""
    from megatron.core import parallel_state

    out = []
    for tp, pp, ep, optimizer in ctx.args["layouts"]:
        shutdown(keep_default_group=True)
        cfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        initialize(cfg, seed=3)
        actor = Policy(ModelConfig(hf_dir=ctx.args["hf_dir"], params_dtype="bfloat16"), cfg, "actor",
                       OptimConfig(optimizer=optimizer, lr=1e-3))
        actor.optimizer.step()  # zero gradients: creates the optimizer state
        buffers = [buf for chunk in actor.chunks for buf in chunk.buffers + chunk.expert_parallel_buffers]
        inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
        main = [p for o in inner for g in o.param_groups for p in g["params"]]
        states = [t for o in inner for st in o.state.values() for k, t in st.items()
                  if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")]
        gpt = actor.model.gpt_models[0]
        record = {
            "opt": optimizer, "tp": tp, "pp": pp, "ep": ep,
            "dp": parallel_state.get_data_parallel_world_size(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "expert_dp_rank": parallel_state.get_expert_data_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "params": [(n, p.numel(), getattr(p, "allreduce", True)) for n, p in gpt.named_parameters()],
            "weights": sum(b.param_data.numel() * b.param_data.element_size() if b.param_data is not None
                           else sum(p.numel() * p.element_size() for p in b.params) for b in buffers),
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "main_params": sum(p.numel() * p.element_size() for p in main if p.dtype == torch.float32),
            "optimizer": sum(t.numel() * t.element_size() for t in states),
        }
        if pp == 1 and optimizer == "adam":
            g = torch.Generator().manual_seed(record["dp_rank"])  # rows of their own per DP rank
            tokens = torch.randint(0, 90, (ctx.args["micro_batch"], ctx.args["seq_len"]), generator=g)
            record["saved_activations"] = _saved_activation_bytes(actor.chunks[0], tokens)
        out.append(record)
        del actor
    return out
