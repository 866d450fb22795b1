"""Rank bodies for tests/test_trainer_units.py: the trainer's Policy on real megatron-core."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import DIVERGENCES, PolicyLossConfig
from megadiv.parallel import initialize
from megadiv.policy.objectives import grpo_objective
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.megatron import Policy

ROWS = 8  # the global batch: every layout trains on these rows, each DP replica on its own slice
SGD = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0)
# Adam with eps = 1e-5, not the default 1e-8. Its first step moves a weight by lr * g / (|g| + eps),
# whose slope at g ~ 0 is lr / eps: at 1e-8 a gradient element that rounds to +1e-11 in one layout
# and to -1e-11 in another ends up to 1e-4 apart after three steps (observed 8.3e-5), so weight
# parity would hold only by luck of the summation order. At 1e-5 the slope is 100, and the steps
# are still Adam's normalised ones: median |w - w0| after three steps 1.46e-3 (1.54e-3 at 1e-8).
ADAM = OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, adam_eps=1e-5)
# run name -> optimizer; adam: Adam's default (megatron's plain optimizer at DP=1, its distributed
# one at DP > 1); adam_distributed: the distributed one at DP=1 too
OPTIMIZERS = {"sgd": SGD, "adam": ADAM, "adam_distributed": replace(ADAM, distributed_optimizer=True)}


def _batch(rows: int = ROWS) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (rows,), generator=g)]
    responses = [torch.randint(0, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 8, (rows,), generator=g)]
    return SequenceBatch.pack(prompts, responses, pad_id=0, advantages=torch.randn(rows, generator=g))


def policy_steps(ctx):
    """For each run in ``runs`` (loss aggregation, optimizer, optional full-vocabulary regulariser):
    three steps of a k3-clipped loss with a KL penalty on this replica's rows of the global batch,
    then a NaN step that must be skipped. The figures must not depend on the layout (per-token loss
    scaling over micro-batches and DP replicas, grad norms over TP shards and DP, metric reduction,
    the distributed optimizer over DP). ``model`` holds extra ModelConfig fields (recompute);
    ``threads`` the intra-op threads of each rank (torch.set_num_threads); ``rows`` the global
    batch (default ROWS, micro-batches of 2; more rows: 4 micro-batches); ``virtual_pipeline`` model
    chunks per pipeline rank (megatron's interleaved schedule)."""
    a = ctx.args
    if "threads" in a:
        torch.set_num_threads(a["threads"])
    parallel = ParallelConfig(tensor_parallel=a["tp"], pipeline_parallel=a["pp"], stage_layers=a.get("stage_layers"),
                              virtual_pipeline=a.get("virtual_pipeline"))
    info = initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=a["hf_dir"], **a.get("model", {}))
    rows = a.get("rows", ROWS)
    mbs = max(2, rows // 4)
    per_replica = rows // info.dp_size
    mine = slice(info.dp_rank * per_replica, (info.dp_rank + 1) * per_replica)
    out = {"dp_size": info.dp_size}
    for agg, optimizer, regularizer in a["runs"]:
        actor = Policy(model, parallel, "actor", OPTIMIZERS[optimizer], total_steps=3, temperature=0.7)
        reference = Policy(model, parallel, "reference", temperature=0.7)
        batch = _batch(rows).rows(mine)
        batch.logp_ref = reference.log_probs(batch, micro_batch_size=mbs)
        batch.logp_old = actor.log_probs(batch, micro_batch_size=mbs)
        loss = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.01, kl_coef=0.1, loss_agg=agg,
                                regularizer=regularizer, regularizer_coef=0.5 if regularizer else 0.0)
        vocab_div = DIVERGENCES[regularizer](consume_base=True) if regularizer else None
        steps = [actor.train_step(batch, grpo_objective(loss), micro_batch_size=mbs, regularizer=vocab_div,
                                  reference=reference) for _ in range(3)]
        weights = {name: t for bucket in actor.export_buckets(64 << 20) for name, t in bucket}
        # a NaN advantage makes every gradient NaN: the step must be skipped, the weights untouched
        before = [p.detach().clone() for p in actor.model.gpt_models[0].parameters()]
        bad = batch.rows(slice(0, len(batch)))
        bad.advantages = torch.full((len(batch),), float("nan"))
        skipped = actor.train_step(bad, grpo_objective(loss), micro_batch_size=mbs, regularizer=vocab_div,
                                   reference=reference)
        unchanged = all(torch.equal(x, p) for x, p in zip(before, actor.model.gpt_models[0].parameters()))
        # sum over the global batch of the updated policy's log-probs: each last stage sums its rows
        logp = actor.log_probs(batch, micro_batch_size=mbs)
        counted = logp is not None and info.tp_rank == 0  # each row once: its replica's TP rank 0, last stage
        logp_sum = torch.tensor(float((logp * batch.loss_mask).sum()) if counted else 0.0, dtype=torch.float64)
        dist.all_reduce(logp_sum)
        # the same in one requested micro-batch (the post-sync probe's call): the interleaved
        # schedule regroups the rows into a multiple of PP micro-batches
        whole = actor.log_probs(batch, micro_batch_size=len(batch))
        whole_sum = torch.tensor(float((whole * batch.loss_mask).sum()) if counted else 0.0, dtype=torch.float64)
        dist.all_reduce(whole_sum)
        gpt = actor.model.gpt_models[0]
        out[(agg, optimizer, regularizer)] = {
            "steps": steps, "skipped": skipped["skipped"], "unchanged": unchanged, "weights": weights,
            "logp_sum": float(logp_sum), "logp_sum_one_micro_batch": float(whole_sum), "chunks": len(actor.chunks),
            "threads": torch.get_num_threads(),
            "layers_here": len(gpt.decoder.layers),
            "recompute": (gpt.config.recompute_granularity, gpt.config.recompute_method,
                          gpt.config.recompute_num_layers),
            "optimizer": type(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0]).__name__}
    return out


def one_update_old_logprobs(ctx):
    """One update (SGD) on off-policy rows, as grpo.overlap trains them (rollout log-probs from other
    weights, truncated importance weights): once with ``logp_old`` from a forward pass of its own,
    once without (the training forward's log-probs, detached: grpo.py with one update per batch).
    Returns each one's step metrics and weights."""
    parallel = ParallelConfig(tensor_parallel=ctx.args["tp"])
    initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=ctx.args["hf_dir"])
    loss = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.01, tis_cap=2.0)
    out = {}
    for name in ("own_forward", "training_forward"):
        actor = Policy(model, parallel, "actor", SGD, total_steps=1, temperature=0.7)
        batch = _batch()
        noise = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
        batch.logp_rollout = (actor.log_probs(batch, micro_batch_size=2) + 0.6 * noise) * batch.loss_mask
        if name == "own_forward":
            batch.logp_old = actor.log_probs(batch, micro_batch_size=2)
        out[name] = {"step": actor.train_step(batch, grpo_objective(loss), micro_batch_size=2),
                     "weights": {n: t for bucket in actor.export_buckets(64 << 20) for n, t in bucket}}
    return out
