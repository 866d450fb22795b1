"""Build megatron-core GPTModels (actor or reference) from a Hugging Face checkpoint.

    info = megadiv.parallel.initialize(ParallelConfig(tensor_parallel=2, pipeline_parallel=2))
    model = build_model(ModelConfig(hf_dir="ckpt/Qwen2.5-7B", params_dtype="bfloat16"), role="actor")
    model.chunks          # what megatron's schedules and DDP take: one module per virtual stage
    model.vocab_size      # true vocabulary (HF rows); logits columns >= this are padding
    model.padded_vocab_size

The HF config becomes one TransformerConfig (RMSNorm, SwiGLU, GQA, RoPE theta and Llama-3
scaling, QKV bias / QK layernorm per family); the layer spec is megatron's local spec (CPU, or
``transformer_impl: local``) or the Transformer Engine spec (GPU; required for FP8). Weights are
streamed from the safetensors files, each rank reading only its TP shard of its PP stage's
layers (megadiv.models.loading).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from megadiv.config import ConfigError, ModelConfig, ParallelConfig
from megadiv.models.families import FAMILIES, Family, arch_from_hf_config
from megadiv.models.hf_config import ArchSpec, load_hf_config
from megadiv.models.sharding import VOCAB_MULTIPLE, padded_vocab_size, stage_layer_counts

log = logging.getLogger(__name__)

Role = Literal["actor", "reference"]


@dataclass
class MegatronModel:
    """What :func:`build_model` returns: this rank's part of the model plus the facts needed to
    map it to and from Hugging Face names.

    ``chunks`` are the modules megatron's pipeline schedules take (a list; one entry per virtual
    pipeline stage held by this rank, one entry without interleaving): a GPTModel in float32, a
    megatron Float16Module around it in bf16/fp16. Wrap them in DDP for training (actor); the
    exporter and checkpoint functions see through both wrappers.
    """

    chunks: list[torch.nn.Module]
    arch: ArchSpec
    family: Family
    config: "TransformerConfig"  # noqa: F821 (megatron import kept lazy)
    role: Role
    padded_vocab_size: int
    hf_config: dict
    """The config.json the model was built from (written back on export)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the true vocabulary; logits columns >= vocab_size are padding."""
        return self.arch.vocab_size

    @property
    def gpt_models(self) -> list:
        """The GPTModels inside ``chunks``, unwrapped from Float16Module/DDP."""
        return [unwrap(c) for c in self.chunks]


def runs_in_half_precision(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` holds its GPTModel inside megatron's Float16Module (bf16/fp16 weights)."""
    from megatron.core.transformer.module import Float16Module

    while not isinstance(chunk, Float16Module) and hasattr(chunk, "module"):
        chunk = chunk.module
    return isinstance(chunk, Float16Module)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a chunk (Float16Module, DDP)."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(module, GPTModel):
        module = module.module
    return module


