"""Training checkpoints: model, optimizer, LR schedule, trainer state and RNG, resumable exactly.

    run_dir/checkpoints/step_000040/   megatron dist_checkpointing (model + optimizer, sharded: every
                                       rank writes its share, __<rank>_<i>.distcp) +
                                       common.pt (schedule, trainer state) + rng_<rank>.pt +
                                       rollout_state.pt (the rollout driver's: prompt position,
                                       a batch generated ahead; written by the driver) +
                                       megadiv_model.json (the model, for ``megadiv convert``) +
                                       manifest.json (format, step, TP/PP layout, backend, each
                                       rank's (tp, pp, dp) coordinates, the rollout state's file,
                                       every file with its size and xxh3-64 checksum)
                                       With model.backend=deepspeed: deepspeed/ (DeepSpeed's save_checkpoint:
                                       module, optimizer and ZeRO partitions, schedule and trainer state as
                                       its client state) + rng_<rank>.pt + manifest.json; resumed at the
                                       same world size only.
    run_dir/checkpoints/latest         the newest complete checkpoint's directory name (for people)
    run_dir/mirror_map.json            the run's neural mirror map (380 floats), when a loss term uses one

A save (``CheckpointSaver.save``) writes ``step_N.partial`` in parallel and in the background:
megatron's fully parallel save strategy spreads the shards that data-parallel replicas hold in
common over the replicas, so every rank writes its own files; the training ranks block only while
the state is planned, staged on the host and hashed (megatron's async save: the writer is a process
forked from the rank, which writes the staged tensors, checks them against those hashes and then
writes the checksums of the files it wrote, ``written_<rank>.json``; the saver holds the staged
tensors until the save is sealed, ``_Staging``). The rollout driver writes and hashes its own
file meanwhile (``StateFile``): the batch it generated ahead never passes through a rank. Once
every rank's writer has finished (``poll``, one all-reduce per step), rank 0 waits for the
driver's file, merges those records, hashes the few small files it wrote itself, writes the
manifest last and renames the directory. megatron's validation of the shards and the common state
runs at a run's first save only (the structure stays). A crash or a signal mid-save leaves
only a ``.partial`` directory, which is never resumed from. Only ``keep_last`` complete
checkpoints are kept. Collective: call on every rank. The DeepSpeed backend saves synchronously
(DeepSpeed's own writer); its files are hashed in shares by every rank.

Resume (``find_resume_point``) scans ``step_*`` newest first and takes the first one that is
complete and intact (manifest present, every listed file present with its size, checked by rank
0, and its checksum, each file read by one rank), naming each one it skips and why, before
megatron reads a byte of it; megatron's fully parallel load then reads each shard once in every
data-parallel group and sends it to the replicas that need it. It never falls back to step 0 while a
checkpoint exists: none complete is an error. A checkpoint written at another pipeline layout, or
in an older FORMAT, is refused (the TP and data-parallel sizes may change). A rank whose (tp, pp, dp) coordinates the saved
layout had continues that rank's RNG streams; any other rank (more ranks than the checkpoint has
RNG files for, or another TP size) derives its streams from the step and its coordinates.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import random
import shutil
import time
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from megadiv.config import ConfigError, ParallelConfig
from megadiv.divergence.losses import PolicyLossConfig
from megadiv.divergence.mirror_map import fingerprint, load_vector, save_vector
from megadiv.models.checkpoint import (
    CheckpointError,
    load_module_state,
    load_sharded,
    sharded_state_dict,
    write_metadata,
)
from megadiv.policy.megatron import Policy
from megadiv.progress import Progress, bytes_read, directory_bytes
from megadiv.trainer.checksum import CHECKSUM, file_checksum, file_record
from megadiv.trainer.lifecycle import RestartRefused, start_helper, writing

# Distributed-optimizer state in model space (one tensor per parameter and moment, like a plain
# optimizer's), gathered over DP on save and sliced on load: it reloads at another TP or DP size
# (megatron-core rejects its default 'fully_sharded_model_space' on this path, docs/cpu.md).
# Without a prefix per chained optimizer (a mixture-of-experts model's dense and expert optimizers,
# one optimizer at EP = 1 and DP = 1): the tensors keep their keys whatever the chain, so a
# checkpoint reloads at another expert-parallel size.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
MANIFEST = "manifest.json"
# 2: the rollout side's state (the prompt position, a batch generated ahead) in a file its driver
# writes, named in the manifest (``rollout_state``), instead of in megatron's common state
FORMAT = 2
# What a checkpoint is tied to: resuming at another TP or DP size is tested
# (tests/test_trainer.py, a DP=2 checkpoint resumed at DP=1 and at TP=2); another pipeline split is not.
LAYOUT_KEYS = ("pipeline_parallel", "virtual_pipeline", "stage_layers")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def layout_of(parallel: ParallelConfig) -> dict:
    """The layout a checkpoint is tied to (the TP and data-parallel sizes are not)."""
    return {k: getattr(parallel, k) for k in LAYOUT_KEYS}


MIRROR_MAP = "mirror_map.json"


def check_resumed_mirror_map(loss: PolicyLossConfig, run_dir: Path) -> None:
    """A resumed run keeps its regulariser: raise ConfigError when the map pinned in ``run_dir``
    differs from the configured one (also checked by preflight, before any rank starts)."""
    path = run_dir / MIRROR_MAP
    if loss.uses_mirror_map and path.is_file() and not torch.equal(
            load_vector(path, loss.mirror_map.allow_nonconvex), loss.mirror_map.vector()):
        raise ConfigError(f"{path} (this run's mirror map) differs from loss.mirror_map={loss.mirror_map}; a "
                          f"resumed run keeps its map: set loss.mirror_map.params={path} or start a new run.name")


def fix_mirror_map(loss: PolicyLossConfig, run_dir: Path, resuming: bool) -> float | None:
    """Pin the run's mirror map (collective): write ``mirror_map.json`` on a fresh run; on a resumed
    run the saved map must be the configured one bit for bit (a resumed run never changes its
    regulariser). Checks that every rank built the same map; returns its fingerprint (None when no
    loss term uses a mirror map)."""
    if not loss.uses_mirror_map:
        return None
    vec = loss.mirror_map.vector()
    path = run_dir / MIRROR_MAP
    if resuming:
        check_resumed_mirror_map(loss, run_dir)
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


def checkpoint_problem(path: Path, checksums: bool = True) -> str | None:
    """Why ``path`` is not a complete, intact checkpoint, or None. Sizes first (cheap, and the
    clearer message for a truncated file), then, with ``checksums``, every file's checksum (one
    read of the whole checkpoint; manifests written before checksums existed are checked by size)."""
    problem = size_problem(path)
    return problem if problem or not checksums else checksum_problem(path, share=(0, 1))


def size_problem(path: Path) -> str | None:
    """Why ``path`` is not complete (no or unreadable manifest, a listed file missing or of
    another size), or None: stat calls only."""
    manifest = path / MANIFEST
    try:
        listed = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish, or an older megadiv wrote it)"
    except (OSError, ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, size in listed.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
    return None


def checksum_problem(path: Path, share: tuple[int, int]) -> str | None:
    """The first file of this rank's ``share`` (rank, ranks) of a complete checkpoint's files whose
    checksum differs from the manifest's, as a reason, or None."""
    record = json.loads((path / MANIFEST).read_text())
    expected_sums = record.get(CHECKSUM, {})
    for name in share_of(record["files"], *share):
        if name not in expected_sums:
            continue
        try:
            actual = file_checksum(path / name)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if actual != expected_sums[name]:
            return (f"{name} has {CHECKSUM} {actual}, the manifest says {expected_sums[name]} (corrupted on disk "
                    f"after the save: same size, other bytes)")
    return None


