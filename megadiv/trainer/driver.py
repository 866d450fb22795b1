"""The rollout side of a run, held by global rank 0 alone: prompts, the engine, rewards, evaluation.

The other ranks never touch the engine or the reward workers; they receive the rows to train on
(grpo.py broadcasts them) and take part in the weight export, which is collective.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from megadiv.data import PromptSampler, PromptTemplate, load_dataset
from megadiv.evaluation import EvalSampling, EvalSuite, default_reward
from megadiv.rewards import build_reward
from megadiv.rollout import Bucket, SamplingParams, make_engine
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.experience import (Experience, build_experience, concat, informative_groups,
                                        take_groups)
from megadiv.trainer.metrics import StepTimer

log = logging.getLogger(__name__)


class RolloutDriver:
    """Prompts -> completions -> rewards -> advantages, and held-out evaluation."""

    def __init__(self, cfg: TrainConfig, hf_dir: str, tokenizer, reserved_bytes: int = 0):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.dataset = load_dataset(cfg.data)
        self.template = PromptTemplate.resolve(cfg.data, self.dataset, tokenizer)
        self.sampler = PromptSampler(len(self.dataset), cfg.grpo.prompts_per_step, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle)
        self.reward = build_reward(cfg.reward)
        # eval.data is graded with the training reward, eval.extra_data with their datasets' own
        eval_data = ([cfg.eval.data] if cfg.eval.data is not None else []) + list(cfg.eval.extra_data)
        self.eval_suite = EvalSuite.build(
            eval_data, [cfg.reward] * (cfg.eval.data is not None) + [default_reward(d.name, cfg.reward)
                                                                     for d in cfg.eval.extra_data],
            tokenizer, shared={cfg.reward: self.reward})
        self.engine = make_engine(cfg.rollout, hf_dir, reserved_bytes)  # after the models: see place_server
        self.sampling = SamplingParams.from_config(cfg.rollout)

    def collect(self, step: int, timer: StepTimer) -> Experience:
        """One rollout batch of grpo.prompts_per_step groups; with dynamic sampling, groups without
        reward variance are replaced by fresh ones for up to grpo.max_resample_rounds rounds."""
        g, want = self.cfg.advantage.group_size, self.cfg.grpo.prompts_per_step
        torch.manual_seed(self.cfg.run.seed * 1_000_003 + step)  # sampling reproducible per step (resume)
        kept, spare, rounds = [], [], 0
        while True:
            exp = self._rollout(self.sampler.next_batch(), timer)
            if not self.cfg.grpo.dynamic_sampling:
                return exp
            useful = informative_groups(exp, g)
            kept.append(take_groups(exp, useful, g))
            spare.append(take_groups(exp, [i for i in range(len(exp) // g) if i not in useful], g))
            have = sum(len(e) for e in kept) // g
            if have >= want or rounds == self.cfg.grpo.max_resample_rounds:
                break
            rounds += 1
        # Fill up with zero-advantage groups (no policy gradient) to keep the batch shape.
        batch = concat(kept + spare)
        batch = take_groups(batch, list(range(want)), g)
        batch.metrics = exp.metrics | {"dynamic/kept_groups": min(have, want) / want, "dynamic/rounds": rounds + 1}
        return batch

    def _rollout(self, indices: list[int], timer: StepTimer) -> Experience:
        records = [self.dataset[i] for i in indices]
        prompts = [self.template.token_ids(r, self.tokenizer) for r in records]
        with timer("rollout"):
            groups = self.engine.generate(prompts, self.sampling)
        with timer("reward"):
            texts = [self._decode(c.token_ids) for group in groups for c in group]
            result = self.reward(texts, [r for r in records for _ in range(self.sampling.n)])
        return build_experience(prompts, groups, result.scores, result.reasons, self.cfg.advantage,
                                self.sampling.max_new_tokens, self.cfg.grpo.overlong_buffer,
                                self.cfg.grpo.overlong_penalty, self.cfg.grpo.mask_truncated)

    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 (eval/accuracy) on eval.data, with eval.samples = k > 0 also avg@k and pass@k
        at eval.temperature; the same for each of eval.extra_data as eval/<name>_<split>/<metric>."""
        cfg = self.cfg.eval
        sampling = EvalSampling(cfg.max_new_tokens or self.sampling.max_new_tokens, cfg.samples, cfg.temperature)
        metrics = {}
        for i, (name, result) in enumerate(self.eval_suite.run(self.engine, sampling).items()):
            primary = i == 0 and cfg.data is not None
            prefix = "eval/" if primary else f"eval/{name.replace(':', '_')}/"
            metrics |= {prefix + ("accuracy" if key == "pass@1" and primary else key): value
                        for key, value in result.items() if key != "n"}
        return metrics

    def push_weights(self, buckets, version: str) -> dict[str, float]:
        report = self.engine.update_weights(buckets, version)
        return {"sync/mb_per_s": report.mb_per_s, "sync/buckets": report.num_buckets}

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        for close in (self.engine.shutdown, self.eval_suite.close, self.reward.close):
            try:
                close()
            except Exception:  # closing must not mask the error that brought us here
                log.exception("while closing the rollout driver")


def drain(buckets: Iterable[Bucket]) -> None:
    """Take part in a collective weight export without sending anything (ranks other than 0)."""
    for _ in buckets:
        pass
