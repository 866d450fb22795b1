"""Known-harmless dependency warnings on the CPU tier, filtered once at start-up.

On a machine without CUDA, megatron-core and torch print a dozen warnings per rank that say
nothing about the run: that Apex and Transformer Engine are absent (megatron falls back to torch
implementations, which the CPU tier is built on), that collectives megatron calls are deprecated
in newer torch, megatron's CUDA-graph scope notice, ... . With several ranks they bury the
progress lines. :func:`quiet_known_warnings` filters exactly these (by message, category and the
module that warns) and nothing else; it does nothing on a GPU machine, where a missing Apex or
Transformer Engine is worth hearing about. docs/cpu.md lists them.
"""
from __future__ import annotations

import logging
import warnings

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
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megadiv\.parallel\.cpu_compat",
     "a .grad read of a non-leaf tensor in megatron's training step, reported at the CPU layer's "
     "torch-function mode that every torch call passes through; gradients are unaffected"),
]


def quiet_known_warnings() -> None:
    """Filter the warnings of KNOWN_HARMLESS in this process when there is no CUDA (call it once,
    before megatron-core is imported)."""
    import torch

    # megatron's checkpoint writer logs a writer's error, then raises it; megadiv reports it once
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)
    if torch.cuda.is_available():
        return
    for message, category, module, _ in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
