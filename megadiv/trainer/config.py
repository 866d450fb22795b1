"""The run config of ``megadiv train``: one frozen section per component.

    parallel   megadiv.config.ParallelConfig       TP / PP sizes, stage split, collective timeout
    model      megadiv.config.ModelConfig          the HF checkpoint (or a tiny one made on the spot)
    optim      megadiv.config.OptimConfig          optimizer and LR schedule
    deepspeed  DeepSpeedConfig                     ZeRO stage, offload (model.backend=deepspeed)
    data       megadiv.data.DataConfig             training prompts
    eval       EvalConfig                          held-out evaluation
    reward     megadiv.rewards.RewardConfig        how responses are scored
    rollout    megadiv.rollout.RolloutConfig       engine, sampling, weight sync
    advantage  megadiv.divergence.AdvantageConfig  GRPO / Dr. GRPO / RLOO / REINFORCE++
    loss       megadiv.divergence.PolicyLossConfig clipping rule, penalties, regularisers, aggregation
    grpo       GRPOConfig                          batch shape, PPO epochs, DAPO extras, guards
    warm_start WarmStartConfig                     optional tiny model + supervised warm start (demos)
    checkpoint CheckpointConfig                    save / resume / HF export
    run        megadiv.config.RunConfig            name, output directory, seed

Every key is documented in docs/training.md.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megadiv.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunConfig, check_model_parallel
from megadiv.data import DataConfig
from megadiv.divergence import (
    DIVERGENCES,
    AdvantageConfig,
    PolicyLossConfig,
    TokenDivergence,
    VocabDivergence,
    names_of_kind,
)
from megadiv.models.families import FAMILIES as MEGATRON_FAMILIES
from megadiv.policy.deepspeed_config import DeepSpeedConfig, check_raw_keys
from megadiv.rewards import RewardConfig
from megadiv.rollout import RolloutConfig


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 100
    """GRPO steps (one rollout batch each)."""
    prompts_per_step: int = 64
    """Prompts per rollout batch; each gets rollout.n_samples responses."""
    micro_batch_size: int = 8
    """Sequences per micro-batch through megatron's pipeline schedule (with
    max_tokens_per_micro_batch: the most sequences per micro-batch)."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro-batch (verl's dynamic batch size): each mini-batch's rows, sorted by
    length, are grouped into micro-batches of at most this many padded tokens (rows x longest row),
    each padded only to its own longest row; losses are unchanged. None: micro_batch_size rows
    each, grouped by length the same way (no more micro-batches and no more memory than rows in
    batch order padded to the batch's longest, which parallel.virtual_pipeline keeps). At least
    rollout.max_new_tokens + 1; a row longer than the budget (a long prompt) forms a micro-batch
    alone."""
    pack_sequences: bool | None = None
    """Feed each micro-batch's rows concatenated, without padding (THD layout: Transformer Engine
    attention with packed_seq_params; the same losses and gradients as padded rows). None: packed
    wherever the model runs TE attention (model.transformer_impl auto on a GPU with TE, or
    transformer_engine) and the micro-batches are grouped by length (not under
    parallel.virtual_pipeline); padded elsewhere (megatron's local spec, the CPU, mixture-of-experts
    models). true: packed, refused where it cannot be; false: padded."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    routing_replay: Literal["none", "r2", "r3"] = "none"
    """Mixture-of-experts actors. 'r2': every training pass over a batch routes each token to the
    experts its old-log-prob pass chose (the weights before the batch's first update; verl's R2),
    so that pi_theta / pi_old compares one sub-network; the gate values still follow the current
    weights, and router/replay_agreement logs how many of the routers' own choices that is.
    Needs several updates per batch (ppo_epochs x mini_batches > 1; with one, the training pass
    is the first and nothing has moved). 'r3': every pass (old log-probs and training) routes each
    token to the experts the rollout engine chose when it generated the row, so that pi_old and
    pi_theta are the sub-network that sampled it (verl's R3, slime's rollout routing replay);
    router/replay_agreement is then the trainer's agreement with the engine. Needs the embedded
    engine (SGLang's routing capture is not wired). docs/models.md, Routing replay."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many mini-batches)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and generate more to refill."""
    oversample: float = 1.0
    """Dynamic sampling: groups drawn at once per step, as a multiple of prompts_per_step; the step
    ends when prompts_per_step informative groups are in and the rest are aborted. Above 1 the
    step is filled in one wave, at the cost of a bias towards the groups that finish first
    (shorter responses), which slime accepts too (docs/training.md, Dynamic sampling)."""
    max_resample_rounds: int = 3
    """Top-ups a step may draw when the groups in flight cannot fill it (dropped groups, or
    uniform ones under dynamic sampling): at most (1 + this) x ceil(prompts_per_step x oversample)
    groups in all. Dynamic sampling fills what is still missing with zero-advantage groups (no
    policy gradient) to keep the batch shape."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_new_tokens - buffer lose reward linearly,
    reaching -overlong_penalty at max_new_tokens; 0 disables."""
    overlong_penalty: float = 1.0
    """Reward lost by a response of max_new_tokens under overlong shaping."""
    mask_truncated: bool = False
    """Drop completions that hit rollout.max_new_tokens from the loss (their loss mask is zeroed;
    they still count in their group's advantage baseline), as TRL's mask_truncated_completions,
    which the GBMPO authors train with."""
    log_probs_chunk: int | None = None
    """Token rows per chunk of the vocab-parallel log-prob/entropy (None: a per-device byte budget,
    1 MiB of float32 on CPU, 128 MiB on GPU; docs/vocab_parallel.md)."""
    max_nonfinite_steps: int = 3
    """Abort after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""
    check_mismatch_every: int = 10
    """Compare engine and trainer log-probs on a probe batch after the first step's weight sync and
    every N-th one (0: never). Each probe costs a trainer forward and an engine scoring of the probe
    batch (about 3% of a step of the tiny arithmetic workload); a corrupted sync is caught within N
    steps (docs/rollout.md, Mismatch check)."""
    stop_after: int | None = None
    """End this launch after this step (checkpointed); the same command resumes. The LR schedule
    and everything else still plan for ``steps``. For time-limited or preemptible jobs."""
    overlap: bool = False
    """One-step off-policy: generate batch k+1 on step k-1's weights while training on batch k
    (staleness exactly one version, logged as rollout/staleness). The loss recomputes pi_old with
    the current weights and weighs tokens by min(pi_old / pi_rollout, loss.tis_cap), which it
    therefore needs (docs/training.md, Overlap)."""

    def __post_init__(self):
        for key in ("steps", "prompts_per_step", "micro_batch_size", "ppo_epochs", "mini_batches",
                    "max_nonfinite_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"grpo.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_resample_rounds < 0 or self.overlong_buffer < 0 or self.check_mismatch_every < 0:
            raise ConfigError("grpo.max_resample_rounds, grpo.overlong_buffer and grpo.check_mismatch_every "
                              "must be >= 0")
        if self.oversample < 1 or (self.oversample > 1 and not self.dynamic_sampling):
            raise ConfigError(f"grpo.oversample must be >= 1, and above 1 only with grpo.dynamic_sampling (without "
                              f"a filter the first groups to finish would bias every batch), got {self.oversample}")
        if self.overlong_penalty < 0:
            raise ConfigError(f"grpo.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.routing_replay == "r2" and self.ppo_epochs * self.mini_batches == 1:
            raise ConfigError(f"grpo.routing_replay={self.routing_replay} replays the old-log-prob pass's routing in "
                              "the later updates of a batch; with grpo.ppo_epochs x grpo.mini_batches = 1 there are "
                              "none (the one training pass routes as that pass would)")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ConfigError(f"grpo.stop_after must lie in [1, grpo.steps={self.steps}], got {self.stop_after}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"grpo.max_tokens_per_micro_batch must be >= 1 (or null), got "
                              f"{self.max_tokens_per_micro_batch}")


@dataclass(frozen=True)
class EvalConfig:
    data: DataConfig | None = None
    """Held-out split, graded with the training reward (eval/accuracy, summary.json); None: none."""
    extra_data: tuple[DataConfig, ...] = ()
    """Further held-out splits (e.g. MATH-500, AIME24, AIME25), each graded with its dataset's own
    reward (math-verify, the code sandbox, exact match) and logged as eval/<name>_<split>/pass@1
    (and avg@k, pass@k)."""
    every: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    max_new_tokens: int | None = None
    """None: rollout.max_new_tokens."""
    samples: int = 0
    """k for avg@k and pass@k at ``temperature`` (0: greedy pass@1 only)."""
    temperature: float = 1.0
    """Sampling temperature of avg@k / pass@k."""

    def __post_init__(self):
        if self.every < 0 or self.samples < 0 or self.temperature < 0:
            raise ConfigError("eval.every, eval.samples and eval.temperature must be >= 0")


@dataclass(frozen=True)
class WarmStartConfig:
    """For demos that start from nothing: create a random model at model.hf_dir (architecture from
    the model.* fields, a character tokenizer), then fine-tune it briefly on the training set's
    reference answers so that reinforcement learning has signal."""

    make_model: Literal["none", "qwen2", "qwen3", "llama", "mistral", "olmo2"] = "none"
    """Create a random model of this family at model.hf_dir unless a checkpoint is already there
    (megadiv.models.tiny; mistral and olmo2 have no Megatron mapping: DeepSpeed backend only)."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Tokenizer of the created model: one token per character of tokenizer_chars, or a small
    byte-level BPE (for text tasks)."""
    tokenizer_chars: str = "0123456789+="
    """Alphabet of the created model's character tokenizer."""
    sft_steps: int = 0
    """Supervised steps on data's reference answers before GRPO (0: none)."""
    sft_batch_size: int = 128
    """Sequences per warm-start step (divisible by the data-parallel size)."""
    sft_lr: float = 1e-3
    """Learning rate of the warm start (constant, Adam)."""

    def __post_init__(self):
        if self.sft_steps < 0 or self.sft_batch_size < 1 or self.sft_lr <= 0:
            raise ConfigError("warm_start: need sft_steps >= 0, sft_batch_size >= 1, sft_lr > 0")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted once a newer one is complete)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest complete checkpoint in the run directory, if any."""
    export_hf: bool = True
    """Write the final policy as a Hugging Face checkpoint (run_dir/hf), with a model card (README.md)."""
    node_mtbf_hours: float = 6300.0
    """Mean hours between failures of one node, from which `megadiv plan` recommends checkpoint.every
    (Young's rule over the job's MTBF, this / nodes; training itself saves at checkpoint.every).
    Default: Llama 3's 54-day pre-training snapshot, 419 unexpected interruptions on 2,048 nodes of
    8 H100s: 54 x 24 x 2,048 / 419 = 6,300 node-hours. Set your cluster's own."""
    base_model_id: str | None = None
    """Hub id of the model training started from (e.g. Qwen/Qwen3-1.7B), written as base_model in the
    exported model card so a hub links the two; None: the card names model.hf_dir's directory only."""

    def __post_init__(self):
        if self.every < 0 or self.keep_last < 1 or not self.node_mtbf_hours > 0:
            raise ConfigError("checkpoint.every must be >= 0, checkpoint.keep_last >= 1 and "
                              "checkpoint.node_mtbf_hours > 0")
        if self.base_model_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", self.base_model_id):
            raise ConfigError(f"checkpoint.base_model_id must be a hub id 'owner/name', got {self.base_model_id!r}")
        if self.base_model_id is not None and not self.export_hf:
            raise ConfigError("checkpoint.base_model_id goes into the exported model card: it needs "
                              "checkpoint.export_hf=true")


