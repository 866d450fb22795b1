"""Which FP8 recipe runs where: Transformer Engine versions and GPU generations.

``model.fp8`` names megatron-core's ``fp8_recipe`` (E4M3 forward, E5M2 gradients: 'hybrid'), which
megatron maps to a Transformer Engine recipe (megatron/core/fp8_utils.py, get_fp8_recipe):

    recipe      TE class               TE >=   GPU (compute capability)
    delayed     DelayedScaling         2.0     8.9+ (Ada, Hopper, Blackwell)
    tensorwise  Float8CurrentScaling   2.2     8.9+
    blockwise   Float8BlockScaling     2.3     9.x  (Hopper; 1x128 / 128x128 block scales)
    mxfp8       MXFP8BlockScaling      2.1     10.0+ (Blackwell: MX scales are a tensor-core format)

An older TE makes megatron fall back to delayed scaling silently or fail at the first forward; a
GPU of the wrong generation fails in the first GEMM. :func:`check_fp8` turns both into a
ConfigError naming the key: ``megadiv check-config`` runs it with what it can see on its machine,
the model builder with the GPU it builds on.
"""
from __future__ import annotations

import importlib.metadata

from megadiv.config import ConfigError

# recipe: (minimum TE version, lowest compute capability, first capability it no longer supports)
FP8_RECIPES: dict[str, tuple[tuple[int, int], tuple[int, int], tuple[int, int] | None]] = {
    "delayed": ((2, 0), (8, 9), None),
    "tensorwise": ((2, 2), (8, 9), None),
    "blockwise": ((2, 3), (9, 0), (10, 0)),
    "mxfp8": ((2, 1), (10, 0), None),
}


def te_version() -> tuple[int, int] | None:
    """Transformer Engine's (major, minor) from the installed distribution, without importing it."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            major, minor = importlib.metadata.version(dist).split(".")[:2]
            return int(major), int(minor)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    return None


def check_fp8(recipe: str, te: tuple[int, int] | None, capability: tuple[int, int] | None) -> None:
    """Raise ConfigError if ``model.fp8=recipe`` cannot run with TE ``te`` on a GPU of compute
    capability ``capability`` (None: not known here, not checked)."""
    if recipe == "none":
        return
    min_te, low, high = FP8_RECIPES[recipe]
    if te is not None and te < min_te:
        raise ConfigError(f"model.fp8={recipe!r} needs Transformer Engine >= {min_te[0]}.{min_te[1]}; "
                          f"{te[0]}.{te[1]} is installed")
    if capability is not None and (capability < low or (high is not None and capability >= high)):
        where = f"compute capability {low[0]}.{low[1]}" + (f" to below {high[0]}.{high[1]}" if high else " or newer")
        hint = " (Blackwell)" if recipe == "mxfp8" else " (Hopper)" if recipe == "blockwise" else ""
        raise ConfigError(f"model.fp8={recipe!r} needs a GPU of {where}{hint}; this GPU has compute capability "
                          f"{capability[0]}.{capability[1]}" + ("; use 'tensorwise' or 'delayed'" if recipe != "delayed"
                                                              and capability >= (8, 9) else ""))


def check_fp8_here(recipe: str) -> None:
    """:func:`check_fp8` with this machine's TE and first GPU (whatever of them is present)."""
    import torch

    capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
    check_fp8(recipe, te_version(), capability)
