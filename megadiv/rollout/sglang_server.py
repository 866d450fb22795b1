"""An SGLang server as a child process: launch on loopback, wait for health, stop, never leak.

    server = SGLangServer.launch(hf_dir, cfg)    # python -m sglang.launch_server ... on 127.0.0.1
    server.url                                  # http://127.0.0.1:<free port>
    server.stop()                               # SIGTERM to its process group, SIGKILL after a grace

The child runs in its own session (process group), so stop() reaches SGLang's scheduler and
detokenizer processes too; stop() also runs at interpreter exit, and on Linux the server gets
SIGTERM if the launching thread dies. Its stdout/stderr go to a log file named in every error.

CPU (no CUDA): the flags of the measured CPU tier (docs/rollout.md), SGLANG_USE_CPU_ENGINE=1 and,
on the child's PYTHONPATH only, the stand-ins in ``megadiv/rollout/sglang_cpu`` (an import-only
torchvision and the one sgl_kernel op a dense model calls); the trainer process never sees them.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from megadiv.config import ConfigError
from megadiv.parallel.threads import server_threads
from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import RolloutError

log = logging.getLogger(__name__)

CPU_STANDINS = Path(__file__).resolve().parent / "sglang_cpu"

# Measured on the CPU tier (2 cores, no AMX): torch attention and sampling, float32, a small KV
# pool, no CUDA graphs, no grammar backend, no warm-up request (start-up 20-80 s).
# SGLang sizes the KV pool as (free memory now) - (1 - f) x (free memory before loading) and refuses
# to start when that is <= 0: with f = 0.05 a host whose free memory drops by 5% during the load
# (other processes, the weights themselves) cannot start a server. f = 0.5 tolerates that; the pool
# itself stays capped by --max-total-tokens.
# --sleep-on-idle: without it the idle scheduler polls its sockets in a busy loop, a whole core
# (measured 0.8 of one at load 17) taken from the trainer's ranks, which share the cores, during
# every training phase; with it the scheduler blocks in zmq poll until a request arrives (generation
# time unchanged, measured interleaved: docs/performance.md, Overlap).
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--dtype", "float32", "--mem-fraction-static", "0.5", "--max-total-tokens", "16384",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--grammar-backend", "none", "--skip-server-warmup", "--sleep-on-idle",
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class GpuPlacement:
    """Where a launched server runs on this node: GPUs [base_gpu_id, base_gpu_id + server_tp),
    and the share of each GPU's memory its weights and KV cache may reach."""

    base_gpu_id: int
    shares_trainer_gpus: bool
    mem_fraction_static: float


@dataclass(frozen=True)
class TrainerMemory:
    """The trainer's ranks on this node just before a colocated server starts, by local GPU:
    bytes free on that GPU (``torch.cuda.mem_get_info``, what SGLang will measure) and bytes the
    rank will still allocate after the server has sized its KV cache (Adam's moments, created at
    the first optimizer step)."""

    free_bytes: tuple[int, ...]
    reserved_bytes: tuple[int, ...]


def gather_trainer_memory(reserved_bytes: int) -> TrainerMemory:
    """Collective: every trainer rank calls it with its own ``reserved_bytes``; each reports its
    GPU's free memory, and all get this node's (the node of rank 0, which launches the servers),
    indexed by LOCAL_RANK = the GPU that rank uses (torchrun)."""
    import torch
    import torch.distributed as dist

    mine = (int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
            int(torch.cuda.mem_get_info()[0]), int(reserved_bytes))
    everyone = [mine]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    node = everyone[0][0]
    local = sorted((local_rank, free, reserved) for group, local_rank, free, reserved in everyone if group == node)
    return TrainerMemory(tuple(f for _, f, _ in local), tuple(r for _, _, r in local))


# Below this share of a GPU a colocated server has no room for a useful KV cache.
MIN_COLOCATED_FRACTION = 0.05