def share_of(sizes: dict[str, int], rank: int, ranks: int) -> list[str]:
    """The files rank ``rank`` of ``ranks`` reads: largest first, dealt round the ranks (each file to
    one rank; the bytes per rank differ by at most one file's)."""
    return sorted(sizes, key=lambda name: (-sizes[name], name))[rank::ranks]


def resume_point(run_dir: Path, parallel: ParallelConfig, checksums: bool = True,
                 problem=None) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint or None when there is none at all, one line per skipped one).
    ``problem(path)``: why a checkpoint is not intact (default: ``checkpoint_problem``).

    Raises CheckpointError when checkpoints exist but none is complete, and ConfigError when the
    chosen one was written at another pipeline layout."""
    problem = problem or (lambda path: checkpoint_problem(path, checksums))
    candidates = sorted((p for p in checkpoint_root(run_dir).glob("step_*") if p.is_dir()
                         and not p.name.endswith(".partial")), key=lambda p: p.name, reverse=True)
    skipped = []
    for path in candidates:
        why = problem(path)
        if why is None:
            _check_layout(path, parallel)
            return path, skipped
        skipped.append(f"skipping checkpoint {path}: {why}")
    if skipped:
        raise CheckpointError(f"no complete checkpoint in {checkpoint_root(run_dir)} (" + "; ".join(skipped)
                              + "); move them away to start afresh, or set checkpoint.resume=never")
    return None, skipped


def find_resume_point(run_dir: Path, parallel: ParallelConfig) -> Path | None:
    """Collective ``resume_point``: rank 0 checks the sizes, every rank the checksums of its share
    of the files (each file read once, by one rank); rank 0 says what was skipped, and every rank
    gets the same answer or raises the same error."""
    path, skipped = resume_point(run_dir, parallel, problem=_problem_on_all_ranks)
    if dist.get_rank() == 0:
        for line in skipped:
            print(line, flush=True)
    return path


def _problem_on_all_ranks(path: Path) -> str | None:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    why = _from_rank0(size_problem(path) if rank == 0 else None)
    if why is None:
        found = [None] * ranks
        dist.all_gather_object(found, checksum_problem(path, share=(rank, ranks)))
        why = next((w for w in found if w is not None), None)
    return why


ATTEMPT = "attempt.json"  # in run_dir/logs: where the current attempt of the job started


def note_attempt(run_dir: Path, start: Path | None, restart: int) -> None:
    """Rank 0, at the start of every attempt of a job (``restart``: torchrun's restart count, 0 at
    the first launch): refuse a restart when the failed attempt wrote no checkpoint after the one
    it started from (a failure before the first checkpoint is not retried), else record where this
    attempt starts."""
    step = int(start.name.removeprefix("step_")) if start is not None else 0
    record = run_dir / "logs" / ATTEMPT
    if restart > 0:
        try:
            previous = json.loads(record.read_text())["from_step"]
        except (OSError, ValueError, KeyError):
            previous = None
        if previous is not None and step <= previous:
            raise RestartRefused(f"restart {restart}: not retrying, the failed attempt wrote no checkpoint after step "
                                 f"{previous} (it started there and failed before its next checkpoint); its "
                                 f"failure is above and in {run_dir / 'logs'}")
        print(f"restart {restart}: resuming from {start or 'the start (no checkpoint yet)'}", flush=True)
    with writing(record, "the attempt record"):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"restart": restart, "from_step": step}) + "\n")


def _check_layout(path: Path, parallel: ParallelConfig) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format", 1) != FORMAT:
        raise ConfigError(f"{path} is a checkpoint of format {manifest.get('format', 1)} (the rollout state in "
                          f"megatron's common.pt); this megadiv resumes format {FORMAT} (the rollout driver's file): "
                          f"resume it with the megadiv that wrote it, or convert its weights (megadiv convert "
                          f"megatron-to-hf --ckpt-dir {path}) and start a new run from them")
    stored = manifest["layout"]
    mine = layout_of(parallel)
    if stored != mine:
        diff = ", ".join(f"parallel.{k}={stored[k]} (now {mine[k]})" for k in LAYOUT_KEYS if stored[k] != mine[k])
        raise ConfigError(f"{path} was written with {diff}; resuming at another pipeline layout is not supported "
                          f"(the TP and data-parallel sizes may change). Resume with that layout, or convert the model "
                          f"(megadiv convert megatron-to-hf --ckpt-dir {path}) and start a new run from it")


class StateFile(Protocol):
    """A component that writes its own file into a checkpoint, outside the ranks' state (the
    rollout side: rank 0's driver, in its own process with SGLang)."""

    def save_state(self, directory: Path, step: int) -> None:
        """Start writing the state after ``step`` into ``directory`` (returns at once)."""

    def state_saved(self) -> dict[str, list]:
        """Wait until written: {file name: [size, xxh3-64]} (rank 0), {} elsewhere."""


