"""What can be known about a run before any rank starts, checked in seconds (``check-config`` and
``megadiv train`` before launching): the data, the output directory, the model directory, and
the checkpoint a resume would start from (and that it keeps its pinned mirror map). Every error is
a ConfigError naming the file.

W&B, when run.loggers lists it, must be installed. The config's own keys, types and combinations
are checked when it is loaded (megadiv.config).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from megadiv.config import ConfigError, ModelConfig
from megadiv.data import DataConfig, load_dataset
from megadiv.data.templates import check_message_prompts
from megadiv.trainer.config import TrainConfig, chat_template_text
from megadiv.trainer.loggers import import_wandb


def preflight(cfg: TrainConfig, check_weights: bool = True, checksums: bool = True) -> list[str]:
    """Raise ConfigError for the first problem found; return notes for the user (where a resume
    would start, checkpoints it would skip). ``check_weights=False``: model.hf_dir holds only a
    config.json standing in for a checkpoint not yet on disk (check-config --hf-config).
    ``checksums=False``: the resume point is checked by file sizes only (``train``, whose rank 0
    verifies the checksums before loading: a large checkpoint is not read twice)."""
    for data, section in [(cfg.data, "data"), (cfg.eval.data, "eval.data")]:
        if data is not None:
            _check_data(data, section, cfg.model)
    if "wandb" in cfg.run.loggers:
        import_wandb()  # installed, or a ConfigError saying so
    _check_rollout(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    _check_writable(run_dir, "run.output_dir")
    if cfg.model.has_checkpoint():
        _check_model_dir(Path(cfg.model.hf_dir), cfg, check_weights)
    else:  # warm_start.make_model creates it (TrainConfig requires that)
        _check_writable(Path(cfg.model.hf_dir), "model.hf_dir")
    return _resume_notes(cfg, run_dir, checksums) if cfg.checkpoint.resume == "auto" else []


def _check_rollout(cfg: TrainConfig) -> None:
    """The Python of servers megadiv launches finds sglang (engine 'sglang', or a server_python
    given), and both ends of an NCCL weight broadcast load one NCCL. The trainer's own Python
    needs no sglang for any sync method."""
    import sys

    import torch

    from megadiv.rollout.sglang_server import check_server_python, finds_sglang, nccl_version, server_python

    r = cfg.rollout
    if not r.server_urls and (r.engine == "sglang" or r.server_python is not None):
        check_server_python(r)
    # NCCL refuses a communicator whose ranks run different versions, at the first broadcast: a
    # server Python other than ours (the container's /opt/sglang; attached servers are assumed to
    # run it too) must load our NCCL
    python = server_python(r)
    if (torch.cuda.is_available() and r.engine != "embedded" and r.sync_method in ("auto", "distributed")
            and python != sys.executable and finds_sglang(python)):
        ours, theirs = nccl_version(sys.executable), nccl_version(python)
        if ours != theirs:
            raise ConfigError(f"rollout.sync_method {r.sync_method!r} broadcasts over NCCL between the trainer (NCCL "
                              f"{ours}) and servers run by {python} (NCCL {theirs}), which NCCL refuses: use "
                              f"sync_method 'disk', or one NCCL for both (docker/Dockerfile preloads the image's)")


def sync_method_note(cfg: TrainConfig) -> str | None:
    """How the weights will reach the servers, for check-config to print (None: no server)."""
    from megadiv.rollout import resolve_engine_name

    r = cfg.rollout
    if resolve_engine_name(r) != "sglang":
        return None
    if r.sync_method == "distributed" and not r.server_urls:
        return ("rollout.sync_method: distributed (the launched servers need GPUs of their own on a GPU machine: "
                "NCCL refuses a group on a GPU the trainer holds; 'auto' picks tensor there)")
    if r.sync_method != "auto":
        return f"rollout.sync_method: {r.sync_method}"
    if r.server_urls:
        return "rollout.sync_method: auto -> distributed (attached servers: a broadcast group)"
    return ("rollout.sync_method: auto -> tensor for servers launched on GPUs the trainer's ranks hold (CUDA-IPC "
            "handles, as when the ranks fill the node), distributed on GPUs of their own or on a CPU")


def _check_data(data: DataConfig, section: str, model: ModelConfig) -> None:
    """The data loads and is not empty; prompts given as chat messages are rendered as they are (no
    data key adds to them) by a chat template (a model made by warm_start.make_model always has one)."""
    from megadiv.data.datasets import DatasetError

    try:
        dataset = load_dataset(data)
    except (DatasetError, OSError) as e:
        raise ConfigError(f"{section}: {e}") from None
    if len(dataset) == 0:
        raise ConfigError(f"{section}: {data.path or f'{data.name}/{data.split}'} holds no records")
    if any(r.messages for r in dataset):
        try:
            check_message_prompts(data)
        except ValueError as e:
            raise ConfigError(f"{section}: {e}") from None
        if model.has_checkpoint() and not chat_template_text(model.hf_dir):
            raise ConfigError(f"{section}: the prompts of {data.path} are chat messages, and the tokenizer of "
                              f"model.hf_dir={model.hf_dir} has no chat template to render them")


def _check_writable(path: Path, key: str) -> None:
    """``path`` exists as a writable directory, or can be created (its nearest existing ancestor is
    a writable directory). Creates nothing."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}: {probe} is not a directory, so {path} cannot be created")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot write in {probe} ({e.strerror or e})") from None


