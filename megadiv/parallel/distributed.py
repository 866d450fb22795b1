"""Initialise torch.distributed from the torchrun environment and megatron-core's parallel state.

``torchrun --nproc_per_node N`` (or ``--nnodes``/``--rdzv_endpoint`` for several nodes) sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; :func:`initialize` reads them, opens the
default process group (NCCL on GPUs, gloo on CPU) with the config's timeout, and builds
megatron-core's TP/PP/DP groups. A plain ``python`` process (no torchrun) runs as a world of
one. Megatron's rank order is tp-cp-ep-dp-pp: TP ranks are adjacent, so a TP group stays on one
node whenever TP divides the GPUs per node. Expert groups (mixture-of-experts models: ETP x EP x
expert-DP, in the order tp-ep-dp-pp) are cut from each stage's TP x DP ranks: with TP=1, ranks r
and r+1 hold different experts when EP=2; an expert's gradients are reduced over its
expert-data-parallel group (TP x DP / (ETP x EP) ranks) only.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadiv.config import ConfigError, ParallelConfig
from megadiv.parallel import cpu_compat


@dataclass(frozen=True)
class ParallelInfo:
    """Where this rank sits. Ranks are global; *_rank are positions inside each group."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    ep_rank: int = 0
    ep_size: int = 1
    """Expert-parallel position and size (mixture-of-experts models; ranks within the DP ranks)."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_INFO: ParallelInfo | None = None


def check_gpus_per_node(local_world_size: int, visible_gpus: int) -> None:
    """One GPU per rank: torchrun's ranks on this node use GPUs 0 .. LOCAL_WORLD_SIZE - 1, and a
    rank without one would fail in torch.cuda.set_device with a CUDA error (NCCL also refuses two
    ranks on one GPU)."""
    if local_world_size > visible_gpus:
        raise ConfigError(
            f"{local_world_size} ranks on this node (LOCAL_WORLD_SIZE) but {visible_gpus} CUDA device(s) visible: "
            f"one GPU per rank; launch at most {visible_gpus} ranks per node, or hide CUDA "
            f"(CUDA_VISIBLE_DEVICES=) to run on CPU with gloo")


def initialize(cfg: ParallelConfig, seed: int = 1234) -> ParallelInfo:
    """Open the process groups for ``cfg`` (idempotent) and seed every RNG megatron uses.

    Raises ConfigError before any group is created if the world does not split as configured.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    from megatron.core import parallel_state, tensor_parallel

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg.data_parallel_size(world_size)  # validates divisibility before anything starts

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        cpu_compat.enable(allow_untested=cfg.allow_untested_megatron)
        device = torch.device("cpu")

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a world of one without torchrun
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("LOCAL_RANK", "0")  # what torchrun sets; DeepSpeed's engine requires it
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s))

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        # experts split over EP ranks, each expert over ETP ranks, cut from each stage's TP x DP ranks
        expert_model_parallel_size=cfg.expert_parallel,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)),
    )
    torch.manual_seed(seed)
    # inference_rng_tracker: a tracker without CUDA RNG states (CPU); on GPU the regular one.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not use_cuda)

    _INFO = ParallelInfo(
        rank=rank, world_size=world_size, local_rank=local_rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=cfg.tensor_parallel,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(), pp_size=cfg.pipeline_parallel,
        dp_rank=parallel_state.get_data_parallel_rank(), dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
        ep_rank=parallel_state.get_expert_model_parallel_rank(), ep_size=cfg.expert_parallel,
    )
    return _INFO


def info() -> ParallelInfo:
    if _INFO is None:
        raise RuntimeError("megadiv.parallel.initialize() has not been called")
    return _INFO


def shutdown(keep_default_group: bool = False) -> None:
    """Destroy megatron's groups and (unless ``keep_default_group``, e.g. to initialise another
    layout in the same job) the default group; switch the CPU layer off with it."""
    global _INFO
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _INFO = None
    if keep_default_group:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_compat.disable()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