def build_model(source: ModelConfig | str | Path, role: Role = "actor", *, parallel: ParallelConfig | None = None,
                load_weights: bool = True, stage_layers: list[int] | None = None,
                vocab_multiple: int = VOCAB_MULTIPLE, config_overrides: dict | None = None) -> MegatronModel:
    """Build this rank's chunks of the model described by ``source`` (a ModelConfig or an HF
    directory); collective over the model-parallel group when loading weights.

    megadiv.parallel.initialize() must have run: TP, PP and virtual PP sizes come from megatron's
    parallel state; ``parallel`` (optional) supplies sequence_parallel and is checked against it.
    ``load_weights`` streams the HF safetensors (False: leave megatron's random init, e.g. before
    loading a megatron checkpoint). ``stage_layers`` (default: ``parallel.stage_layers``) forces
    the layers per PP stage (see sharding.stage_layer_counts for the default). ``config_overrides``
    are extra TransformerConfig fields. A ``reference`` model is frozen: eval mode, no gradients.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    cfg = source if isinstance(source, ModelConfig) else ModelConfig(hf_dir=str(source))
    if role not in ("actor", "reference"):
        raise ValueError(f"role must be 'actor' or 'reference', got {role!r}")
    if cfg.hf_dir is not None:
        hf_config = load_hf_config(cfg.hf_dir)
        arch = arch_from_hf_config(hf_config)
    else:
        hf_config, arch, load_weights = {}, _arch_from_model_config(cfg), False
    family = FAMILIES[arch.family]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if parallel is not None and (parallel.tensor_parallel, parallel.pipeline_parallel) != (tp, pp):
        raise ConfigError(f"parallel config TP={parallel.tensor_parallel} PP={parallel.pipeline_parallel} does not "
                          f"match the initialised parallel state TP={tp} PP={pp}")
    _check_divisible(arch, tp, pp)
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    sequence_parallel = parallel.sequence_parallel if parallel else False
    check_expert_parallel(arch, tp, ep, sequence_parallel, etp)
    if arch.is_moe:
        _define_te_general_gemm()
    if stage_layers is None and parallel is not None:
        stage_layers = parallel.stage_layers
    padded = padded_vocab_size(arch.vocab_size, tp, vocab_multiple)

    impl = _resolve_impl(cfg)
    config = transformer_config(arch, family, cfg, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sequence_parallel,
                                stage_layers=stage_layer_counts(arch.num_layers, pp, stage_layers),
                                initialize=not load_weights, ep=ep, etp=etp,
                                grouped_experts=impl == "transformer_engine", **(config_overrides or {}))
    spec = layer_spec(family, impl, arch.num_experts or None)
    chunks = []
    for vp_stage in range(vpp or 1):
        vp = vp_stage if vpp else None
        gpt = GPTModel(
            config=config, vocab_size=padded,
            transformer_layer_spec=block_spec(spec, config, vp) if sequence_parallel and impl == "local" else spec,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope", rotary_base=arch.rope_theta,
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 1.0, vp_stage=vp)
        mark_tensor_parallel(gpt)
        if config.params_dtype == torch.float64:  # megatron's torch norms are float32 whatever params_dtype
            gpt.double()
        chunks.append(Float16Module(config, gpt) if (config.bf16 or config.fp16) else gpt)
    model = MegatronModel(chunks=chunks, arch=arch, family=family, config=config, role=role,
                          padded_vocab_size=padded, hf_config=hf_config)
    if load_weights:
        from megadiv.models.loading import load_hf_weights

        load_hf_weights(model, cfg.hf_dir)
    if role == "reference":
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
    return model


def gradient_accumulation_fusion_available() -> bool:
    """Whether megatron's local linear layers can fuse the weight-gradient accumulation: apex's
    CUDA extension fused_weight_gradient_mlp_cuda is importable (megatron asserts otherwise)."""
    from megatron.core.tensor_parallel import layers

    return layers._grad_accum_fusion_available


def transformer_config(arch: ArchSpec, family: Family, cfg: ModelConfig, *, tp: int, pp: int, vpp: int | None,
                       sequence_parallel: bool, stage_layers: list[int], initialize: bool, ep: int = 1,
                       etp: int | None = None, grouped_experts: bool = False, **overrides):
    """The megatron TransformerConfig reproducing the HF architecture exactly (a mixture-of-experts
    model's: ``moe_fields``)."""
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, cfg.params_dtype)
    cuda = torch.cuda.is_available()
    uneven = pp > 1 and len(set(stage_layers)) > 1
    fields = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,  # SwiGLU: silu(x W_gate) * (x W_up)
        add_bias_linear=False, add_qkv_bias=family.qkv_bias, qk_layernorm=family.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel,
        num_layers_in_first_pipeline_stage=stage_layers[0] if uneven else None,
        num_layers_in_last_pipeline_stage=stage_layers[-1] if uneven else None,
        use_cpu_initialization=not cuda,
        # Skipped when every weight is loaded next; mark_tensor_parallel then sets the TP markers
        # that megatron-core < 0.19 sets only inside its init routines.
        perform_initialization=initialize,
        # activation recompute (megatron applies it in training mode only: never to the reference)
        recompute_granularity=None if cfg.recompute_granularity == "none" else cfg.recompute_granularity,
        recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers,
        batch_p2p_sync=cuda,  # True calls torch.cuda.synchronize() around p2p
        # Two stages interleaved: each rank's previous and next stage are the same rank, and in one
        # batch_isend_irecv the activation and the gradient it sends that rank are matched with the
        # peer's receives in posting order, which megatron posts the other way round (observed
        # under gloo: a chunk trained on the other message). Unbatched, megatron sends one
        # direction over a second group for exactly this case (p2p_communication._p2p_ops).
        batch_p2p_comm=not (vpp and pp == 2),
        # the weight gradient GEMM accumulates straight into DDP's fp32 main_grad (apex's
        # fused_weight_gradient_mlp_cuda; TE layers have their own) instead of a bf16 grad and an add
        gradient_accumulation_fusion=cuda and gradient_accumulation_fusion_available(),
    )
    if arch.is_moe:
        fields.update(moe_fields(arch, ep, cfg.moe_aux_loss_coeff, etp or tp, grouped_experts))
        if cuda:
            # The router's GEMM in float64: megatron computes it with Transformer Engine's GEMM
            # wherever TE imports, and TE takes float32 GEMMs in TF32 (10 mantissa bits) whatever
            # torch's flags say, enough to flip near-tie top-k choices between two passes or
            # against the engine. float64 takes torch's matmul (moe_utils.router_gating_linear);
            # [tokens, hidden] x [hidden, experts] is negligible beside the experts' GEMMs.
            fields["moe_router_dtype"] = "fp64"
    if cfg.fp8 != "none" and arch.is_moe:
        raise ConfigError(f"model.fp8={cfg.fp8!r} with a mixture-of-experts model is not supported (megatron pads "
                          f"each expert's tokens for FP8 GEMMs; not wired or tested here): use model.fp8=none")
    if cfg.fp8 != "none":
        from megadiv.models.fp8 import check_fp8_here

        check_fp8_here(cfg.fp8)  # TE version and GPU generation (models/fp8.py)
        # 'hybrid': E4M3 forward, E5M2 gradients; the recipe picks the scaling (delayed/tensorwise/...)
        fields.update(fp8="hybrid", fp8_recipe=cfg.fp8)
    fields.update(overrides)
    # megatron refuses variable_seq_lengths (pipeline stages sending each micro-batch's shape
    # first) with the allgather token dispatcher, because its all-gather needs equally many tokens
    # from every rank of the expert group; megadiv's micro-batches have that (Policy's
    # _expert_group_widths brings micro-batch i of every expert-parallel rank to one width), so
    # the flag is set after megatron's validation. A dense model never dispatches.
    variable_seq_lengths = fields.pop("variable_seq_lengths", False)
    config = TransformerConfig(**fields)
    config.variable_seq_lengths = variable_seq_lengths
    return config


