"""Stream Hugging Face safetensors into this rank's Megatron parameters.

Every rank opens the safetensors files lazily (memory-mapped) and, parameter by parameter in
layer order, reads only the rows/columns of its own TP shard (``get_slice``) of its own PP
stage's layers: a 32B checkpoint is never materialised in one process. Before anything is read,
every rank checks the checkpoint's tensor names and shapes against the family table, so a
missing, extra or mis-shaped tensor stops all ranks with the same message.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import torch

from megadiv.models.families import Rule, plan
from megadiv.models.hf_config import ArchSpec
from megadiv.models.sharding import shard
from megadiv.progress import Progress

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the architecture (names and both shapes given)."""


def megatron_params(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) for every parameter this rank holds, in module order.

    Canonical names are the dist-checkpoint names with global layer indices: local-spec names
    are mapped through each layer's ``sharded_state_dict_keys_map`` (input_layernorm ->
    self_attention.linear_qkv.layer_norm_, the Transformer Engine spelling) and the local layer
    index is replaced by ``layer_number - 1`` (so PP stages, uneven splits and virtual stages all
    name layers globally); a MoE layer's experts as :func:`canonical_expert_name` names them."""
    for gpt in model.gpt_models:
        for name, p in gpt.named_parameters():
            if not name.startswith("decoder.layers."):
                yield name, p
        for layer in gpt.decoder.layers:
            keys_map = layer.submodules_config.sharded_state_dict_keys_map
            global_experts = getattr(layer.mlp, "local_expert_indices", None)
            for name, p in layer.named_parameters():
                if p.numel() == 0:  # empty placeholders (Transformer Engine's absent biases) hold no weights
                    continue
                for old, new in keys_map.items():
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if global_experts is not None:
                    name = canonical_expert_name(name, global_experts)
                yield f"decoder.layers.{layer.layer_number - 1}.{name}", p


_LOCAL_EXPERTS = "mlp.experts.local_experts."
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_expert_name(name: str, global_experts: list[int]) -> str:
    """A MoE layer's parameter ``name`` with its expert named by the global index: local expert i
    is expert ``global_experts[i]`` = ep_rank * local_experts + i (``mlp.local_expert_indices``).
    SequentialMLP (the local spec) holds ``mlp.experts.local_experts.{i}.linear_fc1.weight``,
    Transformer Engine's TEGroupedMLP ``mlp.experts.linear_fc1.weight{i}``, the same [rows, cols]
    tensor: both become ``mlp.experts.local_experts.{g}.linear_fc1.weight``. Other names pass."""
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        return f"{_LOCAL_EXPERTS}{global_experts[int(grouped[2])]}.{grouped[1]}.weight"
    if name.startswith(_LOCAL_EXPERTS):
        local, rest = name[len(_LOCAL_EXPERTS):].split(".", 1)
        return f"{_LOCAL_EXPERTS}{global_experts[int(local)]}.{rest}"
    return name


def rule_index(model) -> dict[str, tuple[Rule, int | None, int | None]]:
    """Canonical megatron name -> (rule, layer, expert) for every parameter the family defines."""
    return {rule.megatron_name(layer, expert): (rule, layer, expert)
            for rule in model.family.rules_for(model.arch) for layer, expert in rule.instances(model.arch)}


class SafetensorsCheckpoint:
    """Names, shapes and lazy slices of a (possibly sharded) HF safetensors checkpoint."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        index_file = hf_dir / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise WeightMismatchError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
        self._stack = ExitStack()
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = self._stack.enter_context(safe_open(str(hf_dir / f), framework="pt"))
            except Exception as e:  # safetensors' errors (a truncated file: "incomplete metadata") name no file
                self._stack.close()
                raise WeightMismatchError(f"{hf_dir / f}: cannot read it: {e}") from None
        self.file_of = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def slice(self, name: str):
        return self._handles[self.file_of[name]].get_slice(name)

    def close(self) -> None:
        self._stack.close()


def check_checkpoint(ckpt: SafetensorsCheckpoint, arch: ArchSpec) -> None:
    """Raise WeightMismatchError listing every missing, extra or mis-shaped tensor."""
    expected = {t.hf_name: t.shape for t in plan(arch)}
    present = set(ckpt.file_of)
    problems = [f"missing tensor {name} (expected shape {list(shape)})"
                for name, shape in expected.items() if name not in present]
    allowed = {"lm_head.weight"} if arch.tie_word_embeddings else set()  # tied duplicate, unused
    problems += [f"unexpected tensor {name} (shape {list(ckpt.shape(name))}) in the checkpoint"
                 for name in sorted(present - set(expected) - allowed) if not name.endswith(_IGNORED_SUFFIXES)]
    for name, shape in expected.items():
        if name in present and ckpt.shape(name) != shape:
            problems.append(f"tensor {name} has shape {list(ckpt.shape(name))}, expected {list(shape)} "
                            f"from config.json")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise WeightMismatchError(f"the {arch.family} checkpoint does not match its config.json:\n  "
                                  + "\n  ".join(problems[:20]) + more)


@torch.no_grad()
def load_hf_weights(model, hf_dir: str | Path) -> None:
    """Fill every parameter of ``model`` (a MegatronModel) with its TP shard from ``hf_dir`` (an
    expert's: its shard over the expert-tensor-parallel group)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    expert_rank = parallel_state.get_expert_tensor_parallel_rank()
    rules = rule_index(model)
    ckpt = SafetensorsCheckpoint(hf_dir)
    try:
        check_checkpoint(ckpt, model.arch)
        last_layer = None
        params = list(megatron_params(model))
        with Progress(f"loading weights from {hf_dir}", total=len(params), unit="tensor") as bar:
            for name, param in params:
                if name not in rules:
                    raise WeightMismatchError(f"megatron parameter {name} {list(param.shape)} has no entry in the "
                                              f"{model.family.name} weight table (megadiv/models/families.py)")
                rule, layer, expert = rules[name]
                names = rule.hf_names(layer, expert)
                part = shard(rule.layout, [ckpt.slice(n) for n in names], *((rank, tp) if expert is None else
                                                                              (expert_rank, etp)),
                             model.arch, model.padded_vocab_size)
                if tuple(part.shape) != tuple(param.shape):
                    raise WeightMismatchError(f"{name}: shard built from {names} has shape "
                                              f"{list(part.shape)}, the megatron parameter {list(param.shape)}")
                # NaN/Inf weights would train on as nan losses until sampling fails
                if not torch.isfinite(part).all():
                    raise WeightMismatchError(f"{Path(hf_dir) / ckpt.file_of[names[0]]}: tensor {', '.join(names)} "
                                              f"holds NaN or Inf values")
                param.copy_(part)
                bar.update()
                if layer is not None and layer != last_layer:
                    log.info("loaded layer %d/%d from %s", layer + 1, model.arch.num_layers, hf_dir)
                    last_layer = layer
    finally:
        ckpt.close()
