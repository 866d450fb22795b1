"""Memory planner: what one GPU holds for a model at a TP x PP x DP (x EP) layout, before launching.

    arch = arch_from_hf_config(json.load(open("Qwen2.5-32B/config.json")))
    plan = plan_layout(arch, Layout(tp=8, pp=2, dp=1), Workload(micro_batch_size=2, seq_len=2048))
    plan.per_gpu_bytes, plan.components        # the worst pipeline stage, by component

Parameters, gradients and optimizer state are counted the way megatron-core 0.16 allocates them
for megadiv's model (megadiv.models.builder + trainer.policy): the per-rank parameter list of each
pipeline stage (the padded vocabulary, TP shards, the tied output copy on the last stage), laid out
in DDP's contiguous buffers (``distributed/param_and_grad_buffer.py``: reverse order, with the
distributed optimizer each parameter start padded to 64 elements and each bucket end to
lcm(DP, 128), the shared embedding in its own bucket), and the distributed optimizer's DP shard of
every bucket (``optimizer/distrib_optimizer.py``). A mixture-of-experts layer holds its router and
num_experts/EP local experts, each split over the expert-tensor-parallel ranks (ETP, TP by
default); under EP > 1 these experts' weights sit in DDP buffers of their own, reduced and sharded
over the expert-data-parallel group of TP x DP / (ETP x EP) ranks (``distributed_data_parallel.py``:
parameters without ``allreduce``). tests/test_plan.py and
tests/test_plan_moe.py check these numbers against what megatron allocates on CPU, exactly.

Activations are the tensors saved for backward per micro-batch, written term by term from what the
layers keep (formulas in :func:`layer_activation_bytes`, per token); "local" is megatron's local
spec (the CPU tier: unfused attention with the [b, heads, s, s] softmax, torch norms in fp32),
"te" Transformer Engine (GPU: flash attention, fused norm + linear). The local formula is checked
against the saved tensors on CPU (within 25%); the TE one follows the same accounting unverified.
A mixture-of-experts layer's router, token dispatch and experts are counted at the expected even
load (each token's top-k rows spread evenly over the experts), checked on CPU at TP=1 (EP=1, 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megadiv.config import OptimConfig
from megadiv.models.families import FAMILIES
from megadiv.models.hf_config import ArchSpec
from megadiv.models.sharding import VOCAB_MULTIPLE, padded_vocab_size, stage_layer_counts

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PARAM_ALIGN = 64
"""Distributed optimizer: every parameter starts at a multiple of 64 elements of the buffer."""
BUCKET_ALIGN = 128
"""... and every bucket ends at a multiple of lcm(DP, 128) elements."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    """Expert-parallel ranks splitting the experts (num_experts/EP each)."""
    etp: int | None = None
    """Expert tensor parallelism (parallel.expert_tensor_parallel): each expert split over ETP
    ranks; None: TP (megatron's default expert_tensor_parallel_size)."""

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp, self.ep, self.expert_tp) < 1 or self.tp % self.expert_tp:
            raise ValueError(f"{self}: sizes must be >= 1 and ETP must divide TP")
        if (self.tp * self.dp) % (self.expert_tp * self.ep):
            raise ValueError(f"{self}: ETP x EP must divide the TP x DP ranks of a stage (expert groups are cut "
                             f"from them)")

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: ranks holding the same expert shard, per stage."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    def __str__(self) -> str:
        experts = ", ".join([f"EP={self.ep}"] * (self.ep > 1) + [f"ETP={self.expert_tp}"] * (self.expert_tp != self.tp))
        return f"TP={self.tp} x PP={self.pp} x DP={self.dp}" + (f" ({experts})" if experts else "")

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "etp": self.expert_tp}