def save_checkpoint(run_dir: Path, step: int, actor: Policy, trainer_state: dict, keep_last: int,
                    parallel: ParallelConfig, side: StateFile | None = None) -> Path:
    """Write step ``step`` and wait until it is sealed (``CheckpointSaver`` without the overlap)."""
    saver = CheckpointSaver(run_dir, keep_last, parallel)
    saver.save(step, actor, trainer_state, side)
    saver.wait()
    return saver.final(step)


@dataclass
class _SaveInFlight:
    step: int
    partial: Path
    backend: str
    started: float       # time.perf_counter() at the start of save()
    blocking_s: float = 0.0
    staging: _Staging | None = None  # what the writer writes from, held until the save is sealed
    side: StateFile | None = None    # writes a file of its own, awaited by the seal


class _Staging:
    """megatron's staging of a save (its ``preload_fn``: the state copied to host memory, pinned
    on a GPU), wrapped so that the saver owns the copies until the save is sealed. megatron-core
    0.16.1 keeps its only reference to them in a local of the call that forks the writer (the
    forked ``multiprocessing.Process`` drops its arguments once started): once that call returns,
    a later pinned allocation can reuse the pages while the writer is still writing them.

    ``checksums``: the staged tensors' bytes hashed here, in the rank, before the writer exists.
    The writer compares the tensors it wrote from against them once written, so a buffer that
    changed under it fails the save rather than being written and hashed as if it were the state."""

    def __init__(self, preload):
        self._preload = preload
        self.buckets = None    # megatron's write buckets: (path, file name, (bytes items, [(item, tensor)]))
        self.checksums = None

    def __call__(self):
        self.buckets = self._preload()
        self.checksums = _staged_checksums(self.buckets)
        return self.buckets

    def changed(self) -> list[str]:
        """The staged tensors whose bytes differ from what was staged (file: tensor name)."""
        return [f"{name}: {item.index.fqn}" for (_, name, (_, tensors)), sums in zip(self.buckets, self.checksums)
                for (item, tensor), staged in zip(tensors, sums) if _tensor_checksum(tensor) != staged]


def _staged_checksums(buckets) -> list[list[str]]:
    return [[_tensor_checksum(tensor) for _, tensor in tensors] for _, _, (_, tensors) in buckets]


