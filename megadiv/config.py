"""Typed run configuration: frozen dataclasses, loaded from YAML with ``key.sub=value`` overrides.

Every component owns one frozen dataclass that validates itself in ``__post_init__``; the
sections every layer needs (parallel, model, optim, run) live here, the others next to their
component, and the run's top-level ``megadiv.trainer.config.TrainConfig`` holds one of each and
checks the combinations (TP must divide the attention heads, ...). Everything is checked when the config is loaded, before any process
group or model exists, and every error names the offending key (with the closest valid key for
typos)::

    cfg = load_config(TrainConfig, "examples/tiny/grpo.yaml", ["parallel.tensor_parallel=2"])

Defaults live in code; a YAML file only states what differs.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config that cannot run: unknown key, wrong type or impossible combination."""


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split. World size = tensor_parallel * pipeline_parallel * DP (data parallel);
    there is no context parallelism (docs/scaling.md says why)."""

    tensor_parallel: int = 1
    """Tensor-parallel ranks: each holds 1/TP of every weight matrix and of the vocabulary."""
    pipeline_parallel: int = 1
    """Pipeline stages: each holds a contiguous block of layers."""
    virtual_pipeline: int | None = None
    """Model chunks per pipeline rank (interleaved 1F1B); None disables interleaving."""
    stage_layers: list[int] | None = None
    """Transformer layers per pipeline stage, first to last (e.g. [7, 8, 8, 7]), for uneven splits;
    megatron needs equal middle stages. None: even, or the first and last stages take the rest."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the tensor-parallel group (needs tensor_parallel > 1)."""
    expert_parallel: int = 1
    """Expert-parallel ranks of a mixture-of-experts model: each holds num_experts / expert_parallel
    of every MoE layer's experts. With expert_tensor_parallel = TP they are data-parallel ranks (the
    data-parallel size must be a multiple); the rest of the model is replicated over them. With
    tensor_parallel > 1 sequence_parallel is required (docs/models.md, Mixture of experts)."""
    expert_tensor_parallel: int | None = None
    """Tensor parallelism inside each expert (megatron's expert_tensor_parallel_size): each expert's
    weights split over this many ranks. None: tensor_parallel (every weight split alike). Must
    divide tensor_parallel; below it, experts are wider per rank and the expert-parallel groups
    take tensor-parallel ranks too (expert_tensor_parallel x expert_parallel must divide
    tensor_parallel x DP), and expert_parallel > 1 is needed (docs/models.md)."""
    timeout_s: float = 600.0
    """Timeout of every collective; a dead peer fails the run after this long instead of hanging it."""
    allow_untested_megatron: bool = False
    """Let the CPU compatibility layer run on a megatron-core version it was not tested against."""

    def __post_init__(self):
        for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.virtual_pipeline is not None and (self.virtual_pipeline < 1 or self.pipeline_parallel < 2):
            raise ConfigError("parallel.virtual_pipeline needs pipeline_parallel >= 2 and a value >= 1")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tensor_parallel > 1")
        if self.stage_layers is not None and (len(self.stage_layers) != self.pipeline_parallel
                                              or min(self.stage_layers) < 1 or len(set(self.stage_layers[1:-1])) > 1):
            raise ConfigError(f"parallel.stage_layers={self.stage_layers} must give >= 1 layer to each of the "
                              f"parallel.pipeline_parallel={self.pipeline_parallel} stages, middle stages equal")
        if self.stage_layers is not None and self.virtual_pipeline is not None:
            raise ConfigError("parallel.stage_layers and parallel.virtual_pipeline cannot be combined")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be > 0, got {self.timeout_s}")
        etp = self.expert_tensor_parallel
        if etp is not None and (etp < 1 or self.tensor_parallel % etp):
            raise ConfigError(f"parallel.expert_tensor_parallel={etp} must divide parallel.tensor_parallel="
                              f"{self.tensor_parallel}")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def expert_tensor_parallel_size(self) -> int:
        """expert_tensor_parallel, None resolved to tensor_parallel."""
        return self.expert_tensor_parallel or self.tensor_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises ConfigError when the world does not split evenly."""
        if world_size % self.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tensor_parallel * "
                f"parallel.pipeline_parallel = {self.tensor_parallel} * {self.pipeline_parallel} = "
                f"{self.model_parallel_size}")
        data_parallel = world_size // self.model_parallel_size
        # megatron cuts the expert groups (ETP x EP x expert-DP) from each stage's TP x DP ranks
        expert_group = self.expert_tensor_parallel_size * self.expert_parallel
        if (self.tensor_parallel * data_parallel) % expert_group:
            raise ConfigError(
                f"parallel.expert_tensor_parallel x parallel.expert_parallel = {self.expert_tensor_parallel_size} x "
                f"{self.expert_parallel} does not divide the {self.tensor_parallel * data_parallel} ranks of a "
                f"pipeline stage (tensor_parallel {self.tensor_parallel} x {data_parallel} data-parallel, world size "
                f"{world_size}): expert groups are cut from them")
        return data_parallel


@dataclass(frozen=True)
class ModelConfig:
    """The network. When ``hf_dir`` holds a checkpoint, the architecture comes from its config.json
    and the fields below are ignored; otherwise they describe the model to create there
    (``warm_start.make_model``)."""

    hf_dir: str | None = None
    """Hugging Face checkpoint directory (config.json, safetensors, tokenizer). None with
    warm_start.make_model: the created model goes to run.output_dir/run.name/init."""
    backend: Literal["megatron", "deepspeed"] = "megatron"
    """Policy backend: megatron-core (TP/PP/DP, the families megadiv maps) or DeepSpeed ZeRO
    (any Hugging Face causal LM, data parallelism only; the deepspeed: section)."""
    num_layers: int = 2
    """Transformer layers of a model to create."""
    hidden_size: int = 64
    """Hidden width of a model to create."""
    num_attention_heads: int = 4
    """Attention heads of a model to create (TP must divide them)."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); None means as many as attention heads."""
    ffn_hidden_size: int = 256
    """MLP width of a model to create."""
    vocab_size: int = 128
    """Vocabulary of a model to create without a tokenizer (a created model takes its tokenizer's)."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) of a model to create."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Megatron weights (bf16 wraps the model in megatron's Float16Module). The Python
    API's build_model and megatron Policy also take float64 (CPU: the layout parity tests)."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: megatron's local spec (CPU), Transformer Engine (GPU); auto picks."""
    fp8: Literal["none", "delayed", "tensorwise", "mxfp8", "blockwise"] = "none"
    """FP8 recipe (Transformer Engine only): tensorwise and delayed need compute capability 8.9+,
    blockwise Hopper, mxfp8 Blackwell (megadiv/models/fp8.py). Sequences are padded to a multiple
    of 16 x TP for it."""
    recompute_granularity: Literal["none", "full", "selective"] = "none"
    """Megatron activation recompute (actor only): 'full' recomputes whole transformer layers in the
    backward pass, 'selective' only core attention; 'none' keeps every activation."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With 'full': 'uniform' checkpoints every group of recompute_num_layers layers, 'block' the
    first recompute_num_layers layers of each pipeline stage (the rest keep their activations)."""
    recompute_num_layers: int | None = None
    """With 'full': layers per checkpointed group ('uniform') or per stage ('block')."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the load-balancing loss (megatron's moe_aux_loss_coeff,
    its Switch loss E sum_e f_e P_e per layer and micro-batch). 0, the default, turns it off, as RL
    recipes for trained routers do; router/aux_loss logs its value either way. docs/models.md,
    Router settings."""

    def __post_init__(self):
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                    "max_position_embeddings"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size {self.hidden_size} is not divisible by "
                              f"model.num_attention_heads {self.num_attention_heads}")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model.num_attention_heads {self.num_attention_heads} is not divisible by "
                              f"model.num_query_groups {self.num_query_groups}")
        full = self.recompute_granularity == "full"
        if full != (self.recompute_method is not None) or full != (self.recompute_num_layers is not None):
            raise ConfigError("model.recompute_method and model.recompute_num_layers are set exactly when "
                              f"model.recompute_granularity is 'full' (got granularity "
                              f"{self.recompute_granularity!r}, method {self.recompute_method!r}, num_layers "
                              f"{self.recompute_num_layers!r})")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ConfigError(f"model.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.fp8 != "none" and self.transformer_impl == "local":
            raise ConfigError("model.fp8 needs model.transformer_impl 'transformer_engine' or 'auto'")

    def has_checkpoint(self) -> bool:
        return self.hf_dir is not None and (Path(self.hf_dir) / "config.json").is_file()

    def heads(self) -> tuple[int, int, int]:
        """(layers, attention heads, key/value heads), read from hf_dir's config.json when it exists."""
        if not self.has_checkpoint():
            return self.num_layers, self.num_attention_heads, self.num_query_groups or self.num_attention_heads
        path = Path(self.hf_dir) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_dir: cannot read {path} ({e}): truncated or damaged?") from None
        heads = hf["num_attention_heads"]
        return hf["num_hidden_layers"], heads, hf.get("num_key_value_heads") or heads


@dataclass(frozen=True)
class OptimConfig:
    optimizer: Literal["adam", "sgd"] = "adam"
    """Megatron's Adam (AdamW-style decoupled weight decay) or SGD."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the linear/cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR decay after warm-up, over all optimizer steps of the run (grpo.steps x epochs x mini-batches)."""
    distributed_optimizer: bool | None = None
    """Megatron backend, Adam: shard Adam's state over the data-parallel ranks with megatron's
    DistributedOptimizer (ZeRO-1). Unset: on for Adam at DP > 1, off at DP = 1, where there is
    nothing to shard and megatron's plain optimizer is faster (the distributed one still runs its
    collectives through gloo, which on CPU throttles the compute threads: docs/performance.md,
    Threads). Either way a checkpoint resumes at any DP size and with either optimizer (the state
    is converted on load, megadiv/trainer/checkpoint.py). true/false: that optimizer at every DP
    size. SGD has no state to shard: true is refused with it."""

    def __post_init__(self):
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim: need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, min_lr={self.min_lr})")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError("optim.adam_beta1 and optim.adam_beta2 must lie in [0, 1)")
        if self.clip_grad < 0 or self.warmup_steps < 0:
            raise ConfigError("optim.clip_grad and optim.warmup_steps must be >= 0")
        if self.distributed_optimizer and self.optimizer != "adam":
            raise ConfigError("optim.distributed_optimizer=true shards Adam's state; optim.optimizer=sgd has none")

    def shards_state(self, dp_size: int) -> bool:
        """Whether megatron's DistributedOptimizer holds the state at ``dp_size`` data-parallel
        ranks (Adam at DP > 1 unless switched off, at DP = 1 only when switched on)."""
        if self.optimizer != "adam":
            return False
        return dp_size > 1 if self.distributed_optimizer is None else self.distributed_optimizer


