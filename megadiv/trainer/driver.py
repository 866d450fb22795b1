"""The rollout side of a run, held by global rank 0: prompts, the engine, rewards, evaluation.

The other ranks never touch the reward workers; they receive the rows to train on (grpo.py
broadcasts them) and take part in the weight export, which is collective. With the embedded
engine (and no overlap) every rank generates: each holds an EmbeddedEngine, rank 0's
RankSplitEngine sends every rank a slice of each generate call, and the others serve it in
``RolloutWorker.serve`` until rank 0 releases them (``generation_group``; docs/rollout.md).

One-step off-policy (``grpo.overlap``): ``collect_ahead(k + 1)`` generates, grades and shapes batch
k+1 in a background thread, on the weights the engine serves (step k-1's), while the ranks train
on batch k. The engine's weights change only in ``push_weights``, which first waits for that
batch: every batch comes from one weight version, carried with it (``Experience.policy_version``,
checked against each completion's version), and ``collect`` records the staleness and refuses
more than one. The thread only drives the engine: with an SGLang server the generation runs in the
server's processes; the embedded engine runs it in this process (docs/rollout.md, Overlap).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from concurrent.futures import Future
from typing import Iterable

import torch
import torch.distributed as dist

from megadiv.data import PromptSampler, PromptTemplate, load_dataset
from megadiv.evaluation import EvalSampling, EvalSuite, accuracy, default_reward
from megadiv.rewards import build_reward
from megadiv.rollout import Bucket, RolloutError, SamplingParams, make_engine, resolve_engine_name
from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.sglang_server import TrainerMemory, gather_trainer_memory
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.experience import Experience, build_experience, concat, informative_groups, take_groups
from megadiv.trainer.metrics import StepTimer

log = logging.getLogger(__name__)

MAX_STALENESS = 1
"""Weight versions a trained batch may lag the policy it updates (0 on-policy, 1 with grpo.overlap)."""


def trainer_memory_for_servers(cfg: RolloutConfig, reserved_bytes: int) -> TrainerMemory | None:
    """Collective (every trainer rank, after its models are built): each rank's free GPU memory
    and ``reserved_bytes`` (its optimizer state to come), for SGLang servers rank 0 launches on
    CUDA beside the trainer (sglang_server.place_server); None when no server is launched there."""
    launches = torch.cuda.is_available() and not cfg.server_urls and resolve_engine_name(cfg) == "sglang"
    return gather_trainer_memory(reserved_bytes) if launches else None


def generation_group(cfg: TrainConfig, world_size: int):
    """Collective (every rank): a gloo group of all ranks when every rank generates (the embedded
    engine, more than one rank, no grpo.overlap), else None. Not with overlap: rank 0 generates
    in a thread while every rank trains, and the others cannot serve generation meanwhile."""
    if resolve_engine_name(cfg.rollout) != "embedded" or world_size == 1 or cfg.grpo.overlap:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))


def shares_weights(cfg: TrainConfig) -> bool:
    """Whether the embedded engine takes the actor's parameters as its weights (views, no copy)
    where the policy offers them (Policy.hf_weight_views: TP = PP = 1). Not with grpo.overlap:
    the engine then generates while the optimizer changes the parameters."""
    return resolve_engine_name(cfg.rollout) == "embedded" and not cfg.grpo.overlap


class RolloutDriver:
    """Prompts -> completions -> rewards -> advantages, and held-out evaluation."""

    def __init__(self, cfg: TrainConfig, hf_dir: str, tokenizer, trainer_memory: TrainerMemory | None = None,
                 group=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.dataset = load_dataset(cfg.data)
        self.template = PromptTemplate.resolve(cfg.data, self.dataset, tokenizer)
        self.sampler = PromptSampler(len(self.dataset), cfg.grpo.prompts_per_step, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle)
        self.reward = build_reward(cfg.reward)
        # eval.data is graded with the training reward, eval.extra_data with their datasets' own
        eval_data = ([cfg.eval.data] if cfg.eval.data is not None else []) + list(cfg.eval.extra_data)
        self.eval_suite = EvalSuite.build(
            eval_data, [cfg.reward] * (cfg.eval.data is not None) + [default_reward(d.name, cfg.reward)
                                                                     for d in cfg.eval.extra_data],
            tokenizer, shared={cfg.reward: self.reward})
        self.engine = make_engine(cfg.rollout, hf_dir, trainer_memory, group)  # after the models: place_server
        self._split = group is not None  # generation_group: every rank generates a slice of each call
        self.sampling = SamplingParams.from_config(cfg.rollout)
        self.served_step = 0  # the trainer step whose weights the engine serves (0: the starting ones)
        self._ahead: Future | None = None  # the next batch, in flight or done (grpo.overlap)

    def collect(self, step: int) -> Experience:
        """Batch ``step``: the one generated ahead (grpo.overlap, or restored from a checkpoint), else
        one generated now. Records rollout/staleness, the trainer's weight version (step - 1) minus
        the generating one, and raises if it is outside [0, MAX_STALENESS]."""
        ahead, self._ahead = self._ahead, None
        exp = ahead.result() if ahead is not None else self._generate(step)
        staleness = step - 1 - exp.policy_version
        if not 0 <= staleness <= MAX_STALENESS:
            raise RolloutError(f"batch {step} was generated by the weights of step {exp.policy_version}: {staleness} "
                               f"versions behind the policy it would train (at most {MAX_STALENESS})")
        exp.metrics = exp.metrics | {"rollout/staleness": staleness}
        return exp

    def collect_ahead(self, step: int) -> None:
        """Start batch ``step`` on the weights served now, in a daemon thread (a stop signal must not
        wait for it); ``collect`` takes it, ``push_weights`` and ``state_dict`` wait for it."""
        if self._ahead is not None:
            raise RuntimeError(f"batch {step} requested while the batch ahead is still pending")
        self._ahead = Future()
        threading.Thread(target=_run_into, args=(self._ahead, self._generate, step), daemon=True,
                         name=f"megadiv-rollout-step{step}").start()

    def _finish_ahead(self) -> float:
        """Wait until the batch ahead, if any, is done (``collect`` takes it); the seconds waited."""
        start = time.perf_counter()
        if self._ahead is not None:
            self._ahead.result()
        return time.perf_counter() - start

    def _generate(self, step: int) -> Experience:
        timer = StepTimer()
        torch.manual_seed(self.cfg.run.seed * 1_000_003 + step)  # sampling reproducible per step (resume)
        exp = self._sample(timer)
        exp.metrics = exp.metrics | timer.as_metrics(total=False)  # time/rollout, time/reward of this batch
        return exp

    def _sample(self, timer: StepTimer) -> Experience:
        """One rollout batch of grpo.prompts_per_step groups; with dynamic sampling, groups without
        reward variance are replaced by fresh ones for up to grpo.max_resample_rounds rounds."""
        g, want = self.cfg.advantage.group_size, self.cfg.grpo.prompts_per_step
        kept, spare, rounds = [], [], 0
        while True:
            exp = self._rollout(self.sampler.next_batch(), timer)
            if not self.cfg.grpo.dynamic_sampling:
                return exp
            useful = informative_groups(exp, g)
            kept.append(take_groups(exp, useful, g))
            spare.append(take_groups(exp, [i for i in range(len(exp) // g) if i not in useful], g))
            have = sum(len(e) for e in kept) // g
            if have >= want or rounds == self.cfg.grpo.max_resample_rounds:
                break
            rounds += 1
        # Fill up with zero-advantage groups (no policy gradient) to keep the batch shape.
        batch = concat(kept + spare)
        batch = take_groups(batch, list(range(want)), g)
        batch.metrics = exp.metrics | {"dynamic/kept_groups": min(have, want) / want, "dynamic/rounds": rounds + 1}
        return batch

    def _rollout(self, indices: list[int], timer: StepTimer) -> Experience:
        records = [self.dataset[i] for i in indices]
        prompts = [self.template.token_ids(r, self.tokenizer) for r in records]
        with timer("rollout"):
            groups = self.engine.generate(prompts, self.sampling)
        versions = {c.weight_version for group in groups for c in group}
        if versions != {version_name(self.served_step)}:  # a push can never land mid-batch (push_weights)
            raise RolloutError(f"a rollout batch came from weight versions {sorted(versions)}, expected only "
                               f"{version_name(self.served_step)!r}")
        with timer("reward"):
            texts = [self._decode(c.token_ids) for group in groups for c in group]
            result = self.reward(texts, [r for r in records for _ in range(self.sampling.n)])
        return build_experience(prompts, groups, result.scores, result.reasons, self.cfg.advantage,
                                self.sampling.max_new_tokens, self.cfg.grpo.overlong_buffer,
                                self.cfg.grpo.overlong_penalty, self.cfg.grpo.mask_truncated, self.served_step)

    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 (eval/accuracy) on eval.data, with eval.samples = k > 0 also avg@k and pass@k
        at eval.temperature; the same for each of eval.extra_data as eval/<name>_<split>/<metric>."""
        cfg = self.cfg.eval
        self._finish_ahead()  # on an idle engine, with torch's generator to itself
        sampling = EvalSampling(cfg.max_new_tokens or self.sampling.max_new_tokens, cfg.samples, cfg.temperature)
        metrics = {}
        for i, (name, result) in enumerate(self.eval_suite.run(self.engine, sampling).items()):
            primary = i == 0 and cfg.data is not None
            prefix = "eval/" if primary else f"eval/{name.replace(':', '_')}/"
            metrics |= {prefix + ("accuracy" if key == "pass@1" and primary else key): value
                        for key, value in accuracy(result).items()}
        return metrics

    def release(self) -> None:
        """End a rollout phase (collect, evaluate): the other ranks stop serving generation."""
        if self._split:
            self.engine.release()

    def push_weights(self, buckets, step: int, share: bool = False) -> dict[str, float]:
        """Serve the weights of ``step``: after the batch in flight, which the old weights finish.
        ``share``: the buckets are views of the actor's parameters (embedded engine only)."""
        waited = self._finish_ahead()
        report = (self.engine.update_weights(buckets, version_name(step), share=True) if share
                  else self.engine.update_weights(buckets, version_name(step)))
        self.served_step = step
        return {"sync/mb_per_s": report.mb_per_s, "sync/buckets": report.num_buckets, "time/rollout_wait": waited}

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollout side: the prompt position and the batch generated
        ahead (saved, not regenerated: its weights, step - 1's, are not in the checkpoint)."""
        ahead = self._ahead.result().state_dict() if self._ahead is not None else None  # waits for it
        return {"sampler": self.sampler.state_dict(), "batch_ahead": ahead}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if state.get("batch_ahead") is not None:
            self._ahead = Future()
            self._ahead.set_result(Experience.from_state_dict(state["batch_ahead"]))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        for close in (self.engine.shutdown, self.eval_suite.close, self.reward.close):
            try:
                close()
            except Exception:  # closing must not mask the error that brought us here
                log.exception("while closing the rollout driver")


class RolloutWorker:
    """A rank other than 0 when every rank generates (generation_group): its own embedded engine
    generates its slice of rank 0's calls and serves the weights of this rank's own export."""

    def __init__(self, cfg: TrainConfig, hf_dir: str, group):
        self.engine, self.group = make_engine(cfg.rollout, hf_dir, group=group), group

    def serve(self) -> None:
        """Generate this rank's slices of rank 0's calls until rank 0 releases the ranks."""
        self.engine.serve(self.group)

    def push_weights(self, buckets, step: int, share: bool = False) -> dict[str, float]:
        self.engine.update_weights(buckets, version_name(step), share=share)
        return {}

    def close(self) -> None:
        self.engine.shutdown()


def version_name(step: int) -> str:
    """The engine's name for the weights of trainer step ``step`` (0: "default", the starting weights)."""
    return f"step-{step}" if step else "default"


def _run_into(future: Future, fn, *args) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to whoever waits for the batch
        future.set_exception(e)


def drain(buckets: Iterable[Bucket]) -> None:
    """Take part in a collective weight export without sending anything (ranks other than 0)."""
    for _ in buckets:
        pass
