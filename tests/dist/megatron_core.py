"""Rank bodies for tests/test_megatron_cpu.py: the real megatron-core GPTModel on CPU under gloo.

Each body builds a tiny GPTModel at some TP x PP layout, runs it, then rebuilds the same weights
at TP=1 x PP=1 in the same launch (megatron's parallel state torn down and set up again) and
returns the figures the tests compare.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, LAYERS = 128, 16, 2, 4


def _setup(tp: int, pp: int):
    from megadiv.config import ParallelConfig
    from megadiv.parallel import initialize

    return initialize(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=1234)


def _teardown_megatron_only():
    """Drop megatron's groups but keep the default group, so the next layout can be built."""
    from megadiv.parallel import shutdown

    shutdown(keep_default_group=True)


def _model(info, seed: int = 7):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=info.tp_size, pipeline_model_parallel_size=info.pp_size,
        pipeline_dtype=torch.float32, batch_p2p_sync=False, normalization="RMSNorm",
        add_bias_linear=False, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=info.is_first_stage,
                    post_process=info.is_last_stage, share_embeddings_and_output_weights=False)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _positions():
    return torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def _full_state_dict(model, info) -> dict:
    """The TP=1 x PP=1 state dict of ``model``: TP shards concatenated along their partition
    dimension (valid here: no gated MLP), PP stages' local layer numbers made global."""
    from megatron.core import parallel_state

    local = {}
    offset = info.pp_rank * (LAYERS // info.pp_size)
    for name, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and info.tp_size > 1:
            parts = [torch.empty_like(t) for _ in range(info.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            t = torch.cat(parts, dim=p.partition_dim)
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(idx) + offset}.{rest}"
        local[name] = t.clone()
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, local)
    full = {}
    for sd in stages:
        full.update(sd)
    return full


def _load_full_state_dict(model, full: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name])


def _gathered_logits(model, info) -> torch.Tensor | None:
    """Forward on the fixed batch; returns [batch, seq, vocab] on the last stage (gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, _ = _batch()
    if info.pp_size > 1:
        return None
    logits = model(tokens, _positions(), attention_mask=None)  # [b, s, V/TP]
    return gather_from_tensor_model_parallel_region(logits)


def tp_forward_backward(ctx):
    """TP=2: forward + backward through the real TP layers, then TP=1 logits for the same weights."""
    info = _setup(tp=2, pp=1)
    model = _model(info)
    tokens, labels = _batch()
    logits = _gathered_logits(model, info)
    loss = model(tokens, _positions(), attention_mask=None, labels=labels).mean()  # vocab-parallel CE
    loss.backward()
    grad_norm_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
    grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
    full = _full_state_dict(model, info)

    _teardown_megatron_only()
    info1 = _setup(tp=1, pp=1)
    ref = _model(info1, seed=99)
    _load_full_state_dict(ref, full)
    ref_logits = _gathered_logits(ref, info1)
    ref_loss = ref(tokens, _positions(), attention_mask=None, labels=labels).mean()
    return {
        "logits_shape": tuple(logits.shape),
        "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
        "loss": float(loss), "ref_loss": float(ref_loss),
        "grad_norm_sq": grad_norm_sq, "grads_finite": bool(grads_finite),
        "tp_rank": info.tp_rank,
    }


def _train_steps(model, info, steps: int, num_microbatches: int = 2) -> list[float]:
    """Training steps through megatron-core's pipeline schedule and Megatron's Adam optimizer."""
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [ddp])
    tokens, labels = _batch()

    def loss_func(output_tensor):  # [b, s] per-token cross entropy on the last stage
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        tok, lab = next(data_iterator)
        return model(tok, _positions()[: tok.shape[0]], attention_mask=None, labels=lab), loss_func

    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        micro = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(num_microbatches)]
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=1, forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok, "optimizer step reported non-finite gradients"
        step_loss = torch.tensor(sum(float(o["loss"]) for o in out) / num_microbatches if out else 0.0)
        # the loss lives on the last stage: share it so every rank reports the same number
        dist.all_reduce(step_loss, group=_pp_group())
        losses.append(float(step_loss))
    return losses


def _pp_group():
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def pipeline_training(ctx):
    """TP x PP from ctx.args: train a few steps through the 1F1B schedule, then the same start
    weights at TP=1 x PP=1 must follow the same loss curve."""
    tp, pp = ctx.args["tp"], ctx.args["pp"]
    info = _setup(tp=tp, pp=pp)
    model = _model(info)
    start = _full_state_dict(model, info)
    losses = _train_steps(model, info, steps=3)

    _teardown_megatron_only()
    info1 = _setup(tp=1, pp=1)
    ref = _model(info1, seed=99)
    _load_full_state_dict(ref, start)
    ref_losses = _train_steps(ref, info1, steps=3)
    return {"losses": losses, "ref_losses": ref_losses, "pp_rank": info.pp_rank, "tp_rank": info.tp_rank}