def _tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of a host tensor's storage: the bytes torch.save writes (megatron's staging gives
    each tensor a storage of its own size: views are cloned)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return xxhash.xxh3_64_hexdigest(raw.numpy())


class CheckpointSaver:
    """Writes checkpoints while training goes on (one save in flight at a time; module docstring).

    ``save`` blocks for the plan and the copy to host only; ``poll`` (every rank, once per step)
    seals the save in flight when every rank's writer has finished; ``wait`` blocks until it is
    sealed. Both return ``(step, figures)`` of a save they sealed: checkpoint/blocking_s (training
    stopped for it), checkpoint/write_s (the slowest rank's writer: shards and their checksums) and
    checkpoint/total_s (from the save's start until sealed; at most a step later than written),
    for every save sealed since the last call (``save`` seals the one before it)."""

    def __init__(self, run_dir: Path, keep_last: int, parallel: ParallelConfig):
        self.root, self.keep_last, self.layout = checkpoint_root(run_dir), keep_last, layout_of(parallel)
        self._in_flight: _SaveInFlight | None = None
        self._sealed: list[tuple[int, dict]] = []
        self._calls = None         # megatron's AsyncCallsQueue, made at the first save
        self._strategy = None      # megatron's fully parallel save strategy (its distribution cached)
        self._coordinates = None   # every rank's (tp, pp, dp), gathered at the first save
        # megatron's check that the shards cover every tensor once and that the common state is the
        # same on every rank (an all-gather of every shard's metadata, the common state broadcast
        # and diffed element by element): the first save checks the run's structure, which the
        # later ones keep (the same model and optimizer; the common state is rank 0's, broadcast)
        self._validated = False

    def final(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, step: int, actor: Policy, trainer_state: dict, side: StateFile | None = None) -> None:
        """Start writing step ``step``; ``trainer_state`` (picklable, global rank 0's copy is kept)
        holds what the loop needs to continue: counters, evaluation figures. ``side`` (the rollout)
        writes its own file meanwhile, named in the manifest (``rollout_state``) and awaited by
        the seal."""
        from megatron.core import dist_checkpointing

        self._sealed = self.wait()  # the save before, sealed: its figures go out at the next poll
        started = time.perf_counter()
        partial = self.final(step).with_name(self.final(step).name + ".partial")
        rank = dist.get_rank()
        if self._coordinates is None:
            self._coordinates = [None] * dist.get_world_size()
            dist.all_gather_object(self._coordinates, _coordinates())
        # a full disk or an I/O error: one line naming the checkpoint and the free space (DiskError).
        # torch's writers report it as CheckpointException (a BaseException, which would pass the rank's
        # one-line report by) wrapping the OSError, torch.save as a RuntimeError. The earlier checkpoints
        # are never touched before this one is sealed.
        with self._writing(partial):
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            dist.barrier()
            rng_state = _rng_state()  # written after megatron's save, which wants partial/ empty
            self._in_flight = _SaveInFlight(step, partial, actor.backend, started, side=side)
            if actor.backend == "deepspeed":  # DeepSpeed's own format, under partial/deepspeed, synchronous
                actor.save_state(partial, _from_rank0(trainer_state))
                dist.barrier()
                missing = [f for f in actor.checkpoint_files(dist.get_world_size()) if not (partial / f).is_file()]
                if missing:
                    raise CheckpointError(f"checkpoint {partial} is incomplete after saving: missing {missing}")
                files = {str(f.relative_to(partial)): f.stat().st_size for f in (partial / "deepspeed").rglob("*")
                         if f.is_file()}
                mine = _save_rng(rng_state, partial, rank) | {name: [files[name], file_checksum(partial / name)]
                         for name in share_of(files, rank, dist.get_world_size())}
                if side is not None:
                    side.save_state(partial, step)
                _record_written(partial, rank, mine, time.perf_counter() - started)
                self._in_flight.blocking_s = time.perf_counter() - started
                self._seal()
                return
            _results_queue_that_dies_with_us()
            state = _state_template(actor, is_loading=False)
            state["scheduler"] = actor.scheduler.state_dict()
            state["trainer"] = _from_rank0(trainer_state)
            state["adam_step"] = _adam_step(actor.optimizer)
            state["distributed_optimizer"] = actor.use_distributed_optimizer
            state["optimizer_parts"] = len(_parts(actor.optimizer))
            request = dist_checkpointing.save(state, str(partial), sharded_strategy=self._save_strategy(),
                                              async_sharded_save=True, validate_access_integrity=not self._validated)
            self._validated = True
            if side is not None:  # after megatron's save, which wants partial/ empty
                side.save_state(partial, step)
            if rank == 0:
                write_metadata(actor.model, partial)
            mine = _save_rng(rng_state, partial, rank)
            staging = self._in_flight.staging = _Staging(request.preload_fn) if request.preload_fn else None
            # the forked writer writes this rank's shards, checks them against the staging checksums,
            # then hashes the files (_write_and_record)
            request = request._replace(preload_fn=staging, async_fn=functools.partial(
                _write_and_record, request.async_fn, partial, rank, mine, staging))
            request.add_finalize_fn(self._seal)
            self._async_calls().schedule_async_request(request)  # stages on the host, forks the writer
        self._in_flight.blocking_s = time.perf_counter() - started

    def poll(self) -> list[tuple[int, dict]]:
        """Seal the save in flight if every rank's writer is done (collective: one all-reduce)."""
        if self._in_flight is not None and self._in_flight.backend == "megatron":
            with self._writing(self._in_flight.partial):
                self._calls.maybe_finalize_async_calls(blocking=False)
        return self._take_sealed()

    def wait(self) -> list[tuple[int, dict]]:
        """Block until the save in flight is sealed (collective); shows its progress on rank 0."""
        if self._in_flight is not None and self._in_flight.backend == "megatron":
            partial = self._in_flight.partial
            final = self.final(self._in_flight.step)
            with self._writing(partial), \
                    Progress(f"saving checkpoint step {self._in_flight.step}", total=_checkpoint_bytes(self.root),
                             unit="B") as bar, \
                    bar.following(lambda: directory_bytes(partial if partial.exists() else final)):
                self._calls.maybe_finalize_async_calls(blocking=True)
        return self._take_sealed()

    def _take_sealed(self) -> list[tuple[int, dict]]:
        sealed, self._sealed = self._sealed, []
        return sealed

    def _writing(self, partial: Path):
        return writing(partial, "checkpoint", errors=(OSError, CheckpointException), wrapping=(RuntimeError,))

    def _save_strategy(self):
        """torch_dist, with the shards data-parallel replicas hold in common (the replicated weights,
        the model-space optimizer state) dealt over the replicas: every rank writes a share."""
        if self._strategy is None:
            from megatron.core import parallel_state
            from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

            self._strategy = FullyParallelSaveStrategyWrapper(
                get_default_save_sharded_strategy(),
                parallel_state.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=True)
        return self._strategy

    def _async_calls(self):
        if self._calls is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._calls = AsyncCallsQueue(persistent=False)  # a writer forked per save: a snapshot of the state
        return self._calls

    def _seal(self) -> None:
        """Every rank's writer is done (collective): rank 0 writes the manifest and renames."""
        save = self._in_flight
        final = self.final(save.step)
        dist.barrier()
        if dist.get_rank() == 0:
            side = save.side.state_saved() if save.side is not None else {}
            write_s = _verify_and_seal(save.partial, save.step, self.layout, self._coordinates, save.backend, side)
            shutil.rmtree(final, ignore_errors=True)
            save.partial.rename(final)
            (self.root / "latest.tmp").write_text(final.name + "\n")
            (self.root / "latest.tmp").rename(self.root / "latest")
            complete = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
            for old in complete[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        else:
            write_s = None
        dist.barrier()
        self._in_flight = None
        self._sealed.append((save.step, {"checkpoint/blocking_s": save.blocking_s, "checkpoint/write_s": write_s,
                                         "checkpoint/total_s": time.perf_counter() - save.started}))


def _save_rng(state: dict, partial: Path, rank: int) -> dict:
    """Write this rank's RNG file; its record entry (size, checksum)."""
    rng = partial / f"rng_{rank}.pt"
    torch.save(state, rng)
    return file_record(rng)


WRITTEN = "written_{rank}.json"  # a rank's record of the files it wrote (merged into the manifest)


def _write_and_record(write, partial: Path, rank: int, mine: dict, staging: _Staging | None, *args,
                      **kwargs) -> None:
    """In the rank's forked writer: megatron's write of this rank's shards (``write``; None when
    the rank has none to write), a check that the staged tensors it wrote from still hold what
    was staged, then the size and checksum of each shard (read back from the page cache, on every
    rank at once), recorded with ``mine`` (the rank's RNG file). A failed check is recorded
    instead of the checksums: the seal refuses the save."""
    started = time.perf_counter()
    if write is not None:
        write(*args, **kwargs)
    changed = staging.changed() if staging is not None else []
    if changed:
        _record_written(partial, rank, {}, time.perf_counter() - started,
                        error=f"rank {rank}'s staged copy changed while its writer wrote it: {changed[:4]}")
        return
    try:
        shards = {f.name: [f.stat().st_size, file_checksum(f)] for f in sorted(partial.glob(f"__{rank}_*.distcp"))}
        _record_written(partial, rank, mine | shards, time.perf_counter() - started)
    except OSError:  # a full disk: the write's own error (megatron's results queue) names it at the seal,
        return       # else the missing record does; a traceback from this process would only echo it


def _record_written(partial: Path, rank: int, files: dict, seconds: float, error: str | None = None) -> None:
    path = partial / WRITTEN.format(rank=rank)
    path.with_suffix(".tmp").write_text(json.dumps({"files": files, "seconds": seconds, "error": error}))
    path.with_suffix(".tmp").rename(path)


def _verify_and_seal(partial: Path, step: int, layout: dict, coordinates: list, backend: str,
                     side: dict[str, list]) -> float:
    """Check what every rank wrote (each rank's record of its files, megatron's common state
    loads) and the rollout's state file (``side``: its record, {} without one), hash what rank 0
    wrote outside the records (common.pt, megatron's metadata, the model description), then write
    the manifest: the last file of a complete checkpoint. Returns the slowest rank's seconds of
    writing."""
    from megatron.core import dist_checkpointing

    world_size = len(coordinates)
    records = [partial / WRITTEN.format(rank=r) for r in range(world_size)]
    missing = [f.name for f in records if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {partial} is incomplete after saving: missing {missing} (the ranks' "
                              f"records of what they wrote; their writers failed)")
    written, seconds, errors = {}, [], []
    for f in records:
        record = json.loads(f.read_text())
        written |= record["files"]
        seconds.append(record["seconds"])
        errors += [record["error"]] if record.get("error") else []
        f.unlink()
    if errors:
        raise CheckpointError(f"checkpoint {partial} is not sealed: " + "; ".join(errors))
    written |= side
    if backend == "megatron":
        dist_checkpointing.load_common_state_dict(str(partial))
    for name in written:
        if not (partial / name).is_file():
            raise CheckpointError(f"checkpoint {partial} is incomplete after saving: missing {name}")
    missing = [f"rng_{r}.pt" for r in range(world_size) if f"rng_{r}.pt" not in written]
    if missing or (backend == "megatron" and not (partial / "metadata.json").is_file()):
        raise CheckpointError(f"checkpoint {partial} is incomplete after saving: missing "
                              f"{missing or ['metadata.json']}")
    paths = [f for f in sorted(partial.rglob("*")) if f.is_file()]
    names = [str(f.relative_to(partial)) for f in paths]
    files = {n: written[n][0] if n in written else f.stat().st_size for n, f in zip(names, paths)}
    checksums = {n: written[n][1] if n in written else file_checksum(f) for n, f in zip(names, paths)}
    manifest = {"format": FORMAT, "step": step, "layout": layout, "world_size": world_size, "backend": backend,
                "ranks": coordinates, "rollout_state": next(iter(side), None), "files": files, CHECKSUM: checksums}
    (partial / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
    (partial / (MANIFEST + ".tmp")).rename(partial / MANIFEST)
    return max(seconds)


# megatron-core's checkpoint writer reports through a queue served by a multiprocessing manager it
# spawns on first use (dist_checkpointing/strategies/filesystem_async.py: _get_write_results_queue);
# that server outlives a rank killed with SIGKILL, and dies first when torchrun signals the rank's
# process group. Start it ourselves as a helper that lives exactly as long as the rank.
_MANAGER: SyncManager | None = None


def _results_queue_that_dies_with_us() -> None:
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _MANAGER is None and getattr(filesystem_async, "_results_queue", False) is None:
        _MANAGER = SyncManager(ctx=multiprocessing.get_context("spawn"))
        _MANAGER.start(initializer=start_helper)
        filesystem_async._results_queue = _MANAGER.Queue()


EXPORT_MARKER = "megadiv_step.json"


def _checkpoint_bytes(root: Path) -> int | None:
    """Bytes of the newest complete checkpoint under ``root``, None without one."""
    newest = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    return directory_bytes(newest[-1]) if newest else None


def export_hf(run_dir: Path, actor: Policy, template_dir: str, step: int, retrained: bool) -> None:
    """Write the policy to ``run_dir/hf`` (collective), unless this launch trained nothing and hf/
    already holds step ``step``. The step is recorded in hf/megadiv_step.json after the export, so
    an extended run (more grpo.steps) re-exports."""
    marker = run_dir / "hf" / EXPORT_MARKER
    if not retrained and marker.is_file() and json.loads(marker.read_text()).get("step") == step:
        return
    actor.save_hf(run_dir / "hf", template_dir, replace=True)
    if dist.get_rank() == 0:
        marker.write_text(json.dumps({"step": step}) + "\n")


def rollout_state_file(path: Path) -> Path:
    """The rollout driver's state file of checkpoint ``path`` (checksummed with the others)."""
    name = json.loads((path / MANIFEST).read_text())["rollout_state"]
    if name is None:
        raise CheckpointError(f"{path} holds no rollout state (saved outside a training run)")
    return path / name


def load_checkpoint(path: Path, actor: Policy) -> dict:
    """Restore ``actor`` (model, optimizer, schedule) and this rank's RNG; returns the trainer state."""
    manifest = json.loads((path / MANIFEST).read_text())
    saved_by = manifest.get("backend", "megatron")
    if saved_by != actor.backend:
        raise ConfigError(f"{path} was written by the {saved_by} backend; this run uses model.backend={actor.backend} "
                          f"(export it to Hugging Face format and start a new run from that)")
    if actor.backend == "deepspeed" and manifest["world_size"] != dist.get_world_size():
        raise ConfigError(f"{path} is a DeepSpeed checkpoint of {manifest['world_size']} ranks; resume it with "
                          f"{manifest['world_size']} ranks (ZeRO partitions are per rank)")
    # the bytes this rank reads; the whole checkpoint is the total when one rank reads it all
    total = directory_bytes(path) if dist.get_world_size() == 1 else None
    start = bytes_read()
    try:
        with Progress(f"loading checkpoint {path.name}", total=total, unit="B") as bar, \
                bar.following(lambda: bytes_read() - start):
            return _load(path, actor)
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:  # torch's and megatron's errors do not say which checkpoint
        raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from e


def _load(path: Path, actor: Policy) -> dict:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    manifest = json.loads((path / MANIFEST).read_text())
    if actor.backend == "deepspeed":
        trainer_state = actor.load_state(path)
        _load_rng(path, manifest)
        return trainer_state
    common = dist_checkpointing.load_common_state_dict(str(path))
    # written before the key existed: the distributed optimizer's exactly when it holds Adam's state
    saved_distributed = common.get("distributed_optimizer", common["adam_step"] is not None)
    # another chain of optimizers (expert parallelism changed): the same tensors, another nesting
    converting = (saved_distributed != actor.use_distributed_optimizer
                  or common.get("optimizer_parts", 1) != len(_parts(actor.optimizer)))
    _materialize_adam_state(actor.optimizer, common["adam_step"])
    # the replicas of a data-parallel group need the same shards: each is read by one of them and
    # broadcast to the others (megatron's fully parallel load), not read once per replica
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)),
                                                parallel_state.get_data_parallel_group(with_context_parallel=True))
    state = load_sharded(_state_template(actor, is_loading=True, saved_distributed=saved_distributed,
                                         converting=converting), path, sharded_strategy=strategy)
    for key, gpt in zip([k for k in state if k.startswith("model")], actor.model.gpt_models):
        load_module_state(gpt, state[key])
    optimizer_state = state["optimizer"]
    if converting:
        optimizer_state = _converted_optimizer_state(actor, state[CONVERTED], common["optimizer"])
    with torch.no_grad():
        _load_optimizer(actor.optimizer, optimizer_state)
    actor.scheduler.load_state_dict(state["scheduler"])
    _load_rng(path, manifest)
    return state["trainer"]


