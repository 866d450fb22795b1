"""The output layer at chosen positions only.

A policy reads logits only where a loss reads them: at the positions that predict response
tokens. With prompts of 512 tokens and responses of 32 that is one position in 17, and the
output layer ([tokens, h] x [h, V/TP]), the [tokens, V/TP] logits and every pass over them
(log-probs, entropy, full-vocabulary divergences) shrink alike.

megatron-core's GPTModel applies its output layer to every position inside ``forward``; within
:func:`logits_at`, a forward pre-hook hands the output layer the chosen rows of the final hidden
states instead, so everything else (embedding, decoder, Float16Module's casts, the tied output
weight, the pipeline schedule) runs as megatron wrote it. The model builds no multi-token
prediction block (builder.py), the one other reader of those hidden states.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megadiv.models.builder import unwrap


@contextmanager
def logits_at(chunk: torch.nn.Module, index: torch.Tensor):
    """Within this block, a forward of ``chunk`` (a model chunk as megatron's schedules take it:
    a GPTModel, maybe inside Float16Module and DDP) on a pipeline's last stage returns the logit
    shard [1, n, V/TP] at ``index`` [n] only: positions of the final hidden states flattened from
    megatron's [s, b, h] layout. Other stages are untouched (they have no output layer)."""
    gpt = unwrap(chunk)
    if not gpt.post_process:
        yield
        return
    layer = gpt.output_layer
    sequence_parallel = layer.sequence_parallel

    def pick(module, args):
        hidden = args[0]  # [s, b, h]; [s/TP, b, h] under sequence parallelism
        if sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every rank needs the chosen rows whole; the backward keeps this rank's part of the
            # gradient, which the output layer all-reduces over TP (copy_to_tensor_model_parallel_region)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return (hidden.flatten(0, 1).index_select(0, index).unsqueeze(1), *args[1:])  # [n, 1, h]

    handle = layer.register_forward_pre_hook(pick)
    # the rows are gathered already: the layer must not gather them again (megatron's own inference
    # path, GPTModel._postprocess, switches it off around the output layer the same way)
    layer.sequence_parallel = False
    try:
        yield
    finally:
        handle.remove()
        layer.sequence_parallel = sequence_parallel
