"""Rollout, as one rank of the trainer sees it: the rows it trains on, the weights it serves,
the evaluations it waits for. One object per rank; the loop (grpo.py) calls the same methods on
every rank and never asks which rank it is.

    rollout = Rollout(cfg, info, start_dir, tokenizer, actor)   # collective
    rows, metrics = rollout.collect(step)        # this replica's rows of batch ``step``
    sync = rollout.push_weights(actor, step)     # the engines serve the weights of ``step``
    evaluated = rollout.evaluate()               # metrics on rank 0, {} elsewhere
    probe = rollout.probe_batch()                # the weight-sync probe, on every rank

Where things run (docs/architecture.md):
- the driver (driver.py: prompts, generation stream, rewards, advantages, evaluation): with SGLang
  in a process of its own beside rank 0 (DriverProcess); with the embedded engine in rank 0's
  process, whose engine is the model (and, at TP = PP = 1, shares the actor's parameters);
- with the embedded engine on several ranks (no overlap) every rank generates a slice of each
  call: ranks other than 0 serve generation over a gloo group until the driver releases them;
- the weight push: the ranks of data-parallel replica 0 export (TP gather, PP collect; every rank
  under DeepSpeed ZeRO-3, whose export gathers over all); rank 0 sends it to the servers (or its
  engine), a rank with an engine of its own loads its own export;
- every wait for the driver is a wait on a store key (handoff.py), never an open collective.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from megadiv.rollout import Bucket, ProbeBatch, make_engine, resolve_engine_name
from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.fleet import FleetEngine
from megadiv.rollout.sglang_server import TrainerMemory, gather_trainer_memory
from megadiv.rollout.weight_sync import address_seen_by
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.driver import DriverProcess, RolloutDriver, version_name
from megadiv.trainer.handoff import Handoff, ReplicaRows, from_torch_bytes, replica_group

STARTED = "megadiv/rollout/started"
"""The launch store's key under which rank 0 publishes the driver's address (or its failure)."""


class Rollout:
    """This rank's side of the rollout (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, info, start_dir: str, tokenizer, reserved_bytes: int):
        """Collective (every rank, after the models are built). ``reserved_bytes``: the actor's
        optimizer state still to be allocated, for servers launched beside it on its GPUs."""
        self.cfg, self.info = cfg, info
        memory = trainer_memory_for_servers(cfg.rollout, reserved_bytes)  # collective
        group = generation_group(cfg, info.world_size)                     # collective
        timeout_s = cfg.rollout.handoff_timeout_s
        self.driver = self.engine = None
        # Rank 0 starts the servers (up to rollout.startup_timeout_s each) and the driver while the
        # others wait for the driver's address on a key of the launch's store, not in a collective
        # that parallel.timeout_s (the NCCL watchdog) would end first; a failure wakes them with it.
        started = Handoff(dist.distributed_c10d._get_default_store(), timeout_s)
        if info.rank == 0:
            try:
                port = self._start_driver(cfg, start_dir, tokenizer, info, memory, group)
            except BaseException as e:
                started.fail(STARTED, e)
                raise
            started.publish(STARTED, json.dumps([address_seen_by(os.environ.get("MASTER_ADDR", "127.0.0.1")),
                                                 port]).encode())
        elif group is not None:  # a rank that generates its slices of the driver's calls
            self.engine = make_engine(cfg.rollout, start_dir, group=group)
        self._worker = group if info.rank != 0 else None
        host, port = json.loads(started.wait(STARTED))
        self.handoff = Handoff.connect(host, port, timeout_s)
        self.replica, self.replica_source = replica_group(info, cfg.parallel.timeout_s)  # collective
        self._started, self._evaluations, self._pipe_bytes = 0, 0, 0

    def _start_driver(self, cfg: TrainConfig, start_dir: str, tokenizer, info, memory, group) -> int:
        """Rank 0: the engines and the driver; the port of the driver's hand-off store."""
        if resolve_engine_name(cfg.rollout) == "sglang":
            # rank 0 keeps the fleet for weight pushes and the probe; the driver attaches to it
            self.engine = make_engine(cfg.rollout, start_dir, memory)
            attached = cfg.rollout.attached(self.engine.urls)
            self.driver = DriverProcess(dataclasses.replace(cfg, rollout=attached), start_dir, info.dp_size)
            return self.driver.port
        handoff, port = Handoff.host(cfg.rollout.handoff_timeout_s)
        self.driver = RolloutDriver(cfg, start_dir, tokenizer, handoff, info.dp_size, memory, group)
        self.engine = self.driver.engine
        return port

    def collect(self, step: int) -> tuple[ReplicaRows, dict]:
        """This replica's rows of batch ``step`` and the batch's metrics (the driver's, on every
        rank), plus handoff/bytes_received: what this rank received for them, and with the driver
        in a process of its own handoff/driver_pipe_bytes: what its replies to rank 0's calls
        brought since the previous batch."""
        if self.driver and self._started < step:
            self.driver.start_batch(step)
            self._started = step
        self._serve()
        metrics = from_torch_bytes(self.handoff.wait(f"batch/{step}"))
        if self.driver and self.cfg.grpo.overlap and step < self.cfg.grpo.steps:
            self.driver.start_batch(step + 1)  # on step - 1's weights, while the ranks train on this one
            self._started = step + 1
        data = self.handoff.receive(f"batch/{step}/{self.info.dp_rank}", self.replica, self.replica_source)
        metrics |= {"handoff/bytes_received": len(data)}
        if isinstance(self.driver, DriverProcess):  # replies since the last batch: calls' results, never rows
            metrics["handoff/driver_pipe_bytes"] = self.driver.received_bytes - self._pipe_bytes
            self._pipe_bytes = self.driver.received_bytes
        return ReplicaRows.decode(data), metrics

    def push_weights(self, actor, step: int) -> dict[str, float]:
        """Serve the actor's weights of ``step`` on every engine: after the batch in flight, which
        the old weights finish. Views of the parameters where the embedded engine shares them (no
        copy, no communication), else the collective export."""
        waited = time.perf_counter()
        if self.driver:
            for url, why in self.driver.quiesce(step).items():  # lost during generation: push to the others
                self.engine.drop(url, f"dropped by the rollout driver: {why}")
        self.handoff.wait(f"push/{step}")
        waited = time.perf_counter() - waited
        views = actor.hf_weight_views() if shares_weights(self.cfg) else None
        buckets = [views] if views is not None else actor.export_buckets(self.cfg.rollout.bucket_bytes)
        if self.engine is None:
            if self.info.dp_rank == 0 or not actor.exports_per_replica:
                drain(buckets)  # the export rank 0 sends is replica 0's: the other replicas skip it
            return {}
        report = (self.engine.update_weights(buckets, version_name(step), share=True) if views is not None
                  else self.engine.update_weights(buckets, version_name(step)))
        if self.driver:
            self.driver.served(step, self.engine.urls if isinstance(self.engine, FleetEngine) else None)
        return {"sync/mb_per_s": report.mb_per_s, "sync/buckets": report.num_buckets, "sync/bytes_sent": report.bytes_sent,
                "time/rollout_wait": waited}

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation on the engine's current weights: the metrics on rank 0, {} elsewhere."""
        index, self._evaluations = self._evaluations, self._evaluations + 1
        metrics = self.driver.evaluate(index) if self.driver else {}
        self._serve()
        self.handoff.wait(f"eval/{index}")
        return metrics

    def probe_batch(self) -> ProbeBatch:
        """The weight-sync probe, the same on every rank: held-out prompts and the engine's answers
        on the weights it serves now (RolloutDriver.probe)."""
        if self.driver:
            self.driver.probe()
        self._serve()
        prompts, responses = from_torch_bytes(self.handoff.wait("probe"))
        return ProbeBatch(prompts, responses)

    def _serve(self) -> None:
        if self._worker is not None:
            self.engine.serve(self._worker)  # until the driver releases the ranks

    def save_state(self, directory: Path, step: int) -> None:
        """Start writing the rollout side of a checkpoint after ``step`` into ``directory``: rank 0's
        driver writes its own file (the prompt position, the batch generated ahead) in the
        background, in its own process with SGLang; nothing on the other ranks."""
        if self.driver:
            self.driver.save_state(str(directory), step)

    def state_saved(self) -> dict[str, list]:
        """Wait for ``save_state``'s file: its manifest entry (rank 0), {} elsewhere."""
        return self.driver.state_saved() if self.driver else {}

    def load_state(self, path: Path, step: int) -> None:
        """Continue from the rollout state file ``path`` of a checkpoint after ``step``."""
        if self.driver:
            self.driver.load_state(str(path))
        self._started = step

    def close(self) -> None:
        """Stop the driver and the engines this rank holds (an in-process driver closes its own)."""
        if self.driver is not None:
            self.driver.close()
        if self.engine is not None and not isinstance(self.driver, RolloutDriver):
            self.engine.shutdown()


