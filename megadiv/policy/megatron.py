"""The policy on this rank: megatron-core chunks, and for the actor DDP, optimizer and LR schedule.

Everything that touches megatron's pipeline schedule lives here, so the GRPO loop sees three calls:
``log_probs(batch)`` (forward only), ``train_step(batch, loss_cfg)`` (forward, backward, optimizer
step) and ``export_buckets()`` (weights for the rollout engine).

Sequences are [B, S] token rows (prompt + response, right-padded). Position t of a row predicts
token t+1, so every per-token tensor is [B, S] aligned with the *predicting* position:
``loss_mask[b, t] = 1`` when ``tokens[b, t+1]`` is a response token.

Micro-batches: rows grouped by length (longest first), each micro-batch fed at its own longest
row: ``micro_batch_size`` rows each by default (as many micro-batches, and no more memory, than
rows in batch order all padded to the batch's longest row, which the interleaved schedule keeps),
or as many as a token budget (``max_tokens_per_micro_batch``) holds, or packed without padding
(THD, Transformer Engine): batches.py. The losses are the same whichever way the rows are cut.

Logits only where a loss reads them: the last stage applies the output layer to the positions that
predict response tokens alone (megadiv.models.output), and log-probs, entropy and full-vocabulary
regularisers run on those logits; every other position of the [B, S] results is 0.

Loss scaling (the one Megatron-specific piece): megatron runs with ``calculate_per_token_loss``,
so each micro-batch's loss function returns an aggregation *numerator* and its share of the
*denominator* (tokens, sequences or B * L, depending on ``loss_agg``); megatron sums both over
micro-batches and data-parallel ranks and divides the gradients once. A token-mean over a batch
split into micro-batches and DP ranks is therefore exactly the token-mean over the whole batch.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megadiv.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import vocab_parallel
from megadiv.divergence.registry import VocabDivergence
from megadiv.models.builder import MegatronModel, build_model, runs_in_half_precision
from megadiv.models.output import logits_at
from megadiv.parallel import cpu_compat
from megadiv.policy.batches import ModelInput, SequenceBatch, round_up, row_lengths
from megadiv.policy.router_stats import RouterStats
from megadiv.policy.routing_replay import RoutingReplay

if TYPE_CHECKING:
    from megadiv.policy.objectives import LossFn

HF_SHARD_BYTES = 2 << 30  # safetensors file size of a Hugging Face export


class Policy:
    """One rank's share of a policy model. ``role='reference'`` builds a frozen copy without
    optimizer state; ``role='actor'`` adds Megatron DDP, the Megatron optimizer (distributed, i.e.
    sharded over DP, for Adam) and the LR schedule."""

    backend = "megatron"
    exports_per_replica = True
    """export_buckets is collective over one data-parallel replica's TP x PP ranks only: the other
    replicas hold the same weights and need not take part in a push. Not with expert parallelism
    (set per instance): the experts live on EP ranks, which are data-parallel ranks, so every
    rank takes part."""

    def __init__(self, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, role: str = "actor",
                 optim_cfg: OptimConfig | None = None, total_steps: int = 1, log_probs_chunk: int | None = None,
                 temperature: float = 1.0, max_tokens_per_micro_batch: int | None = None,
                 pack_sequences: bool | None = None, group_by_length: bool = True, routing_replay: bool = False):
        """``group_by_length=False``: micro-batches of ``micro_batch_size`` rows in batch order at
        the batch's width (what the interleaved schedule runs; the tests' padded reference).
        ``pack_sequences=None``: packed wherever Transformer Engine attention runs and the
        micro-batches are grouped by length (grpo.pack_sequences). ``routing_replay``: a
        mixture-of-experts actor's passes over a batch whose routing was recorded
        (``log_probs(record_routing=True)``) take those experts (routing_replay.py, R2)."""
        from megatron.core import parallel_state

        self.role = role
        self.exports_per_replica = parallel_cfg.expert_parallel == 1
        self.log_probs_chunk = log_probs_chunk
        self.temperature = temperature
        self.max_tokens = max_tokens_per_micro_batch
        # the interleaved schedule needs micro-batches of one shape (interleaved_rows)
        self.group_by_length = max_tokens_per_micro_batch is not None or (
            group_by_length and parallel_cfg.virtual_pipeline is None)
        if max_tokens_per_micro_batch is not None and parallel_cfg.expert_parallel > 1:
            raise ConfigError("grpo.max_tokens_per_micro_batch cannot be combined with parallel.expert_parallel > 1 "
                              "(the replicas would run different numbers of micro-batches)")
        if pack_sequences and not self.group_by_length:
            raise ConfigError("grpo.pack_sequences packs micro-batches grouped by length: not with "
                              "parallel.virtual_pipeline or group_by_length=False")
        overrides = {"calculate_per_token_loss": True}
        if self.group_by_length and parallel_cfg.pipeline_parallel > 1:
            # micro-batches of different shapes: the pipeline stages send each other the shape first
            overrides |= {"variable_seq_lengths": True}
        if routing_replay:
            overrides |= {"moe_enable_routing_replay": True}
        if model_cfg.fp8 == "delayed" and max_tokens_per_micro_batch is not None:
            # Delayed scaling all-reduces each layer's amax history at every micro-batch over
            # megatron's amax group, TP x DP; token budgets give the DP replicas different micro-batch
            # counts, so they would meet in different reductions and hang. Over TP only, each replica
            # keeps scales of its own (its weights are the same; only activation scales differ).
            overrides |= {"tp_only_amax_red": True}
        self.model: MegatronModel = build_model(model_cfg, role=role, parallel=parallel_cfg,
                                                config_overrides=overrides)
        runs_te = _runs_transformer_engine(self.model)
        # mixture of experts: padded micro-batches, the layout router statistics and routing replay
        # read positions in (and what the CPU tier verifies them on)
        moe = self.model.arch.is_moe
        self.pack_sequences = runs_te and self.group_by_length and not moe if pack_sequences is None else pack_sequences
        if pack_sequences and moe:
            raise ConfigError("grpo.pack_sequences=true with a mixture-of-experts model: its micro-batches run padded "
                              "(router statistics and routing replay read padded positions); leave it unset")
        if pack_sequences and not runs_te:
            raise ConfigError("grpo.pack_sequences needs the Transformer Engine layer spec (THD attention); this "
                              "model was built with megatron's local spec (no TE or no GPU here, or "
                              "model.transformer_impl=local)")
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        # the ranks that each hold a slice of every sequence between the attention blocks
        self.sequence_parallel_group = self.tp_group if parallel_cfg.sequence_parallel else None
        # the ranks megatron's token dispatcher gathers from (expert TP x EP: replicas of their own at EP > 1)
        self.expert_group = (parallel_state.get_expert_tensor_and_model_parallel_group()
                             if parallel_cfg.expert_parallel > 1 else None)
        self.vocab_start = tp_rank * self.model.padded_vocab_size // parallel_state.get_tensor_model_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.chunks = self.model.chunks
        # interleaved schedule (VPP): the micro-batch count must be a multiple of PP (interleaved_rows)
        self.interleave_stages = parallel_cfg.pipeline_parallel if parallel_cfg.virtual_pipeline else None
        # every tensor of a step is made on (or moved to) the device of the weights
        self.device = next(self.chunks[0].parameters()).device
        self.seq_multiple = sequence_multiple(model_cfg, parallel_cfg)
        self.optimizer = self.scheduler = None
        self.router_stats = self.routing_replay = None
        if routing_replay:
            if not self.model.arch.is_moe or self.pack_sequences:
                raise ConfigError("routing replay needs a mixture-of-experts model fed padded micro-batches "
                                  f"({model_cfg.hf_dir} is {self.model.arch.family}, packed: {self.pack_sequences})")
            self.routing_replay = RoutingReplay(self.model.chunks, self.model.arch.moe_router_topk,
                                                self.sequence_parallel_group)
        if role == "actor":
            self._init_training(optim_cfg or OptimConfig(), total_steps)
            if self.model.arch.is_moe:
                self.router_stats = RouterStats(self.chunks, self.model.arch.num_layers, self.device,
                                                self.sequence_parallel_group, replayed=routing_replay)

    def _init_training(self, optim: OptimConfig, total_steps: int) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.model.config
        # ZeRO-1 style sharding of optimizer state over DP (megatron's DistributedOptimizer keeps Adam
        # only); by default at DP > 1 only: at DP=1 it would shard nothing and its gloo collectives
        # throttle the CPU threads. Checkpoints convert between the two (trainer/checkpoint.py).
        use_distributed_optimizer = optim.shards_state(parallel_state.get_data_parallel_world_size())
        self.optim_name, self.use_distributed_optimizer = optim.optimizer, use_distributed_optimizer
        # gradients are reduced in float32, or in float64 for float64 weights (the layout parity
        # tests' precision; a float32 buffer would round every gradient to float32)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=config.params_dtype != torch.float64, use_distributed_optimizer=use_distributed_optimizer,
            average_in_collective=False)  # per-token loss: megatron divides by the global denominator
        self.chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
                       for chunk in self.model.chunks]
        self.model.chunks = self.chunks  # exporter and checkpoint see through DDP
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                            clip_grad=optim.clip_grad, bf16=config.bf16, fp16=config.fp16,
                            params_dtype=config.params_dtype,
                            use_distributed_optimizer=use_distributed_optimizer),
            self.chunks)
        self.scheduler = lr_scheduler(self.optimizer, optim, total_steps)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync

    # ------------------------------------------------------------------ forward passes

    def _micro_batches(self, batch: SequenceBatch, micro_batch_size: int
                       ) -> tuple[list[SequenceBatch], list[ModelInput], torch.Tensor | None]:
        """``batch``'s micro-batches (on the model's device), what the model reads for each, and
        the row order they hold (None: the batch order). Fixed: ``micro_batch_size`` rows each,
        all at the batch's width. Grouped by length: see SequenceBatch.by_token_budget, each at its
        own width (padded) or packed; ``micro_batch_size`` caps the rows."""
        width = round_up(batch.tokens.shape[1], self.seq_multiple)
        if not self.group_by_length:
            if self.interleave_stages is not None:
                # fixed-width micro-batches sum the same per-token terms however the rows are grouped
                micro_batch_size = interleaved_rows(len(batch), micro_batch_size, self.interleave_stages)
            micro = [mb.to(self.device) for mb in batch.micro_batches(micro_batch_size)]
            widths = self._expert_group_widths([width] * len(micro))
            return micro, [ModelInput.padded(mb, w) for mb, w in zip(micro, widths)], None
        # without a budget, the fixed micro-batches' own size: runs of micro_batch_size sorted rows
        # (rows x their longest <= micro_batch_size x the batch's width always holds)
        budget = self.max_tokens or micro_batch_size * width
        parts, order = batch.by_token_budget(budget, micro_batch_size, self.seq_multiple)
        micro = [mb.to(self.device) for mb in parts]
        if self.pack_sequences:
            inputs = [ModelInput.packed(mb, self.seq_multiple) for mb in micro]
        else:  # the rows come longest first: the first row's length is the micro-batch's
            widths = self._expert_group_widths([round_up(int(row_lengths(mb.loss_mask)[0]), self.seq_multiple)
                                                for mb in micro])
            inputs = [ModelInput.padded(mb, w) for mb, w in zip(micro, widths)]
        return micro, inputs, order.to(self.device)

    def _expert_group_widths(self, widths: list[int]) -> list[int]:
        """The widths the micro-batches run at: with expert parallelism each forward is collective
        over the expert-parallel group, whose ranks are data-parallel ranks with rows of their own,
        and megatron's allgather token dispatcher gathers equally many tokens from every rank; so
        micro-batch i runs at the widest i of the group (one all-reduce of the widths). The group
        must run equally many micro-batches (equal rows per replica, no token budget: checked
        here, which would otherwise be a collective mismatch or a hang)."""
        if self.expert_group is None:
            return widths
        counts = torch.tensor([len(widths), -len(widths)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.expert_group)
        if int(counts[0]) != -int(counts[1]):
            raise RuntimeError(f"expert-parallel ranks would run {-int(counts[1])} to {int(counts[0])} micro-batches "
                               f"in one pass: each forward is collective over them, so every rank needs as many")
        common = torch.tensor(widths, device=self.device)
        dist.all_reduce(common, op=dist.ReduceOp.MAX, group=self.expert_group)
        return common.tolist()

    def _run_schedule(self, batch: SequenceBatch, micro_batch_size: int, loss_func, forward_only: bool,
                      extra_forward=None, record_routing: bool = False) -> tuple[list[dict], torch.Tensor | None]:
        """Push ``batch`` through megatron's pipeline schedule; returns the last stage's per-micro-batch
        dicts (empty elsewhere) and the row order of the micro-batches (None: the batch order).
        ``loss_func(mb, x, logits, extra)`` gets the micro-batch on the model's device, its
        ModelInput ``x`` (padded to a multiple of ``seq_multiple``: FP8 / sequence-parallel shape
        rules) and the logit shard [1, n, V/TP] at x's n response positions (``_forward``);
        ``extra_forward(x)`` gets the ModelInput too. ``record_routing``: sets ``batch.routing``
        (with routing replay); a batch that has it is routed by it."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro, inputs, order = self._micro_batches(batch, micro_batch_size)

        # the routers' statistics: of the training passes only (router_stats.py)
        routers = self.router_stats if self.router_stats is not None and not forward_only else None
        replay, recorded = self.routing_replay, []

        def routed(mb: SequenceBatch, x: ModelInput):
            """This forward's experts: recorded, replayed (the batch's recorded ones), or the routers' own."""
            if replay is None:
                return nullcontext()
            if record_routing:
                return replay.recording(x, recorded)
            return replay.replaying(mb.routing, x) if mb.routing is not None else nullcontext()

        def forward_step(data_iterator, model):
            mb, x = next(data_iterator)
            with routers.reading(x.index) if routers is not None else nullcontext(), routed(mb, x):
                output = self._forward(model, x)
            extra = extra_forward(x) if (extra_forward is not None and self.is_last_stage) else None
            return output, partial(loss_func, mb, x, extra=extra)

        # the shape of the first micro-batch; the others' travel with them (variable_seq_lengths)
        rows, seq_len = inputs[0].tokens.shape
        data = list(zip(micro, inputs))
        # the interleaved schedule runs every micro-batch through each model chunk, reading it from
        # that chunk's own iterator (it asserts a list, one per chunk); the others take one iterator
        iterators = [iter(data) for _ in self.chunks] if len(self.chunks) > 1 else iter(data)
        context = torch.no_grad() if forward_only else torch.enable_grad()
        with context:
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators, model=self.chunks,
                num_microbatches=len(micro), seq_length=seq_len, micro_batch_size=rows,
                forward_only=forward_only)
        if record_routing and replay is not None:
            batch.routing = replay.assemble(recorded, order, batch.tokens.shape[1])
        return out, order

    @staticmethod
    def _forward(model: torch.nn.Module, x: ModelInput) -> torch.Tensor:
        """``model`` (one chunk) on ``x``: hidden states for the next pipeline stage, or on the
        last stage the logit shard [1, n, V/TP] at x's n positions that predict response tokens,
        in the model's precision (Float16Module's float32 upcast off: see :func:`tempered`)."""
        half = {"fp32_output": False} if runs_in_half_precision(model) else {}
        with logits_at(model, x.index), cpu_compat.paused():
            return model(x.tokens, x.positions, attention_mask=None, packed_seq_params=x.packed_seq_params, **half)

    def _token_log_probs(self, logits: torch.Tensor, x: ModelInput, with_entropy: bool,
                         inplace_backward: bool = False):
        """log p(tokens[t+1] | tokens[:t+1]) and entropy as [b, S] rows (x.to_rows: zeros but at
        the response positions), from the vocab shard [1, n, V/TP] at x's response positions.
        ``inplace_backward`` writes the gradient into the logits' storage (as megatron's cross
        entropy does): one [n, V/TP] buffer less, allowed when nothing else uses the logits."""
        kwargs = dict(group=self.tp_group, vocab_start=self.vocab_start, vocab_size=self.model.vocab_size,
                      chunk_size=self.log_probs_chunk, inplace_backward=inplace_backward)
        targets = x.targets[None]  # [1, n], as the logits
        if with_entropy:
            logp, ent = vocab_parallel.log_probs_and_entropy(logits, targets, **kwargs)
            return x.to_rows(logp), x.to_rows(ent)
        return x.to_rows(vocab_parallel.log_probs(logits, targets, **kwargs)), None

    def _tempered(self, logits: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        return tempered(logits, self.temperature if temperature is None else temperature)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def log_probs(self, batch: SequenceBatch, micro_batch_size: int, temperature: float | None = None,
                  record_routing: bool = False) -> torch.Tensor | None:
        """[B, S] log-probs of each response token at ``temperature`` (default: the rollout's) at
        the position that predicts it (0 elsewhere), on the last pipeline stage; None on the others.
        ``record_routing`` (with routing replay): also sets ``batch.routing``, the experts this
        pass routed each position to, which the later passes over the batch replay."""
        def loss_func(mb, x, logits, extra=None):
            logp, _ = self._token_log_probs(self._tempered(logits, temperature), x, with_entropy=False)
            return logits.new_zeros(()), torch.ones((), dtype=torch.int, device=logits.device), {"logp": logp}

        out, order = self._run_schedule(batch, micro_batch_size, loss_func, forward_only=True,
                                        record_routing=record_routing)
        if not self.is_last_stage:
            return None
        logp = torch.cat([o["logp"] for o in out])
        return logp if order is None else torch.empty_like(logp).index_copy_(0, order, logp)  # batch order

    def logits_for(self, x: ModelInput) -> torch.Tensor:
        """Logit shard [1, n, V/TP] of this rank at the response positions of what the actor's
        schedule feeds (on this model's device), without grad (reference model at PP=1 only)."""
        with torch.no_grad():
            return self._forward(self.chunks[0], x)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: SequenceBatch, loss_fn: "LossFn", micro_batch_size: int,
                   regularizer: VocabDivergence | None = None, reference: "Policy | None" = None) -> dict[str, float]:
        """One optimizer step of ``loss_fn`` (see objectives.py) on ``batch``. Skips the update, and
        reports ``skipped=1``, when any gradient is not finite. A full-vocabulary ``regularizer``
        D(pi_theta, pi_ref) is evaluated on the actor's and ``reference``'s logit shards (PP=1)."""
        def loss_func(mb, x, logits, extra=None):
            logits = self._tempered(logits)
            logp, ent = self._token_log_probs(logits, x, with_entropy=True, inplace_backward=regularizer is None)
            vocab_div = None
            if regularizer is not None:
                vocab_div = x.to_rows(regularizer(logits, self._tempered(extra), group=self.tp_group,
                                                  vocab_start=self.vocab_start, vocab_size=self.model.vocab_size))
            numerator, denominator, metrics = loss_fn(mb, logp, ent.detach(), vocab_div)
            denominator = torch.as_tensor(denominator, dtype=torch.float32, device=logits.device)
            return numerator, denominator.round().to(torch.int), weighted_metrics(metrics, denominator, mb.loss_mask)

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        extra = reference.logits_for if regularizer is not None else None
        out, _ = self._run_schedule(batch, micro_batch_size, loss_func, forward_only=False, extra_forward=extra)

        grad_norm = float("nan")
        finite = self._grads_finite()
        if finite:
            ok, norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            finite = bool(ok)
            grad_norm = float(norm) if norm is not None else grad_norm
        metrics = reduce_metrics(out, self.device)
        metrics.update(skipped=float(not finite), lr=self.optimizer.param_groups[0]["lr"], grad_norm=grad_norm)
        if self.router_stats is not None:
            metrics |= self.router_stats.metrics()
        return metrics

    def _grads_finite(self) -> bool:
        """All gradients of all ranks finite (one all-reduce): a NaN step is skipped, not applied."""
        flags = [torch.isfinite(p.main_grad).all() for c in self.chunks for p in c.parameters()
                 if p.requires_grad and getattr(p, "main_grad", None) is not None]
        ok = torch.stack(flags).all().float() if flags else torch.ones((), device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok > 0)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank allocates at its first step (Adam's two float32
        moments per parameter it updates, sharded over DP by the distributed optimizer); what
        a rollout server started beside it must leave free."""
        from megatron.core import parallel_state

        if self.optimizer is None or self.optim_name != "adam":
            return 0
        params = sum(p.numel() for c in self.chunks for p in c.parameters() if p.requires_grad)
        shards = parallel_state.get_data_parallel_world_size() if self.use_distributed_optimizer else 1
        return 8 * params // shards

    def export_buckets(self, bucket_bytes: int):
        from megadiv.models.export import iter_hf_weight_buckets

        return iter_hf_weight_buckets(self.model, bucket_bytes)

    def hf_weight_views(self) -> list[tuple[str, torch.Tensor]] | None:
        """The HF tensors as views of this rank's parameters where the layout allows, without
        communication (models.export.hf_weight_views), when this rank holds the whole model
        (TP = PP = EP = 1); None otherwise. What the embedded engine shares instead of a copy."""
        from megatron.core import parallel_state

        from megadiv.models.export import hf_weight_views

        whole = (parallel_state.get_tensor_model_parallel_world_size() == 1
                 and parallel_state.get_pipeline_model_parallel_world_size() == 1
                 and parallel_state.get_expert_model_parallel_world_size() == 1)
        return hf_weight_views(self.model) if whole else None

    def save_hf(self, out, template_dir: str, replace: bool = False) -> None:
        """Write the policy as a Hugging Face checkpoint (collective; rank 0 writes)."""
        from megadiv.models.convert import write_hf_checkpoint

        write_hf_checkpoint(self.model, out, template_dir, shard_bytes=HF_SHARD_BYTES, replace=replace)


def sequence_multiple(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> int:
    """What the sequence length fed to the model must be a multiple of: FP8 GEMMs (Transformer
    Engine) need the token count per rank a multiple of 16, sequence parallelism splits the
    sequence over the TP ranks; 16 x TP satisfies both."""
    tp = parallel_cfg.tensor_parallel
    if model_cfg.fp8 != "none":
        return 16 * tp
    return tp if parallel_cfg.sequence_parallel else 1


def interleaved_rows(rows: int, micro_batch_size: int, pipeline_parallel: int) -> int:
    """Rows per micro-batch for megatron's interleaved schedule (VPP) on ``rows`` rows: the largest
    size <= ``micro_batch_size`` that splits them into a multiple of ``pipeline_parallel``
    micro-batches (the schedule runs them in groups of PP and refuses a smaller remainder).
    ConfigError when there is none (fewer than PP rows, say)."""
    for size in range(min(micro_batch_size, rows), 0, -1):
        if rows % size == 0 and (rows // size) % pipeline_parallel == 0:
            return size
    raise ConfigError(f"{rows} rows do not split into a multiple of parallel.pipeline_parallel={pipeline_parallel} "
                      f"equal micro-batches, which the interleaved schedule (parallel.virtual_pipeline) needs")


def _runs_transformer_engine(model: MegatronModel) -> bool:
    """Whether the model's attention is Transformer Engine's (the one that reads THD packing)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer = next(m for m in model.gpt_models[0].modules() if isinstance(m, TransformerLayer))
    module = type(layer.self_attention.core_attention).__module__
    return module.startswith("megatron.core.extensions.transformer_engine")


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T: log-probs of the distribution the rollout engine sampled from (megadiv.rollout's
    convention), so that ratios to rollout log-probs are meaningful. At T = 1 (and 0, greedy, scored
    at 1) the shard stays as it is, bf16 included: the vocab-parallel kernels upcast it chunk by
    chunk, so no float32 copy of the [n, V/TP] shard (nor of its gradient) is made; otherwise it is
    divided in at least float32 (float64 logits stay float64)."""
    if temperature in (0.0, 1.0):
        return logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


def weighted_metrics(metrics: dict[str, torch.Tensor], denominator: torch.Tensor,
                     loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch's metrics for ``reduce_metrics``: loss/* metrics are numerators too, made
    per-micro-batch means here and weighted by the denominator; the other metrics are token means,
    weighted by the token count."""
    metrics = {k: v.detach() / denominator.clamp(min=1) if k.startswith("loss/") else v.detach()
               for k, v in metrics.items()}
    return metrics | {"_weight/loss": denominator, "_weight/tokens": loss_mask.sum()}


