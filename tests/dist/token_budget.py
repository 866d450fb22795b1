"""Rank bodies for tests/test_token_budget.py: token-budget micro-batches against the padded path on
real megatron-core (gloo), the same rows, the same weights, in one process."""
from __future__ import annotations

import torch

from megadiv.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import DIVERGENCES, PolicyLossConfig
from megadiv.parallel import initialize
from megadiv.policy.batches import row_lengths
from megadiv.policy.objectives import grpo_objective
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.megatron import Policy

# Response lengths vary 10x (3..30 tokens). At DP=2 replica 0 holds the long rows and replica 1
# the short ones, so the replicas form different numbers of micro-batches under the budget.
RESPONSE_LENGTHS = [30, 28, 25, 3, 4, 5, 3, 12]
PROMPT_LENGTHS = [3, 5, 4, 6, 2, 3, 5, 4]
BUDGET, ROW_CAP, PADDED_MBS = 64, 4, 2
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def skewed_batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, 90, (n,), generator=g).tolist()  # noqa: E731
    rows = len(RESPONSE_LENGTHS)
    return SequenceBatch.pack([draw(n) for n in PROMPT_LENGTHS], [draw(n) for n in RESPONSE_LENGTHS], pad_id=0,
                              advantages=torch.randn(rows, generator=g))


def _one_step(actor: Policy, reference: Policy, batch: SequenceBatch, loss: PolicyLossConfig, regularizer) -> dict:
    """Reference and old log-probs, two SGD steps, the updated log-probs and weights."""
    batch = batch.rows(slice(0, len(batch)))
    mbs = PADDED_MBS if actor.max_tokens is None else ROW_CAP
    batch.logp_ref = reference.log_probs(batch, mbs)
    logp_old = actor.log_probs(batch, mbs)
    batch.logp_old = None if logp_old is None else logp_old - 0.05 * batch.loss_mask.to(logp_old.device)  # ratios != 1
    # two steps: at the second the actor has moved away from the reference (KL, regulariser > 0)
    steps = [actor.train_step(batch, grpo_objective(loss), mbs, regularizer=regularizer, reference=reference)
             for _ in range(2)]
    return {"steps": steps, "logp_ref": batch.logp_ref, "logp_old": logp_old,
            "logp_after": actor.log_probs(batch, mbs),
            "weights": {name: t for bucket in actor.export_buckets(64 << 20) for name, t in bucket}}


def budget_vs_padded(ctx):
    """For every loss aggregation (and a full-vocabulary regulariser at PP=1): two steps from the
    same weights on this replica's rows, padded (micro_batch_size 2 in batch order, every row at
    the batch's width), grouped by length (the default: 2 rows each, longest first, each
    micro-batch at its own width) and under the token budget (as many rows as it holds)."""
    a = ctx.args
    parallel = ParallelConfig(tensor_parallel=a["tp"], pipeline_parallel=a["pp"], stage_layers=a.get("stage_layers"))
    info = initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=a["hf_dir"])
    per = len(RESPONSE_LENGTHS) // info.dp_size
    batch = skewed_batch().rows(slice(info.dp_rank * per, (info.dp_rank + 1) * per))
    optim = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0)  # clipped: seq-mean-token-sum losses are large
    paths = {"padded": dict(group_by_length=False), "grouped": {}, "budget": dict(max_tokens_per_micro_batch=BUDGET)}
    references = {path: Policy(model, parallel, "reference", temperature=0.7, **micro) for path, micro in paths.items()}
    runs = [(agg, None) for agg in AGGREGATIONS] + ([("token-mean", "full_prob_l2")] if a["pp"] == 1 else [])
    out = {"dp_size": info.dp_size, "lengths": row_lengths(batch.loss_mask).tolist(),
           "micro_batches": len(batch.by_token_budget(BUDGET, ROW_CAP)[0]),
           "packs_by_default": references["grouped"].pack_sequences}
    if info.world_size == 1:  # megatron's local layer spec here: packing (THD) is refused, not run unpacked
        try:
            Policy(model, parallel, "reference", max_tokens_per_micro_batch=BUDGET, pack_sequences=True)
        except ConfigError as e:
            out["pack_refused"] = str(e)
    for agg, regularizer in runs:
        loss = PolicyLossConfig(policy_loss="clip", kl_coef=0.1, loss_agg=agg, regularizer=regularizer,
                                regularizer_coef=0.5 if regularizer else 0.0)
        vocab_div = DIVERGENCES[regularizer](consume_base=True) if regularizer else None
        out[(agg, regularizer)] = {
            path: _one_step(Policy(model, parallel, "actor", optim, total_steps=1, temperature=0.7, **micro),
                            references[path], batch, loss, vocab_div)
            for path, micro in paths.items()}
    return out


def packed_vs_padded_on_gpu(ctx):
    """One GPU, Transformer Engine layers, bf16: the padded path, the token budget (each micro-batch
    at its own width) and the token budget with packed rows (THD, packed_seq_params), from the same
    weights: reference and old log-probs, two SGD steps, updated log-probs."""
    a = ctx.args
    parallel = ParallelConfig()
    initialize(parallel, seed=1)
    model = ModelConfig(hf_dir=a["hf_dir"], params_dtype="bfloat16", transformer_impl="transformer_engine")
    loss = PolicyLossConfig(policy_loss="clip", kl_coef=0.1)
    optim = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0)
    batch = skewed_batch()
    out = {"lengths": row_lengths(batch.loss_mask).tolist()}
    for path, micro in (("padded", dict(group_by_length=False)),
                        ("budget", dict(max_tokens_per_micro_batch=BUDGET, pack_sequences=False)),
                        ("packed", dict(max_tokens_per_micro_batch=BUDGET)),  # packed by default under TE
                        ("packed_rows", dict(pack_sequences=True))):  # micro_batch_size rows, no budget
        reference = Policy(model, parallel, "reference", temperature=0.7, **micro)
        actor = Policy(model, parallel, "actor", optim, total_steps=1, temperature=0.7, **micro)
        result = _one_step(actor, reference, batch, loss, None)
        result["packed"] = actor.pack_sequences and reference.pack_sequences
        out[path] = {k: ({n: t.float().cpu() for n, t in v.items()} if k == "weights" else
                         v.float().cpu() if isinstance(v, torch.Tensor) else v) for k, v in result.items()}
    return out