def moe_fields(arch: ArchSpec, ep: int, aux_loss_coeff: float = 0.0, etp: int = 1, grouped: bool = False) -> dict:
    """The TransformerConfig fields of a Qwen3-MoE / Qwen2-MoE layer, routed as transformers routes it.

    HF: p = softmax(x W_gate^T) over all E experts, keep the top k, and with norm_topk_prob
    divide them by their sum. Megatron's softmax router with moe_router_pre_softmax=False takes
    the top k logits first and softmaxes over those k: exp(l_i) / sum_topk exp(l_j), the same
    renormalised probabilities; pre_softmax=True is the unnormalised case. Every token reaches
    all of its k experts (no capacity factor: token-dropless), and the load-balancing loss is off
    unless ``aux_loss_coeff`` > 0 (RL fine-tuning of a trained router; the released checkpoints'
    router_aux_loss_coef applies to pre-training): then megatron's per-micro-batch Switch loss
    coeff * E sum_e f_e P_e of each layer, whose gradient megatron scales, under the per-token loss,
    by the micro-batch's tokens T over the step's loss denominator D (router.py
    _apply_aux_loss): coeff * sum_mb T_mb grad(aux_mb) / D. ``etp``: ranks each expert is split
    over; ``grouped``: Transformer Engine's grouped GEMM over a rank's experts (TEGroupedMLP) in
    place of one MLP per expert (SequentialMLP, the local spec's)."""
    return dict(
        num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk, moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff, moe_expert_capacity_factor=None,
        # alltoall sends each token to its experts' ranks only (megatron's default on GPUs); on the
        # CPU, where its CUDA streams do not exist, allgather: every EP rank gathers the group's
        # tokens and runs its own experts on them.
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather", moe_grouped_gemm=grouped,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        # a shared expert (Qwen2-MoE): out = experts(x) + sigmoid(x W_g) * mlp_shared(x)
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_hidden_size or None,
        moe_shared_expert_gate=arch.moe_shared_expert_hidden_size > 0)


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1 imports ``te_general_gemm`` in transformer/moe/moe_utils.py only when
    Transformer Engine imports, yet the router's RouterGatingLinearFunction tests
    ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError (fixed upstream in 0.19, which defines it as None). Defining the absent name as
    None selects the torch.mm path that test guards, exactly as 0.19 does."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def check_expert_parallel(arch: ArchSpec, tp: int, ep: int, sequence_parallel: bool, etp: int | None = None) -> None:
    """The layouts megadiv builds a model at: EP dividing a mixture-of-experts model's experts,
    expert tensor parallelism (``etp``, None: TP) dividing their width, sequence parallelism with
    experts at TP > 1 (megatron's MoE layer refuses to train without it), and EP > 1 wherever
    ETP < TP: megatron reduces an expert's gradients over its expert-data-parallel group only
    under EP > 1 (otherwise over the data-parallel group, which would leave out the tensor-parallel
    ranks that ran the other sequence slices); EP = 1 and ETP = TP for a dense model."""
    etp = tp if etp is None else etp
    if not arch.is_moe:
        if ep > 1:
            raise ConfigError(f"expert_parallel={ep} needs a mixture-of-experts model; {arch.family} is dense")
        if etp != tp:
            raise ConfigError(f"expert_tensor_parallel={etp} needs a mixture-of-experts model; {arch.family} is dense")
        return
    if arch.num_experts % ep:
        raise ConfigError(f"expert_parallel={ep} does not divide the {arch.num_experts} experts of this model")
    if arch.moe_ffn_hidden_size % etp:
        raise ConfigError(f"expert_tensor_parallel={etp} does not divide the expert width {arch.moe_ffn_hidden_size}")
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"tensor_parallel={tp} with a mixture-of-experts model needs sequence_parallel=true "
                          f"(megatron's MoE layer trains with TP > 1 under sequence parallelism only)")
    if etp < tp and ep == 1:
        raise ConfigError(f"expert_tensor_parallel={etp} below tensor_parallel={tp} needs expert_parallel > 1: "
                          f"megatron reduces the experts' gradients over their expert-data-parallel group only "
                          f"under expert parallelism")