def _load_rng(path: Path, manifest: dict) -> None:
    """This rank's RNG streams: those of the saved rank at the same (tp, pp, dp) coordinates, or,
    where the saved layout had none (a run resumed on more ranks, or at another TP size), streams
    derived from the step and the coordinates, the same on every resume at this layout."""
    mine = _coordinates()
    if "ranks" in manifest:
        source = manifest["ranks"].index(mine) if mine in manifest["ranks"] else None
    else:  # written before the coordinates were recorded: rank by rank at the same world size
        source = dist.get_rank() if manifest["world_size"] == dist.get_world_size() else None
    if source is None:
        seed = xxhash.xxh3_64_intdigest(json.dumps([manifest["step"], *mine]).encode())
        random.seed(seed)
        torch.manual_seed(seed)  # every device's generator too
        return
    rng = path / f"rng_{source}.pt"
    if not rng.is_file():
        raise CheckpointError(f"{rng} is missing from {path}")
    _set_rng_state(torch.load(rng, weights_only=False))


def _coordinates() -> list[int]:
    """This rank's [tp, pp, dp] (a list: what JSON gives back)."""
    from megatron.core import parallel_state

    return [parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True)]


def _parts(optimizer) -> list:
    """The optimizers megatron chains (dense and expert parameters of a mixture-of-experts model),
    or the one optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _part_states(optimizer, state) -> list[dict]:
    """``state`` (a ChainedOptimizer's: one entry per part, as a list or keyed 0..n-1) per part."""
    parts = _parts(optimizer)
    if len(parts) == 1:
        return [state]
    states = [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state)
    if len(states) != len(parts):
        raise CheckpointError(f"the checkpoint's optimizer state has {len(states)} parts, this run's optimizer "
                              f"{len(parts)}")
    return states


def _load_optimizer(optimizer, state) -> None:
    """``optimizer.load_state_dict(state)``, part by part, working around two defects of
    megatron-core's distributed optimizer without Apex/TE (0.16.1):

    * loading 'fully_reshardable' parameter state copies every key of a parameter's optimizer
      state from the checkpoint, 'step' included, which the checkpoint does not hold
      (distrib_optimizer.py:937, KeyError 'step'): the parameter state is loaded here, with each
      'step' set aside meanwhile;
    * the load writes ONE 'step' tensor into every parameter's state (distrib_optimizer.py:825);
      torch's Adam increments it in place per parameter, so each would see another step count:
      each parameter gets its own copy."""
    for part, part_state in zip(_parts(optimizer), _part_states(optimizer, state)):
        param_state = None
        if part_state.get("param_state_sharding_type") == "fully_reshardable":
            part_state = dict(part_state)
            del part_state["param_state_sharding_type"]
            param_state = part_state.pop("param_state")
        part.load_state_dict(part_state)
        inner_states = [st for inner in _adam_steps(part) for st in inner.state.values()]
        if param_state is not None:
            steps = [st.pop("step", None) for st in inner_states]
            part.load_parameter_state_from_fully_reshardable(param_state)
            for st, step in zip(inner_states, steps):
                if step is not None:
                    st["step"] = step
        for st in inner_states:
            if "step" in st:
                st["step"] = st["step"].clone()


def _state_template(actor: Policy, is_loading: bool, saved_distributed: bool | None = None,
                    converting: bool = False) -> dict:
    """What megatron saves or loads. Loading another optimizer's state (``converting``: the plain
    and the distributed optimizer, ``saved_distributed`` telling how the checkpoint was written,
    or another chain of them), the running optimizer's tensors are asked for under the saved keys
    (``_retarget_main_params``) and under CONVERTED, apart from the saved non-tensor state."""
    model_state = sharded_state_dict(actor.model)
    optimizer_state = actor.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                         metadata=OPTIMIZER_METADATA)
    if is_loading and converting:
        if saved_distributed != actor.use_distributed_optimizer:
            optimizer_state = _retarget_main_params(actor, optimizer_state, model_state, saved_distributed)
        return {**model_state, CONVERTED: optimizer_state}
    return {**model_state, "optimizer": optimizer_state}