def _check_model_dir(hf_dir: Path, cfg: TrainConfig, check_weights: bool) -> None:
    """config.json parses and describes a supported model (one megadiv maps to megatron, at the
    configured expert parallelism, or with the DeepSpeed backend any model transformers knows);
    the safetensors files are complete and, for megatron, hold every tensor of that model with
    its shape."""
    from megadiv.models.families import arch_from_hf_config
    from megadiv.models.hf_config import load_hf_config
    from megadiv.models.loading import SafetensorsCheckpoint, WeightMismatchError, check_checkpoint

    backend = cfg.model.backend
    if backend == "deepspeed":
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(hf_dir)
        except (ValueError, KeyError, OSError) as e:
            raise ConfigError(f"model.hf_dir: transformers cannot read {hf_dir}/config.json: {e}") from None
    else:
        arch = arch_from_hf_config(load_hf_config(hf_dir))
        _check_experts(arch, hf_dir, cfg)
    if not check_weights:
        return
    try:
        ckpt = SafetensorsCheckpoint(hf_dir)  # opening checks each file's header against its size
        try:
            if backend == "megatron":
                check_checkpoint(ckpt, arch)
        finally:
            ckpt.close()
    except WeightMismatchError as e:
        raise ConfigError(f"model.hf_dir: {e}") from None


def _check_experts(arch, hf_dir: Path, cfg: TrainConfig) -> None:
    """The expert-parallel layout suits the model (models.builder.check_expert_parallel), and a
    mixture-of-experts model trains without FP8 and on padded micro-batches (docs/models.md,
    Mixture of experts); routing replay needs experts, and R3 an engine that returns its routing."""
    from megadiv.models.builder import check_expert_parallel

    p = cfg.parallel
    try:
        check_expert_parallel(arch, p.tensor_parallel, p.expert_parallel, p.sequence_parallel, p.expert_tensor_parallel)
    except ConfigError as e:
        raise ConfigError(f"model.hf_dir={hf_dir}: parallel.{e}") from None
    if not arch.is_moe:
        if cfg.model.moe_aux_loss_coeff > 0:
            raise ConfigError(f"model.moe_aux_loss_coeff={cfg.model.moe_aux_loss_coeff} weights a mixture-of-experts "
                              f"model's load-balancing loss; model.hf_dir={hf_dir} is {arch.family} (dense)")
        if cfg.grpo.routing_replay != "none":
            raise ConfigError(f"grpo.routing_replay={cfg.grpo.routing_replay} needs a mixture-of-experts model; "
                              f"model.hf_dir={hf_dir} is {arch.family} (dense)")
        return
    if cfg.grpo.routing_replay == "r3":
        from megadiv.rollout import resolve_engine_name

        engine = resolve_engine_name(cfg.rollout)
        if engine != "embedded":
            raise ConfigError(f"grpo.routing_replay=r3 replays the rollout engine's routing, which only the embedded "
                              f"engine returns (SGLang's routing capture is not wired: docs/models.md); "
                              f"rollout.engine={cfg.rollout.engine} runs {engine} here: use r2 or "
                              f"rollout.engine=embedded")
    if cfg.model.fp8 != "none":
        raise ConfigError(f"model.fp8={cfg.model.fp8} with a mixture-of-experts model ({arch.family}) is not supported "
                          f"(docs/models.md, Mixture of experts): use model.fp8=none")
    if cfg.grpo.pack_sequences:
        raise ConfigError(f"grpo.pack_sequences=true with a mixture-of-experts model ({arch.family}): its "
                          f"micro-batches run padded (router statistics and routing replay read padded positions); "
                          f"leave it unset")


def _resume_notes(cfg: TrainConfig, run_dir: Path, checksums: bool) -> list[str]:
    from megadiv.models.checkpoint import CheckpointError
    from megadiv.trainer.checkpoint import check_resumed_mirror_map, resume_point

    try:
        path, skipped = resume_point(run_dir, cfg.parallel, checksums)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.resume=auto: {e}") from None
    if path is not None:
        check_resumed_mirror_map(cfg.loss, run_dir)
    return skipped + ([f"resumes from {path}"] if path is not None else [])
