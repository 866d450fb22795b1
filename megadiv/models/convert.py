"""``megadiv convert``: Hugging Face safetensors <-> megatron-core distributed checkpoints.

    # small models: one process (TP = PP = 1)
    megadiv convert hf-to-megatron --hf-dir Qwen2.5-0.5B --out ckpt/qwen-mcore
    megadiv convert megatron-to-hf --ckpt-dir ckpt/qwen-mcore --hf-template Qwen2.5-0.5B --out qwen-hf
    # a training checkpoint (its model part; the optimizer state is not read)
    megadiv convert megatron-to-hf --ckpt-dir RUN/checkpoints/step_000100 --hf-template RUN/sft --out step100-hf
    # large models: TP x PP processes, each holding one shard (several nodes: docs/models.md)
    torchrun --nproc-per-node 8 -m megadiv.cli convert hf-to-megatron --hf-dir D --out D --tp 4 --pp 2

hf-to-megatron streams the safetensors files: every rank reads only its own TP shard of its own
pipeline stage's layers, then the ranks write one megatron-core distributed checkpoint (loadable
at any TP/PP). megatron-to-hf loads that checkpoint at --tp/--pp, gathers HF tensors bucket by
bucket (megadiv.models.export) and rank 0 writes each bucket as one safetensors file, plus the
index, config.json (dtype updated) and the template's tokenizer files. Missing, extra or
mis-shaped tensors stop the run naming the tensor and both shapes; outputs are written to
``<out>.partial`` and renamed at the very end. The verb's arguments: megadiv/cli/convert.py.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from megadiv.config import ConfigError, ModelConfig, ParallelConfig
from megadiv.models.checkpoint import CheckpointError, read_metadata
from megadiv.models.families import arch_from_hf_config
from megadiv.models.hf_config import load_hf_config

log = logging.getLogger("megadiv.convert")

# files of a HF checkpoint directory that are weights, not to be copied from the template
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|h5|msgpack)$|.*\.index\.json$")
DTYPES = ("float32", "bfloat16", "float16")


def hf_to_megatron(hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
                   stage_layers: list[int] | None = None, overwrite: bool = False, ep: int = 1) -> Path:
    """Stream ``hf_dir``'s safetensors into a megatron-core distributed checkpoint at ``out``,
    on TP x PP x EP ranks (this process's world; EP: each rank reads 1/EP of a mixture-of-experts
    model's experts); ``dtype`` None keeps the checkpoint's."""
    from megadiv.models.builder import build_model
    from megadiv.models.checkpoint import save_megatron_checkpoint

    arch = arch_from_hf_config(load_hf_config(hf_dir))
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} exists (use --overwrite)")
    parallel = _start(tp, pp, ep, arch.is_moe)
    model = build_model(ModelConfig(hf_dir=hf_dir, params_dtype=dtype or arch.dtype, transformer_impl="local"),
                        role="reference", parallel=parallel, stage_layers=stage_layers)
    written = save_megatron_checkpoint(model, out, overwrite=overwrite)
    log.info("wrote megatron checkpoint %s (TP=%d, PP=%d, %s)", written, tp, pp, model.config.params_dtype)
    return written


def megatron_to_hf(ckpt_dir: str, hf_template: str, out: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
                   shard_bytes: int = 2 << 30, ep: int = 1) -> Path:
    """Load the megatron checkpoint ``ckpt_dir`` at TP x PP x EP and write it as a Hugging Face
    directory ``out`` (config and tokenizer files from ``hf_template``), ``shard_bytes`` per file."""
    from megadiv.models.builder import build_model
    from megadiv.models.checkpoint import load_megatron_checkpoint

    meta = read_metadata(ckpt_dir)
    template = load_hf_config(hf_template)
    stored, given = arch_from_hf_config(meta["hf_config"]), arch_from_hf_config(template)
    diff = {k: (v, given.__dict__[k]) for k, v in stored.__dict__.items() if k != "dtype" and given.__dict__[k] != v}
    if diff:
        raise CheckpointError(f"--hf-template {hf_template} describes another architecture than {ckpt_dir}; "
                              f"(checkpoint, template) differ in {diff}")
    if Path(out).exists():
        raise FileExistsError(f"{out} exists")
    parallel = _start(tp, pp, ep, given.is_moe)
    model = build_model(ModelConfig(hf_dir=hf_template, params_dtype=dtype or meta["dtype"],
                                    transformer_impl="local"), role="reference", parallel=parallel,
                        load_weights=False)
    load_megatron_checkpoint(model, ckpt_dir)
    return write_hf_checkpoint(model, out, hf_template, shard_bytes)


def write_hf_checkpoint(model, out: str | Path, template_dir: str | Path, shard_bytes: int,
                        replace: bool = False) -> Path:
    """Collective: gather ``model`` bucket by bucket; rank 0 writes each bucket as one safetensors
    file (see write_hf_buckets)."""
    from megadiv.models.export import bucket_count, iter_hf_weight_buckets

    dtype = str(model.config.params_dtype).removeprefix("torch.")
    return write_hf_buckets(iter_hf_weight_buckets(model, shard_bytes), bucket_count(model, shard_bytes), out,
                            template_dir, model.hf_config, dtype, replace)


def write_hf_buckets(buckets, files: int, out: str | Path, template_dir: str | Path, hf_config: dict, dtype: str,
                     replace: bool = False) -> Path:
    """Collective: consume ``buckets`` (``files`` lists of (HF name, tensor), the same on every
    rank); rank 0 writes each as one safetensors file, then the index, config.json (``hf_config``
    with ``dtype``) and the template's other files, into ``<out>.partial``, renamed to ``out`` when
    complete (``replace``: an existing ``out`` is swapped out only then)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    writer = dist.get_rank() == 0
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    weight_map, total = {}, 0
    for k, bucket in enumerate(buckets):
        if not writer:
            continue
        name = "model.safetensors" if files == 1 else f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        tensors = {hf_name: t.cpu().contiguous() for hf_name, t in bucket}
        save_file(tensors, str(partial / name), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total += size
        weight_map.update(dict.fromkeys(tensors, name))
        log.info("[%d/%d] wrote %s (%d tensors, %.1f MiB)", k + 1, files, name, len(tensors), size / 2**20)
    if writer:
        if files > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for f in Path(template_dir).iterdir():
            if f.is_file() and f.name != "config.json" and not _WEIGHT_FILE.match(f.name):
                shutil.copy2(f, partial / f.name)
        config = dict(hf_config)
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if replace and out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old)
        else:
            partial.rename(out)
        log.info("wrote Hugging Face checkpoint %s (%.1f MiB)", out, total / 2**20)
    dist.barrier()
    return out


def parse_size(text: str) -> int:
    """'2GB' -> 2 * 2**30 (binary multiples; K/M/G/T with optional B or iB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot read size {text!r}; use e.g. 500MB or 2GB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _start(tp: int, pp: int, ep: int, moe: bool) -> ParallelConfig:
    """The layout a conversion builds its model at, initialised unless this process runs one
    already (which must be it). A mixture-of-experts model at TP > 1 is built with sequence
    parallelism (builder.check_expert_parallel; it changes no weight)."""
    import torch.distributed as dist

    from megadiv.parallel import info, initialize

    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                              sequence_parallel=moe and tp > 1)
    if dist.is_initialized():  # inside a running job: its layout must be the requested one
        have = info()
        if (have.tp_size, have.pp_size, have.ep_size) != (tp, pp, ep):
            raise ConfigError(f"--tp {tp} --pp {pp} --ep {ep} differs from the running job's TP={have.tp_size} "
                              f"PP={have.pp_size} EP={have.ep_size}")
        return parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp * ep:
        raise ConfigError(
            f"--tp {tp} --pp {pp} --ep {ep} needs {tp * pp * ep} processes, this run has {world}; launch it as "
            f"torchrun --nproc-per-node {tp * pp * ep} -m megadiv.cli convert ... (several nodes: docs/models.md)")
    initialize(parallel)
    return parallel