# The two optimizers' checkpoints hold the same model-space tensors (one per parameter and state,
# keyed by the parameter's key K, sharded like it): 'optimizer.state.exp_avg.K' and
# 'optimizer.state.exp_avg_sq.K' (SGD: none), and the fp32 main parameter as
# 'optimizer.state.param.K' (distributed, 'fully_reshardable') or 'optimizer.state.fp32_param.K'
# (plain, bf16/fp16 weights; with fp32 weights the plain optimizer steps the weights K
# themselves). So one loads the other's by renaming the main parameters' keys; the non-tensor
# state (hyperparameters, the step, the LR) is the running optimizer's own, from the same config,
# with the saved step (``_materialize_adam_state``) and schedule, and the saved loss scale.
CONVERTED = "optimizer_converted"
MAIN_PARAM = {True: "optimizer.state.param.", False: "optimizer.state.fp32_param."}


def _retarget_main_params(actor: Policy, optimizer_state: dict, model_state: dict, saved_distributed: bool) -> dict:
    """The running optimizer's load template with its main parameters' keys as the other
    optimizer wrote them; a distributed optimizer resuming a plain fp32 checkpoint takes its main
    parameters from the weights (loaded first, in place)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory

    config = actor.model.config
    half = config.bf16 or config.fp16
    mine, saved = MAIN_PARAM[actor.use_distributed_optimizer], MAIN_PARAM[saved_distributed]

    def place(sh, key: str) -> tuple:
        """Where a tensor sits in the checkpoint: stacked layers share a key and differ in their
        offsets (a factory's offsets live in its build function, which optimizer tensors share)."""
        return (key, sh.global_offset) if isinstance(sh, ShardedTensor) else (key, id(sh.build_fn))

    weights = {place(sh, sh.key): sh.data for sh in nested_values(model_state)
               if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}

    def retarget(x):
        if not isinstance(x, (ShardedTensor, ShardedTensorFactory)) or not x.key.startswith(mine):
            return x
        if half:
            return dataclasses.replace(x, key=saved + x.key.removeprefix(mine))
        return LocalNonpersistentObject(weights[place(x, x.key.removeprefix(mine))])

    return dict_list_map_inplace(retarget, optimizer_state)


def _converted_optimizer_state(actor: Policy, loaded: dict, saved_common: dict) -> dict:
    """The running optimizer's state dict (its hyperparameters and materialized step) with the
    tensors loaded from the other optimizer's checkpoint, and the saved loss scale (fp16)."""
    state = _with_tensors(actor.optimizer.state_dict(), loaded)
    saved_parts = saved_common if isinstance(saved_common, list) else (
        [v for _, v in sorted(saved_common.items())] if all(isinstance(k, int) for k in saved_common) else
        [saved_common])
    scaler = next((p["grad_scaler"] for p in saved_parts if "grad_scaler" in p), None)
    for part in _part_states(actor.optimizer, state):
        if scaler is not None:
            part["grad_scaler"] = scaler
        if actor.use_distributed_optimizer:
            part["param_state_sharding_type"] = OPTIMIZER_METADATA["distrib_optim_sharding_type"]
    return state


def _with_tensors(base, loaded):
    """``base`` with every tensor of ``loaded`` put at its place (the same nesting of dicts and lists)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    if isinstance(loaded, (dict, list)):
        for k, v in (loaded.items() if isinstance(loaded, dict) else enumerate(loaded)):
            base[k] = _with_tensors(base[k], v) if isinstance(base, list) or k in base else v
    return base


def _adam_steps(optimizer):
    for opt in _parts(optimizer):
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
