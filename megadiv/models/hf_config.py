"""A Hugging Face ``config.json`` on disk, and :class:`ArchSpec`, the architecture facts the Megatron
builder needs from it.

``ArchSpec`` is read from a parsed config by ``megadiv.models.families.arch_from_hf_config``, which
knows the families; this module knows none, so families.py and sharding.py can both import it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megadiv.config import ConfigError


@dataclass(frozen=True)
class ArchSpec:
    """The architecture of one decoder-only checkpoint (dense, or mixture-of-experts with
    ``num_experts`` > 0), independent of parallelism."""

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
    num_experts: int = 0
    """Routed experts of every MoE layer; 0 for a dense model (then the three fields below are unused)."""
    moe_router_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """MLP width of one expert (HF ``moe_intermediate_size``)."""
    moe_norm_topk_prob: bool = False
    """Whether the top-k routing probabilities are renormalised to sum to 1 (HF ``norm_topk_prob``)."""
    moe_shared_expert_hidden_size: int = 0
    """MLP width of the shared expert every token passes through beside its routed ones, its output
    scaled by sigmoid(x W_g) with W_g [1, H] (HF ``shared_expert_intermediate_size``, Qwen2-MoE); 0: none."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
