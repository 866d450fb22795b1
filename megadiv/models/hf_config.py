"""Read a Hugging Face ``config.json`` into the architecture facts the Megatron builder needs.

Both spellings of the RoPE settings are accepted: transformers 4.x writes ``rope_theta`` and
``rope_scaling`` at the top level; 5.x moved both into ``rope_parameters`` (``rope_type``,
``rope_theta`` and the scaling fields in one mapping). ``torch_dtype`` (4.x) and ``dtype`` (5.x)
likewise. Anything megatron's local/TE layers cannot reproduce exactly (sliding windows, other
RoPE scalings, MLP biases, other activations) is refused here, by name, before a model is built.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megadiv.config import ConfigError

# Llama 3.x RoPE scaling as megatron-core implements it
# (models/common/embeddings/rotary_pos_embedding.py: RotaryEmbedding._apply_scaling): only the
# factor is a parameter, the other three are fixed to the values every Llama 3.1/3.2/3.3 uses.
LLAMA3_FIXED_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ArchSpec:
    """The architecture of one dense decoder-only checkpoint, independent of parallelism."""

    family: str
    """Key into megadiv.models.families.FAMILIES (the HF ``model_type``)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA); equal to num_attention_heads for plain multi-head attention."""
    head_dim: int
    """Per-head width; Qwen3 sets it explicitly and it may differ from hidden/heads."""
    ffn_hidden_size: int
    vocab_size: int
    """Rows of the HF embedding matrix (may exceed the tokenizer's size, as in Qwen)."""
    max_position_embeddings: int
    rope_theta: float
    rope_scaling_factor: float | None
    """Llama-3 RoPE scaling factor; None when the checkpoint uses plain RoPE."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: str
    """Storage dtype of the checkpoint: float32, bfloat16 or float16."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def load_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {hf_dir}")
    return read_json_config(path)


def read_json_config(path: Path) -> dict:
    """A checkpoint's config.json; a damaged or unreadable one is a ConfigError naming it."""
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}): truncated or damaged") from None


def arch_from_hf_config(cfg: dict) -> ArchSpec:
    """Validate ``cfg`` (a parsed config.json) and return its ArchSpec; raises ConfigError naming
    the unsupported setting."""
    from megadiv.models.families import FAMILIES

    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not supported; "
                          f"supported: {sorted(FAMILIES)} (docs/models.md explains how to add a family)")
    family = FAMILIES[model_type]

    def refuse(key: str, why: str):
        raise ConfigError(f"{model_type} config: {key}={cfg.get(key)!r} is not supported ({why})")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "megadiv builds SwiGLU MLPs")
    if cfg.get("mlp_bias", False):
        refuse("mlp_bias", "the supported families have bias-free MLPs")
    if cfg.get("attention_bias", family.qkv_bias) != family.qkv_bias:
        refuse("attention_bias", f"{model_type} checkpoints have attention_bias={family.qkv_bias}")
    if cfg.get("use_sliding_window", False):
        refuse("use_sliding_window", "megatron's attention here is full causal")
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        refuse("num_experts", "dense models only")

    theta, factor = _rope(cfg, model_type)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(f"{model_type} config: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"{model_type} config: dtype {dtype!r} is not one of {_DTYPES}")
    return ArchSpec(
        family=model_type,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling_factor=factor,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # transformers defaults tie_word_embeddings to True when the key is absent
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        dtype=dtype,
    )


def _rope(cfg: dict, model_type: str) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None) from either config spelling."""
    params = cfg.get("rope_parameters")
    if params is not None:  # transformers 5.x: everything in one mapping
        scaling = params if params.get("rope_type", "default") != "default" else None
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:  # transformers 4.x
        scaling = cfg.get("rope_scaling")
        theta = cfg.get("rope_theta", 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{model_type} config: RoPE scaling type {kind!r} is not supported (only 'llama3')")
    for key, expected in LLAMA3_FIXED_ROPE.items():
        if float(scaling.get(key, expected)) != expected:
            raise ConfigError(
                f"{model_type} config: llama3 RoPE scaling with {key}={scaling[key]} is not supported; "
                f"megatron-core fixes it to {expected}")
    return theta, float(scaling["factor"])
