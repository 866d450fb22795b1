"""One declarative weight table per model family: Megatron name <-> Hugging Face names + layout.

A :class:`Rule` says: the Megatron parameter ``megatron`` (its dist-checkpoint name, i.e. the
Transformer Engine spelling; ``{i}`` is the global layer index, ``{e}`` the global expert index)
is built from the HF tensors ``hf`` (names with ``{i}`` and ``{e}``, each with its full shape in
symbols) fused by ``layout`` (megadiv.models.sharding). Shape symbols: V vocabulary, H hidden,
F MLP width, D head width, Q = heads*D (query rows), KV = key/value heads*D, E routed experts,
M one expert's MLP width, S the shared expert's MLP width.

Mixture-of-experts layers (megatron's MoELayer with SequentialMLP experts): the router is
``mlp.router.weight`` [E, H] (HF ``mlp.gate.weight``), and expert g's MLP is
``mlp.experts.local_experts.{e}.linear_fc1/linear_fc2`` like a dense MLP's. Megatron numbers
experts locally on each expert-parallel rank (``local_experts.0 ..``); megadiv's canonical names
use the global index g = ep_rank * local_experts + i (megadiv.models.loading.megatron_params).
A shared expert (Qwen2-MoE) is megatron's SharedExpertMLP ``mlp.shared_experts.linear_fc1/
linear_fc2``, split over TP like a dense MLP, and its sigmoid gate ``mlp.shared_experts.gate_weight``
[1, H] (HF ``mlp.shared_expert_gate.weight``).

Tables list the pre-layer rules, then the per-layer rules, then the post-layer rules: that is
also the order in which the exporter yields tensors. Adding a family = one table + one entry in
FAMILIES (docs/models.md).

:func:`arch_from_hf_config` reads a parsed ``config.json`` into an ArchSpec. Both spellings of the
RoPE settings are accepted: transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at the top
level; 5.x moved both into ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling
fields in one mapping). ``torch_dtype`` (4.x) and ``dtype`` (5.x) likewise. Anything megatron's
local/TE layers cannot reproduce exactly (sliding windows, other RoPE scalings, MLP biases, other
activations) is refused there, by name, before a model is built.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megadiv.config import ConfigError
from megadiv.models.hf_config import ArchSpec
from megadiv.models.sharding import Layout

EMBED_HF_NAME = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Rule:
    megatron: str
    layout: Layout
    hf: tuple[tuple[str, tuple[str, ...]], ...]
    """(HF name, shape in symbols) for each fused input, in the order the layout concatenates."""
    export: bool = True
    """False for a Megatron copy of a tensor exported elsewhere (the tied output layer)."""

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.megatron

    def megatron_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.megatron.format(i=layer, e=expert)

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [n.format(i=layer, e=expert) for n, _ in self.hf]

    def hf_shapes(self, arch: ArchSpec) -> list[tuple[int, ...]]:
        sizes = {"V": arch.vocab_size, "H": arch.hidden_size, "F": arch.ffn_hidden_size, "D": arch.head_dim,
                 "Q": arch.num_attention_heads * arch.head_dim, "KV": arch.num_query_groups * arch.head_dim,
                 "E": arch.num_experts, "M": arch.moe_ffn_hidden_size, "S": arch.moe_shared_expert_hidden_size,
                 "1": 1}
        return [tuple(sizes[s] for s in shape) for _, shape in self.hf]

    def instances(self, arch: ArchSpec) -> list[tuple[int | None, int | None]]:
        """(layer, expert) of every Megatron tensor this rule makes, in export order."""
        layers = range(arch.num_layers) if self.per_layer else [None]
        experts = range(arch.num_experts) if self.per_expert else [None]
        return [(i, e) for i in layers for e in experts]


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool
    """Biases on q/k/v projections (Qwen2); o_proj and the MLP never have biases here."""
    qk_layernorm: bool
    """RMSNorm over each head's queries and keys before RoPE (Qwen3)."""
    rules: tuple[Rule, ...]
    moe: bool = False
    """Every layer's MLP is a mixture of routed experts."""
    shared_expert: bool = False
    """... plus a gated shared expert (moe only)."""

    def rules_for(self, arch: ArchSpec) -> tuple[Rule, ...]:
        """The rules of this checkpoint: with tied embeddings the output layer is a copy of the
        embedding (megatron holds one on the last pipeline stage) and is not exported."""
        if not arch.tie_word_embeddings:
            return self.rules
        return tuple(replace(r, hf=((EMBED_HF_NAME, ("V", "H")),), export=False)
                     if r.megatron == "output_layer.weight" else r for r in self.rules)


def _layer(name: str) -> str:
    return "decoder.layers.{i}." + name


def _hf_layer(name: str) -> str:
    return "model.layers.{i}." + name


_ATTN = _layer("self_attention.")
_EMBED = Rule("embedding.word_embeddings.weight", Layout.VOCAB, ((EMBED_HF_NAME, ("V", "H")),))
_INPUT_NORM = Rule(_ATTN + "linear_qkv.layer_norm_weight", Layout.REPLICATED,
                   ((_hf_layer("input_layernorm.weight"), ("H",)),))
