"""The GRPO loop: generate -> reward -> advantage -> train -> sync -> evaluate / save.

One rollout driver per job (driver.py: the engine's stream, rewards, advantages) deals each batch
to the data-parallel replicas as packed tensors; every rank reaches it through one ``Rollout``
(rollout.py), trains on its replica's rows through megatron's pipeline schedule
(megadiv/policy/megatron.py) and takes part in the collective weight export that is pushed to the
engines. With grpo.overlap, batch k+1 is generated on step k-1's weights while the ranks train on
batch k (one step off-policy).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from megadiv import parallel
from megadiv.config import ModelConfig, to_dict
from megadiv.divergence import compute_advantages, kl_reward_penalty
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.megatron import Policy
from megadiv.policy.objectives import grpo_objective
from megadiv.rollout import ProbeBatch, check_mismatch, probe_limit, probe_mismatch
from megadiv.trainer import checkpoint
from megadiv.trainer.backend import make_policy
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.handoff import ReplicaRows
from megadiv.trainer.lifecycle import NonFiniteError, RunGuard
from megadiv.trainer.metrics import MetricsLogger, StepTimer, plot_curves
from megadiv.trainer.model_card import write_model_card
from megadiv.trainer.rollout import Rollout, shares_weights
from megadiv.trainer.warm_start import starting_checkpoint


def train(cfg: TrainConfig) -> Path:
    """Run ``cfg`` to the end; returns the run directory (summary.json, metrics.jsonl, curves.png).
    Raises RunInterrupted on SIGTERM/SIGINT and RankFailure (one line) on any error (lifecycle.py)."""
    info = parallel.initialize(cfg.parallel, cfg.run.seed)
    cfg.check_world_size(info.world_size)  # every batch splits exactly over the DP replicas
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    with RunGuard(run_dir, info.rank) as run:  # run-directory lock, stop signals, one-line errors
        return _train(cfg, info, run_dir, run)


def _train(cfg: TrainConfig, info, run_dir: Path, run: RunGuard) -> Path:
    _write_run_config(cfg, run_dir, info.rank)
    rollout = logger = None
    try:
        start_dir = starting_checkpoint(cfg, run_dir, info)
        model_cfg = ModelConfig(**{**to_dict(cfg.model), "hf_dir": start_dir})
        updates_per_step = cfg.grpo.ppo_epochs * cfg.grpo.mini_batches
        actor = make_policy(cfg, model_cfg, "actor", cfg.optim, cfg.grpo.steps * updates_per_step,
                            cfg.grpo.log_probs_chunk, cfg.rollout.temperature)
        reference = (make_policy(cfg, model_cfg, "reference", log_probs_chunk=cfg.grpo.log_probs_chunk,
                                 temperature=cfg.rollout.temperature) if cfg.needs_reference else None)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(start_dir)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rollout = Rollout(cfg, info, start_dir, tokenizer, actor.optimizer_state_bytes())  # collective

        state = {"step": 0, "nonfinite_in_row": 0, "skipped_steps": 0, "eval_before": None}
        latest = checkpoint.find_resume_point(run_dir, cfg.parallel) if cfg.checkpoint.resume == "auto" else None
        if info.rank == 0:  # torchrun --max-restarts: resume, or refuse when the failed attempt saved nothing
            checkpoint.note_attempt(run_dir, latest, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        mirror_map = checkpoint.fix_mirror_map(cfg.loss, run_dir, resuming=latest is not None)
        if latest is not None:
            state = checkpoint.load_checkpoint(latest, actor)
            rollout.load_state(checkpoint.rollout_state_file(latest), state["step"])  # prompts, batch ahead
            _say(info.rank, f"resumed from {latest} at step {state['step']}")
        if latest is not None or shares_weights(cfg):  # the loaded weights; shared from the start (no copy)
            rollout.push_weights(actor, state["step"])
        probe = _probe_baseline(cfg, actor, rollout)  # engine and trainer on the same weights, before training
        resumed_step = state["step"]
        logger = MetricsLogger(run_dir, info.rank == 0, cfg.grpo.steps, cfg.run, to_dict(cfg),
                               resumed_step=resumed_step if latest else None)
        if latest is None:
            state["eval_before"] = rollout.evaluate()
            logger.log(0, state["eval_before"], prefix="eval")

        saver = checkpoint.CheckpointSaver(run_dir, cfg.checkpoint.keep_last, cfg.parallel)
        last = cfg.grpo.stop_after or cfg.grpo.steps
        for step in range(state["step"] + 1, last + 1):
            run.step, timer = step, StepTimer()
            with timer("batch_wait"):
                rows, rollout_metrics = rollout.collect(step)                   # this replica's rows: generated,
            with timer("train"):                                                # rewarded, advantages
                metrics = _optimize(cfg, actor, reference, rows, pad_id)        # ref/old log-probs, updates
            if mirror_map is not None:                                          # the same h, every rank and step
                metrics["mirror_map/fingerprint"] = checkpoint.check_mirror_map(cfg.loss, mirror_map)
            state = _guard(cfg, state, metrics, step)                           # skip / abort on NaN
            with timer("sync"):
                sync = _sync_weights(cfg, actor, rollout, probe, step)          # (batch ahead done) push, probe
            evaluates = cfg.eval.every and step % cfg.eval.every == 0
            evaluated = rollout.evaluate() if evaluates else {}
            saves = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == last
            _log_saved(logger, saver.wait() if saves else saver.poll())         # the save before, sealed
            logger.log(step, rollout_metrics | metrics | sync | evaluated | timer.as_metrics())
            state["step"] = step
            if saves:                                                           # written in the background,
                saver.save(step, actor, state, rollout)                         # the driver's state by the driver
        _log_saved(logger, saver.wait())
        if last < cfg.grpo.steps:
            _say(info.rank, f"stopped after step {last} (grpo.stop_after); the same command with a larger or no "
                            f"grpo.stop_after continues from here\n"
                            f"run directory: {run_dir}")
            return run_dir

        after = rollout.evaluate()
        if cfg.checkpoint.export_hf:
            checkpoint.export_hf(run_dir, actor, start_dir, state["step"], retrained=state["step"] > resumed_step)
        if info.rank == 0:
            logger.log(cfg.grpo.steps, after, prefix="eval")
            _finish(cfg, run_dir, logger, state, after)
        return run_dir
    except BaseException:
        if logger:
            logger.close(failed=True)  # W&B marks its run failed, not finished
        raise
    finally:
        if logger:
            logger.close()
        if rollout:
            rollout.close()
        parallel.shutdown()


def _log_saved(logger: MetricsLogger, sealed: list[tuple[int, dict]]) -> None:
    """Each sealed checkpoint's seconds (blocking, writing, in all) as a record of the step it holds."""
    for step, figures in sealed:
        logger.log(step, {k: v for k, v in figures.items() if v is not None}, prefix="checkpoint")


