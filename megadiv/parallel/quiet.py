"""Known-harmless dependency warnings, filtered once at start-up (``MEGADIV_ALL_WARNINGS=1`` shows them all).

On a machine without CUDA, megatron-core and torch print a dozen warnings per rank that say
nothing about the run: that Apex and Transformer Engine are absent (megatron falls back to torch
implementations, which the CPU tier is built on), that collectives megatron calls are deprecated
in newer torch, megatron's CUDA-graph scope notice, DeepSpeed's "Setting accelerator to CPU" ... .
With several ranks they bury the progress lines. :func:`quiet_known_warnings` filters exactly these
(by message, category and the module that warns) and nothing else; on a GPU machine, where a
missing Apex or Transformer Engine is worth hearing about, it keeps them. On every machine it
drops what is addressed to the dependencies' own developers or repeats what megadiv reports:
FutureWarnings raised inside torch, transformers, megatron and DeepSpeed, transformers' progress
bars (loading and writing a model's shards), and megatron's log line for a checkpoint writer's
error, which is raised again and reported once. docs/cpu.md lists them.
"""
from __future__ import annotations

import logging
import os
import warnings

ALL_WARNINGS = "MEGADIV_ALL_WARNINGS"  # =1: filter nothing
FILTERED_NOTE = (f"megadiv: dependency warnings that say nothing about the run are filtered (docs/cpu.md, "
                 f"Quiet output); {ALL_WARNINGS}=1 shows them all")
# FutureWarnings raised inside these packages are deprecation notices to their own developers
DEPENDENCIES = r"(torch|transformers|megatron|deepspeed|accelerate)(\.|$)"

# (message regex (matched at the start), category, module regex of the warning's origin, why harmless)
KNOWN_HARMLESS: list[tuple[str, type[Warning], str, str]] = [
    ("Apex is not installed", UserWarning, r"megatron\.core\.",
     "megatron falls back to torch's RMSNorm; Apex is GPU-only"),
    ("Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core\.",
     "megatron falls back to torch optimizers and local multi-tensor ops; both are GPU-only packages"),
    ("full scope is deprecated", UserWarning, r"megatron\.core\.transformer\.transformer_config",
     "megatron's CUDA-graph scope default; megadiv does not capture CUDA graphs"),
    ("If you are using transformer_engine as the transformer implementation", UserWarning,
     r"megatron\.core\.transformer\.transformer_config",
     "selective recompute of core attention: the CPU tier runs megatron's local attention, not TE's fused one"),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base|_reduce_scatter_base)` "
     r"(is deprecated|is a private function)", FutureWarning, r"torch\.distributed\.c10d_logger",
     "collectives megatron-core 0.16 calls; deprecated in torch 2.13 but working"),
    ("When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     UserWarning, r"megatron\.core\.tensor_parallel\.layers",
     "a CUDA stream setting for overlapping gradient all-reduce; there is no CUDA stream on the CPU tier"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning, r"megadiv\.parallel\.cpu_compat",
     "torch's deprecation of the ShardedTensor that megatron's checkpoint loading uses, reported at the CPU "
     "layer's torch-function mode (on a GPU it is reported inside torch, and filtered with the other "
     "dependency FutureWarnings)"),
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megadiv\.parallel\.cpu_compat",
     "a .grad read of a non-leaf tensor in megatron's training step, reported at the CPU layer's "
     "torch-function mode that every torch call passes through; gradients are unaffected"),
]


def quiet_known_warnings() -> None:
    """Filter the warnings described above in this process (call it once, before megatron-core,
    DeepSpeed or transformers is imported); with MEGADIV_ALL_WARNINGS=1, nothing."""
    if os.environ.get(ALL_WARNINGS) == "1":
        return
    import torch
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", category=FutureWarning, module=DEPENDENCIES)
    transformers_logging.disable_progress_bar()
    # megatron's checkpoint writer logs a writer's error, then raises it; megadiv reports it once
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)
    if torch.cuda.is_available():
        return
    for message, category, module, _ in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    # DeepSpeed logs this at import when it finds no GPU ("DeepSpeed" is its logger's name)
    logging.getLogger("DeepSpeed").addFilter(lambda record: not record.getMessage().startswith(
        "Setting accelerator to CPU"))
