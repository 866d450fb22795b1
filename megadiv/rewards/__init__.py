"""Rewards: math-verify in worker processes, MBPP tests in a sandbox, exact match; a registry.

Public interface:

- ``math_scores(responses, golds) -> list[float]``
- ``run_sandboxed(program, tests, timeout_s=10.0) -> SandboxResult`` (``status``, ``passed``, ``total``)
- ``build_reward(RewardConfig) -> Reward``; ``reward(responses, records) -> RewardResult`` (scores
  and a reason code per response: correct, wrong, unparsable, timeout, crashed)

Imports from the rest of megadiv only ``megadiv.data.code_tests`` (how a code record's tests split).
"""
from megadiv.rewards.base import REASONS, RewardResult
from megadiv.rewards.code_reward import CodeReward, extract_program
from megadiv.rewards.config import RewardConfig
from megadiv.rewards.math_reward import Grade, MathReward, MathVerifyPool, math_scores
from megadiv.rewards.registry import REWARDS, ExactMatchReward, Reward, build_reward, register_reward
from megadiv.rewards.sandbox import SandboxError, SandboxLimits, SandboxResult, run_sandboxed

__all__ = ["REASONS", "REWARDS", "CodeReward", "ExactMatchReward", "Grade", "MathReward", "MathVerifyPool",
           "Reward", "RewardConfig", "RewardResult", "SandboxError", "SandboxLimits", "SandboxResult",
           "build_reward", "extract_program", "math_scores", "register_reward", "run_sandboxed"]