@dataclass(frozen=True)
class Workload:
    """What the run does per GPU, from the run config (megadiv.cli.plan builds it)."""

    micro_batch_size: int
    seq_len: int
    """Tokens per row: longest prompt + rollout.max_new_tokens (rows are padded to the longest)."""
    logit_positions: int | None = None
    """Positions per row whose logits are made: rollout.max_new_tokens, since the output layer sees
    only those that predict response tokens (models/output.py); None: every position (seq_len)."""
    micro_batches_in_flight: int = 1
    """Micro-batches per mini-batch on one DP replica (1F1B keeps min(PP, this) on stage 0)."""
    params_dtype: str = "bfloat16"
    optimizer: Literal["adam", "sgd"] = "adam"
    distributed_optimizer: bool | None = None
    """optim.distributed_optimizer (unset: megatron's distributed optimizer with Adam at DP > 1)."""
    reference: bool = False
    """A frozen reference model beside the actor (KL penalty or regulariser)."""
    log_probs_chunk: int | None = None
    """Token rows per vocab-parallel log-prob chunk (None: megadiv's ~2 MiB default)."""
    sequence_parallel: bool = False
    spec: Literal["te", "local"] = "te"
    """Layer implementation the activations are counted for (GPU: Transformer Engine)."""
    recompute_method: Literal["uniform", "block"] | None = None
    """model.recompute_method with full recompute (None: every layer keeps its activations;
    selective recompute is counted as none, an upper bound)."""
    recompute_num_layers: int = 0
    """model.recompute_num_layers: layers per checkpointed group (uniform) or per stage (block)."""
    server_fraction: float = 0.0
    """GPU memory fraction a colocated SGLang server reserves (rollout.mem_fraction_static)."""
    bucket_bytes: int = 0
    """rollout.bucket_bytes: every rank holds one gathered bucket during a weight sync
    (megadiv.models.export) ..."""
    rank0_bucket_copies: int = 0
    """... and global rank 0 this many more: the bucket exported ahead while the one before is
    sent to SGLang servers (rollout/weight_sync.py exported_ahead), and the flattened copy
    broadcast to the fleet (none without a broadcast group)."""
    rank0_queued_buckets: int = 0
    """Gathered buckets global rank 0 holds beyond the one being gathered while the slowest server
    reads, without a broadcast group: a queue per member (rollout/fleet.py QUEUE_DEPTH) plus the
    one each member sends."""
    rank0_communicators: int = 0
    """NCCL communicators global rank 0 opens for weight syncs (the fleet's one broadcast group)."""
    batch_host_bytes: int = 0
    """Host bytes of the batches the rollout driver holds on node 0 (its own process beside global
    rank 0 with SGLang, rank 0 itself with the embedded engine): the batch trained on, and with
    grpo.overlap the one generated ahead (:func:`driver_batch_bytes`)."""
    host_bytes_per_rank: int = 0
    """Host memory of a node divided by its ranks (0: not checked)."""
    reserve_bytes: int = 3 * GiB
    """CUDA context, NCCL buffers, allocator fragmentation: held back from every GPU."""


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    shared_embedding: bool = False
    """megatron's flag for a tied embedding split over the first and last stages (own DDP bucket)."""
    allreduce: bool = True
    """megatron's flag, False for an expert weight under EP > 1: its gradient is reduced over the
    expert-data-parallel group (TP x DP / (ETP x EP) ranks), in DDP buffers of its own."""


