"""Did the weights arrive? Compare the engine's log-probs of a fixed probe batch with the trainer's.

After every sync the engine scores the same probe tokens the trainer scores with its own model::

    probe = ProbeBatch.random(vocab_size, cfg.rollout, seed=0)           # fixed for the run
    trainer_lp = trainer_logprobs(probe)                                # [len(response)] per pair
    report = check_mismatch(engine, probe, trainer_lp, cfg.rollout.mismatch_threshold, version)

Both sides use the raw policy, log_softmax(logits) (temperature 1). With identical weights the
difference is numerical noise (float32: ~1e-6; bf16: ~1e-2); a stale, missing or misnamed tensor
moves it by O(1), and the threshold turns that silent corruption into an error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import RolloutEngine, WeightSyncError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeBatch:
    prompts: list[list[int]]
    responses: list[list[int]]

    @classmethod
    def random(cls, vocab_size: int, cfg: RolloutConfig, seed: int = 0) -> ProbeBatch:
        """cfg.probe_prompts pairs of uniformly random tokens (a fixed seed: the same every sync)."""
        g = torch.Generator().manual_seed(seed)
        draw = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
        return cls([draw(cfg.probe_prompt_len) for _ in range(cfg.probe_prompts)],
                   [draw(cfg.probe_response_len) for _ in range(cfg.probe_prompts)])


@dataclass(frozen=True)
class MismatchReport:
    version: str
    mean_abs: float
    """mean over probe tokens of |engine log-prob - trainer log-prob| (the thresholded figure)."""
    max_abs: float
    tokens: int


TrainerLogprobs = Sequence[torch.Tensor] | Callable[[ProbeBatch], Sequence[torch.Tensor]]


def check_mismatch(engine: RolloutEngine, probe: ProbeBatch, trainer: TrainerLogprobs, threshold: float,
                   version: str) -> MismatchReport:
    """Score ``probe`` with the engine, compare with the trainer's log-probs (a list of
    [len(response)] tensors, or a callable producing it); log the figures; raise WeightSyncError
    when the mean absolute difference exceeds ``threshold``. A fleet (an engine with ``members``,
    megadiv.rollout.fleet) is checked server by server: every server scores the whole probe, the
    error names each one above the threshold, and the report is the worst server's."""
    expected = trainer(probe) if callable(trainer) else trainer
    members = getattr(engine, "members", None) or {"the engine": engine}
    reports = {name: _compare(member, probe, expected, version) for name, member in members.items()}
    bad = {name: r for name, r in reports.items() if not r.mean_abs <= threshold}  # NaN fails too
    if bad:
        figures = "; ".join(f"{name}: mean {r.mean_abs:.3g} (max {r.max_abs:.3g})" for name, r in bad.items())
        raise WeightSyncError(f"after weight sync {version!r}: the engine's log-probs differ from the trainer's over "
                              f"{next(iter(bad.values())).tokens} probe tokens, above the limit {threshold} "
                              f"(rollout.mismatch_threshold, or _fp8 for an FP8 trainer) ({figures}): not serving the trainer's weights (stale, missing or "
                              f"misnamed tensors?)")
    return max(reports.values(), key=lambda r: r.mean_abs)


def _compare(engine: RolloutEngine, probe: ProbeBatch, expected: Sequence[torch.Tensor],
             version: str) -> MismatchReport:
    got = engine.score(probe.prompts, probe.responses)
    if len(expected) != len(got) or any(e.numel() != g.numel() for e, g in zip(expected, got)):
        raise ValueError(f"trainer log-probs have shapes {[tuple(e.shape) for e in expected]}, the probe's "
                         f"responses {[len(r) for r in probe.responses]}")
    diff = torch.cat([(g.double().flatten() - e.detach().double().cpu().flatten()).abs()
                      for e, g in zip(expected, got)])
    report = MismatchReport(version, float(diff.mean()), float(diff.max()), diff.numel())
    log.info("log-prob mismatch after sync %s on %s: mean |d| %.3g, max |d| %.3g over %d probe tokens", version,
             getattr(engine, "urls", ["the engine"])[0], report.mean_abs, report.max_abs, report.tokens)
    return report
