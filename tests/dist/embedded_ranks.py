"""Rank body for tests/test_rollout_ranks.py: the embedded engine on every trainer rank.

One launch, two ranks, two layouts in turn (TP=1 x DP=2, then TP=2):

- TP=1: two Adam actors from one checkpoint (distributed optimizer: parameters live in megatron's
  contiguous buffer), one feeding a copied engine (the export), one a shared engine (views of its
  parameters). Same seeds -> same completions and log-probs; one training step on them -> same
  losses, gradients and weights; generation never changes the actor's parameters; after the
  step the shared engine serves the new weights with no copy; a copy into a shared engine
  leaves the actor untouched.
- both layouts: RankSplitEngine over the two ranks (rank 1 serving) gives what one engine gives
  for the same seed, with an uneven split; each rank's engine passes the probe against the
  trainer; a failure on rank 1 comes back to rank 0 as a RolloutError naming it, one on rank 0
  raises as is, and the ranks go on serving.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import PolicyLossConfig
from megadiv.parallel import initialize, shutdown
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.megatron import Policy
from megadiv.policy.objectives import grpo_objective
from megadiv.rollout import ProbeBatch, RolloutError, SamplingParams, check_mismatch
from megadiv.rollout.embedded import EmbeddedEngine, RankSplitEngine, draw_seed
from tests.test_rollout import random_probe

PROMPTS = [[5, 17, 33, 8], [40, 41], [9, 60, 61, 62, 63, 64, 70], [3, 3, 3], [77, 12, 6, 1, 90]]  # 3 + 2 over ranks
PARAMS = SamplingParams(n=3, temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=6)
ADAM = OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, adam_eps=1e-5)
LOSS = PolicyLossConfig(policy_loss="clip", eps_low=0.2, eps_high=0.2, kl_coef=0.0, loss_agg="token-mean")


def _generate(engine, seed: int, params: SamplingParams = PARAMS):
    torch.manual_seed(seed)
    return engine.generate(PROMPTS, params)


def _content(groups) -> tuple[list, list]:
    return [[c.token_ids for c in g] for g in groups], [[c.logprobs for c in g] for g in groups]


def _lp_diff(a, b) -> float:
    return max(abs(x - y) for ga, gb in zip(a, b) for ca, cb in zip(ga, gb) for x, y in zip(ca.logprobs, cb.logprobs))


def _trainer_probe(actor: Policy, probe: ProbeBatch) -> list[torch.Tensor]:
    from megadiv.trainer.grpo import _probe_logprobs
    return _probe_logprobs(actor, probe)


def _train_once(actor: Policy, groups, info) -> tuple[dict, list[torch.Tensor]]:
    """One GRPO update on this replica's half of the rows of ``groups``: metrics and main_grads."""
    prompts = [p for p in PROMPTS for _ in range(PARAMS.n)]
    responses = [c.token_ids for g in groups for c in g]
    advantages = torch.linspace(-1, 1, len(prompts))
    batch = SequenceBatch.pack(prompts, responses, pad_id=0, advantages=advantages,
                               response_values=[c.logprobs for g in groups for c in g])
    half = len(batch) // info.dp_size
    batch = batch.rows(slice(info.dp_rank * half, (info.dp_rank + 1) * half))
    metrics = actor.train_step(batch, grpo_objective(LOSS), micro_batch_size=len(batch))
    grads = [p.main_grad.detach().clone() for c in actor.chunks for p in c.parameters()]
    return metrics, grads


def _params(actor: Policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.gpt_models[0].parameters()]


def _split_checks(local: EmbeddedEngine, group, rank: int, out: dict, key: str) -> None:
    """RankSplitEngine (rank 1 serving) == rank 0's engine alone with the same seed; a rank-1 failure."""
    if rank == 0:
        split = RankSplitEngine(local, group)
        together = _generate(split, seed=11)
        torch.manual_seed(11)
        alone = local.generate(PROMPTS, PARAMS, seed=draw_seed())
        greedy_split = split.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=6))
        greedy_alone = local.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=6))
        try:
            split.generate(PROMPTS[:3] + [[10 ** 6], [10 ** 6]], PARAMS)  # rank 1's prompts: no such token
            failure = None
        except RolloutError as e:
            failure = str(e)
        try:
            split.generate([[10 ** 6]] + PROMPTS[1:], PARAMS)  # rank 0's own prompt fails: its error, as is
            own = None
        except Exception as e:
            own = type(e).__name__
        recovered = len(split.generate(PROMPTS, PARAMS)) == len(PROMPTS)  # rank 1 is serving again
        split.release()
        out[key] = {"tokens_equal": _content(together)[0] == _content(alone)[0],
                    "lp_diff": _lp_diff(together, alone), "greedy_equal": _content(greedy_split)[0] == _content(greedy_alone)[0],
                    "versions": {c.weight_version for g in together for c in g}, "failure": failure,
                    "own_failure": own, "recovered": recovered}
    else:
        local.serve(group)