def place_server(cfg: RolloutConfig, trainer_gpus: int, visible_gpus: int, memory: TrainerMemory | None = None,
                 index: int = 0) -> GpuPlacement:
    """The GPUs of launched server ``index`` (of a fleet; 0 for one server) on a node where the
    trainer's ranks hold GPUs [0, trainer_gpus); server i's share is GPUs [i x tp, (i+1) x tp)
    of the region it lands in.

    Free GPUs after the trainer's: the server takes them (``--base-gpu-id trainer_gpus + i x tp``)
    and its configured memory share. Otherwise it shares GPUs [i x tp, (i+1) x tp) with trainer
    ranks (colocated), and ``rollout.mem_fraction_static`` = F is the share of each GPU's memory
    free at that moment that the server's weights and KV cache plus the trainer's optimizer state
    to come may take; (1 - F) x free stays for the trainer's activations. SGLang 0.5.23 sizes a
    server against pre = the least memory free on any of its TP GPUs when it starts
    (bootstrap.measure_pre_model_load_memory), and leaves (1 - f) x pre free after its weights
    and KV cache (kv_cache_configurator._profile_available_bytes): it takes f x pre on every GPU.
    GPU g, with free_g and reserved_g (``memory``), then keeps free_g - f x pre - reserved_g,
    which must be >= (1 - F) x free_g, so f = min over g of (F x free_g - reserved_g) / pre.
    (Against the total memory instead, the optimizer state was under-reserved by free / total.)"""
    tp = cfg.server_tp
    if trainer_gpus + (index + 1) * tp <= visible_gpus:
        return GpuPlacement(trainer_gpus + index * tp, False, cfg.mem_fraction_static)
    if (index + 1) * tp > visible_gpus:
        raise RolloutError(f"rollout server {index} with rollout.server_tp={tp} needs GPUs {index * tp}.."
                           f"{(index + 1) * tp - 1}; {visible_gpus} are visible here")
    gpus = [g for g in range(index * tp, (index + 1) * tp) if memory is not None and g < len(memory.free_bytes)]
    if not gpus:   # no trainer rank measured on these GPUs: nothing to reserve
        return GpuPlacement(index * tp, True, cfg.mem_fraction_static)
    pre = min(memory.free_bytes[g] for g in gpus)
    binding = min(gpus, key=lambda g: (cfg.mem_fraction_static * memory.free_bytes[g] - memory.reserved_bytes[g]) / pre)
    fraction = (cfg.mem_fraction_static * memory.free_bytes[binding] - memory.reserved_bytes[binding]) / pre
    if fraction < MIN_COLOCATED_FRACTION:
        raise RolloutError(
            f"a server colocated with the trainer on GPUs {index * tp}..{(index + 1) * tp - 1} would get "
            f"{fraction:.3f} of the memory free there: rollout.mem_fraction_static={cfg.mem_fraction_static} minus the "
            f"trainer's optimizer state on GPU {binding} ({memory.reserved_bytes[binding] / 2**30:.1f} GiB of "
            f"{memory.free_bytes[binding] / 2**30:.1f} GiB free); raise mem_fraction_static, shard the optimizer "
            f"over more data-parallel ranks, or leave GPUs free for the server")
    return GpuPlacement(index * tp, True, math.floor(fraction * 1e4) / 1e4)   # rounded down: never over


def served_model_flags(hf_dir: str) -> list[str]:
    """``--dtype`` and, where needed, ``--attention-backend`` for a GPU server of ``hf_dir``.
    SGLang's ``--dtype auto`` serves a float32 checkpoint in float16 (range 6.5e4: logits and
    activations of a trained model can overflow it); megadiv's trainers compute in bf16, so a
    float32 checkpoint is served in bfloat16 and a bf16/fp16 one as stored. The attention
    kernels SGLang picks on Hopper (FlashAttention 3, FlashInfer) are built for head dims 64, 128
    and 256; other head dims (the tiny test models have 16 and 32) get the Triton backend, which
    pads any head dim to a power of two."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    flags = ["--dtype", "bfloat16" if stored in ("float32", "float") else str(stored)]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in (64, 128, 256):
        flags += ["--attention-backend", "triton"]
    return flags


# docker/Dockerfile's SGLang environment: sglang pins a torch of its own, so in the container it
# lives beside the trainer's Python, not in it.
CONTAINER_SGLANG_PYTHON = "/opt/sglang/bin/python"


def server_python(cfg: RolloutConfig) -> str:
    """The interpreter of a launched server: ``rollout.server_python``, else the container's SGLang
    environment where it exists, else this one."""
    if cfg.server_python is not None:
        return cfg.server_python
    return CONTAINER_SGLANG_PYTHON if os.access(CONTAINER_SGLANG_PYTHON, os.X_OK) else sys.executable


@functools.cache
def finds_sglang(python: str) -> bool:
    """Whether ``python`` runs and finds sglang (a module lookup, not an import: ~0.1 s)."""
    if python == sys.executable:
        return importlib.util.find_spec("sglang") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_server_python(cfg: RolloutConfig) -> None:
    """ConfigError unless the interpreter that would run a launched server finds sglang."""
    python = server_python(cfg)
    if not finds_sglang(python):
        raise ConfigError(f"rollout.server_python: {python} cannot import sglang (or does not run): install sglang "
                          f"there, or set rollout.server_python to the Python of an environment that has it (in "
                          f"the container: {CONTAINER_SGLANG_PYTHON})")


def nccl_version(python: str) -> str:
    """The NCCL that torch loads under ``python`` ("2.28.9"), or why none could be read."""
    code = "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))"
    if python == sys.executable:
        import torch

        return ".".join(map(str, torch.cuda.nccl.version()))
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    return proc.stdout.strip() if proc.returncode == 0 else f"unreadable ({proc.stderr.strip()[-200:]})"


def launch_command(hf_dir: str, port: int, cfg: RolloutConfig, gpu: GpuPlacement | None) -> list[str]:
    """The ``sglang.launch_server`` command line for ``hf_dir`` on 127.0.0.1:``port``, on the GPUs
    of ``gpu`` (None: a CPU server), run by :func:`server_python`. ``rollout.server_args`` come
    last and so override these."""
    cmd = [server_python(cfg), "-m", "sglang.launch_server", "--model-path", str(hf_dir),
           "--host", "127.0.0.1", "--port", str(port)]
    if gpu is not None:
        cmd += ["--tp-size", str(cfg.server_tp), "--base-gpu-id", str(gpu.base_gpu_id),
                "--mem-fraction-static", str(gpu.mem_fraction_static), *served_model_flags(hf_dir)]
    else:
        if cfg.server_tp != 1:
            raise ValueError(f"rollout.server_tp={cfg.server_tp}: a CPU SGLang server runs TP=1")
        cmd += list(CPU_FLAGS)
    return cmd + list(cfg.server_args)


# torchrun's variables (and the trainer's CUDA_DEVICE_MAX_CONNECTIONS): a server started by a trainer rank
# must not join the trainer's rendezvous
# (SGLang initialises torch.distributed from the environment and would wait for the trainer's ranks).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                      # the trainer's TP overlap setting (cli/train.py): it would serialise the server's streams
                      "CUDA_DEVICE_MAX_CONNECTIONS")


def child_env(cuda: bool, shares_trainer_gpus: bool = False) -> dict[str, str]:
    """The server's environment: ours without torchrun's, plus the CPU tier's switches, stand-ins
    and thread count (megadiv.parallel.threads.server_threads) without CUDA. A server on the trainer's GPUs finds them holding unequal memory
    (pipeline stages, rank 0's extras): SGLang's TP memory-balance check (on by default) refuses
    to start when one GPU has less than 0.9 x another's free memory; place_server has sized the
    server against the least free GPU, as SGLang then does, so the check is turned into its warning."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["HF_HUB_OFFLINE"] = env.get("HF_HUB_OFFLINE", "1")  # serve local checkpoints, never download
    if shares_trainer_gpus:
        env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
    if not cuda:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["OMP_NUM_THREADS"] = str(server_threads())  # the cores the ranks leave, not the rank's own count
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STANDINS), env.get("PYTHONPATH")) if p)
    return env


