"""Training checkpoints: model, optimizer, LR schedule, trainer state and RNG, resumable exactly.

    run_dir/checkpoints/step_000040/   megatron dist_checkpointing (model + optimizer, sharded) +
                                       common.pt (schedule, trainer state) + rng_<rank>.pt
    run_dir/checkpoints/latest         the newest complete checkpoint's directory name
    run_dir/mirror_map.json            the run's neural mirror map (380 floats), when a loss term uses one

A save writes ``step_N.partial`` and renames it once every rank has finished, then moves
``latest``; a crash mid-save leaves the previous checkpoint as the newest complete one. Only
``keep_last`` complete checkpoints are kept. Collective: call on every rank.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megadiv.config import ConfigError
from megadiv.divergence.losses import PolicyLossConfig
from megadiv.divergence.mirror_map import fingerprint, load_vector, save_vector
from megadiv.models.checkpoint import sharded_state_dict
from megadiv.trainer.policy import Policy

# Distributed-optimizer state in model space (one tensor per parameter and moment, like a plain
# optimizer's), gathered over DP on save and sliced on load: it reloads at another TP, PP or DP
# size (megatron-core rejects its default 'fully_sharded_model_space' on this path, docs/cpu.md).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def fix_mirror_map(loss: PolicyLossConfig, run_dir: Path, resuming: bool) -> float | None:
    """Pin the run's mirror map (collective): write ``mirror_map.json`` on a fresh run; on a resumed
    run the saved map must be the configured one bit for bit (a resumed run never changes its
    regulariser). Checks that every rank built the same map; returns its fingerprint (None when no
    loss term uses a mirror map)."""
    if not loss.uses_mirror_map:
        return None
    vec = loss.mirror_map.vector()
    path = run_dir / "mirror_map.json"
    if resuming and path.is_file() and not torch.equal(load_vector(path), vec):
        raise ConfigError(f"{path} (this run's mirror map) differs from loss.mirror_map={loss.mirror_map}; a "
                          f"resumed run keeps its map: set loss.mirror_map.params={path} or start a new run.name")
    if dist.get_rank() == 0 and not (resuming and path.is_file()):
        save_vector(vec, path)
    check_same_on_all_ranks(fingerprint(vec), "the mirror map")
    return fingerprint(vec)


def check_mirror_map(loss: PolicyLossConfig, pinned: float) -> float:
    """The fingerprint of the map the loss uses now, checked against the pinned one and across
    ranks (collective; a 380-float sum and one all-reduce per step)."""
    now = fingerprint(loss.mirror_map.vector())
    if now != pinned:
        raise RuntimeError(f"the mirror map changed during the run (fingerprint {pinned!r} -> {now!r})")
    check_same_on_all_ranks(now, "the mirror map")
    return now


def check_same_on_all_ranks(value: float, what: str) -> None:
    """Raise unless ``value`` is bit-identical on every rank (one all-reduce of max and -min)."""
    both = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[0] != -both[1]:
        raise RuntimeError(f"{what} differs between ranks (values from {-float(both[1])!r} to {float(both[0])!r})")


def save_checkpoint(run_dir: Path, step: int, actor: Policy, trainer_state: dict, keep_last: int) -> Path:
    """Write step ``step``; ``trainer_state`` (picklable, global rank 0's copy is kept) holds what the
    loop needs to continue: data position, counters, evaluation figures."""
    from megatron.core import dist_checkpointing

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = _state_template(actor, is_loading=False)
    state["scheduler"] = actor.scheduler.state_dict()
    state["trainer"] = _from_rank0(trainer_state)
    state["adam_step"] = _adam_step(actor.optimizer)
    dist_checkpointing.save(state, str(partial))
    torch.save(_rng_state(), partial / f"rng_{rank}.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        (root / "latest.tmp").write_text(final.name + "\n")
        (root / "latest.tmp").rename(root / "latest")
        complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, actor: Policy) -> dict:
    """Restore ``actor`` (model, optimizer, schedule) and this rank's RNG; returns the trainer state."""
    from megatron.core import dist_checkpointing

    _materialize_adam_state(actor.optimizer, dist_checkpointing.load_common_state_dict(str(path))["adam_step"])
    state = dist_checkpointing.load(_state_template(actor, is_loading=True), str(path))
    for key, gpt in zip([k for k in state if k.startswith("model")], actor.model.gpt_models):
        gpt.load_state_dict(state[key])
    with torch.no_grad():
        _load_optimizer(actor.optimizer, state["optimizer"])
    actor.scheduler.load_state_dict(state["scheduler"])
    rng = path / f"rng_{dist.get_rank()}.pt"
    if not rng.is_file():
        raise FileNotFoundError(f"{rng} is missing: {path} was written by a job with another world size")
    _set_rng_state(torch.load(rng, weights_only=False))
    return state["trainer"]


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, working around two defects of megatron-core's
    distributed optimizer without Apex/TE (0.16.1):

    * loading 'fully_reshardable' parameter state copies every key of a parameter's optimizer
      state from the checkpoint, 'step' included, which the checkpoint does not hold
      (distrib_optimizer.py:937, KeyError 'step'): the parameter state is loaded here, with each
      'step' set aside meanwhile;
    * the load writes ONE 'step' tensor into every parameter's state (distrib_optimizer.py:825);
      torch's Adam increments it in place per parameter, so each would see another step count:
      each parameter gets its own copy."""
    param_state = None
    if state.get("param_state_sharding_type") == "fully_reshardable":
        state = dict(state)
        del state["param_state_sharding_type"]
        param_state = state.pop("param_state")
    optimizer.load_state_dict(state)
    inner_states = [st for inner in _adam_steps(optimizer) for st in inner.state.values()]
    if param_state is not None:
        (distributed,) = getattr(optimizer, "chained_optimizers", [optimizer])  # one per dense model
        steps = [st.pop("step", None) for st in inner_states]
        distributed.load_parameter_state_from_fully_reshardable(param_state)
        for st, step in zip(inner_states, steps):
            if step is not None:
                st["step"] = step
    for st in inner_states:
        if "step" in st:
            st["step"] = st["step"].clone()


def _state_template(actor: Policy, is_loading: bool) -> dict:
    model_state = sharded_state_dict(actor.model)
    optimizer_state = actor.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                         metadata=OPTIMIZER_METADATA)
    return {**model_state, "optimizer": optimizer_state}


def _adam_steps(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt.optimizer, torch.optim.Adam):  # AdamW subclasses Adam
            yield opt.optimizer


def _adam_step(optimizer) -> float | None:
    """torch Adam's step count (the same for every parameter), None before the first step."""
    steps = {float(st["step"]) for inner in _adam_steps(optimizer) for st in inner.state.values() if "step" in st}
    return steps.pop() if len(steps) == 1 else None


def _materialize_adam_state(optimizer, step: float | None) -> None:
    """torch's Adam creates its per-parameter state at the first step, but megatron-core's checkpoint
    code (distrib_optimizer.py:642, without Apex/TE) reads 'step' from it, and its distributed
    optimizer keeps an existing state's 'step' on load (distrib_optimizer.py:817-825 write it into
    a copy). So a fresh optimizer gets state with the saved step; the moments are overwritten."""
    if step is None:
        return
    for inner in _adam_steps(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(step), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def _from_rank0(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