def reduce_metrics(out: list[dict], device: torch.device) -> dict[str, float]:
    """The last stages' micro-batch metrics over all DP replicas, known to every rank: ``*/max``
    and ``*/min`` by max and min, the others as weighted means. (TP ranks of a last stage hold
    identical values: their copies cancel out.) Two collectives per step, no more."""
    keys = [sorted(k for k in out[0] if not k.startswith("_")) if out else None]
    dist.broadcast_object_list(keys, src=dist.get_world_size() - 1)  # the last rank is a last stage
    keys = keys[0]
    weight_of = ["_weight/loss" if k.startswith("loss/") else "_weight/tokens" for k in keys]
    f64 = torch.float64  # the default group may be NCCL: device tensors on ``device``
    sign = torch.tensor([1.0 if k.endswith("/max") else -1.0 if k.endswith("/min") else 0.0 for k in keys],
                        dtype=f64, device=device)
    sums = torch.zeros(2, len(keys), dtype=f64, device=device)  # [weighted sum, weight] per key
    extreme = torch.full((len(keys),), -math.inf, dtype=f64, device=device)  # max of sign * value
    for o in out:
        values = torch.stack([o[k].double() for k in keys])
        w = torch.stack([o[wk].double() for wk in weight_of])
        sums[0] += values * w
        sums[1] += w
        extreme = torch.maximum(extreme, values * sign)
    dist.all_reduce(sums)
    dist.all_reduce(extreme, op=dist.ReduceOp.MAX)
    means = sums[0] / sums[1].clamp(min=1e-30)
    reduced = torch.where(sign != 0, extreme * sign, means)
    return {k: float(v) for k, v in zip(keys, reduced.tolist())}


def lr_scheduler(optimizer, optim: OptimConfig, total_steps: int):
    """Megatron's LR (and weight-decay) schedule over ``optimizer.param_groups``: linear warm-up,
    then constant/linear/cosine decay over the run's optimizer steps (both backends use it)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
