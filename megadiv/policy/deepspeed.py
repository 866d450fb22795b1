"""The policy on this rank under DeepSpeed ZeRO: any Hugging Face causal LM, data parallelism only.

The same interface as the Megatron policy (megatron.py), so the GRPO loop does not know which one
it holds (megadiv.trainer.backend.make_policy picks): ``log_probs``, ``train_step``,
``export_buckets``, ``logits_for``, ``save_hf``, ``save_state``/``load_state`` (checkpoint.py).

Every rank holds the whole vocabulary: log-probs, entropy and full-vocabulary divergences come
from the divergence library with ``group=None``. ZeRO 1/2/3 shard the optimizer state, the
gradients and the parameters over the data-parallel ranks (= all ranks); stage 3 gathers each
layer's parameters for its forward and backward, and the weight export gathers them bucket by
bucket, never the whole model.

The output layer runs from a micro-batch's first position that predicts a response token to the
end of the rows (Hugging Face's ``logits_to_keep``): the prompt positions before it, most of a row
when prompts are long, get no logits.

Loss scaling, as Megatron's per-token loss: with N_m the numerator of micro-batch m on rank r and
D_m its denominator (tokens, sequences or B * L, depending on ``loss_agg``), the gradient is

    g = sum_{r, m} dN_{r,m}/dtheta / D,    D = sum_{r, m} D_{r,m}

i.e. the configured aggregation over the whole batch. D depends on the loss masks alone, so it
is known before any forward pass (one all-reduce); each micro-batch's backward takes
N * dp / D, since DeepSpeed averages gradients over the dp ranks. The optimizer steps once, at the
accumulation boundary megadiv marks on the last micro-batch.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig
from megadiv.divergence import vocab_parallel
from megadiv.divergence.registry import VocabDivergence
from megadiv.models.checkpoint import CheckpointError
from megadiv.models.hf_config import load_hf_config
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.deepspeed_config import DeepSpeedConfig, engine_config
from megadiv.policy.megatron import HF_SHARD_BYTES, lr_scheduler, reduce_metrics, tempered, weighted_metrics

if TYPE_CHECKING:
    from megadiv.policy.objectives import LossFn

CHECKPOINT_TAG = "deepspeed"  # run_dir/checkpoints/step_N/deepspeed/: DeepSpeed's own files
# config.json keys of dropout probabilities (zeroed, as megatron's builder does: log-probs of the
# policy must be those of the model the engine samples from, with no noise in training mode)
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")


class DeepSpeedPolicy:
    """A Hugging Face causal LM in a DeepSpeed engine. ``role='actor'``: ZeRO engine with torch's
    AdamW (or SGD with momentum 0.9), the update rule megatron uses on CPU, and megatron's LR
    schedule. ``role='reference'``: frozen, no optimizer state; under ZeRO-3 an inference-only
    engine with partitioned parameters, otherwise the plain module."""

    backend = "deepspeed"
    exports_per_replica = False
    """Under ZeRO-3 every rank holds a shard of each parameter: the export gathers over all ranks."""

    def __init__(self, model_cfg: ModelConfig, ds_cfg: DeepSpeedConfig, role: str = "actor",
                 optim_cfg: OptimConfig | None = None, total_steps: int = 1, log_probs_chunk: int | None = None,
                 temperature: float = 1.0):
        import deepspeed
        from deepspeed.utils import logger as deepspeed_logger
        from transformers import AutoConfig

        from megadiv.parallel import info

        deepspeed_logger.setLevel(logging.WARNING)  # its INFO lines (config dumps per engine) bury the progress line
        if role not in ("actor", "reference"):
            raise ValueError(f"role must be 'actor' or 'reference', got {role!r}")
        self.role, self.ds_cfg = role, ds_cfg
        self.log_probs_chunk, self.temperature = log_probs_chunk, temperature
        self.hf_dir = model_cfg.hf_dir
        self.device = info().device  # where the engine computes (its parameters may sit in host memory)
        self.hf_config = AutoConfig.from_pretrained(model_cfg.hf_dir)
        for key in DROPOUT_KEYS:
            if isinstance(getattr(self.hf_config, key, None), float):
                setattr(self.hf_config, key, 0.0)
        self.dtype = getattr(torch, model_cfg.params_dtype)
        module = self._load(model_cfg.hf_dir)
        self.optimizer = self.scheduler = None
        if role == "actor":
            if ds_cfg.gradient_checkpointing:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.optim_cfg = optim_cfg or OptimConfig()
            self.optimizer = _torch_optimizer(module, self.optim_cfg)
            self.engine, *_ = deepspeed.initialize(model=module, optimizer=self.optimizer,
                                                   config=engine_config(ds_cfg, model_cfg, self.optim_cfg),
                                                   dist_init_required=False)
            self.scheduler = lr_scheduler(self.optimizer, self.optim_cfg, total_steps)
            self.module = self.engine.module
        elif ds_cfg.zero_stage == 3:  # parameters partitioned as the actor's, no optimizer
            module.requires_grad_(False)
            self.engine, *_ = deepspeed.initialize(model=module, config=engine_config(ds_cfg, model_cfg, None),
                                                   dist_init_required=False)
            self.module = self.engine.module
        else:
            self.engine = self.module = module.to(self.device).requires_grad_(False)
        self.module.eval()  # train_step switches to train mode: HF's activation checkpointing acts only there

    def _load(self, hf_dir: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        # Loaded whole on every rank, then partitioned by the engine under ZeRO-3: deepspeed.zero.Init
        # around transformers 5.x from_pretrained fails in the weight init of Qwen2 (padding row of a
        # partitioned embedding), so a model must fit in one rank's host memory to start.
        module = AutoModelForCausalLM.from_pretrained(hf_dir, config=self.hf_config, dtype=self.dtype)
        # Hugging Face embeddings built with padding_idx=pad_token_id never pass a gradient to the pad
        # token's row, even where that token is real text (Qwen's pad is <|endoftext|>, also its EOS).
        # Padding never reaches a loss here (right-padded rows, causal attention, masked targets), so
        # the row trains like any other, as in megatron's embedding. The forward is unchanged.
        embedding = module.get_input_embeddings()
        if isinstance(embedding, torch.nn.Embedding):
            embedding.padding_idx = None
        return module

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def zero3(self) -> bool:
        return self.ds_cfg.zero_stage == 3

    # ------------------------------------------------------------------ forward passes

    def _logits(self, mb: SequenceBatch) -> torch.Tensor:
        """[b, k, V] logits of the last k positions of ``mb``'s right-padded rows, from the first
        that predicts a response token on (causal attention: padding never reaches the positions
        before it, as in megatron's forward without an attention mask)."""
        return self.engine(input_ids=mb.tokens, use_cache=False, logits_to_keep=_response_span(mb.loss_mask)).logits

    def _token_log_probs(self, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool,
                         inplace_backward: bool = False):
        """log p(tokens[t+1] | tokens[:t+1]) and entropy as [b, s] rows from the logits [b, k, V] of
        the last k positions; 0 before them. The last position (no next token) gets the last token
        as a target and is masked by every loss."""
        k = logits.shape[1]
        target = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)[:, -k:]
        kwargs = dict(group=None, vocab_size=self.vocab_size, chunk_size=self.log_probs_chunk,
                      inplace_backward=inplace_backward)
        width = tokens.shape[1]
        if with_entropy:
            logp, ent = vocab_parallel.log_probs_and_entropy(logits, target, **kwargs)
            return _rows(logp, width), _rows(ent, width)
        return _rows(vocab_parallel.log_probs(logits, target, **kwargs), width), None

    def log_probs(self, batch: SequenceBatch, micro_batch_size: int,
                  temperature: float | None = None) -> torch.Tensor:
        """[B, S] log-probs of each next token at ``temperature`` (default: the rollout's), on
        every rank (collective under ZeRO-3)."""
        t = self.temperature if temperature is None else temperature
        with torch.no_grad():
            return torch.cat([self._token_log_probs(tempered(self._logits(mb), t), mb.tokens, False)[0]
                              for mb in (m.to(self.device) for m in batch.micro_batches(micro_batch_size))])

    def logits_for(self, mb: SequenceBatch) -> torch.Tensor:
        """Logits [b, k, V] for the micro-batch ``mb`` (on this model's device) where the actor
        computes them, without grad."""
        with torch.no_grad():
            return self._logits(mb)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: SequenceBatch, loss_fn: "LossFn", micro_batch_size: int,
                   regularizer: VocabDivergence | None = None,
                   reference: "DeepSpeedPolicy | None" = None) -> dict[str, float]:
        """One optimizer step of ``loss_fn`` on ``batch`` (see the module doc for the scaling);
        skips the update, and reports ``skipped=1``, when a gradient is not finite."""
        micro = [mb.to(self.device) for mb in batch.micro_batches(micro_batch_size)]
        total = torch.stack([_denominator(loss_fn, mb, regularizer) for mb in micro]).sum()
        dist.all_reduce(total)
        scale = dist.get_world_size() / total.clamp(min=1)
        self.module.train()
        out = []
        for i, mb in enumerate(micro):
            self.engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            logits = tempered(self._logits(mb), self.temperature)
            logp, ent = self._token_log_probs(logits, mb.tokens, with_entropy=True,
                                              inplace_backward=regularizer is None)
            vocab_div = None
            if regularizer is not None:
                vocab_div = _rows(regularizer(logits, tempered(reference.logits_for(mb), self.temperature),
                                              vocab_size=self.vocab_size), mb.tokens.shape[1])
            numerator, denominator, metrics = loss_fn(mb, logp, ent.detach(), vocab_div)
            self.engine.backward(numerator * scale, scale_wrt_gas=False)
            denominator = torch.as_tensor(denominator, dtype=torch.float32, device=self.device)
            out.append(weighted_metrics(metrics, denominator, mb.loss_mask))
        self.module.eval()
        finite, grad_norm = self._step()
        metrics = reduce_metrics(out, self.device)
        metrics.update(skipped=float(not finite), lr=self.optimizer.param_groups[0]["lr"], grad_norm=grad_norm)
        return metrics

    def _step(self) -> tuple[bool, float]:
        """Clip and step unless a gradient is not finite; (applied, gradient norm before clipping).
        ZeRO's optimizers (and DeepSpeed's bf16 one) check the norm themselves and skip; at
        ZeRO-0 in float32 the engine steps torch's optimizer directly, on gradients already
        averaged over the ranks at the boundary, so the check is made here."""
        if hasattr(self.engine.optimizer, "overflow"):
            self.engine.step()
            applied = self.engine.was_step_applied()
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if applied and norm is not None else float("nan")
        else:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            applied, grad_norm = bool(torch.isfinite(norm)), float(norm)
            if applied:
                self.engine.step()
            else:
                self.engine.zero_grad()
                grad_norm = float("nan")
        if applied:
            self.scheduler.step(increment=1)
        return applied, grad_norm

    def optimizer_state_bytes(self) -> int:
        """Bytes of Adam state (two float32 moments per parameter) this rank keeps on its device:
        sharded over the ranks from ZeRO-1 on, none when offloaded to host memory."""
        if self.optimizer is None or self.optim_cfg.optimizer != "adam" or self.ds_cfg.offload_optimizer != "none":
            return 0
        params = sum(_numel(p) for p in self.module.parameters() if p.requires_grad)
        shards = dist.get_world_size() if self.ds_cfg.zero_stage >= 1 else 1
        return 8 * params // shards

    # ------------------------------------------------------------------ weights out

    def export_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (HF name, full tensor) of about ``bucket_bytes`` each, in the module's order
        (tied weights once, under the name Hugging Face keeps), the same on every rank. Under
        ZeRO-3 each bucket's parameters are gathered for the copy and released before it is
        yielded (collective); the tensors are fresh copies."""
        import deepspeed

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        for bucket in self._buckets(bucket_bytes):
            params = [p for _, p in bucket]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.zero3):
                copies = [(name, p.detach().clone()) for name, p in bucket]
            yield copies

    def hf_weight_views(self) -> None:
        """None: the embedded engine keeps a copy (a ZeRO engine's parameters may be partitioned,
        flattened or of another dtype than the engine's; sharing them is not implemented)."""
        return None

    def _buckets(self, bucket_bytes: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
        buckets, size = [[]], 0
        for name, p in self.module.named_parameters():
            nbytes = _numel(p) * p.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, p))
            size += nbytes
        return buckets

    def save_hf(self, out, template_dir: str, replace: bool = False) -> None:
        """Write the policy as a Hugging Face checkpoint (collective; rank 0 writes)."""
        from megadiv.models.convert import write_hf_buckets

        write_hf_buckets(self.export_buckets(HF_SHARD_BYTES), len(self._buckets(HF_SHARD_BYTES)), out, template_dir,
                         load_hf_config(self.hf_dir), str(self.dtype).removeprefix("torch."), replace)

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, path: Path, trainer_state: dict) -> None:
        """DeepSpeed's own checkpoint of the engine (module, optimizer, ZeRO partitions) under
        ``path/deepspeed``, with the LR schedule and ``trainer_state`` (collective)."""
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, save_latest=False,
                                    client_state={"scheduler": self.scheduler.state_dict(), "trainer": trainer_state})

    def load_state(self, path: Path) -> dict:
        """Restore what ``save_state`` wrote; returns the trainer state."""
        loaded, client = self.engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                     load_lr_scheduler_states=False, load_module_strict=True)
        if loaded is None or client is None:
            raise CheckpointError(f"{path}/{CHECKPOINT_TAG} holds no DeepSpeed checkpoint this engine can load")
        self.scheduler.load_state_dict(client["scheduler"])
        return client["trainer"]

    def checkpoint_files(self, world_size: int) -> list[str]:
        """The files ``save_state`` leaves on ``world_size`` ranks (DeepSpeed's naming): the module
        (one file, or one partition per rank under ZeRO-3) and the ZeRO optimizer partitions."""
        ranks = range(world_size)
        model = ([f"{CHECKPOINT_TAG}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if self.zero3
                 else [f"{CHECKPOINT_TAG}/mp_rank_00_model_states.pt"])
        bf16 = "bf16_" if self.dtype == torch.bfloat16 else ""
        optim = ([f"{CHECKPOINT_TAG}/{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks]
                 if self.ds_cfg.zero_stage else [])
        return model + optim


def _response_span(loss_mask: torch.Tensor) -> int:
    """Positions from the first that predicts a response token in any row to the end of the rows
    (all of them when none does): Hugging Face's ``logits_to_keep``."""
    first = int((loss_mask > 0).any(0).int().argmax())  # 0 when no position does
    return loss_mask.shape[1] - first


def _rows(values: torch.Tensor, width: int) -> torch.Tensor:
    """[b, k] values of the last k positions -> [b, width] rows, zeros before them."""
    return torch.nn.functional.pad(values, (width - values.shape[1], 0))


def _denominator(loss_fn: "LossFn", mb: SequenceBatch, regularizer) -> torch.Tensor:
    """The micro-batch's aggregation denominator, which depends on its loss mask alone
    (objectives.py): the loss function evaluated on zero log-probs, before the forward pass."""
    zeros = torch.zeros_like(mb.loss_mask)
    _, denominator, _ = loss_fn(mb, zeros, zeros, zeros if regularizer is not None else None)
    return torch.as_tensor(denominator, dtype=torch.float32, device=mb.loss_mask.device)


def _torch_optimizer(module: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """torch's AdamW or SGD (momentum 0.9), megatron's update rules on CPU, with megatron's
    parameter groups: no weight decay on biases and 1-D parameters (norms)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = [g for g in ({"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}) if g["params"]]
    if optim.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                                 weight_decay=optim.weight_decay)
    return torch.optim.SGD(groups, lr=optim.lr, momentum=0.9, weight_decay=optim.weight_decay)


def _numel(p: torch.nn.Parameter) -> int:
    return getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions leave p.numel() == 0

