"""What every reward returns: a score and a reason code per response."""
from __future__ import annotations

from dataclasses import dataclass

REASONS = ("correct", "wrong", "unparsable", "timeout", "crashed")
"""correct / wrong: graded; unparsable: no answer or program found in the response; timeout: grading
or the program ran out of time; crashed: the grader or the program died or hit a resource limit."""


@dataclass(frozen=True)
class RewardResult:
    scores: list[float]
    reasons: list[str]

    def __post_init__(self):
        if len(self.scores) != len(self.reasons):
            raise ValueError(f"{len(self.scores)} scores but {len(self.reasons)} reasons")
        unknown = set(self.reasons) - set(REASONS)
        if unknown:
            raise ValueError(f"unknown reason codes {sorted(unknown)}; allowed: {REASONS}")

    def counts(self) -> dict[str, int]:
        """Responses per reason code (every code present, zeros included), for the trainer's metrics."""
        return {r: self.reasons.count(r) for r in REASONS}