@dataclass(frozen=True)
class TrainConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.model.hf_dir is None and self.warm_start.make_model != "none":
            # a created model lives in its run directory, wherever run.output_dir puts it (a derived
            # default, set once at construction)
            created = str(Path(self.run.output_dir) / self.run.name / "init")
            object.__setattr__(self, "model", dataclasses.replace(self.model, hf_dir=created))
        if self.model.hf_dir is None:
            raise ConfigError("model.hf_dir is required: a Hugging Face checkpoint directory (or set "
                              "warm_start.make_model to create a tiny model in RUN_DIR/init)")
        if self.warm_start.make_model == "none" and not self.model.has_checkpoint():
            raise ConfigError(f"model.hf_dir={self.model.hf_dir} holds no config.json: download the checkpoint "
                              f"there (check-config and plan can check a recipe before that: --hf-config FILE, "
                              f"or examples/hf_configs/<name>/config.json for a model directory named <name>)")
        self._check_backend()
        if self.model.backend == "megatron":  # DeepSpeed: TP = PP = 1, any HF config layout
            # warm_start.make_model makes dense models: the mixture-of-experts settings off their defaults
            moe_only = {"parallel.expert_parallel": (self.parallel.expert_parallel, 1),
                        "parallel.expert_tensor_parallel": (self.parallel.expert_tensor_parallel, None),
                        "model.moe_aux_loss_coeff": (self.model.moe_aux_loss_coeff, 0.0),
                        "grpo.routing_replay": (self.grpo.routing_replay, "none")}
            for key, (value, default) in moe_only.items():
                if value != default and self.warm_start.make_model != "none":
                    raise ConfigError(f"{key}={value} needs a mixture-of-experts model, and warm_start.make_model "
                                      f"makes dense ones: make one with megadiv make-tiny-model --family qwen3_moe "
                                      f"and set model.hf_dir")
            if self.grpo.routing_replay != "none" and self.model.recompute_granularity != "none":
                raise ConfigError(f"grpo.routing_replay={self.grpo.routing_replay} cannot be combined with "
                                  f"model.recompute_granularity={self.model.recompute_granularity}: the recomputed "
                                  f"forward in the backward pass would route by the routers' own choice")
            if self.warm_start.make_model not in ("none", *MEGATRON_FAMILIES):
                raise ConfigError(f"warm_start.make_model={self.warm_start.make_model}: megadiv has no Megatron mapping "
                                  f"for this family (mapped: {', '.join(MEGATRON_FAMILIES)}); train it with "
                                  f"model.backend=deepspeed (docs/deepspeed.md)")
            check_model_parallel(self.parallel, self.model)
        if self.rollout.temperature == 0:
            raise ConfigError("rollout.temperature=0 samples greedily: the n_samples responses to a prompt are all "
                              "the same, so every group's rewards are equal, every advantage is 0 and GRPO cannot "
                              "learn; use a temperature > 0 (1.0 samples the policy itself)")
        if self.advantage.group_size != self.rollout.n_samples:
            raise ConfigError(f"advantage.group_size ({self.advantage.group_size}) must equal rollout.n_samples "
                              f"({self.rollout.n_samples}): both are the GRPO group size")
        self._check_batch_split(data_parallel=1)
        self._check_token_budget()
        if self.uses_vocab_regularizer and self.parallel.pipeline_parallel > 1:
            raise ConfigError(f"loss.regularizer={self.loss.regularizer} is a full-vocabulary measure: it needs the "
                              f"reference logits beside the actor's and supports parallel.pipeline_parallel=1 only")
        if self.loss.policy_loss == "divergence_clip" and issubclass(DIVERGENCES[self.loss.measure], VocabDivergence):
            raise ConfigError(f"loss.measure={self.loss.measure} is a full-vocabulary measure: clipping on it needs "
                              f"D(pi_theta, pi_old) over the whole vocabulary, i.e. the old policy's logits beside "
                              f"the actor's in every micro-batch, which the trainer does not keep; use a token "
                              f"measure ({', '.join(names_of_kind(TokenDivergence))})")
        if self.grpo.overlap and self.loss.tis_cap is None:
            raise ConfigError("grpo.overlap trains each batch on weights one step newer than the ones that generated "
                              "it: set loss.tis_cap (e.g. 2.0), so the policy loss corrects for that by weighing each "
                              "token by min(pi_old / pi_rollout, tis_cap) (docs/training.md, Overlap)")
        if self.warm_start.sft_steps and not self.data_has_answers:
            raise ConfigError("warm_start.sft_steps needs a dataset with reference answers")
        thinking = [d for d in (self.data, self.eval.data, *self.eval.extra_data) if d and d.enable_thinking]
        if thinking and self.model.has_checkpoint() and "enable_thinking" not in chat_template_text(self.model.hf_dir):
            raise ConfigError(f"data.enable_thinking=true ({thinking[0].name}:{thinking[0].split}) but the chat template "
                              f"of {self.model.hf_dir} has no thinking mode (it never reads enable_thinking)")

    def _check_backend(self) -> None:
        """Keys of the other backend are refused: megatron's layout and layer keys with DeepSpeed,
        the deepspeed: section with megatron."""
        if self.model.backend == "megatron":
            changed = [f"deepspeed.{k}" for k, v in vars(self.deepspeed).items() if v != getattr(DeepSpeedConfig(), k)]
            if changed:
                raise ConfigError(f"{changed[0]} applies to model.backend=deepspeed (this run uses megatron)")
            return
        p, m = self.parallel, self.model
        megatron_only = {"parallel.tensor_parallel": (p.tensor_parallel, 1),
                         "parallel.pipeline_parallel": (p.pipeline_parallel, 1),
                         "parallel.virtual_pipeline": (p.virtual_pipeline, None),
                         "parallel.stage_layers": (p.stage_layers, None),
                         "parallel.sequence_parallel": (p.sequence_parallel, False),
                         "parallel.expert_parallel": (p.expert_parallel, 1),
                         "parallel.expert_tensor_parallel": (p.expert_tensor_parallel, None),
                         "model.fp8": (m.fp8, "none"), "model.transformer_impl": (m.transformer_impl, "auto"),
                         "model.recompute_granularity": (m.recompute_granularity, "none"),
                         "model.moe_aux_loss_coeff": (m.moe_aux_loss_coeff, 0.0),
                         "grpo.routing_replay": (self.grpo.routing_replay, "none"),
                         "optim.distributed_optimizer": (self.optim.distributed_optimizer, None)}
        megatron_only |= {  # ZeRO-3 gathers weights in every forward: all ranks must run equally many micro-batches
            "grpo.max_tokens_per_micro_batch": (self.grpo.max_tokens_per_micro_batch, None),
            "grpo.pack_sequences": (self.grpo.pack_sequences or None, None)}  # true is refused; false is DeepSpeed's way
        for key, (value, plain) in megatron_only.items():
            if value != plain:
                instead = ("; use deepspeed.gradient_checkpointing" if key.startswith("model.recompute")
                           else "; DeepSpeed runs ZeRO data parallelism over all ranks" if key.startswith("parallel")
                           else "")
                raise ConfigError(f"{key}={value!r} applies to model.backend=megatron only{instead}")
        if m.params_dtype == "float16":
            raise ConfigError("model.params_dtype=float16 is not supported with model.backend=deepspeed (it needs "
                              "loss scaling); use bfloat16 (GPU) or float32")
        check_raw_keys(self.deepspeed, self.model, self.optim)

    def check_world_size(self, world_size: int) -> int:
        """The data-parallel size on ``world_size`` ranks; raises ConfigError unless the world
        splits into TP x PP x DP and every batch splits exactly over the DP replicas."""
        if world_size < 1:
            raise ConfigError(f"the world size must be >= 1 rank, got {world_size}")
        data_parallel = self.parallel.data_parallel_size(world_size)
        self._check_batch_split(data_parallel, world_size)
        return data_parallel

    def _check_batch_split(self, data_parallel: int, world_size: int = 1) -> None:
        """Each replica trains rows/DP rows as grpo.mini_batches mini-batches of whole micro-batches:
        every division exact, or rows would be dropped."""
        g, n = self.grpo, self.rollout.n_samples
        rows = g.prompts_per_step * n
        where = (f" over {data_parallel} data-parallel replicas (world size {world_size} / (parallel.tensor_parallel="
                 f"{self.parallel.tensor_parallel} x parallel.pipeline_parallel={self.parallel.pipeline_parallel}))"
                 if data_parallel > 1 else "")
        if rows % data_parallel:
            raise ConfigError(f"grpo.prompts_per_step * rollout.n_samples = {g.prompts_per_step} * {n} = {rows} "
                              f"responses do not split{where}")
        per_replica = rows // data_parallel
        share = f"each replica's {per_replica} of the " if data_parallel > 1 else "the "
        whole = g.max_tokens_per_micro_batch is not None or (per_replica // g.mini_batches) % g.micro_batch_size == 0
        if per_replica % g.mini_batches or not whole:
            raise ConfigError(
                f"{share}grpo.prompts_per_step * rollout.n_samples = {g.prompts_per_step} * {n} = {rows} responses"
                f"{where} must split into grpo.mini_batches={g.mini_batches} mini-batches of whole "
                f"grpo.micro_batch_size={g.micro_batch_size} micro-batches")
        if self.warm_start.sft_steps and self.warm_start.sft_batch_size % data_parallel:
            raise ConfigError(f"warm_start.sft_batch_size={self.warm_start.sft_batch_size} does not split{where}")
        if self.parallel.virtual_pipeline is not None and self.model.backend == "megatron":
            self._check_interleaved_batches(per_replica, data_parallel)

    def _check_interleaved_batches(self, per_replica: int, data_parallel: int) -> None:
        """Every batch the interleaved schedule runs (a mini-batch, a replica's rollout batch for
        its log-probs, the post-sync probe, a warm-start batch) must split into a multiple of PP
        equal micro-batches (policy.megatron.interleaved_rows)."""
        from megadiv.policy.megatron import interleaved_rows

        g = self.grpo
        batches = {f"a mini-batch ({per_replica} // grpo.mini_batches={g.mini_batches} rows per replica)":
                   per_replica // g.mini_batches,
                   f"a replica's {per_replica} rollout rows": per_replica,
                   "rollout.probe_prompts": self.rollout.probe_prompts}
        if self.warm_start.sft_steps:
            batches["warm_start.sft_batch_size per replica"] = self.warm_start.sft_batch_size // data_parallel
        for what, rows in batches.items():
            try:
                interleaved_rows(rows, g.micro_batch_size, self.parallel.pipeline_parallel)
            except ConfigError as e:
                raise ConfigError(f"{what}: {e}") from None

    def _check_token_budget(self) -> None:
        """A budget must hold one full-length row (at least one prompt token + max_new_tokens,
        rounded up to the model's sequence multiple); packing needs Transformer Engine's attention
        and micro-batches of varying shapes, which the interleaved schedule does not take."""
        from megadiv.policy.batches import round_up
        from megadiv.policy.megatron import sequence_multiple

        if self.grpo.pack_sequences and self.model.transformer_impl == "local":
            raise ConfigError("grpo.pack_sequences needs Transformer Engine attention (THD); "
                              "model.transformer_impl is 'local'")
        if self.grpo.pack_sequences and self.parallel.virtual_pipeline is not None:
            raise ConfigError("grpo.pack_sequences cannot be combined with parallel.virtual_pipeline: the "
                              "interleaved schedule runs micro-batches of one shape, and packed ones vary")
        budget = self.grpo.max_tokens_per_micro_batch
        if budget is None:
            return
        multiple = sequence_multiple(self.model, self.parallel)
        longest = round_up(1 + self.rollout.max_new_tokens, multiple)
        if budget < longest:
            raise ConfigError(f"grpo.max_tokens_per_micro_batch={budget} cannot hold one full-length row: 1 prompt "
                              f"token + rollout.max_new_tokens={self.rollout.max_new_tokens}, rounded up to the "
                              f"sequence multiple {multiple}, is {longest} tokens")
        if self.parallel.expert_parallel > 1:
            raise ConfigError("grpo.max_tokens_per_micro_batch cannot be combined with parallel.expert_parallel > 1: "
                              "each forward is collective over the expert-parallel ranks, which are data-parallel "
                              "replicas with rows of their own, and a token budget gives them different numbers "
                              "of micro-batches")
        if self.parallel.virtual_pipeline is not None:
            raise ConfigError("grpo.max_tokens_per_micro_batch cannot be combined with parallel.virtual_pipeline: "
                              "the interleaved schedule needs a micro-batch count that is a multiple of "
                              "parallel.pipeline_parallel, which a token budget does not fix")

    @property
    def uses_vocab_regularizer(self) -> bool:
        return self.loss.regularizer is not None and issubclass(DIVERGENCES[self.loss.regularizer], VocabDivergence)

    @property
    def data_has_answers(self) -> bool:
        return not self.data.user_file or self.data.answer_field is not None

    @property
    def needs_reference(self) -> bool:
        return self.loss.kl_coef > 0 or self.loss.regularizer is not None


def chat_template_text(hf_dir: str) -> str:
    """The chat template(s) a checkpoint ships: tokenizer_config.json's and chat_template.jinja."""
    d, text = Path(hf_dir), ""
    if (d / "tokenizer_config.json").is_file():
        template = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template") or ""
        text += template if isinstance(template, str) else json.dumps(template)
    if (d / "chat_template.jinja").is_file():
        text += (d / "chat_template.jinja").read_text()
    return text
