"""From sampled completions to training rows: rewards, shaping, advantages, dynamic sampling, packing.

Everything here runs in the rollout driver (driver.py) and is plain Python/torch: the result, an
:class:`Experience`, is dealt to the data-parallel replicas as packed tensors (handoff.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megadiv.divergence import AdvantageConfig, compute_advantages
from megadiv.policy.batches import SequenceBatch
from megadiv.rewards import REASONS
from megadiv.rollout import Completion


@dataclass
class Experience:
    """One rollout batch, prompt-major: rows [g * G, (g + 1) * G) are prompt g's G responses."""

    prompts: list[list[int]]      # [rows] prompt token ids (repeated per response)
    responses: list[list[int]]    # [rows] response token ids
    rollout_logprobs: list[list[float]]
    rewards: torch.Tensor         # [rows] after shaping
    advantages: torch.Tensor      # [rows]
    in_loss: torch.Tensor         # [rows] 1.0, or 0.0 for a row dropped from the loss (grpo.mask_truncated)
    metrics: dict[str, float]
    policy_version: int = 0       # the trainer step whose weights generated the rows (0: the starting ones)
    routing: list[torch.Tensor] | None = None  # [rows] the engine's experts per position (grpo.routing_replay r3)

    def __len__(self) -> int:
        return len(self.responses)

    def state_dict(self) -> dict:
        """Plain lists, tensors and numbers (what a checkpoint's torch.load(weights_only=True) reads)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "Experience":
        return cls(**state)

    def to_batch(self, pad_id: int) -> SequenceBatch:
        """Right-padded [B, S] rows; position t carries the log-prob of token t + 1 (see megadiv/policy/megatron.py).
        Rows out of the loss keep their place (and count in B for seq-mean-token-sum-norm) with an
        all-zero loss mask."""
        return training_rows(self.prompts, self.responses, self.rollout_logprobs, self.advantages, self.in_loss,
                             pad_id, self.routing)


def training_rows(prompts: list[list[int]], responses: list[list[int]], rollout_logprobs: list[list[float]],
                  advantages: torch.Tensor, in_loss: torch.Tensor, pad_id: int,
                  routing: list[torch.Tensor] | None = None) -> SequenceBatch:
    """The [B, S] rows a policy trains on; a row out of the loss keeps its place with a zero loss mask."""
    batch = SequenceBatch.pack(prompts, responses, pad_id, response_values=rollout_logprobs, routing=routing,
                               advantages=advantages.float())
    batch.loss_mask *= in_loss[:, None]
    return batch


def overlong_shaping(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_new - buffer tokens, then
    falling linearly to -penalty at max_new tokens. [rows] -> [rows]."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def build_experience(prompts: list[list[int]], groups: list[list[Completion]], scores: list[float],
                     reasons: list[str], adv_cfg: AdvantageConfig, max_new_tokens: int,
                     overlong_buffer: int = 0, overlong_penalty: float = 1.0,
                     mask_truncated: bool = False, policy_version: int = 0) -> Experience:
    """Rows for ``prompts`` and their completion ``groups`` (one list of G per prompt), with the
    reward of each completion in ``scores`` / ``reasons`` (prompt-major order). With
    ``mask_truncated``, completions cut at max_new_tokens stay in their group's advantage
    baseline but are dropped from the loss (TRL's mask_truncated_completions, which GBMPO uses).
    ``policy_version``: the trainer step whose weights generated ``groups`` (the staleness check)."""
    completions = [c for group in groups for c in group]
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    raw = torch.tensor(scores, dtype=torch.float32)
    rewards = raw + overlong_shaping(lengths, max_new_tokens, overlong_buffer, overlong_penalty)
    advantages = compute_advantages(adv_cfg, rewards)
    correct = torch.tensor([r == "correct" for r in reasons]).view(-1, adv_cfg.group_size)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/accuracy": float(correct.float().mean()),
        "reward/solved_groups": float(correct.any(-1).float().mean()),
        "reward/uniform_groups": float((raw.view(-1, adv_cfg.group_size).std(-1) == 0).float().mean()),
        "response/length_mean": float(lengths.float().mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(truncated.float().mean()),
    }
    metrics |= {f"reward/reason_{r}": reasons.count(r) / len(reasons) for r in REASONS}
    return Experience(
        prompts=[p for p, group in zip(prompts, groups) for _ in group],
        responses=[c.token_ids for c in completions],
        rollout_logprobs=[c.logprobs for c in completions],
        rewards=rewards, advantages=advantages,
        in_loss=(~truncated).float() if mask_truncated else torch.ones(len(completions)), metrics=metrics,
        policy_version=policy_version,
        routing=[c.routing for c in completions] if completions[0].routing is not None else None)


def informative(scores: list[float], completions: list[Completion], max_new_tokens: int, overlong_buffer: int = 0,
                overlong_penalty: float = 1.0) -> bool:
    """DAPO dynamic sampling: whether one group's rewards (after overlong shaping, as the batch's)
    are not all equal, i.e. whether it carries a policy gradient."""
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    rewards = torch.tensor(scores, dtype=torch.float32) + overlong_shaping(lengths, max_new_tokens, overlong_buffer,
                                                                         overlong_penalty)
    return bool((rewards != rewards[0]).any())
