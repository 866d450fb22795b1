"""Reward registry: the trainer builds its reward by name from a RewardConfig.

A reward is a callable ``(responses: list[str], records: list[Record]) -> RewardResult`` with a
``close()`` method; it never raises for anything a response contains and never hangs (timeouts
and crashes score 0 with their reason code). Add one with :func:`register_reward`.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from megadiv.rewards.base import RewardResult


class Reward(Protocol):
    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult: ...

    def close(self) -> None: ...


class ExactMatchReward:
    """1 when the response, stripped of surrounding whitespace, equals ``record.answer`` (the
    synthetic arithmetic task: the model writes digits then EOS)."""

    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult:
        scores, reasons = [], []
        for response, record in zip(responses, records, strict=True):
            answer = response.strip()
            ok = answer == str(record.answer).strip()
            scores.append(float(ok))
            reasons.append("correct" if ok else "wrong" if answer else "unparsable")
        return RewardResult(scores, reasons)

    def close(self) -> None:
        pass


def _math(cfg) -> Reward:
    from megadiv.rewards.math_reward import MathReward

    return MathReward(cfg.workers, cfg.timeout_s, cfg.answer_format, cfg.format_weight)


def _code(cfg) -> Reward:
    from megadiv.rewards.code_reward import CodeReward

    return CodeReward(cfg.workers, cfg.timeout_s, cfg.partial_credit, _sandbox_limits(cfg))


def _sandbox_limits(cfg):
    from megadiv.rewards.sandbox import SandboxLimits

    return SandboxLimits(memory_mb=cfg.sandbox_memory_mb, max_processes=cfg.sandbox_max_processes,
                         max_open_files=cfg.sandbox_max_open_files, output_bytes=cfg.sandbox_output_kb * 1024,
                         isolation=cfg.sandbox_isolation)


def _code_shaped(cfg) -> Reward:
    from megadiv.rewards.gbmpo import ShapedCodeReward

    return ShapedCodeReward(cfg.workers, cfg.timeout_s, False, _sandbox_limits(cfg))


def _last_number(cfg) -> Reward:
    from megadiv.rewards.gbmpo import LastNumberReward

    return LastNumberReward()


REWARDS: dict[str, Callable] = {"math": _math, "code": _code, "mbpp": _code, "code_shaped": _code_shaped,
                                "last_number": _last_number, "exact_match": lambda cfg: ExactMatchReward()}


def register_reward(name: str, factory: Callable, *, overwrite: bool = False) -> None:
    """Add a reward: ``factory(cfg: RewardConfig) -> Reward``."""
    if name in REWARDS and not overwrite:
        raise ValueError(f"reward {name!r} is already registered (pass overwrite=True to replace it)")
    REWARDS[name] = factory


def build_reward(cfg) -> Reward:
    """The reward ``cfg.name`` names, configured by ``cfg`` (a RewardConfig)."""
    return REWARDS[cfg.name](cfg)