def mark_tensor_parallel(module: torch.nn.Module) -> None:
    """Set megatron's TP markers (tensor_model_parallel, partition_dim, partition_stride) on every
    parameter of ``module`` that lacks them.

    megatron-core before 0.19 sets them on the weights of its own TP layers only inside the init
    routines (tensor_parallel/layers.py, _initialize_affine_weight_cpu/_gpu), which
    ``perform_initialization=False`` skips when the weights are loaded instead (fixed upstream by
    NVIDIA/Megatron-LM#4084, "Set tensor-parallel attributes irrespective of perform_initialization"). Without them the
    gradient-norm and clipping code counts a TP-split weight on TP rank 0 alone, as if it were
    replicated: the norm misses the other shards (on any backend). Transformer Engine's layers
    set their own markers whether or not they initialise. Every other parameter is replicated
    over TP and gets the defaults."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    splits = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))  # (layer, dim)
    for layer in module.modules():
        split = next((dim for cls, dim in splits if isinstance(layer, cls)), None)
        weight = getattr(layer, "weight", None)
        if split is not None and isinstance(weight, torch.nn.Parameter) and not getattr(
                weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=split, stride=1)
    for p in module.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)


def layer_spec(family: Family, impl: str, num_experts: int | None = None):
    """Megatron's local layer spec, or the Transformer Engine spec (needs TE, i.e. a GPU). With
    experts: SequentialMLP (one MLP per expert) in the local spec, TE's grouped GEMM (TEGroupedMLP)
    in the TE spec, whose MoE layer keeps the local spec's checkpoint key for its pre-MLP norm
    (mlp.linear_fc1.layer_norm_weight, megadiv's canonical name), so checkpoints move between the
    two specs (megatron makes the experts' keys interchangeable itself)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                        qk_layernorm=family.qk_layernorm, normalization="RMSNorm")
    if not gpt_layer_specs.HAVE_TE:
        raise ConfigError("model.transformer_impl=transformer_engine needs Transformer Engine, which is not "
                          "importable here (pip install 'megadiv[gpu]' on a CUDA machine); use "
                          "transformer_impl=local, without fp8")
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=family.qk_layernorm)
    if num_experts:
        spec = copy.deepcopy(spec)
        spec.submodules.sharded_state_dict_keys_map = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return spec


def block_spec(layer: "ModuleSpec", config: "TransformerConfig", vp_stage: int | None):  # noqa: F821
    """The local spec's transformer block under sequence parallelism: every norm (the layers',
    their q/k norms and the final one) a :class:`SequenceParallelTorchNorm`."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = copy.deepcopy(layer)
    attention = layer.submodules.self_attention.submodules
    for parent, name in ((layer.submodules, "input_layernorm"), (layer.submodules, "pre_mlp_layernorm"),
                         (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(parent, name) is not IdentityOp:
            setattr(parent, name, SequenceParallelTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


class SequenceParallelTorchNorm:
    """megatron's torch norm (WrappedTorchNorm) in a model with sequence parallelism, which
    megatron refuses for it: under SP each TP rank normalises its slice of the sequence, so the
    weight's gradient is a partial sum that must be summed over TP, and megatron's
    finalize_model_grads sums exactly the parameters marked ``sequence_parallel`` (as Transformer
    Engine's norms mark theirs). Built as without SP (the normalisation of one token does not
    depend on it), its parameters marked. The q/k norms, which see whole sequences of this rank's
    heads, are summed over TP with or without SP."""

    def __new__(cls, config: "TransformerConfig", hidden_size: int, eps: float = 1e-5, **kwargs):  # noqa: F821
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _resolve_impl(cfg: ModelConfig) -> str:
    if cfg.transformer_impl != "auto":
        return cfg.transformer_impl
    from megatron.core.models.gpt import gpt_layer_specs

    if torch.cuda.is_available() and gpt_layer_specs.HAVE_TE:
        return "transformer_engine"
    if cfg.fp8 != "none":
        raise ConfigError(f"model.fp8={cfg.fp8!r} needs Transformer Engine on a GPU; it is not available here")
    return "local"


def _check_divisible(arch: ArchSpec, tp: int, pp: int) -> None:
    if arch.num_query_groups % tp:
        raise ConfigError(
            f"tensor_parallel={tp} does not divide the {arch.num_query_groups} key/value heads of this "
            f"{arch.family} model: megatron-core needs at least one whole KV head per TP rank "
            f"(use a TP that divides {arch.num_query_groups})")
    if arch.num_attention_heads % tp:
        raise ConfigError(f"tensor_parallel={tp} does not divide the {arch.num_attention_heads} attention heads")
    if arch.ffn_hidden_size % tp:
        raise ConfigError(f"tensor_parallel={tp} does not divide the MLP width {arch.ffn_hidden_size}")
    if arch.num_layers < pp:
        raise ConfigError(f"pipeline_parallel={pp} exceeds the {arch.num_layers} layers")


def _arch_from_model_config(cfg: ModelConfig) -> ArchSpec:
    """A randomly initialised Llama-layout model from the ModelConfig fields (no hf_dir)."""
    return ArchSpec(
        family="llama", num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0, rope_scaling_factor=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
        dtype=cfg.params_dtype)
