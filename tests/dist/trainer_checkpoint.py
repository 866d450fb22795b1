"""Rank bodies for tests/test_trainer_units.py: a training checkpoint written at one layout and
resumed at another (megadiv.trainer.checkpoint with megatron's distributed optimizer)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megadiv.config import ModelConfig, ParallelConfig
from megadiv.divergence import PolicyLossConfig
from megadiv.parallel import initialize
from megadiv.trainer import checkpoint
from megadiv.policy.objectives import grpo_objective
from megadiv.policy.megatron import Policy
from tests.dist.trainer_policy import ADAM, ROWS, _batch

LOSS = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.01, loss_agg="token-mean")
OPTIM = dataclasses.replace(ADAM, warmup_steps=1, decay_style="linear")


def _step(actor: Policy, info) -> dict:
    per = ROWS // info.dp_size
    batch = _batch().rows(slice(info.dp_rank * per, (info.dp_rank + 1) * per))
    return actor.train_step(batch, grpo_objective(LOSS), micro_batch_size=2)


def save_then_continue(ctx):
    """Two Adam steps, a checkpoint written in the background while the third step trains: the
    uninterrupted reference, with the save's figures."""
    a = ctx.args
    parallel = ParallelConfig(tensor_parallel=a["tp"])
    info = initialize(parallel, seed=1)
    actor = Policy(ModelConfig(hf_dir=a["hf_dir"]), parallel, "actor", OPTIM, total_steps=3)
    for _ in range(2):
        _step(actor, info)
    saver = checkpoint.CheckpointSaver(Path(a["run_dir"]), keep_last=1, parallel=parallel)
    saver.save(2, actor, {"step": 2})
    draws = torch.rand(4).tolist()  # the RNG streams the checkpoint holds (training draws nothing: dropout 0)
    third = _step(actor, info)  # changes the weights and the optimizer state the writer is writing
    (sealed,) = saver.wait()
    return {"third": third, "weights": {n: t for b in actor.export_buckets(64 << 20) for n, t in b},
            "optimizer": type(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0]).__name__,
            "sealed": sealed, "draws": draws}


def resume_and_step(ctx):
    """A fresh actor at this layout, loaded from the checkpoint, then the third step."""
    a = ctx.args
    parallel = ParallelConfig(tensor_parallel=a["tp"])
    info = initialize(parallel, seed=2)  # another seed: everything must come from the checkpoint
    actor = Policy(ModelConfig(hf_dir=a["hf_dir"]), parallel, "actor", OPTIM, total_steps=3)
    state = checkpoint.load_checkpoint(checkpoint.find_resume_point(Path(a["run_dir"]), parallel), actor)
    draws = torch.rand(4).tolist()
    third = _step(actor, info)
    return {"state": state, "third": third, "dp_size": info.dp_size, "draws": draws,
            "coordinates": [info.tp_rank, info.pp_rank, info.dp_rank],
            "weights": {n: t for b in actor.export_buckets(64 << 20) for n, t in b}}
