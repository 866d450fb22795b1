"""Did the weights arrive? Compare the engine's log-probs of a fixed probe batch with the trainer's.

The probe is real text: held-out prompts, rendered with the run's template, and the engine's own
answers to them, drawn once at the start of the run (never a padding id). Then, on identical
weights, the engine's figure against the trainer's is measured (the baseline: what this engine
and this trainer differ by in their arithmetic), and every later check is judged against it::

    probe = ProbeBatch.answer(engine, prompts, cfg.rollout, real_vocab=len(tokenizer))
    baseline = probe_mismatch(engine, probe, trainer_logprobs(probe), "step-0")  # the same weights
    limit = probe_limit(baseline.mean_abs, cfg.rollout)     # max(floor, factor x baseline), capped
    ...push...
    report = check_mismatch(engine, probe, trainer_logprobs(probe), limit, version)

Both sides use the raw policy, log_softmax(logits) (temperature 1). With identical weights the
difference is numerical noise (float32: ~1e-6; bf16 and FP8: larger, and larger on tail tokens);
a stale, missing or misnamed tensor moves it by O(1), and the limit turns that silent corruption
into an error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import RolloutEngine, RolloutError, SamplingParams, WeightSyncError

log = logging.getLogger(__name__)

ANSWER_DRAWS = 4
"""Answers drawn per probe prompt; the one with the longest run of real-vocabulary tokens is kept
(a sampled padding id ends an answer: a trained model all but never samples one, a random test
model often does)."""


@dataclass(frozen=True)
class ProbeBatch:
    prompts: list[list[int]]
    responses: list[list[int]]

    @classmethod
    def answer(cls, engine: RolloutEngine, prompts: Sequence[Sequence[int]], cfg: RolloutConfig,
               real_vocab: int) -> ProbeBatch:
        """``prompts`` and the engine's answers to them, sampled as the run samples (rollout
        temperature, top_p, top_k) for at most cfg.probe_response_len tokens: in-distribution text.
        ``real_vocab``: the tokenizer's size; ids at or above it are the embedding's padding rows,
        which no real text holds, and an answer is cut before the first one."""
        params = SamplingParams(n=ANSWER_DRAWS, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_new_tokens=cfg.probe_response_len, stop_token_ids=tuple(cfg.stop_token_ids))
        responses = []
        for i, group in enumerate(engine.generate(prompts, params)):
            best = max((real_prefix(c.token_ids, real_vocab) for c in group), key=len)
            if not best:
                raise RolloutError(f"every answer the engine drew for probe prompt {i} starts with a token id "
                                   f">= {real_vocab}, the tokenizer's size (padding rows): the served weights favour "
                                   f"padding ids")
            responses.append(best)
        return cls([list(p) for p in prompts], responses)


def real_prefix(token_ids: Sequence[int], real_vocab: int) -> list[int]:
    """``token_ids`` up to (not including) the first id outside [0, real_vocab)."""
    out = []
    for t in token_ids:
        if not 0 <= t < real_vocab:
            break
        out.append(t)
    return out


def spread(count: int, n: int) -> list[int]:
    """``n`` indices spread evenly over range(count) (repeating when count < n): which held-out
    problems the probe uses, the same every launch for the same data."""
    return [i * count // n for i in range(n)]


@dataclass(frozen=True)
class MismatchReport:
    version: str
    mean_abs: float
    """mean over probe tokens of |engine log-prob - trainer log-prob| (the judged figure)."""
    max_abs: float
    tokens: int


TrainerLogprobs = Sequence[torch.Tensor] | Callable[[ProbeBatch], Sequence[torch.Tensor]]


def probe_limit(baseline: float, cfg: RolloutConfig) -> float:
    """The limit on the mean |d| after a push: max(rollout.probe_floor, rollout.probe_factor x
    ``baseline``), the mismatch measured on identical weights. Raises WeightSyncError when that
    exceeds rollout.probe_max_limit: engine and trainer already disagree on the same weights by
    so much that a corrupted tensor could no longer be told from noise (a load or conversion
    defect, or a precision gap too wide for the check)."""
    scaled = cfg.probe_factor * baseline
    if not scaled <= cfg.probe_max_limit:  # NaN fails too (max() below would drop it)
        raise WeightSyncError(f"on identical weights the engine's probe log-probs already differ from the trainer's by "
                              f"a mean {baseline:.3g}; x rollout.probe_factor={cfg.probe_factor:g} that is above "
                              f"rollout.probe_max_limit={cfg.probe_max_limit:g}: the engine and the trainer do not "
                              f"compute the same model (a load or conversion defect?)")
    return max(cfg.probe_floor, scaled)


def probe_mismatch(engine: RolloutEngine, probe: ProbeBatch, trainer: TrainerLogprobs,
                   version: str) -> MismatchReport:
    """The engine's log-probs of ``probe`` against the trainer's (a list of [len(response)]
    tensors, or a callable producing it), logged; for a fleet (an engine with ``members``,
    megadiv.rollout.fleet) the worst server's. Raises nothing: the figure alone."""
    return max(_per_server(engine, probe, trainer, version).values(), key=lambda r: r.mean_abs)


def check_mismatch(engine: RolloutEngine, probe: ProbeBatch, trainer: TrainerLogprobs, limit: float,
                   version: str) -> MismatchReport:
    """probe_mismatch, raising WeightSyncError when a server's mean absolute difference exceeds
    ``limit`` (probe_limit). A fleet is checked server by server: every server scores the whole
    probe, and the error names each one above the limit."""
    reports = _per_server(engine, probe, trainer, version)
    bad = {name: r for name, r in reports.items() if not r.mean_abs <= limit}  # NaN fails too
    if bad:
        figures = "; ".join(f"{name}: mean {r.mean_abs:.3g} (max {r.max_abs:.3g})" for name, r in bad.items())
        raise WeightSyncError(f"after weight sync {version!r}: the engine's log-probs differ from the trainer's over "
                              f"{next(iter(bad.values())).tokens} probe tokens, above the limit {limit:.3g} "
                              f"(max(rollout.probe_floor, rollout.probe_factor x the step-0 baseline)) ({figures}): not "
                              f"serving the trainer's weights (stale, missing or misnamed tensors?)")
    return max(reports.values(), key=lambda r: r.mean_abs)


def _per_server(engine: RolloutEngine, probe: ProbeBatch, trainer: TrainerLogprobs,
                version: str) -> dict[str, MismatchReport]:
    expected = trainer(probe) if callable(trainer) else trainer
    members = getattr(engine, "members", None) or {"the engine": engine}
    return {name: _compare(member, probe, expected, version) for name, member in members.items()}


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
