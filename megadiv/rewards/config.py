"""RewardConfig: which reward, how many workers, timeouts, shaping and sandbox limits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored (``megadiv.rewards.build_reward``)."""

    name: str = "math"
    """Registry name: math, code (alias mbpp), exact_match, or one added with register_reward; the
    GBMPO authors' rewards: last_number (GSM8K) and code_shaped (MBPP), megadiv/rewards/gbmpo.py."""
    workers: int = 2
    """math: math-verify worker processes; code: sandboxes running at once."""
    timeout_s: float = 5.0
    """math: limit of each math-verify parse/compare (whole seconds, rounded up);
    code: wall-clock limit of one program with all its tests."""
    answer_format: Literal["auto", "boxed", "hash"] = "auto"
    """math: where the answer is read: the last \\boxed{}, the text after the last ####, or auto
    (boxed, else ####, else wherever math-verify finds one)."""
    format_weight: float = 0.0
    """math: score = correct + format_weight * (answer given in the required format)."""
    partial_credit: bool = False
    """code: a failed program earns passed/total instead of 0 (code_shaped has its own partial credit)."""
    sandbox_memory_mb: int = 1024
    """code: address-space limit of the program."""
    sandbox_max_processes: int = 1
    """code: processes and threads the program may have, itself included (1: none started)."""
    sandbox_max_open_files: int = 64
    """code: open files the program may hold (RLIMIT_NOFILE)."""
    sandbox_output_kb: int = 1024
    """code: stdout + stderr a program may write before it is stopped."""
    sandbox_isolation: Literal["auto", "namespaces", "unsafe"] = "auto"
    """code: namespaces (Linux, root with CAP_SYS_ADMIN); auto (namespaces, or refuse to run code with
    an error saying what is missing); unsafe (explicit opt-in: host filesystem readable, audit-hook
    guards, a warning every batch; see docs/security.md)."""

    def __post_init__(self):
        from megadiv.rewards.registry import REWARDS

        if self.name not in REWARDS:
            raise ValueError(f"reward.name: unknown reward {self.name!r}; registered: {sorted(REWARDS)}")
        for key in ("workers", "sandbox_memory_mb", "sandbox_max_processes", "sandbox_max_open_files",
                    "sandbox_output_kb"):
            if getattr(self, key) < 1:
                raise ValueError(f"reward.{key} must be >= 1, got {getattr(self, key)}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.format_weight < 0:
            raise ValueError(f"reward.format_weight must be >= 0, got {self.format_weight}")
        if self.partial_credit and self.name not in ("code", "mbpp"):
            raise ValueError(f"reward.partial_credit applies to the code reward, not {self.name!r}")
        if self.answer_format != "auto" and self.name != "math":
            raise ValueError(f"reward.answer_format applies to the math reward, not {self.name!r}")
        if self.format_weight and self.name != "math":
            raise ValueError(f"reward.format_weight applies to the math reward, not {self.name!r}")
        if self.sandbox_memory_mb < 64:
            raise ValueError(f"reward.sandbox_memory_mb must be >= 64, got {self.sandbox_memory_mb}")
        if self.sandbox_isolation not in ("auto", "namespaces", "unsafe"):
            raise ValueError(f"reward.sandbox_isolation must be auto, namespaces or unsafe, got "
                             f"{self.sandbox_isolation!r}")
        if self.sandbox_max_open_files < 16:
            raise ValueError(f"reward.sandbox_max_open_files must be >= 16, got {self.sandbox_max_open_files}")
