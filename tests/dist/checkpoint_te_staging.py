"""Rank body for tests/test_checkpoint_te_staging.py: a local-spec checkpoint loaded into a model
shaped like Transformer Engine's, and what an asynchronous save holds while its writer writes.

Transformer Engine cannot be imported on a CPU. Its norms are modules with extra state
(``get_extra_state``/``set_extra_state``: FP8 scaling history), which megatron's local norms lack;
megatron's ``sharded_state_dict`` turns any module's ``_extra_state`` into a ShardedObject
(``transformer/utils.py: make_sharded_tensors_for_checkpoint``). So a local-spec model whose norms
are given extra state asks, through megatron's own code, for the ``<norm>._extra_state`` entries
a TE model asks for and a local-spec checkpoint lacks. (Its linear layers are not changed: megatron's
local linears already save an empty ``_extra_state`` under the keys TE's linears use.)

On a GPU, megatron's staging copies the state into new pinned host tensors; on a CPU it hands the
writer the live tensors. The body stages copies instead (``FileSystemWriterAsync.preload_tensors``
replaced by a copying one) so that there is something whose lifetime the saver decides.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path

import torch

from megadiv.config import ModelConfig, ParallelConfig
from megadiv.models import build_model, load_megatron_checkpoint, save_megatron_checkpoint
from megadiv.models.checkpoint import CheckpointError, sharded_state_dict
from megadiv.parallel import initialize
from megadiv.policy.megatron import Policy
from megadiv.policy.objectives import grpo_objective
from megadiv.trainer import checkpoint
from tests.dist.trainer_checkpoint import LOSS
from tests.dist.trainer_policy import ADAM, _batch


class _ExtraState:
    """Mixed into a norm's class: a module with extra state, as Transformer Engine's norms are."""

    def get_extra_state(self):
        return torch.zeros(0, dtype=torch.uint8)  # TE's encoding of "no FP8 state yet"

    def set_extra_state(self, state):
        self.extra_state_set = state


def _as_transformer_engine(gpt) -> None:
    for name, module in gpt.named_modules():
        if name.endswith("layernorm") and type(module).__name__ != "IdentityOp":
            module.__class__ = type(f"TE{type(module).__name__}", (_ExtraState, type(module)), {})


def _keys(model) -> set[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {sh.key for sh in nested_values(sharded_state_dict(model))}


def _error(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def _te_shaped_model_loads(ctx, name: str) -> dict:
    """A local-spec checkpoint of ``name`` into the TE-shaped model (its weights bit for bit), and
    into one that also asks for a tensor the checkpoint lacks (refused by name)."""
    hf_dir = ctx.args["models"][name]
    ckpt = Path(ctx.args["tmp"]) / f"local-{name}"
    source = build_model(hf_dir, role="reference")
    save_megatron_checkpoint(source, ckpt)
    te = build_model(hf_dir, role="reference", load_weights=False)
    local_keys = _keys(te)
    _as_transformer_engine(te.gpt_models[0])
    absent = sorted(_keys(te) - local_keys)
    load_megatron_checkpoint(te, ckpt)
    want = {k: v for k, v in source.gpt_models[0].state_dict().items() if isinstance(v, torch.Tensor)}
    got = te.gpt_models[0].state_dict()
    extra = build_model(hf_dir, role="reference", load_weights=False)
    _as_transformer_engine(extra.gpt_models[0])
    extra.gpt_models[0].decoder.final_layernorm.register_parameter("bias", torch.nn.Parameter(torch.zeros(1)))
    return {"absent": absent, "equal": all(torch.equal(got[k], v) for k, v in want.items()),
            "extra_state_kept": [type(m.extra_state_set).__name__ for m in te.gpt_models[0].modules()
                                 if hasattr(m, "extra_state_set")],
            "refused": _error(lambda: load_megatron_checkpoint(extra, ckpt))}


@contextlib.contextmanager
def _replaced(cls, name: str, fn):
    original = cls.__dict__[name]
    setattr(cls, name, staticmethod(fn))
    try:
        yield original.__func__
    finally:
        setattr(cls, name, original)


def _weights(actor: Policy) -> dict:
    return {n: t.clone() for b in actor.export_buckets(64 << 20) for n, t in b}


def one_rank(ctx) -> dict:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    parallel = ParallelConfig()
    initialize(parallel, seed=1)
    out = {name: _te_shaped_model_loads(ctx, name) for name in ("dense", "moe")}

    # a training checkpoint of the local spec (Adam state, one step), written asynchronously from
    # staged copies; weak references tell whether anything still holds the copies
    config = ModelConfig(hf_dir=ctx.args["models"]["dense"])
    actor = Policy(config, parallel, "actor", ADAM, total_steps=2)
    actor.train_step(_batch(), grpo_objective(LOSS), micro_batch_size=2)
    staged = []

    def copying(write_buckets, non_blocking=True):
        copies = []
        for path, name, (byte_items, tensors) in write_buckets:
            tensors = [(item, t.clone()) for item, t in tensors]
            staged.extend(weakref.ref(t) for _, t in tensors)
            copies.append((path, name, (byte_items, tensors)))
        return copies

    run_dir = Path(ctx.args["tmp"]) / "run"
    saver = checkpoint.CheckpointSaver(run_dir, keep_last=1, parallel=parallel)
    with _replaced(FileSystemWriterAsync, "preload_tensors", copying):
        saver.save(1, actor, {"step": 1})
        gc.collect()
        out["staged"] = len(staged)
        out["held_while_writing"] = sum(r() is not None for r in staged)
        saver.wait()
        gc.collect()
        out["held_after_sealed"] = sum(r() is not None for r in staged)
    out["saved_weights"] = _weights(actor)

    # the same checkpoint into the TE-shaped actor: weights and Adam's state
    te = Policy(config, parallel, "actor", ADAM, total_steps=2)
    _as_transformer_engine(te.model.gpt_models[0])
    out["trainer_state"] = checkpoint.load_checkpoint(checkpoint.find_resume_point(run_dir, parallel), te)
    out["loaded_weights"] = _weights(te)
    for a in (actor, te):  # the same next step from the same weights and Adam state
        a.train_step(_batch(), grpo_objective(LOSS), micro_batch_size=2)
    after = _weights(actor)
    out["next_step_equal"] = all(torch.equal(w, after[k]) for k, w in _weights(te).items())

    # a staged tensor that changes under the writer (as a reused pinned page would) fails the save
    def corrupting(transform_list, use_msc, rank, write_buckets, results):
        first = next(t for _, _, (_, tensors) in write_buckets for _, t in tensors)
        raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        raw[0] ^= 0xFF  # in the forked writer, after the rank staged and hashed it
        return write(transform_list, use_msc, rank, write_buckets, results)

    corrupt = checkpoint.CheckpointSaver(Path(ctx.args["tmp"]) / "corrupt", keep_last=1, parallel=parallel)
    with _replaced(FileSystemWriterAsync, "write_preloaded_data_multiproc", corrupting) as write:
        corrupt.save(1, actor, {"step": 1})
        out["corrupt_refused"] = _error(corrupt.wait)
    out["corrupt_sealed"] = corrupt.final(1).exists()

    # megatron's validation of the shards and the common state (all-gathers, a broadcast and an
    # element-wise diff on every rank), per save of one saver: the structure stays after the first
    from megatron.core.dist_checkpointing import state_dict_utils

    validate, calls = state_dict_utils.validate_sharding_integrity, []
    state_dict_utils.validate_sharding_integrity = lambda *a, **k: calls.append(1) or validate(*a, **k)
    try:
        twice = checkpoint.CheckpointSaver(Path(ctx.args["tmp"]) / "twice", keep_last=2, parallel=parallel)
        out["validations"] = []
        for step in (1, 2):
            twice.save(step, actor, {"step": step})
            twice.wait()
            out["validations"].append(len(calls))
        out["second_intact"] = checkpoint.checkpoint_problem(twice.final(2))
    finally:
        state_dict_utils.validate_sharding_integrity = validate
    return out
