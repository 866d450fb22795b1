"""Megatron-core distributed checkpoints of a MegatronModel, loadable at any TP/PP.

Layout of a checkpoint directory::

    metadata.json, common.pt, __*_*.distcp   megatron.core.dist_checkpointing (torch_dist format)
    megadiv_model.json                       {"format": 1, "hf_config": {...}, "padded_vocab_size": Vp,
                                              "dtype": "bfloat16"}

Tensors are stored with their global (TP=1, PP=1) shapes and global layer numbers (megatron's
sharded_state_dict), so a checkpoint written at TP=2 x PP=2 loads at TP=1 and vice versa. The
padded vocabulary is part of the stored shapes; megadiv pads to a multiple of 128, the same for
every power-of-two TP (megadiv.models.sharding.padded_vocab_size).

A checkpoint moves between megatron's local spec and Transformer Engine's: TE modules (its norms,
its fused layers) carry an ``_extra_state`` (FP8 scaling history) that the local spec's modules do
not, so a local-spec checkpoint, and any a CPU run wrote, lacks those entries. A module whose extra
state the checkpoint lacks keeps the one it was built with (what a fresh TE model starts from); any
other entry the checkpoint lacks is an error (``load_sharded``, ``load_module_state``).

Writes go to ``<dir>.partial`` and are renamed to ``<dir>`` only after every rank has finished,
so an interrupted save never looks like a checkpoint. Collective: call on every rank.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from megadiv.models.families import arch_from_hf_config

METADATA_FILE = "megadiv_model.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is absent, incomplete or does not fit the model."""


def sharded_state_dict(model) -> dict:
    """megatron sharded state dict of ``model``: {"model": ...}, or {"model0": ..., "model1": ...}
    with virtual pipeline stages (megatron-LM's key convention)."""
    gpts = model.gpt_models
    return {key: g.sharded_state_dict() for key, g in zip(_chunk_keys(len(gpts)), gpts)}


EXTRA_STATE = "_extra_state"


def load_sharded(template: dict, ckpt_dir: str | Path, **kwargs) -> dict:
    """``dist_checkpointing.load(template, ckpt_dir, **kwargs)``, where entries of ``template``
    that the checkpoint lacks are left out if they are a module's extra state, and refused by name
    otherwise (collective: every rank raises the same error)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    # RETURN_UNEXPECTED: megatron drops the requested keys the checkpoint lacks and names them;
    # its default would let the storage reader fail on the first of them, extra state or not
    state, _, absent = dist_checkpointing.load(template, str(ckpt_dir), strict=StrictHandling.RETURN_UNEXPECTED,
                                               **kwargs)
    everyone = [None] * dist.get_world_size()  # each rank asks for its own shards: one's refusal stops all
    dist.all_gather_object(everyone, sorted(k for k in absent if not k.endswith(EXTRA_STATE)))
    refused = sorted({k for keys in everyone for k in keys})
    if refused:
        raise CheckpointError(f"{ckpt_dir} lacks {len(refused)} entries this run needs: {refused[:8]}"
                              f"{' ...' if len(refused) > 8 else ''} (only a module's {EXTRA_STATE} may be absent)")
    return state


def load_module_state(module, state: dict) -> None:
    """``module.load_state_dict(state)``, strict but for extra state that ``state`` lacks (left
    out by ``load_sharded``): such a module keeps its own."""
    own = {k: v for k, v in module.state_dict().items() if k.endswith(EXTRA_STATE) and k not in state}
    module.load_state_dict({**state, **own})


def _chunk_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def save_megatron_checkpoint(model, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write ``model`` to ``out_dir`` (atomically, see module doc) and return the path."""
    from megatron.core import dist_checkpointing

    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    rank = dist.get_rank()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists; refusing to overwrite it")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of an interrupted save
        partial.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(model), str(partial))
    dist.barrier()
    if rank == 0:
        write_metadata(model, partial)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    dist.barrier()
    return out


def write_metadata(model, ckpt_dir: Path) -> None:
    """``megadiv_model.json``: what a reader needs to rebuild the model (also in training checkpoints,
    so that ``megadiv convert megatron-to-hf`` takes ``run_dir/checkpoints/step_N``)."""
    meta = {"format": FORMAT, "hf_config": model.hf_config, "padded_vocab_size": model.padded_vocab_size,
            "dtype": str(model.config.params_dtype).removeprefix("torch.")}
    (Path(ckpt_dir) / METADATA_FILE).write_text(json.dumps(meta, indent=2))


def read_metadata(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} is not a complete megadiv checkpoint (no {METADATA_FILE}): an "
                              f"interrupted save leaves <dir>.partial instead, and training checkpoints have "
                              f"one since megadiv wrote manifests")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')} is not supported (expected {FORMAT})")
    return meta


def load_megatron_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Load ``ckpt_dir`` into ``model`` (built at any TP/PP with the same architecture, with
    either spec)."""
    meta = read_metadata(ckpt_dir)
    stored = arch_from_hf_config(meta["hf_config"])
    mine, theirs = model.arch.__dict__, {**stored.__dict__, "dtype": model.arch.dtype}
    if mine != theirs:
        diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        raise CheckpointError(f"{ckpt_dir} holds a different architecture; (checkpoint, model) differ in {diff}")
    if meta["padded_vocab_size"] != model.padded_vocab_size:
        raise CheckpointError(
            f"{ckpt_dir} stores the vocabulary padded to {meta['padded_vocab_size']} rows, this model pads to "
            f"{model.padded_vocab_size}; build it with a TP and vocab_multiple that give the same padding")
    state = load_sharded(sharded_state_dict(model), ckpt_dir)
    for key, gpt in zip(_chunk_keys(len(model.gpt_models)), model.gpt_models):
        load_module_state(gpt, state[key])