class SGLangServer:
    """A launched server process (see the module docstring). Use :meth:`launch`."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, grace_s: float):
        self.proc, self.url, self.log_path, self.grace_s = proc, url, log_path, grace_s
        # runs once: on stop(), when garbage-collected, or at interpreter exit (weakref.finalize
        # registers itself with atexit); it holds no reference to self
        self._finalizer = weakref.finalize(self, _kill_group, proc, grace_s)

    @classmethod
    def launch(cls, hf_dir: str, cfg: RolloutConfig, gpu: GpuPlacement | None = None,
               port: int | None = None) -> SGLangServer:
        """Start a server for ``hf_dir`` (on the GPUs of ``gpu``; None on a CPU machine) on
        ``port`` (None: a free one) and wait until /health answers (cfg.startup_timeout_s)."""
        cuda = gpu is not None
        port = port or free_port()
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="megadiv-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"sglang-{port}.log"
        cmd = launch_command(hf_dir, port, cfg, gpu)
        log.info("launching SGLang server on port %d (log: %s): %s", port, log_path, " ".join(cmd))
        with open(log_path, "ab") as out:
            env = child_env(cuda, shares_trainer_gpus=cuda and gpu.shares_trainer_gpus)
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=term_on_parent_death)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, cfg.shutdown_grace_s)
        try:
            server.wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RolloutError(f"SGLang server {self.url} exited with code {self.proc.returncode} during "
                                   f"start-up; log {self.log_path}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    log.info("SGLang server %s healthy after %.1f s", self.url, time.monotonic() - t0)
                    return
            except requests.RequestException:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RolloutError(f"SGLang server {self.url} not healthy after {timeout_s:.0f} s "
                                   f"(rollout.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after the grace period. Idempotent."""
        self._finalizer()


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the server's process group; SIGKILL what is left once the leader exits or after
    ``grace_s`` (SGLang may ignore SIGTERM while its scheduler is blocked in a collective, and its
    children may outlive the leader); then wait until no live member remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s if sig == signal.SIGTERM else 10.0)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10.0
    while live_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if live_group_members(proc.pid):
        log.error("SGLang server process group %d still has live members %s", proc.pid, live_group_members(proc.pid))


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are not zombies (orphaned zombies wait for init)."""
    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return live


# libc is loaded here, in the parent: the child between fork and exec should only make the call
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def term_on_parent_death() -> None:
    """In the child before exec: SIGTERM when the launching thread dies (Linux prctl), so a
    trainer killed with SIGKILL does not leave a server behind."""
    if _LIBC is not None:
        PR_SET_PDEATHSIG = 1
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
