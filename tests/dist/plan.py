"""Rank bodies for tests/test_plan.py: what megatron-core allocates for megadiv's actor on CPU, to
compare with megadiv.models.plan (parameter lists, buffers, optimizer state, saved activations)."""
from __future__ import annotations

import torch

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.parallel import initialize, shutdown
from megadiv.policy.megatron import Policy

LAYOUTS_4 = ((1, 1), (2, 1), (1, 2), (2, 2))  # TP, PP on 4 ranks: DP = 4, 2, 2, 1


def _saved_activation_bytes(module: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (weights excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(tokens, positions, attention_mask=None)
    return sum(saved.values())


def stepped_actor(hf_dir: str, cfg: ParallelConfig, optimizer: str) -> Policy:
    """A bf16 actor after one optimizer step of zero gradients (torch creates Adam's state lazily)."""
    actor = Policy(ModelConfig(hf_dir=hf_dir, params_dtype="bfloat16"), cfg, "actor",
                   OptimConfig(optimizer=optimizer, lr=1e-3))
    actor.optimizer.step()
    return actor


def allocated_bytes(actor: Policy) -> dict[str, int]:
    """What megatron allocated on this rank: DDP's weight and fp32 gradient buffers (the experts'
    own at EP > 1 included), the optimizers' fp32 main params and state."""
    buffers = [buf for chunk in actor.chunks for buf in chunk.buffers + chunk.expert_parallel_buffers]
    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    main = [p for o in inner for g in o.param_groups for p in g["params"]]
    states = [t for o in inner for st in o.state.values() for k, t in st.items()
              if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")]
    return {"weights": sum(b.param_data.numel() * b.param_data.element_size() if b.param_data is not None
                           else sum(p.numel() * p.element_size() for p in b.params) for b in buffers),
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "main_params": sum(p.numel() * p.element_size() for p in main if p.dtype == torch.float32),
            "optimizer": sum(t.numel() * t.element_size() for t in states)}


def allocations(ctx) -> list[dict]:
    """For each TP x PP layout on this world, and each model: this rank's parameter list and the
    bytes megatron allocated for weights, gradients, fp32 main params and optimizer state (after
    one optimizer step: torch creates Adam's state lazily), and, at PP=1, the bytes saved for
    backward by one micro-batch's forward."""
    from megatron.core import parallel_state

    out = []
    for tp, pp in LAYOUTS_4:
        shutdown(keep_default_group=True)
        cfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
        initialize(cfg, seed=3)
        # SGD (never the distributed optimizer) at one layout; Adam at all of them
        runs = [(name, hf_dir, opt) for name, hf_dir in ctx.args["models"].items()
                for opt in (("adam", "sgd") if tp * pp == 1 else ("adam",))]
        for name, hf_dir, optimizer in runs:
            actor = stepped_actor(hf_dir, cfg, optimizer)
            gpt = actor.model.gpt_models[0]
            record = {
                "model": name, "opt": optimizer, "tp": tp, "pp": pp,
                "dp": parallel_state.get_data_parallel_world_size(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "params": [(n, p.numel()) for n, p in gpt.named_parameters()],
            } | allocated_bytes(actor)
            if pp == 1 and optimizer == "adam":
                g = torch.Generator().manual_seed(0)
                tokens = torch.randint(0, 90, (ctx.args["micro_batch"], ctx.args["seq_len"]), generator=g)
                record["saved_activations"] = _saved_activation_bytes(actor.chunks[0], tokens)
            out.append(record)
            del actor
    return out
