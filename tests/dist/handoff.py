"""Rank bodies for tests/test_handoff.py: rollout batches dealt to the replicas through the
driver's store (megadiv/trainer/handoff.py) and trained on by real megatron-core ranks."""
from __future__ import annotations

import pickle
import resource
import time

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
from megadiv.divergence import AdvantageConfig, compute_advantages
from megadiv.parallel import initialize
from megadiv.rollout import RolloutConfig, RolloutError
from megadiv.trainer.config import GRPOConfig, TrainConfig
from megadiv.trainer.experience import Experience
from megadiv.trainer.handoff import Handoff, ReplicaRows, assign_rows, replica_group

GROUPS, G = 8, 4  # 32 rows a batch
SGD = OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0.0)  # 4 updates at lr 0.5 (grad norm ~5) amplify float32 rounding to 2e-5


def experience(step: int, prompt_len: int = 6, response_len: int = 9) -> Experience:
    """A rollout batch as the driver makes it: GROUPS groups of G, lengths that differ a lot."""
    g = torch.Generator().manual_seed(step)
    rows = GROUPS * G
    prompts = [torch.randint(0, 90, (int(n),), generator=g).tolist()
               for n in torch.randint(2, prompt_len, (GROUPS,), generator=g) for _ in range(G)]
    responses = [torch.randint(0, 90, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, response_len, (rows,), generator=g)]
    logprobs = [(-torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in responses]
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    advantages = compute_advantages(AdvantageConfig(group_size=G), rewards)
    in_loss = (torch.rand(rows, generator=g) > 0.1).float()
    return Experience(prompts, responses, logprobs, rewards, advantages, in_loss, {"reward/mean": 0.5}, step - 1)


def _config(hf_dir: str, tp: int, pp: int) -> TrainConfig:
    return TrainConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp),
                       model=ModelConfig(hf_dir=hf_dir), optim=SGD,
                       grpo=GRPOConfig(prompts_per_step=GROUPS, micro_batch_size=2, mini_batches=2),
                       rollout=RolloutConfig(n_samples=G), advantage=AdvantageConfig(group_size=G))


def _stores(rank: int) -> tuple[Handoff | None, Handoff]:
    """Rank 0 hosts the driver's store (as the driver does); every rank connects a client to it."""
    address, driver_side = [None], None
    if rank == 0:
        driver_side, port = Handoff.host(timeout_s=60)
        address = [("127.0.0.1", port)]
    dist.broadcast_object_list(address, src=0)
    return driver_side, Handoff.connect(*address[0], timeout_s=60)


def scatter_and_train(ctx):
    """Two steps: rank 0 publishes each batch (the driver's side), every rank receives its
    replica's rows (handoff.receive) and trains on them (grpo._optimize, mini-batches of the
    balanced assignment); a second actor trains the same batches on the contiguous DP slices,
    as before the hand-off. Returns weights, metrics and the bytes each rank received."""
    from megadiv.policy.megatron import Policy
    from megadiv.trainer.grpo import _optimize

    a = ctx.args
    cfg = _config(a["hf_dir"], a["tp"], a["pp"])
    info = initialize(cfg.parallel, seed=1)
    driver_side, handoff = _stores(info.rank)
    replica, source = replica_group(info, cfg.parallel.timeout_s)
    balanced = Policy(cfg.model, cfg.parallel, "actor", SGD, total_steps=2)
    contiguous = Policy(cfg.model, cfg.parallel, "actor", SGD, total_steps=2)
    out = {"dp_size": info.dp_size, "dp_rank": info.dp_rank, "steps": [], "contiguous_steps": [], "received": [],
           "pickled": [], "rows": [], "batches_equal": []}
    for step in (1, 2):
        exp = experience(step)
        if info.rank == 0:
            driver_side.publish_batch(step, exp, info.dp_size, cfg.grpo.mini_batches)
        handoff.wait(f"batch/{step}")
        data = handoff.receive(f"batch/{step}/{info.dp_rank}", replica, source)
        rows = ReplicaRows.decode(data)
        mine = assign_rows([len(p) + len(r) for p, r in zip(exp.prompts, exp.responses)], info.dp_size,
                           cfg.grpo.mini_batches)[info.dp_rank]
        # the payload rebuilds exactly the rows the driver's Experience makes for these indices
        expected = Experience([exp.prompts[i] for i in mine], [exp.responses[i] for i in mine],
                              [exp.rollout_logprobs[i] for i in mine], exp.rewards[mine], exp.advantages[mine],
                              exp.in_loss[mine], {}).to_batch(pad_id=0)
        got = rows.to_batch(pad_id=0)
        out["batches_equal"].append(all(torch.equal(getattr(got, k), getattr(expected, k))
                                        for k in ("tokens", "loss_mask", "advantages", "logp_rollout")))
        out["rows"].append(rows.row_index.tolist())
        out["received"].append(len(data))
        out["pickled"].append(len(pickle.dumps(exp)))  # what broadcast_object_list sent every rank before
        out["steps"].append(_optimize(cfg, balanced, None, rows, pad_id=0))
        per = len(exp) // info.dp_size
        old = ReplicaRows.from_experience(exp, list(range(info.dp_rank * per, (info.dp_rank + 1) * per)))
        out["contiguous_steps"].append(_optimize(cfg, contiguous, None, old, pad_id=0))
    out["weights"] = {n: t for bucket in balanced.export_buckets(64 << 20) for n, t in bucket}
    out["contiguous_weights"] = {n: t for bucket in contiguous.export_buckets(64 << 20) for n, t in bucket}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def waits_outlive_the_collective_timeout(ctx):
    """parallel.timeout_s = 3 s. Rank 0 (the driver's side) publishes a batch only after 4 x that:
    the other ranks wait on the store key (rollout.handoff_timeout_s = 60) and get it. Then rank 1
    enters an all-reduce rank 0 never joins: gloo fails it at parallel.timeout_s. A key that is never
    written fails its wait at handoff_timeout_s, naming it."""
    timeout_s = 3.0
    info = initialize(ParallelConfig(timeout_s=timeout_s), seed=1)
    driver_side, handoff = _stores(info.rank)
    out = {}
    start = time.monotonic()
    if info.rank == 0:
        time.sleep(4 * timeout_s)  # a slow rollout
        driver_side.publish("batch/1", b"payload")
    out["value"] = handoff.wait("batch/1")
    out["waited_s"] = time.monotonic() - start
    dist.barrier()
    if info.rank == 1:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            out["hang"] = "not caught"
        except RuntimeError as e:
            out["hang"] = str(e).splitlines()[0]
        out["hang_s"] = time.monotonic() - start
        try:
            Handoff(handoff.store, timeout_s=2).wait("never/written")
        except RolloutError as e:
            out["missing"] = str(e)
    else:
        time.sleep(3 * timeout_s)  # leaves rank 1's all-reduce unanswered
        handoff.wait("done")  # keep the store up until rank 1 is through
    if info.rank == 1:
        handoff.publish("done")
    return out