def stage_params(arch: ArchSpec, tp: int, pp: int, stage: int, stage_layers: list[int] | None = None,
                 vocab_multiple: int = VOCAB_MULTIPLE, ep: int = 1, etp: int | None = None) -> list[Param]:
    """One TP (and EP) rank's parameters of pipeline ``stage``, in megatron's registration order
    (local spec; Transformer Engine fuses the norms into the linear layers: same sizes, other names).
    A mixture-of-experts layer has, in place of the MLP, a router [E, h] replicated over TP and its
    E/EP local experts, each split over ETP (``etp``, None: TP) ranks as the dense MLP is over TP (fc1
    by columns, fc2 by rows)."""
    family = FAMILIES[arch.family]
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    vocab_rows = padded_vocab_size(arch.vocab_size, tp, vocab_multiple) // tp
    first, last = stage == 0, stage == pp - 1
    tied_split = arch.tie_word_embeddings and pp > 1
    out: list[Param] = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", vocab_rows * h, shared_embedding=tied_split and not last))
    counts = stage_layer_counts(arch.num_layers, pp, stage_layers)
    for i in range(counts[stage]):
        layer = f"decoder.layers.{i}."  # megatron's names count the stage's own layers
        out.append(Param(layer + "input_layernorm.weight", h))
        out.append(Param(layer + "self_attention.linear_proj.weight", h * q // tp))
        out.append(Param(layer + "self_attention.linear_qkv.weight", (q + 2 * kv) // tp * h))
        if family.qkv_bias:
            out.append(Param(layer + "self_attention.linear_qkv.bias", (q + 2 * kv) // tp))
        if family.qk_layernorm:
            out += [Param(layer + "self_attention.q_layernorm.weight", d),
                    Param(layer + "self_attention.k_layernorm.weight", d)]
        out.append(Param(layer + "pre_mlp_layernorm.weight", h))
        if arch.is_moe:
            out.append(Param(layer + "mlp.router.weight", arch.num_experts * h))
            fe = arch.moe_ffn_hidden_size // (etp or tp)
            for j in range(arch.num_experts // ep):
                expert = f"{layer}mlp.experts.local_experts.{j}."
                out += [Param(expert + "linear_fc1.weight", 2 * fe * h, allreduce=ep == 1),
                        Param(expert + "linear_fc2.weight", h * fe, allreduce=ep == 1)]
            if arch.moe_shared_expert_hidden_size:  # its own gate first, then its MLP split over TP
                fs, shared = arch.moe_shared_expert_hidden_size, f"{layer}mlp.shared_experts."
                out += [Param(shared + "gate_weight", h), Param(shared + "linear_fc1.weight", 2 * fs // tp * h),
                        Param(shared + "linear_fc2.weight", h * fs // tp)]
        else:
            out.append(Param(layer + "mlp.linear_fc1.weight", 2 * f // tp * h))
            out.append(Param(layer + "mlp.linear_fc2.weight", h * f // tp))
    if last:
        out.append(Param("decoder.final_layernorm.weight", h))
        if not arch.tie_word_embeddings or pp > 1:  # tied at PP=1: the embedding itself
            out.append(Param("output_layer.weight", vocab_rows * h, shared_embedding=tied_split))
    return out


def parameter_count(arch: ArchSpec, active: bool = False) -> int:
    """Parameters of the Hugging Face model (true vocabulary, one copy of a tied embedding).

    A mixture-of-experts layer holds a router [E, H] and E experts of 3 H F_e each (gate, up,
    down), and a shared expert of 3 H F_s with its gate [1, H] where there is one (Qwen2-MoE);
    ``active`` counts what one token passes through: the router, its top-k experts, the shared one
    (the "A3B" of Qwen3-30B-A3B)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    family = FAMILIES[arch.family]
    layer = 2 * h + (q + 2 * kv) * h + q * h
    layer += (q + 2 * kv) * family.qkv_bias + 2 * d * family.qk_layernorm
    if arch.is_moe:
        experts = arch.moe_router_topk if active else arch.num_experts
        layer += arch.num_experts * h + experts * 3 * h * arch.moe_ffn_hidden_size
        if arch.moe_shared_expert_hidden_size:  # every token's: its gate [1, H] and its MLP
            layer += h + 3 * h * arch.moe_shared_expert_hidden_size
    else:
        layer += 3 * h * arch.ffn_hidden_size
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return embeddings + arch.num_layers * layer + h


@dataclass(frozen=True)
class BufferLayout:
    """DDP's contiguous param/grad buffer of one rank (megatron's _ParamAndGradBuffer)."""

    numel: int
    """Elements of the buffer, padding included (what grad_data / param_data allocate)."""
    params: dict[str, tuple[int, int, int]]
    """name -> (start, end, bucket)."""
    buckets: list[tuple[int, int]]


def buffer_layout(params: list[Param], distributed: bool, dp: int) -> BufferLayout:
    """The buffer megatron builds for ``params`` (no overlapped grad reduce: one bucket, except a
    shared embedding's own bucket under the distributed optimizer)."""
    def pad(n: int, k: int) -> int:
        return -(-n // k) * k

    def end_bucket(end: int) -> int:
        return pad(end, math.lcm(dp, BUCKET_ALIGN)) if distributed else end

    placed, buckets = {}, []
    start = bucket_start = 0
    in_bucket = 0
    for p in reversed(params):  # backprop order
        if distributed:
            start = pad(start, PARAM_ALIGN)
        own = p.shared_embedding and distributed
        if own and in_bucket:
            start = end_bucket(start)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
        placed[p.name] = (start, start + p.numel, len(buckets))
        in_bucket += 1
        start += p.numel
        if own:
            start = end_bucket(start)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
    if in_bucket:
        start = end_bucket(start)
        buckets.append((bucket_start, start))
    return BufferLayout(start, placed, buckets)


def optimizer_shard_numel(layout: BufferLayout, dp: int, dp_rank: int) -> int:
    """Parameter elements whose optimizer state DP rank ``dp_rank`` owns: the intersection of its
    1/DP slice of every bucket with the parameters there (padding holds no state)."""
    total = 0
    for b, (b0, b1) in enumerate(layout.buckets):
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        total += sum(max(0, min(hi, e) - max(lo, s)) for s, e, pb in layout.params.values() if pb == b)
    return total


@dataclass(frozen=True)
class StateBytes:
    """Bytes megatron allocates on one rank for the actor's weights and their training state."""

    weights: int
    """Model weights (params_dtype): DDP's param buffers under the distributed optimizer."""
    grads: int
    """DDP's fp32 gradient buffer (grad_reduce_in_fp32)."""
    main_params: int
    """fp32 master copy of bf16/fp16 weights (this rank's shard under the distributed optimizer)."""
    optimizer: int
    """fp32 optimizer state of this rank's shard: Adam's exp_avg and exp_avg_sq, SGD's momentum
    buffer (megatron's default sgd_momentum 0.9)."""
    expert_weights: int = 0
    """Of ``weights``, the expert-parallel buffers' (EP > 1)."""


def state_bytes(params: list[Param], params_dtype: str, optimizer: str, dp: int, dp_rank: int = 0,
                distributed_optimizer: bool | None = None, expert_dp: int | None = None,
                expert_dp_rank: int = 0) -> StateBytes:
    """Actor state on one rank (megadiv.policy.megatron: megatron's distributed optimizer where
    ``optim.distributed_optimizer`` puts it, by default with Adam at DP > 1; the plain one otherwise).
    Parameters without ``allreduce`` (experts under EP > 1) are laid out in buffers of their own and
    sharded over the expert-data-parallel group (``expert_dp`` ranks, Layout.expert_dp; this rank
    ``expert_dp_rank`` there)."""
    distributed = OptimConfig(optimizer=optimizer, distributed_optimizer=distributed_optimizer).shards_state(dp)
    e = DTYPE_BYTES[params_dtype]
    buffered = weights = owned = expert_weights = 0
    for group, size, rank in (([p for p in params if p.allreduce], dp, dp_rank),
                              ([p for p in params if not p.allreduce], expert_dp or dp, expert_dp_rank)):
        if not group:  # megatron builds no buffer for an empty group
            continue
        layout = buffer_layout(group, distributed, size)
        numel = sum(p.numel for p in group)
        buffered += layout.numel
        weights += (layout.numel if distributed else numel) * e
        owned += optimizer_shard_numel(layout, size, rank) if distributed else numel
        if not group[0].allreduce:
            expert_weights = (layout.numel if distributed else numel) * e
    return StateBytes(
        weights=weights, grads=buffered * 4,
        main_params=owned * 4 if params_dtype != "float32" else 0,
        optimizer=owned * (8 if optimizer == "adam" else 4), expert_weights=expert_weights)


# --------------------------------------------------------------------------- activations


def layer_activation_bytes(arch: ArchSpec, tp: int, micro_batch_size: int, seq_len: int, params_dtype: str,
                           spec: str = "te", sequence_parallel: bool = False, etp: int | None = None) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch [b, s] on one TP rank.

    Per token, with e the weight dtype's bytes, a/g/d the heads/KV heads/head width per rank, f the
    MLP width per rank, h the hidden width (/TP under sequence parallelism), s the sequence:

    local (megatron local spec; torch RMSNorm keeps two fp32 [h] copies + rstd):
        norms 2 (8h + 4) + linear inputs 2eh + q, k for QK^T 2ade + V (ade, or the whole fused QKV
        (a+2g)de without GQA) + softmax 4as + probs eas + context ade + SwiGLU 5fe
        + QK-norm 8(a+g)d + 4(a+g) (Qwen3); plus per sequence the causal mask s^2 bytes and the
        RoPE cos/sin 4sde.
    te (Transformer Engine, flash attention; fused norms keep input + normalised output):
        norms 2 (2eh + 4) + q, k, v (a+2g)de + output ade + softmax statistics 4a + SwiGLU 3fe
        + QK-norm (a+g)de + 4(a+g) (Qwen3).
    mixture of experts, in place of the SwiGLU term (either spec, as the local spec's SequentialMLP
    keeps them; TE's grouped GEMM is counted alike, unverified), with E experts, top-k, F the expert width
    per expert-TP rank (``etp``, None: TP) and H the full hidden width: whatever EP, an even load
    puts k ETP/TP rows per token of the sequence on this rank's E/EP experts (the dispatcher
    gathers ETP x EP x the rank's tokens, s/TP under sequence parallelism; 1/EP of their k rows
    are local), each keeping its permuted input eH and the SwiGLU-with-probabilities
    intermediates 6Fe, and its probability e:
        k ETP/TP (eH + 6Fe + e) + routing map E (bool) and masked probabilities Ee + top-k
        probabilities 4k, top-k and permutation indices 16k.
    (Checked against the saved tensors at TP = 1 only.)
    """
    e = DTYPE_BYTES[params_dtype]
    family = FAMILIES[arch.family]
    h = arch.hidden_size // (tp if sequence_parallel else 1)
    a, g, d = arch.num_attention_heads // tp, arch.num_query_groups // tp, arch.head_dim
    f, s, b = arch.ffn_hidden_size // tp, seq_len, micro_batch_size
    if arch.is_moe:
        k, etp = arch.moe_router_topk, etp or tp
        fe = arch.moe_ffn_hidden_size // etp
        mlp = k * etp * (e * arch.hidden_size + 6 * fe * e + e) // tp + arch.num_experts * (1 + e) + 4 * k + 16 * k
        # a shared expert (Qwen2-MoE): the dense SwiGLU term at its width, and its gate's logit and
        # sigmoid (counted as the dense MLP is; not measured with one)
        mlp += ((5 if spec == "local" else 3) * (arch.moe_shared_expert_hidden_size // tp) + 2) * e \
            if arch.moe_shared_expert_hidden_size else 0
    else:
        mlp = (5 if spec == "local" else 3) * f * e
    if spec == "local":
        v = a * d * e if a > g else (a + 2 * g) * d * e
        per_token = (2 * (8 * h + 4) + 2 * e * h + 2 * a * d * e + v + 4 * a * s + e * a * s + a * d * e
                     + mlp + family.qk_layernorm * (8 * (a + g) * d + 4 * (a + g)))
        per_sequence = s * s + 4 * s * d * e
        return b * s * per_token + per_sequence
    per_token = (2 * (2 * e * h + 4) + (a + 2 * g) * d * e + a * d * e + 4 * a + mlp
                 + family.qk_layernorm * ((a + g) * d * e + 4 * (a + g)))
    return b * s * per_token


def boundary_activation_bytes(arch: ArchSpec, tp: int, micro_batch_size: int, seq_len: int, params_dtype: str,
                              spec: str, first: bool, last: bool) -> int:
    """Saved outside the layers: token ids on the first stage; final norm and output-layer input
    on the last (the logits themselves are counted by :func:`logits_bytes`)."""
    e, h, tokens = DTYPE_BYTES[params_dtype], arch.hidden_size, micro_batch_size * seq_len
    norm = 8 * h + 4 if spec == "local" else 2 * e * h + 4
    return tokens * (8 * first + (norm + e * h) * last)


def logits_bytes(arch: ArchSpec, tp: int, micro_batch_size: int, positions: int, params_dtype: str,
                 log_probs_chunk: int | None) -> tuple[int, int]:
    """(logit shard [b x positions, V/TP] in the weights' dtype plus its fp32 tempered copy, the
    vocab-parallel log-prob workspace of one token chunk: a few [chunk, V/TP] fp32 buffers).
    ``positions``: per row, those the output layer sees (the policy's: the response's, models/output.py)."""
    vocab = padded_vocab_size(arch.vocab_size, tp) // tp
    tokens = micro_batch_size * positions
    logits = tokens * vocab * (DTYPE_BYTES[params_dtype] + 4)
    chunk = log_probs_chunk or max(1, (2 << 20) // (4 * vocab))  # megadiv's default: ~2 MiB per chunk
    return logits, 3 * min(chunk, tokens) * vocab * 4


# --------------------------------------------------------------------------- host memory

NCCL_COMMUNICATOR_BYTES = 32 * 2 * (4 << 20)
"""GPU memory one NCCL communicator takes, estimated (not measured here): NCCL's default 4 MiB
buffer (NCCL_BUFFSIZE) per channel and direction, at the up-to-32 channels NVLink/InfiniBand
nodes get; 256 MiB."""
DRIVER_RESPONSE_BYTES_PER_TOKEN = 74
"""Host bytes the rollout driver's batch (trainer/experience.py Experience) holds per response
token, as Python lists: the token id (an int object, 32 B as allocated, and its 8 B list slot) and
its rollout log-prob (a float, 24 + 8 B), plus list growth. Measured with tracemalloc on CPython
3.11 over build_experience of 128 rows of 2,048 random token ids (tests/test_plan.py re-measures it)."""
DRIVER_PROMPT_BYTES_PER_TOKEN = 40
"""... and per prompt token, once per prompt: a group's rows share their prompt's list (measured
alike: 40 B)."""
MODEL_SPACE_OPTIMIZER_BYTES = 3 * 4
"""Bytes per parameter of the distributed optimizer's state in model space (fp32 main weight,
exp_avg, exp_avg_sq): what the 'fully_reshardable' checkpoint format gathers on every DP rank's host."""


def driver_batch_bytes(prompts: int, samples: int, prompt_tokens: int, response_tokens: int, batches: int) -> int:
    """Host bytes of ``batches`` rollout batches in the driver: ``prompts`` x ``samples`` rows of
    ``response_tokens`` each, and each prompt's ``prompt_tokens`` once."""
    return batches * prompts * (samples * response_tokens * DRIVER_RESPONSE_BYTES_PER_TOKEN
                                + prompt_tokens * DRIVER_PROMPT_BYTES_PER_TOKEN)


def host_bytes(params: list[Param], params_dtype: str, optimizer: str, dp: int, expert_dp: int | None = None
               ) -> dict[str, int]:
    """Host memory of one rank for a checkpoint save (megadiv.trainer.checkpoint): with the
    distributed optimizer its state gathered in model space (every DP rank, megatron's
    'fully_reshardable' without the memory-efficient exchange; its local experts' only), and the
    rank's share of the weights (and a plain optimizer's state) staged for the background writer
    (the fully parallel save deals what the replicas hold in common over them: 1/DP of the dense
    weights each, 1/expert-DP of the experts')."""
    numel = sum(p.numel for p in params)
    gathered = numel * MODEL_SPACE_OPTIMIZER_BYTES if optimizer == "adam" else 0
    per_element = DTYPE_BYTES[params_dtype] + (4 if optimizer == "sgd" else 0)
    staged = sum(-(-n * per_element // size) for n, size in (
        (sum(p.numel for p in params if p.allreduce), dp),
        (sum(p.numel for p in params if not p.allreduce), expert_dp or dp)))
    return {"optimizer_state_gathered": gathered, "checkpoint_staging": staged}


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: int
    components: dict[str, int]
    """Bytes by component on one GPU of this stage."""

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class Plan:
    layout: Layout
    parameters: int
    weight_bytes_per_replica: int
    """Weight bytes of one copy of the model: summed over its TP x PP GPUs, and the experts over the
    ETP x EP ranks that split them (padding and replicated norms included)."""
    stages: list[StagePlan]
    gpu_bytes: int
    activations_with_recompute: int
    """Worst stage's activations with full recompute (each layer keeps only its input)."""
    host: dict[str, int] = field(default_factory=dict)
    """Host bytes by component on global rank 0 (first stage: the rollout driver's batch too)."""
    host_bytes_per_rank: int = 0
    """What a rank may use of its node's host memory (0: not checked)."""
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def host_fits(self) -> bool:
        return not self.host_bytes_per_rank or self.host_total <= self.host_bytes_per_rank

    @property
    def fits(self) -> bool:
        """The worst GPU and global rank 0's host share both hold what is planned."""
        return self.worst.total <= self.gpu_bytes and self.host_fits

    def as_dict(self) -> dict:
        w = self.worst
        return {"layout": self.layout.as_dict(),
                "parameters": self.parameters, "weight_bytes_per_replica": self.weight_bytes_per_replica,
                "gpu_bytes": self.gpu_bytes, "fits": self.fits, "worst_stage": w.stage,
                "per_gpu_bytes": w.total, "components": dict(w.components),
                "activations_with_recompute": self.activations_with_recompute,
                "host_components": dict(self.host), "host_bytes": self.host_total,
                "host_bytes_per_rank": self.host_bytes_per_rank, "host_fits": self.host_fits,
                "stages": [{"stage": s.stage, "layers": s.layers, "total": s.total, "components": dict(s.components)}
                           for s in self.stages],
                "notes": list(self.notes)}


def plan_layout(arch: ArchSpec, layout: Layout, work: Workload, gpu_bytes: int,
                stage_layers: list[int] | None = None) -> Plan:
    """Per-GPU memory of every pipeline stage of ``layout`` (DP rank 0's optimizer shard, which is
    the largest: shards are cut from the buffer start; at EP > 1 expert-DP rank 0's too)."""
    counts = stage_layer_counts(arch.num_layers, layout.pp, stage_layers)
    in_flight = min(layout.pp, work.micro_batches_in_flight)
    b, s, dt = work.micro_batch_size, work.seq_len, work.params_dtype
    per_layer = layer_activation_bytes(arch, layout.tp, b, s, dt, work.spec, work.sequence_parallel, layout.expert_tp)
    layer_input = b * s * arch.hidden_size // (layout.tp if work.sequence_parallel else 1) * DTYPE_BYTES[dt]
    stages, replica_weights, recompute = [], 0, 0
    for stage, layers in enumerate(counts):
        first, last = stage == 0, stage == layout.pp - 1
        params = stage_params(arch, layout.tp, layout.pp, stage, stage_layers, ep=layout.ep, etp=layout.expert_tp)
        state = state_bytes(params, dt, work.optimizer, layout.dp, distributed_optimizer=work.distributed_optimizer,
                            expert_dp=layout.expert_dp)
        replica_weights += ((state.weights - state.expert_weights) * layout.tp
                            + state.expert_weights * layout.ep * layout.expert_tp)
        boundary = boundary_activation_bytes(arch, layout.tp, b, s, dt, work.spec, first, last)
        # 1F1B: stage i holds min(PP - i, micro-batches) micro-batches' activations at its peak
        held = max(1, min(layout.pp - stage, work.micro_batches_in_flight)) if layout.pp > 1 else 1
        logits, chunk = (logits_bytes(arch, layout.tp, b, work.logit_positions or s, dt, work.log_probs_chunk)
                         if last else (0, 0))
        components = {
            "weights": state.weights, "main_params_fp32": state.main_params, "grads_fp32": state.grads,
            "optimizer_states": state.optimizer,
            "activations": held * (stage_layer_activations(layers, per_layer, layer_input, work) + boundary)
                           + recomputed_layers(layers, work) * per_layer,
            "logits": logits, "log_prob_chunk": chunk,
            "reference_weights": sum(p.numel for p in params) * DTYPE_BYTES[dt] if work.reference else 0,
            # a launched server sits on global rank 0's node: GPUs of the first stage (ranks are tp-dp-pp)
            "colocated_server": int(work.server_fraction * gpu_bytes) if first else 0,
            "weight_sync_buckets": work.bucket_bytes * (1 + (work.rank0_bucket_copies + work.rank0_queued_buckets)
                                                        * first),
            "sync_communicators": work.rank0_communicators * NCCL_COMMUNICATOR_BYTES * first,
            "reserve": work.reserve_bytes,
        }
        stages.append(StagePlan(stage, layers, components))
        recompute = max(recompute, held * (layers * layer_input + boundary) + per_layer)
    first_params = stage_params(arch, layout.tp, layout.pp, 0, stage_layers, ep=layout.ep, etp=layout.expert_tp)
    host = host_bytes(first_params, dt, work.optimizer, layout.dp, layout.expert_dp) | {
        "driver_batch": work.batch_host_bytes}
    notes = []
    if in_flight > 1:
        notes.append(f"1F1B keeps up to {in_flight} micro-batches of activations on the first stage")
    return Plan(layout, parameter_count(arch), replica_weights, stages, gpu_bytes, recompute, host,
                work.host_bytes_per_rank, notes)


def stage_layer_activations(layers: int, per_layer: int, layer_input: int, work: Workload) -> int:
    """What a stage's ``layers`` keep for backward per micro-batch in flight: every layer's
    activations; with full recompute a checkpointed group (uniform: each group of N layers; block:
    each of the first N layers) keeps only its input [b, s, h] (h/TP under sequence parallelism)."""
    n = work.recompute_num_layers
    if work.recompute_method == "uniform":
        return -(-layers // n) * layer_input
    if work.recompute_method == "block":
        return min(n, layers) * layer_input + max(0, layers - n) * per_layer
    return layers * per_layer


def recomputed_layers(layers: int, work: Workload) -> int:
    """Layers whose activations the backward of one checkpointed group rebuilds at once (held
    beside the kept ones while it runs): N for uniform, 1 for block, none without recompute."""
    if work.recompute_method == "uniform":
        return min(work.recompute_num_layers, layers)
    return int(work.recompute_method == "block" and layers > 0)


def candidate_layouts(arch: ArchSpec, world: int, gpus_per_node: int) -> list[Layout]:
    """Every TP x PP (x EP, ETP) that megadiv can build on ``world`` GPUs, smallest model-parallel
    size first (then smaller PP, then larger EP: experts split further for the same GPUs, then
    ETP = TP before ETP = 1: less expert memory per rank): TP within a node and dividing the heads
    and KV heads; the MLP width (dense), the shared expert's and ETP the experts' (mixture of
    experts: ETP = TP, or 1 with EP > 1); every power-of-two EP dividing the experts and the
    stage's TP x DP / ETP ranks."""
    out = []
    for tp in range(1, gpus_per_node + 1):
        if gpus_per_node % tp or arch.num_query_groups % tp or arch.num_attention_heads % tp:
            continue
        if (arch.moe_shared_expert_hidden_size if arch.is_moe else arch.ffn_hidden_size) % tp:
            continue
        for pp in range(1, arch.num_layers + 1):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if not arch.is_moe:
                out.append(Layout(tp, pp, dp))
                continue
            for etp in sorted({tp, 1}, reverse=True):
                if arch.moe_ffn_hidden_size % etp:
                    continue
                ranks = tp * dp // etp
                out += [Layout(tp, pp, dp, 1 << i, etp) for i in range(ranks.bit_length())
                        if not ranks % (1 << i) and not arch.num_experts % (1 << i) and (etp == tp or i > 0)]
    return sorted(out, key=lambda lay: (lay.tp * lay.pp, lay.pp, -lay.ep, -lay.expert_tp))


# --------------------------------------------------------------------------- checkpoint interval
# Estimates, not measurements (no GPU cluster here): each assumption is a named constant that
# megadiv plan prints beside the figures it gives.

GPU_PEAK_FLOPS = 989e12
"""Dense bf16 FLOP/s of one H100 SXM (NVIDIA's datasheet: 1,979 TFLOP/s with 2:4 sparsity, half without)."""
TRAIN_MFU = 0.35
"""Assumed model-FLOPs utilisation of the training passes: below the ~40-47% megatron-core reports
for dense GPT pre-training on H100s, since RL micro-batches are few per step (pipeline bubbles) and
their rows vary in length."""
DECODE_MFU = 0.10
"""Assumed utilisation of batched decoding (2 FLOPs per active parameter per token): each decode
step streams every weight from HBM for a batch bounded by the KV cache, so decoding is
memory-bound far below peak."""
HOST_COPY_BYTES_PER_S = 10e9
"""Assumed host-memory copy bandwidth of one rank while the 8 ranks of its node copy at once
(a single-threaded memcpy on a server CPU)."""
GATHERED_STATE_HOST_COPIES = 3
"""Host copies a rank makes of its model-space optimizer state in a 'fully_reshardable' save before
training goes on (megatron-core 0.16.1: gathered into DP-shaped buffers, transformed into the
canonical per-parameter tensors, then staged for the background writer)."""


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one GRPO step, estimated: training FLOPs over the trainer's GPUs at TRAIN_MFU,
    plus (or, with grpo.overlap, beside) generation at DECODE_MFU over the servers' GPUs."""

    active_parameters: int
    """Parameters one token passes through (a mixture of experts: its top-k experts only)."""
    train_tokens: int
    """Tokens the trainer passes over per step: rows x (prompt + max_new_tokens), every response
    at full length (an upper bound, as the memory plan)."""
    generated_tokens: int
    """rows x max_new_tokens."""
    flops_per_token_per_parameter: int
    """2 per forward pass, 6 per forward + backward: the passes a step makes (cli/plan.py)."""
    train_gpus: int
    generation_gpus: int
    overlap: bool
    """grpo.overlap: the next batch is generated while this one trains."""

    @property
    def train_s(self) -> float:
        return (self.flops_per_token_per_parameter * self.active_parameters * self.train_tokens
                / (self.train_gpus * GPU_PEAK_FLOPS * TRAIN_MFU))

    @property
    def generation_s(self) -> float:
        return 2 * self.active_parameters * self.generated_tokens / (self.generation_gpus * GPU_PEAK_FLOPS * DECODE_MFU)

    @property
    def step_s(self) -> float:
        return max(self.train_s, self.generation_s) if self.overlap else self.train_s + self.generation_s


def checkpoint_blocking_s(host: dict[str, int]) -> float:
    """Seconds a save blocks training on rank 0, estimated: its model-space optimizer state copied
    GATHERED_STATE_HOST_COPIES times and its share of the weights staged once, at HOST_COPY_BYTES_PER_S."""
    return ((GATHERED_STATE_HOST_COPIES * host["optimizer_state_gathered"] + host["checkpoint_staging"])
            / HOST_COPY_BYTES_PER_S)


def young_interval_steps(blocking_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's rule (1974): saving every sqrt(2 x C x M) seconds, for a save blocking C seconds and
    a mean time M between failures, minimises the expected time lost to saves plus recomputation;
    in whole steps of ``step_s``, at least one."""
    return max(1, round(math.sqrt(2 * blocking_s * mtbf_s) / step_s))
