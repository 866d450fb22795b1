"""The run config of ``megadiv train``: one frozen section per component.

    parallel   megadiv.config.ParallelConfig       TP / PP / CP sizes, collective timeout
    model      megadiv.config.ModelConfig          the HF checkpoint (or a tiny one made on the spot)
    optim      megadiv.config.OptimConfig          Megatron optimizer and LR schedule
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

from dataclasses import dataclass, field
from typing import Literal

from megadiv.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunConfig, check_model_parallel
from megadiv.data import DataConfig
from megadiv.divergence import (DIVERGENCES, AdvantageConfig, PolicyLossConfig, TokenDivergence, VocabDivergence,
                                names_of_kind)
from megadiv.rewards import RewardConfig
from megadiv.rollout import RolloutConfig


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 100
    """GRPO steps (one rollout batch each)."""
    prompts_per_step: int = 64
    """Prompts per rollout batch; each gets rollout.n_samples responses."""
    micro_batch_size: int = 8
    """Sequences per micro-batch through megatron's pipeline schedule."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many mini-batches)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and generate more to refill."""
    max_resample_rounds: int = 3
    """Extra generation rounds dynamic sampling may use; groups still missing are filled with
    zero-advantage groups (no policy gradient) to keep the batch shape."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_new_tokens - buffer lose reward linearly,
    reaching -overlong_penalty at max_new_tokens; 0 disables."""
    overlong_penalty: float = 1.0
    """Reward lost by a response of max_new_tokens under overlong shaping."""
    log_probs_chunk: int | None = None
    """Token rows per chunk of the vocab-parallel log-prob/entropy (None: sized to ~2 MiB)."""
    max_nonfinite_steps: int = 3
    """Abort after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""
    check_mismatch_every: int = 1
    """Compare engine and trainer log-probs on a probe batch after every N-th weight sync (0: never)."""
    stop_after: int | None = None
    """End this launch after this step (checkpointed); the same command resumes. The LR schedule
    and everything else still plan for ``steps``. For time-limited or preemptible jobs."""

    def __post_init__(self):
        for key in ("steps", "prompts_per_step", "micro_batch_size", "ppo_epochs", "mini_batches",
                    "max_nonfinite_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"grpo.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_resample_rounds < 0 or self.overlong_buffer < 0 or self.check_mismatch_every < 0:
            raise ConfigError("grpo.max_resample_rounds, grpo.overlong_buffer and grpo.check_mismatch_every "
                              "must be >= 0")
        if self.overlong_penalty < 0:
            raise ConfigError(f"grpo.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ConfigError(f"grpo.stop_after must lie in [1, grpo.steps={self.steps}], got {self.stop_after}")


@dataclass(frozen=True)
class EvalConfig:
    data: DataConfig | None = None
    """Held-out split; None: no evaluation."""
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

    make_model: Literal["none", "qwen2", "qwen3", "llama"] = "none"
    """Create a random model of this family at model.hf_dir unless a checkpoint is already there."""
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
    """Write the final policy as a Hugging Face checkpoint (run_dir/hf)."""

    def __post_init__(self):
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep_last >= 1")


@dataclass(frozen=True)
class TrainConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
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
        if self.model.hf_dir is None:
            raise ConfigError("model.hf_dir is required: a Hugging Face checkpoint directory (or where "
                              "warm_start.make_model creates one)")
        if self.warm_start.make_model == "none" and not self.model.has_checkpoint():
            raise ConfigError(f"model.hf_dir={self.model.hf_dir} holds no config.json (set warm_start.make_model "
                              f"to create a tiny model there)")
        check_model_parallel(self.parallel, self.model)
        if self.advantage.group_size != self.rollout.n_samples:
            raise ConfigError(f"advantage.group_size ({self.advantage.group_size}) must equal rollout.n_samples "
                              f"({self.rollout.n_samples}): both are the GRPO group size")
        rows = self.grpo.prompts_per_step * self.rollout.n_samples
        if rows % self.grpo.mini_batches or (rows // self.grpo.mini_batches) % self.grpo.micro_batch_size:
            raise ConfigError(
                f"grpo.prompts_per_step * rollout.n_samples = {rows} responses must split into grpo.mini_batches="
                f"{self.grpo.mini_batches} mini-batches of whole grpo.micro_batch_size={self.grpo.micro_batch_size} "
                f"micro-batches")
        if self.uses_vocab_regularizer and self.parallel.pipeline_parallel > 1:
            raise ConfigError(f"loss.regularizer={self.loss.regularizer} is a full-vocabulary measure: it needs the "
                              f"reference logits beside the actor's and supports parallel.pipeline_parallel=1 only")
        if self.loss.policy_loss == "divergence_clip" and issubclass(DIVERGENCES[self.loss.measure], VocabDivergence):
            raise ConfigError(f"loss.measure={self.loss.measure} is a full-vocabulary measure: clipping on it needs "
                              f"D(pi_theta, pi_old) over the whole vocabulary, i.e. the old policy's logits beside "
                              f"the actor's in every micro-batch, which the trainer does not keep; use a token "
                              f"measure ({', '.join(names_of_kind(TokenDivergence))})")
        if self.warm_start.sft_steps and not self.data_has_answers:
            raise ConfigError("warm_start.sft_steps needs a dataset with reference answers")

    @property
    def uses_vocab_regularizer(self) -> bool:
        return self.loss.regularizer is not None and issubclass(DIVERGENCES[self.loss.regularizer], VocabDivergence)

    @property
    def data_has_answers(self) -> bool:
        return self.data.name != "jsonl" or self.data.answer_field is not None

    @property
    def needs_reference(self) -> bool:
        return self.loss.kl_coef > 0 or self.loss.regularizer is not None
