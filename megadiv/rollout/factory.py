"""Which rollout engine a run uses, and building it: the one place that imports every engine.

Engines import the protocol (engine.py), never this module, so nothing below the factory points
back up to it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from megadiv.rollout.sglang_server import TrainerMemory


def resolve_engine_name(cfg: RolloutConfig) -> str:
    """``auto`` -> sglang when CUDA is present and the server's Python (sglang_server.server_python:
    in the container not the trainer's) finds sglang, or servers are given; else embedded."""
    from megadiv.rollout.sglang_server import finds_sglang, server_python

    if cfg.engine != "auto":
        return cfg.engine
    if cfg.server_urls or cfg.num_servers > 1:
        return "sglang"
    return "sglang" if torch.cuda.is_available() and finds_sglang(server_python(cfg)) else "embedded"


def make_engine(cfg: RolloutConfig, hf_dir: str, trainer_memory: TrainerMemory | None = None,
                group=None) -> RolloutEngine:
    """The engine ``cfg`` names, serving the checkpoint in ``hf_dir`` until the first update.
    ``trainer_memory``: the trainer's GPU memory on this node, for servers launched beside it.
    ``group`` (embedded only; call on every rank of it): generation spread over its ranks, each
    with an engine of its own: rank 0 gets the RankSplitEngine the loop talks to, the others their
    EmbeddedEngine, whose ``serve(group)`` answers it (docs/rollout.md)."""
    if resolve_engine_name(cfg) == "embedded":
        from megadiv.rollout.embedded import EmbeddedEngine, RankSplitEngine
        engine = EmbeddedEngine(hf_dir, cfg)
        return RankSplitEngine(engine, group) if group is not None and dist.get_rank(group) == 0 else engine
    if group is not None:
        raise ValueError(f"generation on every rank needs the embedded engine, not {resolve_engine_name(cfg)!r}")
    from megadiv.rollout.fleet import FleetEngine
    return FleetEngine(hf_dir, cfg, trainer_memory)  # one server or several: the same routing
