"""Rollout engines: generate completions with log-probs, and receive the trainer's weights.

- engine.py: the protocol (generate / score / update_weights / pause / resume / weight_version /
  shutdown), its result types, errors and the log-prob convention
- factory.py: ``resolve_engine_name`` and ``make_engine`` (the only module importing the engines)
- config.py: ``RolloutConfig`` (the ``rollout`` section of the run config)
- embedded.py: transformers in the trainer process (small models, CPU default): row-seeded
  sampling, weights shared with the actor, and `RankSplitEngine` (generation on every rank)
- sglang_engine.py, sglang_server.py, weight_sync.py: SGLang servers, launched or attached, and
  weight sync by process-group broadcast, CUDA-IPC handles or disk
- fleet.py: ``FleetEngine``, every SGLang engine (one SGLangEngine per server): generation as a
  group stream, every update to every server, a lost server dropped
- stream.py, fleet_stream.py: the group stream protocol (``WaveStream`` for the embedded engine);
  ``FleetStream``: one request per GRPO group to the least-loaded live server, heartbeats,
  re-sends, aborts
- mismatch.py: the post-sync log-prob check against the trainer (on every server of a fleet)
- sglang_cpu/: stand-in modules for SGLang's CPU server process only (see its README)

See docs/rollout.md.
"""
from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import (
    Bucket,
    Completion,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    SyncReport,
    WeightSyncError,
)
from megadiv.rollout.factory import make_engine, resolve_engine_name
from megadiv.rollout.mismatch import MismatchReport, ProbeBatch, check_mismatch, probe_limit, probe_mismatch

__all__ = ["Bucket", "Completion", "MismatchReport", "ProbeBatch", "RolloutConfig", "RolloutEngine", "RolloutError",
           "SamplingParams", "SyncReport", "WeightSyncError", "check_mismatch", "make_engine", "probe_limit",
           "probe_mismatch", "resolve_engine_name"]