def engines_on_every_rank(ctx):
    hf_dir = ctx.args["hf_dir"]
    out = {}
    probe = random_probe(seed=3)

    # ---- TP=1 x DP=2: shared vs copied engine, then generation split over the ranks
    parallel = ParallelConfig(tensor_parallel=1)
    info = initialize(parallel, seed=1)
    group = dist.new_group(backend="gloo")
    model = ModelConfig(hf_dir=hf_dir)
    actor_a = Policy(model, parallel, "actor", ADAM, total_steps=2, temperature=PARAMS.temperature)
    actor_b = Policy(model, parallel, "actor", ADAM, total_steps=2, temperature=PARAMS.temperature)
    copied, shared = EmbeddedEngine(hf_dir), EmbeddedEngine(hf_dir)
    copied.update_weights(actor_a.export_buckets(64 << 20), "step-0")
    views = actor_b.hf_weight_views()
    report = shared.update_weights([views], "step-0", share=True)
    storage = {p.untyped_storage().data_ptr() for p in actor_b.model.gpt_models[0].parameters()}
    r = {"method": report.method, "views": {name: t.untyped_storage().data_ptr() in storage for name, t in views},
         "engine_aliases": {name: p.untyped_storage().data_ptr() in storage
                            for name, p in shared.model.named_parameters()}}
    before = _params(actor_b)
    a0, b0 = _generate(copied, seed=5), _generate(shared, seed=5)
    shared.score(probe.prompts, probe.responses)
    r["same_completions"] = _content(a0) == _content(b0)  # exact: same values, same layouts
    r["untouched_by_generation"] = all(torch.equal(x, y) for x, y in zip(before, _params(actor_b)))
    (ma, ga), (mb, gb) = _train_once(actor_a, a0, info), _train_once(actor_b, b0, info)
    r["same_metrics"] = ma == mb
    r["metrics"] = ma
    r["same_grads"] = all(torch.equal(x, y) for x, y in zip(ga, gb))
    r["same_weights"] = all(torch.equal(x, y) for x, y in zip(_params(actor_a), _params(actor_b)))
    r["moved"] = not all(torch.equal(x, y) for x, y in zip(before, _params(actor_b)))
    copied.update_weights(actor_a.export_buckets(64 << 20), "step-1")
    shared.update_weights([actor_b.hf_weight_views()], "step-1", share=True)
    a1, b1 = _generate(copied, seed=6), _generate(shared, seed=6)
    r["same_after_step"] = _content(a1) == _content(b1)
    trainer = _trainer_probe(actor_b, probe)
    r["probe_shared"] = check_mismatch(shared, probe, trainer, 1e-4, "step-1").max_abs
    # a copy into the shared engine gives it storage of its own: the actor keeps its weights
    kept = _params(actor_b)
    noise = [[(name, t + 1.0) for name, t in bucket] for bucket in actor_a.export_buckets(64 << 20)]
    shared.update_weights(noise, "noise")
    r["copy_leaves_actor"] = all(torch.equal(x, y) for x, y in zip(kept, _params(actor_b)))
    r["copy_owns_storage"] = not any(p.untyped_storage().data_ptr() in storage for p in shared.model.parameters())
    shared.update_weights([actor_b.hf_weight_views()], "step-1", share=True)
    out["tp1"] = r
    _split_checks(shared, group, info.rank, out, "split_tp1")
    dist.destroy_process_group(group)
    shutdown(keep_default_group=True)

    # ---- TP=2: every rank's engine is a full copy from its own export
    parallel = ParallelConfig(tensor_parallel=2)
    info = initialize(parallel, seed=1)
    group = dist.new_group(backend="gloo")
    actor = Policy(model, parallel, "actor", ADAM, total_steps=2)
    engine = EmbeddedEngine(hf_dir)
    out["tp2_views"] = actor.hf_weight_views()  # None: no rank holds the whole model
    with torch.no_grad():  # move away from the checkpoint the engine loaded
        for p in actor.model.gpt_models[0].parameters():
            p.add_(0.01 * torch.ones_like(p))
    engine.update_weights(actor.export_buckets(64 << 20), "step-1")
    trainer = _trainer_probe(actor, probe)
    out["probe_tp2"] = check_mismatch(engine, probe, trainer, 1e-4, "step-1").max_abs  # on each rank
    _split_checks(engine, group, info.rank, out, "split_tp2")
    dist.destroy_process_group(group)
    return out
