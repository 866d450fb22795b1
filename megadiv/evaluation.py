"""Held-out evaluation of a policy on benchmark splits: greedy pass@1, and avg@k / pass@k over k
samples. Shared by training (``eval.data`` and ``eval.extra_data``) and ``megadiv eval``.

A response is correct when its reward's reason is ``correct`` (the math answer is right, every test
passed, the digits match), whatever a shaped reward scores it::

    suite = EvalSuite.build(data_cfgs, reward_cfgs, tokenizer)
    metrics = suite.run(engine, EvalSampling(max_new_tokens=1024, samples=4, temperature=0.6))
    # {"gsm8k:test": {"n": 1319, "pass@1": ..., "avg@4": ..., "pass@4": ...}, ...}
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megadiv.data import DataConfig, Dataset, PromptTemplate, load_dataset
from megadiv.rewards import RewardConfig, build_reward
from megadiv.rollout import SamplingParams


@dataclass(frozen=True)
class EvalSampling:
    max_new_tokens: int
    samples: int = 0
    """k of avg@k / pass@k (0: greedy pass@1 only)."""
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class EvalSet:
    """One split, its prompts rendered once, and the reward that grades it."""

    name: str
    dataset: Dataset
    prompts: list[list[int]]
    reward: object

    def run(self, engine, sampling: EvalSampling, decode) -> dict[str, float]:
        records = list(self.dataset)
        metrics = {"n": len(records)}
        greedy = self._correct(engine, records, decode, SamplingParams(
            n=1, temperature=0.0, max_new_tokens=sampling.max_new_tokens))
        metrics["pass@1"] = float(greedy.mean())
        k = sampling.samples
        if k:
            sampled = self._correct(engine, records, decode, SamplingParams(
                n=k, temperature=sampling.temperature, top_p=sampling.top_p,
                max_new_tokens=sampling.max_new_tokens)).view(-1, k)
            metrics[f"avg@{k}"] = float(sampled.mean())
            metrics[f"pass@{k}"] = float(sampled.any(-1).float().mean())
        return metrics

    def _correct(self, engine, records, decode, params: SamplingParams) -> torch.Tensor:
        """[len(records) * n] 1.0 where the response is correct, prompt-major."""
        groups = engine.generate(self.prompts, params)
        texts = [decode(c.token_ids) for group in groups for c in group]
        result = self.reward(texts, [r for r in records for _ in range(params.n)])
        return torch.tensor([reason == "correct" for reason in result.reasons], dtype=torch.float32)


class EvalSuite:
    """Several eval sets; ``run`` evaluates each in turn with one engine."""

    def __init__(self, sets: list[EvalSet], tokenizer, owned_rewards: list):
        self.sets, self.tokenizer, self._owned = sets, tokenizer, owned_rewards

    @classmethod
    def build(cls, data_cfgs: list[DataConfig], reward_cfgs: list[RewardConfig], tokenizer,
              shared: dict | None = None) -> "EvalSuite":
        """One set per (data, reward) config pair; sets with equal reward configs share one reward,
        and ``shared`` (RewardConfig -> reward, e.g. the training reward) is used, not closed."""
        rewards, owned, sets = dict(shared or {}), [], []
        for data_cfg, reward_cfg in zip(data_cfgs, reward_cfgs, strict=True):
            if reward_cfg not in rewards:
                rewards[reward_cfg] = build_reward(reward_cfg)
                owned.append(rewards[reward_cfg])
            dataset = load_dataset(data_cfg)
            template = PromptTemplate.resolve(data_cfg, dataset, tokenizer)
            sets.append(EvalSet(f"{data_cfg.name}:{data_cfg.split}", dataset,
                                [template.token_ids(r, tokenizer) for r in dataset], rewards[reward_cfg]))
        return cls(sets, tokenizer, owned)

    def run(self, engine, sampling: EvalSampling, progress=None) -> dict[str, dict[str, float]]:
        out = {}
        for s in self.sets:
            if progress:
                progress(f"evaluating {s.name} ({len(s.dataset)} problems)")
            out[s.name] = s.run(engine, sampling, self._decode)
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        for reward in self._owned:
            reward.close()


def default_reward(dataset_name: str, like: RewardConfig | None = None) -> RewardConfig:
    """The reward a split is graded with when none is configured for it: its dataset's own (math-verify,
    the code sandbox, exact match), with ``like``'s workers and timeout."""
    from megadiv.data import DATASETS

    name = DATASETS[dataset_name].reward
    if like is None:
        return RewardConfig(name=name)
    return RewardConfig(name=name, workers=like.workers, timeout_s=like.timeout_s,
                        sandbox_isolation=like.sandbox_isolation)