def trainer_memory_for_servers(cfg: RolloutConfig, reserved_bytes: int) -> TrainerMemory | None:
    """Collective (every trainer rank, after its models are built): each rank's free GPU memory
    and ``reserved_bytes`` (its optimizer state to come), for SGLang servers rank 0 launches on
    CUDA beside the trainer (sglang_server.place_server); None when no server is launched there."""
    launches = torch.cuda.is_available() and not cfg.server_urls and resolve_engine_name(cfg) == "sglang"
    return gather_trainer_memory(reserved_bytes) if launches else None


def generation_group(cfg: TrainConfig, world_size: int):
    """Collective (every rank): a gloo group of all ranks when every rank generates (the embedded
    engine, more than one rank, no grpo.overlap), else None. Not with overlap: rank 0 generates
    in a thread while every rank trains, and the others cannot serve generation meanwhile. Its
    timeout is the hand-off's: the ranks wait in it while the driver grades and evaluates."""
    if resolve_engine_name(cfg.rollout) != "embedded" or world_size == 1 or cfg.grpo.overlap:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.rollout.handoff_timeout_s))


def shares_weights(cfg: TrainConfig) -> bool:
    """Whether the embedded engine takes the actor's parameters as its weights (views, no copy)
    where the policy offers them (Policy.hf_weight_views: TP = PP = 1). Not with grpo.overlap:
    the engine then generates while the optimizer changes the parameters."""
    return resolve_engine_name(cfg.rollout) == "embedded" and not cfg.grpo.overlap


def drain(buckets: Iterable[Bucket]) -> None:
    """Take part in a collective weight export without sending anything."""
    for _ in buckets:
        pass
