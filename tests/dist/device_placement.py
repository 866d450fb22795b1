"""Rank bodies for tests/test_device_placement.py: the policy step under the device guard, and
the sequence padding that FP8 / sequence parallelism need."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig, ParallelConfig, load_config
from megadiv.parallel import initialize
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.megatron import Policy
from megadiv.policy.objectives import grpo_objective
from megadiv.rollout import ProbeBatch
from megadiv.trainer import grpo
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.experience import Experience
from megadiv.trainer.handoff import ReplicaRows
from tests.device_guard import DeviceGuard


def _experience(rows: int, vocab: int) -> Experience:
    g = torch.Generator().manual_seed(0)
    draw = lambda lo, hi: torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist()
    prompts = [draw(2, 6) for _ in range(rows // 4) for _ in range(4)]
    responses = [draw(1, 8) for _ in range(rows)]
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return Experience(prompts, responses, [[-1.0] * len(r) for r in responses], rewards,
                      rewards - rewards.mean(), torch.ones(rows), {})


def placement_checks(ctx):
    """Both bodies below in one launch (a launch costs seconds of imports), and what the harness
    gave the rank: no GPU, hence gloo, whatever the machine has."""
    guard = guarded_policy_step(ctx)
    harness = {"cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "backend": dist.get_backend(),
               "cuda": torch.cuda.is_available()}
    return {"guard": guard, "padding": padding_invariance(ctx), "harness": harness}


def guarded_policy_step(ctx):
    """Everything a GRPO step does on a rank, under DeviceGuard: reference and old log-probs, KL in
    the reward (an all-reduce), two optimizer steps with a full-vocabulary regulariser (vocab-
    parallel log-probs, entropy, divergence, their backward), metric reduction, and the post-sync
    probe (an object broadcast). Returns the guard's violations and a few figures."""
    step = _grpo_step(ctx.args["hf_dir"], guarded=True)
    return {"violations": step["violations"], "loss": step["metrics"]["loss/total"],
            "probe_tokens": sum(len(x) for x in step["probe"])}


def policy_step_on_gpu(ctx):
    """The same step on the GPU (the ``gpu`` tests): the weights' device, finite figures, the probe
    log-probs back on the host, the sequence multiple the model was fed."""
    step = _grpo_step(ctx.args["hf_dir"], guarded=False, overrides=ctx.args.get("overrides", []))
    actor = step["actor"]
    return {"device": str(actor.device), "metrics": step["metrics"], "seq_multiple": actor.seq_multiple,
            "probe_devices": sorted({str(x.device) for x in step["probe"]}),
            "probe_finite": all(bool(x.isfinite().all()) for x in step["probe"])}


def _grpo_step(hf_dir: str, guarded: bool, overrides: list[str] = ()) -> dict:
    info = initialize(ParallelConfig(), seed=1)
    cfg = load_config(TrainConfig, None, [
        f"model.hf_dir={hf_dir}", "loss.kl_coef=0.05", "loss.kl_placement=reward",
        "loss.regularizer=full_kl", "loss.regularizer_coef=0.1", "grpo.micro_batch_size=2",
        "grpo.mini_batches=2", "rollout.n_samples=4", "advantage.group_size=4", "grpo.prompts_per_step=2",
        *overrides])
    actor = Policy(cfg.model, cfg.parallel, "actor", OptimConfig(optimizer="sgd", lr=0.1), 4)
    reference = Policy(cfg.model, cfg.parallel, "reference")
    exp = _experience(8, actor.model.vocab_size)
    g = torch.Generator().manual_seed(1)   # the probe's ids: any of the vocabulary, for device placement
    draw = lambda: torch.randint(0, actor.model.vocab_size, (16,), generator=g).tolist()  # noqa: E731
    probe = ProbeBatch([draw() for _ in range(4)], [draw() for _ in range(4)])
    params = [p for policy in (actor, reference) for c in policy.chunks for p in c.parameters()]
    guard = DeviceGuard(params) if guarded else contextlib.nullcontext()
    with guard:
        per = len(exp) // info.dp_size  # this replica's rows, as the hand-off deals them at one rank
        rows = ReplicaRows.from_experience(exp, list(range(info.dp_rank * per, (info.dp_rank + 1) * per)))
        metrics = grpo._optimize(cfg, actor, reference, rows, pad_id=0)
        probe_lp = grpo._probe_logprobs(actor, probe)
    return {"violations": guard.violations if guarded else None, "metrics": metrics, "probe": probe_lp,
            "actor": actor}


def padding_invariance(ctx):
    """One SGD step of the same batch with the model's sequence length left as is and padded to a
    multiple of 16 (FP8's rule): log-probs of the response tokens, loss metrics and every gradient must agree.
    ``ctx.args["model"]``: ModelConfig fields (the GPU check forces ``transformer_impl: local``)."""
    initialize(ParallelConfig(), seed=1)
    model = ModelConfig(hf_dir=ctx.args["hf_dir"], **ctx.args.get("model", {}))
    loss = load_config(TrainConfig, None, [f"model.hf_dir={ctx.args['hf_dir']}", "loss.kl_coef=0.1",
                                           "loss.loss_agg=seq-mean-token-sum-norm"]).loss
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (6, 2, 7, 3)]
    out = {}
    for multiple in (1, 16):
        actor = Policy(model, ParallelConfig(), "actor", OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0.0), 1)
        actor.seq_multiple = multiple
        batch = SequenceBatch.pack(prompts, responses, pad_id=0, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.logp_ref = batch.logp_old = actor.log_probs(batch, micro_batch_size=2) - 0.01
        metrics = actor.train_step(batch, grpo_objective(loss), micro_batch_size=2)
        grads = [p.main_grad.clone() for c in actor.chunks for p in c.parameters()]
        # the positions that predict a response token (the last position of a full-width row predicts
        # nothing, its value depends on what the model input holds after it)
        logp = batch.logp_old * batch.loss_mask
        out[multiple] = {"seq_len": batch.tokens.shape[1], "logp": logp, "metrics": metrics, "grads": grads}
    return out


def tp_markers(ctx):
    """Build the loaded model at TP=2 (or ``tp``; no weight init) and report every parameter's TP
    markers."""
    from megadiv.models.builder import build_model

    tp = ctx.args.get("tp", 2)
    initialize(ParallelConfig(tensor_parallel=tp), seed=1)
    model = build_model(ModelConfig(hf_dir=ctx.args["hf_dir"]), parallel=ParallelConfig(tensor_parallel=tp))
    assert not model.config.perform_initialization  # the weights were loaded, not initialised
    return {name: (getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                   getattr(p, "partition_stride", None))
            for name, p in model.gpt_models[0].named_parameters()}