def _optimize(cfg: TrainConfig, actor: Policy, reference: Policy | None, rows: ReplicaRows, pad_id: int) -> dict:
    """This replica's rows: reference and old-policy log-probs, then ppo_epochs x mini_batches
    optimizer steps."""
    batch = rows.to_batch(pad_id)
    mbs = cfg.grpo.micro_batch_size
    if reference is not None:
        batch.logp_ref = reference.log_probs(batch, mbs)
    kl_in_reward = cfg.loss.kl_coef > 0 and cfg.loss.kl_placement == "reward"
    # pi_old (the weights before this batch's first update) needs a pass of its own for several updates
    # per batch or a KL in the reward; with one update it is the training forward's logp.detach(), the
    # same values without the pass, on-policy and off-policy (grpo.overlap) alike (docs/training.md)
    if cfg.grpo.ppo_epochs * cfg.grpo.mini_batches > 1 or kl_in_reward:
        if cfg.grpo.routing_replay == "r2":  # the experts of this pass are those of every later pass (megatron)
            batch.logp_old = actor.log_probs(batch, mbs, record_routing=True)
        else:
            batch.logp_old = actor.log_probs(batch, mbs)
    kl_metrics = {}
    if kl_in_reward:
        batch.advantages, kl_metrics = _advantages_with_kl_in_reward(cfg, actor, rows, batch)
    # the reference logits are made afresh for each micro-batch: the divergence may overwrite them
    regularizer = cfg.loss.divergence(cfg.loss.regularizer, consume_base=True) if cfg.uses_vocab_regularizer else None
    objective = grpo_objective(cfg.loss)
    steps = [actor.train_step(mini_batch, objective, mbs, regularizer, reference)
             for epoch in range(cfg.grpo.ppo_epochs) for mini_batch in batch.split(cfg.grpo.mini_batches)]
    metrics = {key: sum(m[key] for m in steps) / len(steps) for key in steps[-1]}
    metrics["skipped"] = max(m["skipped"] for m in steps)
    return metrics | kl_metrics


def _advantages_with_kl_in_reward(cfg: TrainConfig, actor: Policy, rows: ReplicaRows, batch: SequenceBatch):
    """KL in the reward: r_i - beta * sum_t k_t(pi_old, pi_ref), then the advantages again (and the
    mean penalty as a metric). The
    last pipeline stages hold the log-probs of their replica's rows; one all-reduce assembles the
    penalty of every row on every rank (each of the TP ranks of a last stage adds the same value)."""
    from megatron.core import parallel_state

    penalty = torch.zeros(len(rows.rewards), device=actor.device)  # the default group may be NCCL
    if batch.logp_ref is not None:
        penalty[rows.row_index.to(actor.device)] = kl_reward_penalty(
            cfg.loss.kl_estimator, cfg.loss.kl_coef, batch.logp_old, batch.logp_ref, batch.loss_mask.to(actor.device))
    dist.all_reduce(penalty)
    penalty = penalty.cpu() / parallel_state.get_tensor_model_parallel_world_size()
    advantages = compute_advantages(cfg.advantage, rows.rewards - penalty)[rows.row_index].float()
    return advantages, {"reward/kl_penalty_mean": float(penalty.mean())}


