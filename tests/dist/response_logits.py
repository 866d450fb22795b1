"""Rank bodies for tests/test_response_logits.py: the policy's logits at the response positions only,
against the output layer applied to every position and the response positions picked afterwards
(what the policy computed before), on real megatron-core (gloo), the same weights and rows."""
from __future__ import annotations

import torch

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import DIVERGENCES, PolicyLossConfig
from megadiv.models.builder import unwrap
from megadiv.parallel import initialize, shutdown
from megadiv.policy.batches import ModelInput, SequenceBatch
from megadiv.policy.megatron import Policy
from megadiv.policy.objectives import grpo_objective

# name -> ParallelConfig fields; all run in one 2-rank launch, one after the other
LAYOUTS = {"tp2": dict(tensor_parallel=2),
           "dp2": dict(),
           "pp2": dict(pipeline_parallel=2, stage_layers=[2, 1]),
           "tp2-sp": dict(tensor_parallel=2, sequence_parallel=True)}
ROWS, BUDGET, ROW_CAP, MBS = 8, 96, 4, 2
SGD = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0)  # unclipped: the gradients are the loss's own


class FullLogitsPolicy(Policy):
    """The reference: the output layer at every position ([b, w, V/TP]), then the response rows."""

    @staticmethod
    def _forward(model: torch.nn.Module, x: ModelInput) -> torch.Tensor:
        out = model(x.tokens, x.positions, attention_mask=None, packed_seq_params=x.packed_seq_params)
        if not unwrap(model).post_process:
            return out
        return out.transpose(0, 1).flatten(0, 1)[x.index][None]  # megatron's [s, b] order, then the n rows


def batch() -> SequenceBatch:
    """Long prompts (8-20 tokens), short responses (1-6); the last two rows without response tokens
    (e.g. grpo.mask_truncated), so that a padded micro-batch holds no response position at all."""
    g = torch.Generator().manual_seed(0)
    draw = lambda lo, hi: torch.randint(1, 90, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()  # noqa: E731
    rows = SequenceBatch.pack([draw(8, 21) for _ in range(ROWS)], [draw(1, 7) for _ in range(ROWS)], pad_id=0,
                              advantages=torch.randn(ROWS, generator=g))
    rows.loss_mask[-2:] = 0
    return rows


def _run(policy_cls, model: ModelConfig, parallel: ParallelConfig, rows: SequenceBatch, budget, regularizer) -> dict:
    """Reference and old log-probs, two unclipped SGD steps (their metrics, and every gradient of
    this rank at the second, where the actor has moved away from the reference: KL and regulariser
    > 0), with and without a full-vocabulary regulariser."""
    micro = dict(temperature=0.7, max_tokens_per_micro_batch=budget)
    mbs = MBS if budget is None else ROW_CAP
    reference = policy_cls(model, parallel, "reference", **micro)
    actor = policy_cls(model, parallel, "actor", SGD, total_steps=1, **micro)
    rows = rows.rows(slice(0, len(rows)))
    rows.logp_ref = reference.log_probs(rows, mbs)
    logp_old = actor.log_probs(rows, mbs)
    rows.logp_old = None if logp_old is None else logp_old - 0.05 * rows.loss_mask  # ratios != 1: clipping
    loss = PolicyLossConfig(policy_loss="clip", kl_coef=0.1, regularizer=regularizer,
                            regularizer_coef=0.5 if regularizer else 0.0)
    vocab_div = DIVERGENCES[regularizer](consume_base=True) if regularizer else None
    steps = [actor.train_step(rows, grpo_objective(loss), mbs, regularizer=vocab_div, reference=reference)
             for _ in range(2)]
    grads = {name: p.main_grad.clone() for name, p in actor.chunks[0].named_parameters()}
    return {"steps": steps, "logp_ref": rows.logp_ref, "logp_old": logp_old, "grads": grads}


def response_vs_full(ctx):
    """For each layout: the padded path and the token budget (and a regulariser at PP=1), once
    with the policy's response-only logits and once with FullLogitsPolicy, from the same weights."""
    out = {}
    for name, fields in LAYOUTS.items():
        parallel = ParallelConfig(**fields)
        info = initialize(parallel, seed=1)
        per = ROWS // info.dp_size
        rows = batch().rows(slice(info.dp_rank * per, (info.dp_rank + 1) * per))
        model = ModelConfig(hf_dir=ctx.args["hf_dir"])
        runs = [(None, None), (BUDGET, None)] + ([(None, "full_prob_l2")] if info.pp_size == 1 else [])
        out[name] = {"dp_size": info.dp_size, "last_stage": info.is_last_stage, "mask": rows.loss_mask}
        for budget, regularizer in runs:
            out[name][(budget, regularizer)] = {
                path: _run(cls, model, parallel, rows, budget, regularizer)
                for path, cls in (("response", Policy), ("full", FullLogitsPolicy))}
        shutdown(keep_default_group=True)
    return out