_QKV = Rule(_ATTN + "linear_qkv.weight", Layout.QKV, (
    (_hf_layer("self_attn.q_proj.weight"), ("Q", "H")),
    (_hf_layer("self_attn.k_proj.weight"), ("KV", "H")),
    (_hf_layer("self_attn.v_proj.weight"), ("KV", "H"))))
_QKV_BIAS = Rule(_ATTN + "linear_qkv.bias", Layout.QKV, (
    (_hf_layer("self_attn.q_proj.bias"), ("Q",)),
    (_hf_layer("self_attn.k_proj.bias"), ("KV",)),
    (_hf_layer("self_attn.v_proj.bias"), ("KV",))))
_Q_NORM = Rule(_ATTN + "q_layernorm.weight", Layout.REPLICATED, ((_hf_layer("self_attn.q_norm.weight"), ("D",)),))
_K_NORM = Rule(_ATTN + "k_layernorm.weight", Layout.REPLICATED, ((_hf_layer("self_attn.k_norm.weight"), ("D",)),))
_O_PROJ = Rule(_ATTN + "linear_proj.weight", Layout.ROW, ((_hf_layer("self_attn.o_proj.weight"), ("H", "Q")),))
_POST_NORM = Rule(_layer("mlp.linear_fc1.layer_norm_weight"), Layout.REPLICATED,
                  ((_hf_layer("post_attention_layernorm.weight"), ("H",)),))
_FC1 = Rule(_layer("mlp.linear_fc1.weight"), Layout.GATE_UP, (
    (_hf_layer("mlp.gate_proj.weight"), ("F", "H")),
    (_hf_layer("mlp.up_proj.weight"), ("F", "H"))))
_FC2 = Rule(_layer("mlp.linear_fc2.weight"), Layout.ROW, ((_hf_layer("mlp.down_proj.weight"), ("H", "F")),))
_ROUTER = Rule(_layer("mlp.router.weight"), Layout.REPLICATED, ((_hf_layer("mlp.gate.weight"), ("E", "H")),))
_EXPERT = "mlp.experts.local_experts.{e}."
_EXPERT_FC1 = Rule(_layer(_EXPERT + "linear_fc1.weight"), Layout.GATE_UP, (
    (_hf_layer("mlp.experts.{e}.gate_proj.weight"), ("M", "H")),
    (_hf_layer("mlp.experts.{e}.up_proj.weight"), ("M", "H"))))
_EXPERT_FC2 = Rule(_layer(_EXPERT + "linear_fc2.weight"), Layout.ROW,
                   ((_hf_layer("mlp.experts.{e}.down_proj.weight"), ("H", "M")),))
_SHARED = "mlp.shared_experts."
_SHARED_FC1 = Rule(_layer(_SHARED + "linear_fc1.weight"), Layout.GATE_UP, (
    (_hf_layer("mlp.shared_expert.gate_proj.weight"), ("S", "H")),
    (_hf_layer("mlp.shared_expert.up_proj.weight"), ("S", "H"))))
_SHARED_FC2 = Rule(_layer(_SHARED + "linear_fc2.weight"), Layout.ROW,
                   ((_hf_layer("mlp.shared_expert.down_proj.weight"), ("H", "S")),))
_SHARED_GATE = Rule(_layer(_SHARED + "gate_weight"), Layout.REPLICATED,
                    ((_hf_layer("mlp.shared_expert_gate.weight"), ("1", "H")),))
_FINAL_NORM = Rule("decoder.final_layernorm.weight", Layout.REPLICATED, (("model.norm.weight", ("H",)),))
_LM_HEAD = Rule("output_layer.weight", Layout.VOCAB, (("lm_head.weight", ("V", "H")),))

LLAMA = Family("llama", qkv_bias=False, qk_layernorm=False, rules=(
    _EMBED, _INPUT_NORM, _QKV, _O_PROJ, _POST_NORM, _FC1, _FC2, _FINAL_NORM, _LM_HEAD))
QWEN2 = Family("qwen2", qkv_bias=True, qk_layernorm=False, rules=(
    _EMBED, _INPUT_NORM, _QKV, _QKV_BIAS, _O_PROJ, _POST_NORM, _FC1, _FC2, _FINAL_NORM, _LM_HEAD))
QWEN3 = Family("qwen3", qkv_bias=False, qk_layernorm=True, rules=(
    _EMBED, _INPUT_NORM, _QKV, _Q_NORM, _K_NORM, _O_PROJ, _POST_NORM, _FC1, _FC2, _FINAL_NORM, _LM_HEAD))
# Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, every MLP routed, no shared expert.
# The post-attention norm keeps the dense name: the local spec maps pre_mlp_layernorm to
# mlp.linear_fc1.layer_norm_ whatever the MLP is.
QWEN3_MOE = Family("qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=True, rules=(
    _EMBED, _INPUT_NORM, _QKV, _Q_NORM, _K_NORM, _O_PROJ, _POST_NORM, _ROUTER, _EXPERT_FC1, _EXPERT_FC2,
    _FINAL_NORM, _LM_HEAD))
# Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases), every MLP routed
# experts plus one gated shared expert.
QWEN2_MOE = Family("qwen2_moe", qkv_bias=True, qk_layernorm=False, moe=True, shared_expert=True, rules=(
    _EMBED, _INPUT_NORM, _QKV, _QKV_BIAS, _O_PROJ, _POST_NORM, _ROUTER, _EXPERT_FC1, _EXPERT_FC2,
    _SHARED_FC1, _SHARED_FC2, _SHARED_GATE, _FINAL_NORM, _LM_HEAD))

# HF model_type -> family (Qwen2.5 checkpoints say "qwen2")
FAMILIES: dict[str, Family] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen2_moe": QWEN2_MOE,
                               "qwen3_moe": QWEN3_MOE}


@dataclass(frozen=True)
class PlannedTensor:
    """One exported HF tensor: which rule and layer produce it and its full shape."""

    hf_name: str
    shape: tuple[int, ...]
    rule: Rule
    layer: int | None
    index: int
    """Position among the rule's fused inputs (0 for q, 1 for k, ...)."""
    expert: int | None = None
    """Global expert index of an expert tensor."""

    @property
    def megatron_name(self) -> str:
        return self.rule.megatron_name(self.layer, self.expert)


def plan(arch: ArchSpec) -> list[PlannedTensor]:
    """Every HF tensor of the checkpoint, in export order: pre-layer rules, each layer's rules
    (an expert rule once per expert), post-layer rules. Computed from the config alone,
    identically on every rank."""
    rules = [r for r in FAMILIES[arch.family].rules_for(arch) if r.export]
    first_layer_rule = next(k for k, r in enumerate(rules) if r.per_layer)
    last_layer_rule = max(k for k, r in enumerate(rules) if r.per_layer)
    ordered = [(r, None, None) for r in rules[:first_layer_rule]]
    for i in range(arch.num_layers):
        for r in rules[first_layer_rule:last_layer_rule + 1]:
            ordered += [(r, i, e) for e in (range(arch.num_experts) if r.per_expert else [None])]
    ordered += [(r, None, None) for r in rules[last_layer_rule + 1:]]
    return [PlannedTensor(name, shape, rule, layer, k, expert)
            for rule, layer, expert in ordered
            for k, (name, shape) in enumerate(zip(rule.hf_names(layer, expert), rule.hf_shapes(arch)))]


# Llama 3.x RoPE scaling as megatron-core implements it
# (models/common/embeddings/rotary_pos_embedding.py: RotaryEmbedding._apply_scaling): only the
# factor is a parameter, the other three are fixed to the values every Llama 3.1/3.2/3.3 uses.
LLAMA3_FIXED_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_DTYPES = ("float32", "bfloat16", "float16")


def arch_from_hf_config(cfg: dict) -> ArchSpec:
    """Validate ``cfg`` (a parsed config.json) and return its ArchSpec; raises ConfigError naming
    the unsupported setting."""
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
    bias_key = "qkv_bias" if "qkv_bias" in cfg else "attention_bias"  # Qwen2-MoE's spelling, the others'
    if cfg.get(bias_key, family.qkv_bias) != family.qkv_bias:
        refuse(bias_key, f"{model_type} checkpoints have {bias_key}={family.qkv_bias}")
    if cfg.get("use_sliding_window", False):
        refuse("use_sliding_window", "megatron's attention here is full causal")
    moe = _moe_fields(cfg, family) if family.moe else {}
    if not family.moe and (cfg.get("num_experts") or cfg.get("num_local_experts")):
        refuse("num_experts", f"{model_type} is a dense family; mixture-of-experts checkpoints are "
                              f"{', '.join(n for n, f in FAMILIES.items() if f.moe)}")

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
        **moe,
    )


def _moe_fields(cfg: dict, family: Family) -> dict:
    """The ArchSpec MoE fields of a Qwen3-MoE or Qwen2-MoE config; refuses layouts megadiv does not
    build (dense layers between the MoE layers, a shared expert the family has not)."""
    model_type = family.name
    # transformers 5.x writes num_local_experts (num_experts is an alias); released checkpoints num_experts
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ConfigError(f"{model_type} config: num_experts is missing or 0")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ConfigError(f"{model_type} config: decoder_sparse_step={cfg.get('decoder_sparse_step', 1)}, "
                          f"mlp_only_layers={cfg.get('mlp_only_layers')} is not supported (megadiv builds every "
                          f"layer as a MoE layer: decoder_sparse_step 1, no mlp_only_layers)")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if bool(shared) != family.shared_expert:
        raise ConfigError(f"{model_type} config: shared_expert_intermediate_size={shared}: {model_type} layers have "
                          + ("a shared expert (> 0)" if family.shared_expert else "no shared experts"))
    topk = cfg["num_experts_per_tok"]
    if not 1 <= topk <= experts:
        raise ConfigError(f"{model_type} config: num_experts_per_tok={topk} must be in 1..num_experts={experts}")
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_shared_expert_hidden_size=shared)


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
