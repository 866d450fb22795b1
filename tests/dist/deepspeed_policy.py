"""Rank bodies for tests/test_deepspeed_policy.py: the DeepSpeed policy on real DeepSpeed (CPU
accelerator, gloo) next to the Megatron policy on real megatron-core."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import DIVERGENCES, PolicyLossConfig
from megadiv.parallel import initialize
from megadiv.trainer import checkpoint
from megadiv.policy.deepspeed_config import DeepSpeedConfig
from megadiv.policy.objectives import grpo_objective
from megadiv.policy.megatron import Policy
from megadiv.policy.deepspeed import DeepSpeedPolicy
from tests.dist.trainer_policy import ADAM, ROWS, SGD, _batch

# a k3-clipped loss with a KL penalty to the reference, and the full-vocabulary regulariser
LOSS = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.01, kl_coef=0.1, loss_agg="token-mean",
                        regularizer="full_prob_l2", regularizer_coef=0.5)
MICRO = 2  # micro-batch rows: the global batch is several micro-batches on every rank


def _my_rows() -> slice:
    per = ROWS // dist.get_world_size()
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def _steps(actor, reference, optim_steps: int) -> list[dict]:
    batch = _batch().rows(_my_rows())
    batch.logp_ref = reference.log_probs(batch, micro_batch_size=MICRO)
    batch.logp_old = actor.log_probs(batch, micro_batch_size=MICRO)
    regularizer = DIVERGENCES[LOSS.regularizer](consume_base=True)
    return [actor.train_step(batch, grpo_objective(LOSS), MICRO, regularizer, reference) for _ in range(optim_steps)]


def _weights(actor) -> dict[str, torch.Tensor]:
    return {name: t for bucket in actor.export_buckets(4096) for name, t in bucket}


def _pair(make, optim: OptimConfig, steps: int) -> dict:
    actor, reference = make("actor", optim), make("reference", None)
    return {"steps": _steps(actor, reference, steps), "weights": _weights(actor)}


def parity(ctx):
    """One process: Megatron (TP=1) and DeepSpeed ZeRO-0 on the same model and batch; SGD for one
    step (the weights show the gradient), Adam with clipping for three. Plus a NaN step (skipped)
    and the bucket sizes of the export."""
    hf_dir = ctx.args["hf_dir"]
    parallel = ParallelConfig()
    initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=hf_dir)

    def megatron(role, optim):
        return Policy(model, parallel, role, optim, total_steps=3, temperature=0.7)

    def deepspeed(role, optim, stage=0):
        return DeepSpeedPolicy(ModelConfig(hf_dir=hf_dir, backend="deepspeed"), DeepSpeedConfig(zero_stage=stage),
                               role, optim, total_steps=3, temperature=0.7)

    out = {name: {"sgd": _pair(make, SGD, 1), "adam": _pair(make, ADAM, 3)}
           for name, make in (("megatron", megatron), ("zero0", deepspeed))}
    actor = deepspeed("actor", ADAM)
    bad = _batch()
    bad.advantages = torch.full((ROWS,), float("nan"))
    before = _weights(actor)
    out["nan_step"] = actor.train_step(bad, grpo_objective(PolicyLossConfig()), MICRO)
    out["nan_unchanged"] = all(torch.equal(before[k], w) for k, w in _weights(actor).items())
    out["bucket_bytes"] = [(sum(t.numel() * t.element_size() for _, t in b), len(b)) for b in actor.export_buckets(4096)]
    return out


def zero3(ctx):
    """Two ranks, ZeRO-3 (parameters, gradients and Adam state partitioned; ZeRO-3 reference):
    the same steps as ``parity`` on each rank's half of the global batch; then exact resume: a
    checkpoint after step 1 of 2, restored into a fresh engine that takes step 2 again."""
    hf_dir, run_dir = ctx.args["hf_dir"], Path(ctx.args["run_dir"])
    parallel = ParallelConfig()
    initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=hf_dir, backend="deepspeed")
    ds = DeepSpeedConfig(zero_stage=3)

    def make(role, optim):
        return DeepSpeedPolicy(model, ds, role, optim, total_steps=3, temperature=0.7)

    out = {"sgd": _pair(make, SGD, 1), "adam": _pair(make, ADAM, 3)}
    # the same SGD step with Hugging Face's activation checkpointing, and at ZeRO-2 with the
    # optimizer state offloaded to host memory
    for name, other in (("sgd_checkpointing", DeepSpeedConfig(zero_stage=3, gradient_checkpointing=True)),
                        ("sgd_zero2_offload", DeepSpeedConfig(zero_stage=2, offload_optimizer="cpu"))):
        out[name] = _pair(lambda role, optim: DeepSpeedPolicy(model, other, role, optim, 3, temperature=0.7), SGD, 1)

    actor, reference = make("actor", ADAM), make("reference", None)
    # ZeRO-3 holds a partition of each parameter (p.numel() == 0 outside a gather)
    out["partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in actor.module.parameters())
    first = _steps(actor, reference, 1)
    checkpoint.save_checkpoint(run_dir, 1, actor, {"step": 1}, keep_last=1, parallel=parallel)
    continued = {"rand": torch.rand(3).tolist(), "step": _steps(actor, reference, 1)}
    weights = _weights(actor)
    torch.manual_seed(999)  # the RNG must come back from the checkpoint
    resumed_actor = make("actor", ADAM)
    state = checkpoint.load_checkpoint(checkpoint.find_resume_point(run_dir, parallel), resumed_actor)
    resumed = {"rand": torch.rand(3).tolist(), "step": _steps(resumed_actor, reference, 1)}
    out["resume"] = {"first": first, "continued": continued, "resumed": resumed, "state": state,
                     "bitwise": all(torch.equal(weights[k], w) for k, w in _weights(resumed_actor).items()),
                     "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())}
    return out


def bf16_stages(ctx):
    """One rank, bf16 weights (``model.params_dtype: bfloat16``, DeepSpeed's bf16 engine, fp32
    master weights and Adam state): three steps of ``parity``'s batch and loss at ZeRO-0, ZeRO-1 and
    ZeRO-3 (on one rank its partitioning hooks still gather and release every parameter), each from
    the same weights. The GPU check's ``deepspeed_bf16`` item runs it on the GPU; a CPU test too."""
    import time

    hf_dir = ctx.args["hf_dir"]
    initialize(ParallelConfig(), seed=1)
    model = ModelConfig(hf_dir=hf_dir, backend="deepspeed", params_dtype="bfloat16")
    out = {}
    for stage in ctx.args.get("stages", (0, 1, 3)):
        def make(role, optim, stage=stage):
            return DeepSpeedPolicy(model, DeepSpeedConfig(zero_stage=stage), role, optim, total_steps=3, temperature=0.7)

        start = time.perf_counter()
        actor, reference = make("actor", ADAM), make("reference", None)
        steps = _steps(actor, reference, 3)
        weights = _weights(actor)
        out[stage] = {"steps": steps, "wall_s": time.perf_counter() - start,
                      "dtypes": sorted({str(w.dtype) for w in weights.values()}),
                      "device": str(next(actor.module.parameters()).device),
                      "optimizer": type(actor.engine.optimizer).__name__,
                      "grad_accum_dtype": str(actor.engine.get_data_types()[1]),
                      "weights": {k: w.float().cpu() for k, w in weights.items()}}
        del actor, reference
    return out
