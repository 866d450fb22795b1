"""Rank bodies for tests/test_trainer_units.py: the trainer's Policy on real megatron-core."""
from __future__ import annotations

import torch

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import DIVERGENCES, PolicyLossConfig
from megadiv.parallel import initialize
from megadiv.trainer.objectives import grpo_objective
from megadiv.trainer.policy import Policy, SequenceBatch


def _batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (8,), generator=g)]
    responses = [torch.randint(0, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 8, (8,), generator=g)]
    return SequenceBatch.pack(prompts, responses, pad_id=0, advantages=torch.randn(8, generator=g))


def policy_steps(ctx):
    """Three SGD steps of a k3-clipped loss with a KL penalty: figures that must not depend on the
    layout (per-token loss scaling, grad norm over TP shards, metric reduction)."""
    a = ctx.args
    initialize(ParallelConfig(tensor_parallel=a["tp"], pipeline_parallel=a["pp"]), seed=1)
    model = ModelConfig(hf_dir=a["hf_dir"])
    actor = Policy(model, ParallelConfig(tensor_parallel=a["tp"], pipeline_parallel=a["pp"]), "actor",
                   OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0), total_steps=3, temperature=0.7)
    reference = Policy(model, ParallelConfig(tensor_parallel=a["tp"], pipeline_parallel=a["pp"]), "reference",
                       temperature=0.7)
    batch = _batch()
    batch.logp_ref = reference.log_probs(batch, micro_batch_size=2)
    batch.logp_old = actor.log_probs(batch, micro_batch_size=2)
    regularizer = a.get("regularizer")
    loss = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.01, kl_coef=0.1,
                            loss_agg=a["agg"], regularizer=regularizer, regularizer_coef=0.5 if regularizer else 0.0)
    vocab_div = DIVERGENCES[regularizer](consume_base=True) if regularizer else None
    steps = [actor.train_step(batch, grpo_objective(loss), micro_batch_size=2, regularizer=vocab_div,
                              reference=reference) for _ in range(3)]
    # a NaN advantage makes every gradient NaN: the step must be skipped, the weights untouched
    before = [p.detach().clone() for p in actor.model.gpt_models[0].parameters()]
    bad = batch.rows(slice(0, 8))
    bad.advantages = torch.full((8,), float("nan"))
    skipped = actor.train_step(bad, grpo_objective(loss), micro_batch_size=2, regularizer=vocab_div,
                               reference=reference)
    unchanged = all(torch.equal(x, p) for x, p in zip(before, actor.model.gpt_models[0].parameters()))
    logp = actor.log_probs(batch, micro_batch_size=4)
    return {"steps": steps, "skipped": skipped["skipped"], "unchanged": unchanged,
            "logp_sum": None if logp is None else float((logp * batch.loss_mask).sum())}