LoggerName = Literal["jsonl", "tensorboard", "wandb"]


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """The run directory is output_dir/name: metrics, checkpoints, summary, exported model. Also the
    name of the W&B run."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 1234
    """Seeds model init, megatron's RNG and the rollout sampling of each step (reproducible resume)."""
    loggers: tuple[LoggerName, ...] = ("jsonl", "tensorboard")
    """Where step metrics go (megadiv/trainer/loggers.py): jsonl (metrics.jsonl and summary.json,
    always written, listed or not), tensorboard (run_dir/tensorboard), wandb (Weights & Biases: the
    resolved config and summary too; WANDB_MODE=offline writes under run_dir/wandb; a resume
    continues the same W&B run; needs the wandb package)."""
    wandb_project: str = "megadiv"
    """W&B project of the run (run.loggers with wandb)."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the account's default (run.loggers with wandb)."""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags of the run (run.loggers with wandb)."""

    def __post_init__(self):
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"run.loggers lists a logger twice: {list(self.loggers)}")
        if "wandb" not in self.loggers:
            for key, default in (("wandb_project", "megadiv"), ("wandb_entity", None), ("wandb_tags", ())):
                if getattr(self, key) != default:
                    raise ConfigError(f"run.{key} applies when run.loggers includes wandb (run.loggers: "
                                      f"{list(self.loggers)})")


def check_model_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The model must split over the configured TP and PP sizes (checked before any process starts)."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    layers, heads, kv_heads = model.heads()
    if heads % tp:
        raise ConfigError(f"parallel.tensor_parallel={tp} does not divide the {heads} attention heads "
                          f"(model.num_attention_heads)")
    if kv_heads % tp:
        raise ConfigError(f"parallel.tensor_parallel={tp} does not divide the {kv_heads} key/value heads "
                          f"(model.num_query_groups); megatron-core needs one or more KV heads per rank")
    if layers < pp:
        raise ConfigError(f"parallel.pipeline_parallel={pp} exceeds the {layers} layers (model.num_layers)")
    if parallel.stage_layers is not None and sum(parallel.stage_layers) != layers:
        raise ConfigError(f"parallel.stage_layers={parallel.stage_layers} places {sum(parallel.stage_layers)} "
                          f"layers; the model has {layers}")
    if model.recompute_num_layers is not None and model.recompute_num_layers > layers:
        raise ConfigError(f"model.recompute_num_layers={model.recompute_num_layers} exceeds the {layers} layers")


# --------------------------------------------------------------------------- loading


def load_config(cls: type, paths: str | Path | list | None = None, overrides: list[str] = ()):
    """Defaults <- YAML files (merged left to right, nested sections key by key) <- ``key.sub=value``
    overrides, validated into ``cls``."""
    return from_dict(cls, merged_config(paths, overrides))


def merged_config(paths: str | Path | list | None = None, overrides: list[str] = ()) -> dict:
    """The YAML files merged left to right with the overrides applied, not yet validated."""
    data: dict = {}
    for path in [paths] if isinstance(paths, (str, Path)) else (paths or []):
        layer = read_yaml(path) or {}
        if not isinstance(layer, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = _merge(data, layer)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({' '.join(str(e).split())})") from None
        _set_dotted(data, key.strip(), parsed)
    return data


def read_yaml(path: str | Path):
    """Parse one YAML file; errors name the file (and the line and column of a syntax error)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None


