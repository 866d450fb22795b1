"""The rollout engine protocol: what the trainer needs from whatever generates its completions.

Two implementations: :class:`megadiv.rollout.embedded.EmbeddedEngine` (transformers in the
trainer process) and :class:`megadiv.rollout.sglang_engine.SGLangEngine` (an SGLang server, launched
or attached); :class:`megadiv.rollout.fleet.FleetEngine`, what make_engine builds for SGLang, holds
one SGLangEngine per server (one or several). factory.py builds the configured one (engines import
this module, never the factory). The GRPO loop only sees this protocol::

    engine = make_engine(cfg.rollout, hf_dir)
    groups = engine.generate(prompt_ids, SamplingParams.from_config(cfg.rollout))  # [prompt][sample]
    ...train...
    engine.update_weights(iter_hf_weight_buckets(model, cfg.rollout.bucket_bytes), version=f"step-{step}")

Log-prob convention (both engines, and what the trainer must compare against): the log-prob of a
sampled token is ``log_softmax(logits / T)[token]`` for temperature T > 0, and
``log_softmax(logits)[token]`` for greedy decoding (T == 0); top-p / top-k truncation is NOT applied.
This is what SGLang returns by default (sampler.py: ``log(softmax(logits / T))`` before top-p/top-k
renormalisation), so the trainer divides its logits by the rollout temperature before log_softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

import torch

from megadiv.rollout.config import RolloutConfig

Bucket = list[tuple[str, torch.Tensor]]
"""One bucket of full, unpadded Hugging Face tensors: [(hf_name, tensor), ...]."""

FinishReason = Literal["stop", "length", "abort"]


class RolloutError(RuntimeError):
    """Generation failed: a server died, timed out or answered an error; the message names it."""


class WeightSyncError(RolloutError):
    """A weight update was refused or failed; the message names the server and the version."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables."""
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens ending a completion (the model's EOS tokens always do); the stop token is kept."""
    return_routing: bool = False
    """Mixture-of-experts models: return each completion's routing (Completion.routing); the
    embedded engine can, SGLang's is not wired."""

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={self.n}, max_new_tokens={self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"need temperature >= 0, top_p in (0, 1], top_k -1 or >= 1; got {self}")

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> SamplingParams:
        return cls(n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_new_tokens=cfg.max_new_tokens, stop_token_ids=tuple(cfg.stop_token_ids))


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    """Generated tokens (the prompt excluded; a stop/EOS token that ended it included)."""
    logprobs: list[float]
    """Per generated token, log_softmax(logits / T)[token] (the module's convention)."""
    finish_reason: FinishReason
    """stop: ended by a stop/EOS token; length: hit max_new_tokens; abort: cut by the server."""
    weight_version: str
    """Version of the weights that generated it (what the last update_weights named)."""
    routing: torch.Tensor | None = None
    """With SamplingParams.return_routing: [prompt + response - 1, MoE layers, k] int16, the experts
    each layer's router chose for each position the engine ran (every one but the last token's)."""


@dataclass(frozen=True)
class SyncReport:
    """What one update_weights did."""

    version: str
    method: str
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float
    bytes_sent: int = 0
    """What this process put on broadcast groups (``distributed``; 0 for ``tensor``/``disk`` and
    the embedded engine): a bucket broadcast once to a whole fleet counts once, a bucket sent again
    after a lost server's group was rebuilt counts twice."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (see the module docstring)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt (token ids in); returns [prompt][sample]."""

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Log-probs of the given response tokens after their prompts under the raw policy
        (temperature 1: log_softmax(logits)): one float32 tensor [len(response)] per pair.
        Used by the mismatch check. (SGLang computes prompt log-probs without temperature.)"""

    def update_weights(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        """Load the trainer's weights, bucket by bucket, then serve them as ``version``.
        Raises WeightSyncError (naming the server and the version) instead of hanging."""

    def pause(self) -> None:
        """Stop generating (in-flight SGLang requests wait); generate() raises until resume()."""

    def resume(self) -> None: ...

    @property
    def weight_version(self) -> str:
        """Version of the served weights: "default" until the first update (SGLang's convention)."""

    def shutdown(self) -> None:
        """Release the engine; stops servers it launched (not attached ones). Idempotent."""


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt and no empty prompt")


def split_evenly(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of range(n), sizes differing by at most one (larger first)."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