def _guard(cfg: TrainConfig, state: dict, metrics: dict, step: int) -> dict:
    """Count skipped (non-finite) steps; abort after grpo.max_nonfinite_steps in a row."""
    skipped = metrics["skipped"] > 0 or not math.isfinite(metrics.get("loss/total", 0.0))
    state = {**state, "nonfinite_in_row": state["nonfinite_in_row"] + 1 if skipped else 0,
             "skipped_steps": state["skipped_steps"] + int(skipped)}
    metrics["guard/skipped_steps"] = state["skipped_steps"]
    if state["nonfinite_in_row"] >= cfg.grpo.max_nonfinite_steps:
        raise NonFiniteError(f"step {step}: {state['nonfinite_in_row']} steps in a row had a non-finite loss or "
                             f"gradient (grpo.max_nonfinite_steps={cfg.grpo.max_nonfinite_steps}); the last "
                             f"checkpoint is intact")
    return state


def _probe_baseline(cfg: TrainConfig, actor: Policy, rollout: Rollout) -> tuple[ProbeBatch, float | None] | None:
    """The weight-sync probe (held-out prompts, the engine's answers) and, on a rank with an engine,
    its limit: the mismatch measured now, while engine and trainer hold the same weights (the
    checkpoint both loaded; on resume the loaded weights, just pushed), scaled by
    megadiv.rollout.mismatch.probe_limit. Taken again at every launch rather than stored: it measures this
    engine against this trainer (GPU, server_tp, kernels, FP8), which a resume may change. None
    when grpo.check_mismatch_every is 0. Collective."""
    if not cfg.grpo.check_mismatch_every:
        return None
    probe = rollout.probe_batch()
    trainer_lp = _probe_logprobs(actor, probe)
    if rollout.engine is None:
        return probe, None
    baseline = probe_mismatch(rollout.engine, probe, trainer_lp, "baseline")
    limit = probe_limit(baseline.mean_abs, cfg.rollout)
    _say(dist.get_rank(), f"weight-sync probe: {baseline.tokens} tokens, baseline mean |d log p| "
                          f"{baseline.mean_abs:.3g} on identical weights, limit {limit:.3g}")
    return probe, limit


def _sync_weights(cfg: TrainConfig, actor: Policy, rollout: Rollout, probe: tuple[ProbeBatch, float | None] | None,
                  step: int) -> dict:
    """Push the actor's weights to the engines, then, at step 1 and every grpo.check_mismatch_every
    steps, compare each engine's log-probs with the trainer's on the probe batch against the limit
    the baseline set (every rank with an engine checks its own: a failing rank raises)."""
    metrics = rollout.push_weights(actor, step)
    every = cfg.grpo.check_mismatch_every
    if every and (step == 1 or step % every == 0):  # step 1: a wrong mapping shows at once
        batch, limit = probe
        trainer_lp = _probe_logprobs(actor, batch)
        if rollout.engine is not None:
            report = check_mismatch(rollout.engine, batch, trainer_lp, limit, f"step-{step}")
            metrics |= {"sync/probe_abs_diff_mean": report.mean_abs, "sync/probe_abs_diff_max": report.max_abs,
                        "sync/probe_limit": limit}
    return metrics


def _probe_logprobs(actor: Policy, probe: ProbeBatch) -> list[torch.Tensor]:
    """The trainer's raw-policy (temperature 1, as engine.score) log-probs of the probe responses
    (collective; every rank gets them)."""
    batch = SequenceBatch.pack(probe.prompts, probe.responses, pad_id=0)
    logp = actor.log_probs(batch, micro_batch_size=len(batch), temperature=1.0)
    out = [None]
    if dist.get_rank() == dist.get_world_size() - 1:  # a last pipeline stage
        logp = logp.cpu()  # an object broadcast pickles tensors with their device: send host copies
        out = [[logp[i, len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(probe.prompts,
                                                                                       probe.responses))]]
    dist.broadcast_object_list(out, src=dist.get_world_size() - 1)
    return out[0]


def _write_run_config(cfg: TrainConfig, run_dir: Path, rank: int) -> None:
    if rank == 0:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    dist.barrier()


def _finish(cfg: TrainConfig, run_dir: Path, logger: MetricsLogger, state: dict, after: dict) -> None:
    before = state.get("eval_before") or {}
    summary = {"run_dir": str(run_dir), "steps": state["step"], "skipped_steps": state["skipped_steps"],
               "accuracy_before": before.get("eval/accuracy"), "accuracy_after": after.get("eval/accuracy"),
               "eval_before": before, "eval_after": after, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    logger.write_summary(summary)
    plot_curves(run_dir)
    if cfg.checkpoint.export_hf:
        write_model_card(run_dir / "hf", cfg, summary)
    logger.close()
    if summary["accuracy_before"] is not None and summary["accuracy_after"] is not None:
        print(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}", flush=True)
    print(f"run directory: {run_dir}", flush=True)
    print(json.dumps({k: summary[k] for k in ("accuracy_before", "accuracy_after")}), flush=True)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)
