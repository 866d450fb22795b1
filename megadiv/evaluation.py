"""Held-out evaluation of a policy on benchmark splits: greedy pass@1, and avg@k / pass@k over k
samples. Shared by training (``eval.data`` and ``eval.extra_data``) and ``megadiv eval``.

A response is correct when its reward's reason is ``correct`` (the math answer is right, every test
passed, the digits match), whatever a shaped reward scores it::

    suite = EvalSuite.build(data_cfgs, reward_cfgs, tokenizer)
    metrics = suite.run(engine, EvalSampling(max_new_tokens=1024, samples=4, temperature=0.6))
    # {"gsm8k:test": {"n": 1319, "pass@1": ..., "avg@4": ..., "pass@4": ..., "max_new_tokens": 1024,
    #                 "response_tokens": {"greedy": {"all": {"n", "mean", "median"}, "correct": ...,
    #                                                "incorrect": ...}, "samples@4": {...}}}, ...}

Each split shows a progress bar (:mod:`megadiv.progress`) counting responses. ``max_new_tokens=None``
gives each split its own length: the run's for a run's own data set, else the data set's
``eval_max_new_tokens`` (docs/data_and_rewards.md says why each is what it is).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megadiv.data import DATASETS, DataConfig, Dataset, PromptTemplate, load_dataset
from megadiv.progress import Progress
from megadiv.rewards import RewardConfig, build_reward
from megadiv.rollout import SamplingParams

# Prompts go to the engine in about this many calls per generation pass, so that the progress bar
# moves every ~5% (at least MIN_PROMPTS_PER_CALL prompts a call, to keep the engine's batches full).
CALLS_PER_PASS = 20
MIN_PROMPTS_PER_CALL = 8


@dataclass(frozen=True)
class EvalSampling:
    max_new_tokens: int | None
    """Longest response of every split; None: each split's own (:attr:`EvalSet.max_new_tokens`)."""
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
    max_new_tokens: int
    """Used when EvalSampling.max_new_tokens is None: the run's, else the dataset's default."""

    @classmethod
    def build(cls, data_cfg: DataConfig, reward, tokenizer, max_new_tokens: int | None = None) -> EvalSet:
        """Load and render the split; a problem whose prompt renders to no token is a ValueError naming
        it (a character tokenizer drops the characters it lacks, so a raw template can leave nothing)."""
        dataset = load_dataset(data_cfg)
        template = PromptTemplate.resolve(data_cfg, dataset, tokenizer)
        prompts = [template.token_ids(r, tokenizer) for r in dataset]
        empty = [r.id for r, p in zip(dataset, prompts) if not p]
        if empty:
            raise ValueError(f"{len(empty)} of {len(prompts)} problems render to an empty prompt with the "
                             f"{template.kind} template (first: {empty[0]}); the tokenizer has no token for "
                             f"their text: choose another template (data.template, --template)")
        return cls(f"{data_cfg.name}:{data_cfg.split}", dataset, prompts, reward,
                   max_new_tokens or DATASETS[data_cfg.name].eval_max_new_tokens)

    def run(self, engine, sampling: EvalSampling, decode) -> dict:
        """{"n", "pass@1", ["avg@k", "pass@k"], "max_new_tokens", "response_tokens"}."""
        records, k = list(self.dataset), sampling.samples
        max_new = sampling.max_new_tokens or self.max_new_tokens
        params = [SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new)]
        if k:
            params.append(SamplingParams(n=k, temperature=sampling.temperature, top_p=sampling.top_p,
                                         max_new_tokens=max_new))
        with Progress(f"evaluating {self.name}", total=len(records) * sum(p.n for p in params),
                      unit="response") as bar:
            (greedy, greedy_len), *sampled = [self._generate(engine, records, decode, p, bar) for p in params]
        metrics = {"n": len(records), "pass@1": float(greedy.mean())}
        lengths = {"greedy": response_tokens(greedy_len, greedy)}
        if k:
            correct, length = sampled[0]
            metrics[f"avg@{k}"] = float(correct.mean())
            metrics[f"pass@{k}"] = float(correct.view(-1, k).any(-1).double().mean())
            lengths[f"samples@{k}"] = response_tokens(length, correct)
        return metrics | {"max_new_tokens": max_new, "response_tokens": lengths}

    def _generate(self, engine, records, decode, params: SamplingParams, bar: Progress
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """([len(records) * n] 1.0 where the response is correct, [same] response tokens), prompt-major."""
        per_call = max(MIN_PROMPTS_PER_CALL, math.ceil(len(records) / CALLS_PER_PASS))
        correct, lengths = [], []
        for start in range(0, len(records), per_call):
            chunk = records[start:start + per_call]
            groups = engine.generate(self.prompts[start:start + per_call], params)
            completions = [c for group in groups for c in group]
            result = self.reward([decode(c.token_ids) for c in completions],
                                 [r for r in chunk for _ in range(params.n)])
            correct += [reason == "correct" for reason in result.reasons]
            lengths += [len(c.token_ids) for c in completions]  # the stop token included, as in training
            bar.update(len(completions))
        # float64: pass@1 of 1/20 reads 0.05, not float32's 0.0500000007
        return torch.tensor(correct, dtype=torch.float64), torch.tensor(lengths)


def response_tokens(lengths: torch.Tensor, correct: torch.Tensor) -> dict[str, dict]:
    """Mean and median response length in tokens over all responses and over the correct / incorrect
    ones: {"all" | "correct" | "incorrect": {"n", "mean", "median"}} (mean and median None when n is 0;
    the median of an even count is the mean of the two middle values)."""
    groups = {"all": lengths.tolist(), "correct": lengths[correct.bool()].tolist(),
              "incorrect": lengths[~correct.bool()].tolist()}
    return {name: {"n": len(v), "mean": statistics.fmean(v) if v else None,
                   "median": float(statistics.median(v)) if v else None} for name, v in groups.items()}


@dataclass
class FailedSet:
    """A split that could not be loaded or rendered: evaluated, it reports its error."""

    name: str
    error: str

    def run(self, engine, sampling: EvalSampling, decode) -> dict:
        return {"n": None, "error": self.error}


class EvalSuite:
    """Several eval sets; ``run`` evaluates each in turn with one engine."""

    def __init__(self, sets: list, tokenizer, owned_rewards: list):
        self.sets, self.tokenizer, self._owned = sets, tokenizer, owned_rewards

    @classmethod
    def build(cls, data_cfgs: list[DataConfig], reward_cfgs: list[RewardConfig], tokenizer,
              shared: dict | None = None, max_new_tokens: Sequence[int | None] | None = None,
              keep_going: bool = False) -> EvalSuite:
        """One set per (data, reward) config pair; sets with equal reward configs share one reward,
        and ``shared`` (RewardConfig -> reward, e.g. the training reward) is used, not closed.
        ``max_new_tokens``: per set (None: the dataset's default). ``keep_going``: a split that fails
        to build becomes a :class:`FailedSet` instead of raising."""
        rewards, owned, sets = dict(shared or {}), [], []
        for i, (data_cfg, reward_cfg) in enumerate(zip(data_cfgs, reward_cfgs, strict=True)):
            try:
                if reward_cfg not in rewards:
                    rewards[reward_cfg] = build_reward(reward_cfg)
                    owned.append(rewards[reward_cfg])
                sets.append(EvalSet.build(data_cfg, rewards[reward_cfg], tokenizer,
                                          max_new_tokens[i] if max_new_tokens else None))
            except Exception as e:  # keep_going: any failure of one split is that split's
                if not keep_going:
                    raise
                sets.append(FailedSet(f"{data_cfg.name}:{data_cfg.split}", error_text(e)))
        return cls(sets, tokenizer, owned)

    def run(self, engine, sampling: EvalSampling, keep_going: bool = False) -> dict[str, dict]:
        """Each split's metrics; with ``keep_going`` a split that raises gets {"n", "error"} and the
        others still run."""
        out = {}
        for s in self.sets:
            try:
                out[s.name] = s.run(engine, sampling, self._decode)
            except Exception as e:  # as above
                if not keep_going:
                    raise
                out[s.name] = {"n": len(s.dataset), "error": error_text(e)}
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        for reward in self._owned:
            reward.close()


def accuracy(result: dict) -> dict[str, float]:
    """The accuracy figures of one split's result: pass@1, avg@k, pass@k (what training logs)."""
    return {key: value for key, value in result.items() if key.startswith(("pass@", "avg@"))}


def error_text(e: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def default_reward(dataset_name: str, like: RewardConfig | None = None) -> RewardConfig:
    """The reward a split is graded with when none is configured for it: its dataset's own (math-verify,
    the code sandbox, exact match), with ``like``'s workers and timeout."""
    from megadiv.data import DATASETS

    name = DATASETS[dataset_name].reward
    if like is None:
        return RewardConfig(name=name)
    return RewardConfig(name=name, workers=like.workers, timeout_s=like.timeout_s,
                        sandbox_isolation=like.sandbox_isolation)
