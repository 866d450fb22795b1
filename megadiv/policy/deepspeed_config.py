"""The ``deepspeed:`` section: how the DeepSpeed backend (``model.backend: deepspeed``) runs ZeRO.

The DeepSpeed JSON config is built from megadiv's own keys (``engine_config``): the optimizer,
its clipping and the LR schedule come from ``optim``, the precision from ``model.params_dtype``,
the ZeRO stage and offload from this section. Raw DeepSpeed keys go in ``deepspeed.config`` (the
escape hatch, e.g. ``zero_optimization.reduce_bucket_size``); ``check_raw_keys`` validates them
against DeepSpeed's own config classes when the config is loaded: a key DeepSpeed does not read
is refused with the closest one it does, and a key megadiv sets itself is refused naming the
megadiv key to use instead.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from megadiv.config import ConfigError, ModelConfig, OptimConfig, _merge

# DeepSpeed keys megadiv derives from its own config, and the megadiv key that sets each.
OWNED_KEYS = {
    "train_batch_size": "grpo.micro_batch_size (megadiv accumulates micro-batches itself)",
    "train_micro_batch_size_per_gpu": "grpo.micro_batch_size",
    "gradient_accumulation_steps": "grpo.micro_batch_size (megadiv accumulates micro-batches itself)",
    "managed_gradient_accumulation": "(none: megadiv marks the accumulation boundary itself)",
    "gradient_clipping": "optim.clip_grad",
    "optimizer": "optim.*",
    "scheduler": "optim.warmup_steps / optim.decay_style",
    "fp16": "model.params_dtype",
    "bf16": "model.params_dtype",
    "zero_allow_untested_optimizer": "(none: megadiv's optimizer is torch's AdamW or SGD)",
    "zero_force_ds_cpu_optimizer": "(none: megadiv's optimizer is torch's AdamW or SGD)",
    "zero_optimization.stage": "deepspeed.zero_stage",
    "zero_optimization.offload_optimizer": "deepspeed.offload_optimizer",
    "zero_optimization.offload_param": "deepspeed.offload_params",
    "activation_checkpointing": "deepspeed.gradient_checkpointing (Hugging Face's per-layer checkpointing)",
    "data_types": "model.params_dtype (bf16 accumulates gradients in fp32 at ZeRO >= 1; DeepSpeed refuses "
                  "that mix at ZeRO-0)",
}


@dataclass(frozen=True)
class DeepSpeedConfig:
    """ZeRO for the DeepSpeed backend; every key here needs ``model.backend: deepspeed``."""

    zero_stage: int = 0
    """ZeRO stage: 0 plain data parallelism, 1 optimizer state sharded over the data-parallel
    ranks, 2 also gradients, 3 also parameters (gathered layer by layer in forward/backward)."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep the optimizer state (and its step) in host memory (ZeRO stage >= 1)."""
    offload_params: Literal["none", "cpu"] = "none"
    """Keep the parameters in host memory between uses (ZeRO stage 3)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (Hugging Face's
    gradient_checkpointing_enable; the actor only). The Megatron keys model.recompute_* do not
    apply to this backend."""
    config: dict = field(default_factory=dict)
    """Raw DeepSpeed config keys merged into the generated config (e.g. {zero_optimization:
    {reduce_bucket_size: 50000000}}); checked against DeepSpeed's config classes, and keys that
    megadiv sets from its own config are refused."""

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ConfigError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ConfigError("deepspeed.offload_params needs deepspeed.zero_stage=3")
        for dotted in _dotted_keys(self.config):
            owner = next((OWNED_KEYS[k] for k in OWNED_KEYS if dotted == k or dotted.startswith(k + ".")), None)
            if owner is not None:
                raise ConfigError(f"deepspeed.config.{dotted} is set by megadiv from its own config; use {owner}")


def engine_config(ds: DeepSpeedConfig, model: ModelConfig, optim: OptimConfig | None) -> dict:
    """The DeepSpeed JSON config of a policy: an actor (``optim`` given) or a frozen reference
    (``optim`` None: no optimizer, no clipping)."""
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer}
    if ds.offload_params != "none":
        zero["offload_param"] = {"device": ds.offload_params}
    generated = {
        # bookkeeping only: megadiv marks the accumulation boundary and scales the loss itself
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.clip_grad if optim is not None else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": model.params_dtype == "bfloat16"},
        # megadiv's optimizer is torch's AdamW/SGD, as megatron's on CPU (same update rule)
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
    }
    if model.params_dtype == "bfloat16" and ds.zero_stage >= 1:
        # DeepSpeed accumulates gradients in the model's dtype unless told otherwise: bf16 (8
        # mantissa bits) sums of many micro-batches. fp32 instead: at ZeRO-1 DeepSpeed's
        # BF16_Optimizer, at 2/3 the ZeRO optimizer's fp32 partitions. ZeRO-0 refuses the mix
        # (engine._do_optimizer_sanity_check: "unsupported mix"), docs/deepspeed.md.
        generated["data_types"] = {"grad_accum_dtype": "fp32"}
    return _merge(generated, ds.config)


def check_raw_keys(ds: DeepSpeedConfig, model: ModelConfig, optim: OptimConfig) -> None:
    """Parse the generated config with DeepSpeed's own DeepSpeedConfig: a nested key DeepSpeed's
    pydantic sections do not know, a wrong type, or a top-level key DeepSpeed never reads is a
    ConfigError naming ``deepspeed.config.<key>``."""
    from deepspeed.runtime.config import DeepSpeedConfig as Parsed

    full = engine_config(ds, model, optim)
    recorder = _ReadKeys(full)
    try:
        Parsed(recorder)
    except Exception as e:  # pydantic's ValidationError, DeepSpeed's asserts and DeepSpeedConfigError
        raise ConfigError(f"deepspeed.config is refused by DeepSpeed's config parser: "
                          f"{' '.join(str(e).split())[:600]}") from None
    unread = sorted(k for k in ds.config if k not in recorder.read)
    if unread:
        close = difflib.get_close_matches(unread[0], sorted(recorder.read), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"deepspeed.config.{unread[0]} is not a DeepSpeed config key{hint}")


class _ReadKeys(dict):
    """A dict that records which top-level keys were looked up (DeepSpeedConfig reads each known
    key with ``get``/``in``/``[]`` and ignores the rest). ``copy.copy`` keeps the shared record."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _dotted_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out += _dotted_keys(v, f"{prefix}{k}.")
    return out

