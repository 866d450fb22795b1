"""Rank body for tests/test_trainer_mirror.py: the run's mirror map on two ranks whose global RNGs
differ, and the cross-rank check that guards it."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megadiv.divergence import PolicyLossConfig
from megadiv.divergence.mirror_map import MirrorMapConfig, build_mirror_map


def pinned_map(ctx):
    from pathlib import Path

    from megadiv.trainer.checkpoint import check_mirror_map, check_same_on_all_ranks, fix_mirror_map

    dist.init_process_group("gloo")
    torch.manual_seed(1000 + ctx.rank)                  # the global RNG differs between ranks
    loss = PolicyLossConfig(regularizer="sampled_mirror", regularizer_coef=1e-4, mirror_map=MirrorMapConfig(seed=5))
    run_dir = Path(ctx.args["run_dir"])
    pinned = fix_mirror_map(loss, run_dir, resuming=False)
    dist.barrier()
    per_step = [check_mirror_map(loss, pinned) for _ in range(3)]
    try:                                                # a rank-dependent value must be caught
        check_same_on_all_ranks(float(ctx.rank), "a test value")
        caught = None
    except RuntimeError as e:
        caught = str(e)
    build_mirror_map(loss.mirror_map).v.data[0, 0] += 1.0   # a map changed mid-run must be caught too
    try:
        check_mirror_map(loss, pinned)
        changed = None
    except RuntimeError as e:
        changed = str(e)
    return {"pinned": pinned, "per_step": per_step, "caught": caught, "changed": changed}