def split_config_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Command-line positionals -> (YAML files, key=value overrides)."""
    return [a for a in args if "=" not in a], [a for a in args if "=" in a]


def _merge(base: dict, layer: dict) -> dict:
    out = dict(base)
    for key, value in layer.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def from_dict(cls: type, data: dict, prefix: str = "", root: type | None = None):
    """Build dataclass ``cls`` from a nested dict, checking keys and types; errors name the key.
    ``root`` is the top-level class, whose keys are searched for typo suggestions."""
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key in getattr(cls, "RETIRED_KEYS", {}):  # a section's removed keys, each with its replacement
            raise ConfigError(f"config key '{dotted}' is no longer taken: {cls.RETIRED_KEYS[key]}")
        if key not in names:
            dotted = _first_leaf(dotted, value)
            raise ConfigError(f"unknown config key '{dotted}'" + _suggestion(dotted, root))
        kwargs[key] = _coerce(hints[key], value, dotted, root)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        section = prefix.rstrip(".") or "config"
        message = str(e) if str(e).startswith(section) else f"{section}: {e}"
        raise ConfigError(message) from e


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key ``cls`` accepts (sections and leaves)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += valid_keys(hints[f.name], f"{prefix}{f.name}.")
    return keys


def _first_leaf(dotted: str, value) -> str:
    """'bogus' with value {'key': 1} -> 'bogus.key': name the key the user actually wrote."""
    while isinstance(value, dict) and len(value) == 1:
        (key, value), = value.items()
        dotted = f"{dotted}.{key}"
    return dotted


def _suggestion(dotted: str, root: type) -> str:
    close = difflib.get_close_matches(dotted, valid_keys(root), n=1, cutoff=0.6)
    if not close:  # compare the last part alone, e.g. 'parallel.tp_size' -> 'parallel.tensor_parallel'
        leaf = dotted.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in valid_keys(root)}
        close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(tp, value: Any, dotted: str, root: type):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, dotted, root)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{dotted}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{dotted}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{dotted}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, f"{dotted}[{i}]", root) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, f"{dotted}.", root)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-6 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{dotted}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):  # .nan / .inf pass every comparison check or none
        raise ConfigError(f"{dotted}: {value!r} is not a finite number")
    return value


def _set_dotted(data: dict, dotted: str, value) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value
