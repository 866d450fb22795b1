"""The rollout driver: prompts -> a stream of GRPO groups -> rewards -> advantages -> each
data-parallel replica's rows in the hand-off store (handoff.py); held-out evaluation.

One driver per job. With SGLang servers it runs in a process of its own (:class:`DriverProcess`,
spawned by rank 0), so decoding, JSON parsing and reward bookkeeping never hold a trainer rank's
GIL; with the embedded engine it runs in rank 0's process, whose engine is (or shares) the model.

A batch is built from a stream (megadiv/rollout/stream.py): the driver keeps as many groups in
flight as the step still needs, grades each group as it comes back (in a thread beside the
generation), and stops once ``grpo.prompts_per_step`` groups are in, aborting the rest:

- groups with an aborted completion, or one the server cut short of max_new_tokens, are never
  trained (rollout/dropped_groups); another prompt takes their place;
- dynamic sampling (DAPO) keeps only groups whose rewards differ, drawing
  ceil(prompts_per_step x grpo.oversample) groups at once and topping up while the groups in
  flight cannot fill the step (at most grpo.max_resample_rounds times); a step still short is
  filled with uniform (zero-advantage) groups.

With ``grpo.overlap`` generation runs in a background thread of the driver (``start_batch``);
without it in the calling thread (rank 0's main thread in-process, which would only wait: a
second thread's torch calls would start a second OpenMP thread pool, and two pools on the same
cores throttle each other's spin-waits, which made 2 threads per rank slower than 1). The ranks
wait on store keys, not collectives. ``quiesce`` waits for it before a weight push, so every
batch comes from one weight version (``Experience.policy_version``, checked against each
completion). With
``grpo.overlap`` batch k+1 is started on step k-1's weights right after batch k is handed over
(one step off-policy, rollout/staleness).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

import torch

from megadiv.data import PromptSampler, PromptTemplate, load_dataset
from megadiv.evaluation import EvalSampling, EvalSuite, accuracy, default_reward
from megadiv.rewards import build_reward
from megadiv.rollout import RolloutError, SamplingParams, make_engine
from megadiv.rollout.fleet import FleetEngine
from megadiv.rollout.mismatch import ProbeBatch, spread
from megadiv.rollout.sglang_server import TrainerMemory
from megadiv.rollout.stream import GroupResult
from megadiv.trainer.checksum import file_record
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.experience import Experience, build_experience, informative
from megadiv.trainer.handoff import Handoff, torch_bytes

log = logging.getLogger(__name__)

MAX_STALENESS = 1
"""Weight versions a trained batch may lag the policy it updates (0 on-policy, 1 with grpo.overlap)."""


class RolloutDriver:
    """Prompts -> completions -> rewards -> advantages -> the hand-off store; evaluation."""

    def __init__(self, cfg: TrainConfig, hf_dir: str, tokenizer, handoff: Handoff, dp_size: int,
                 trainer_memory: TrainerMemory | None = None, group=None):
        self.cfg, self.tokenizer, self.handoff, self.dp_size = cfg, tokenizer, handoff, dp_size
        self.dataset = load_dataset(cfg.data)
        self.template = PromptTemplate.resolve(cfg.data, self.dataset, tokenizer)
        # one prompt at a time: the stream draws as many as the step needs
        self.sampler = PromptSampler(len(self.dataset), 1, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.reward = build_reward(cfg.reward)
        # eval.data is graded with the training reward, eval.extra_data with their datasets' own
        eval_data = ([cfg.eval.data] if cfg.eval.data is not None else []) + list(cfg.eval.extra_data)
        self.eval_suite = EvalSuite.build(
            eval_data, [cfg.reward] * (cfg.eval.data is not None) + [default_reward(d.name, cfg.reward)
                                                                     for d in cfg.eval.extra_data],
            tokenizer, shared={cfg.reward: self.reward})
        self.engine = make_engine(cfg.rollout, hf_dir, trainer_memory, group)  # after the models: place_server
        self._split = group is not None  # generation_group: every rank generates a slice of each call
        # r3: the engine returns the experts it routed each position to, replayed by the trainer
        self.sampling = replace(SamplingParams.from_config(cfg.rollout), return_routing=cfg.grpo.routing_replay == "r3")
        self.served_step = 0  # the trainer step whose weights the engine serves (0: the starting ones)
        self._batches = ThreadPoolExecutor(1, thread_name_prefix="megadiv-rollout") if cfg.grpo.overlap else None
        self._grader = ThreadPoolExecutor(1, thread_name_prefix="megadiv-reward")
        self._job: Future | None = None          # the batch being generated (and published)
        self._published: tuple[int, Experience] | None = None
        self._restored: Experience | None = None  # a batch generated ahead, from a checkpoint
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="megadiv-rollout-save")
        self._saving: Future | None = None       # the state file being written (save_state)

    # ------------------------------------------------------------------ batches

    def start_batch(self, step: int) -> None:
        """Generate batch ``step`` on the weights served now, in the background, and publish each
        replica's rows (or the error, which every waiting rank raises). With grpo.overlap the ranks
        ask for it as soon as the previous batch is published, while that job may still be releasing
        the generation ranks: it queues behind it on the one generation thread. Without overlap the
        batch is generated here, before this returns (the caller would only wait for it)."""
        self._job = self._batches.submit(self._publish, step) if self._batches else finished(self._publish, step)

    def _publish(self, step: int) -> None:
        try:
            exp = self._collect(step)
            self.handoff.publish_batch(step, exp, self.dp_size, self.cfg.grpo.mini_batches)
            self._published = (step, exp)
        except BaseException as e:
            self.handoff.fail(f"batch/{step}", e)
            raise
        finally:
            self._release()

    def _collect(self, step: int) -> Experience:
        """Batch ``step``: the one restored from a checkpoint, else one generated now. Records
        rollout/staleness, the trainer's weight version (step - 1) minus the generating one, and
        raises if it is outside [0, MAX_STALENESS]."""
        exp, self._restored = self._restored, None
        if exp is None:
            torch.manual_seed(self.cfg.run.seed * 1_000_003 + step)  # sampling reproducible per step (resume)
            exp = self._sample()
        staleness = step - 1 - exp.policy_version
        if not 0 <= staleness <= MAX_STALENESS:
            raise RolloutError(f"batch {step} was generated by the weights of step {exp.policy_version}: {staleness} "
                               f"versions behind the policy it would train (at most {MAX_STALENESS})")
        exp.metrics = exp.metrics | {"rollout/staleness": staleness}
        return exp

    def _sample(self) -> Experience:
        """One batch of grpo.prompts_per_step complete groups from the engine's stream (see the
        module docstring)."""
        g, want = self.cfg.grpo, self.cfg.grpo.prompts_per_step
        wave = math.ceil(want * g.oversample)
        limit = wave + g.max_resample_rounds * wave  # groups drawn at most
        stream = self.engine.open_stream(self.sampling)
        useful, uniform, grading = [], [], []
        counts = {"drawn": 0, "dropped": 0, "aborted_completions": 0, "top_ups": 0}
        start, graded_s = time.perf_counter(), [0.0]

        def submit(n: int) -> None:
            for _ in range(min(n, limit - counts["drawn"])):
                index = self.sampler.next_batch()[0]
                stream.submit(index, self.template.token_ids(self.dataset[index], self.tokenizer))
                counts["drawn"] += 1

        def take(graded) -> None:
            result, scores, reasons = graded
            completions = result.completions
            cut = sum(c.finish_reason == "abort" or (c.finish_reason == "length"
                                                     and len(c.token_ids) < self.sampling.max_new_tokens)
                      for c in completions)
            if cut:  # never trained as complete: the server aborted it or cut it short
                counts["dropped"] += 1
                counts["aborted_completions"] += cut
            elif not g.dynamic_sampling or informative(scores, completions, self.sampling.max_new_tokens,
                                                       g.overlong_buffer, g.overlong_penalty):
                useful.append(graded)
            else:
                uniform.append(graded)

        try:
            submit(wave)
            while len(useful) < want:
                for fut in [f for f in grading if f.done()]:
                    grading.remove(fut)
                    take(fut.result())
                if len(useful) >= want:
                    break
                if want - len(useful) - stream.pending - len(grading) > 0 and counts["drawn"] < limit:
                    counts["top_ups"] += 1  # what is in flight cannot fill the step: draw more
                    submit(math.ceil((want - len(useful) - stream.pending - len(grading)) * g.oversample))
                if stream.pending:
                    grading.append(self._grader.submit(self._grade, stream.next_done(), graded_s))
                elif grading:
                    wait(grading, return_when=FIRST_COMPLETED)
                else:
                    break  # nothing left in flight and nothing more to draw
            aborted = stream.abort_pending()
            for fut in grading:  # groups already back: graded, then kept as spares
                take(fut.result())
        finally:
            stream.close()
        kept = useful[:want] + uniform[:max(0, want - len(useful))]
        if len(kept) < want:
            raise RolloutError(f"only {len(kept)} of grpo.prompts_per_step={want} groups came back complete after "
                               f"{counts['drawn']} drawn ({counts['dropped']} with aborted or server-cut completions)")
        exp = self._experience(kept)
        stats = stream.stats
        exp.metrics = exp.metrics | {
            "time/rollout": time.perf_counter() - start, "time/reward": graded_s[0],
            "rollout/drawn_groups": counts["drawn"], "rollout/dropped_groups": counts["dropped"],
            "rollout/aborted_completions": counts["aborted_completions"], "rollout/aborted_groups": aborted,
            "rollout/resent_groups": stats.resent_groups, "rollout/dropped_servers": len(stats.dropped_servers),
            "rollout/servers": len(stats.groups_by_server)}
        if g.dynamic_sampling:
            exp.metrics |= {"dynamic/kept_groups": min(len(useful), want) / want,
                            "dynamic/rounds": counts["top_ups"] + 1}
        return exp

    def _grade(self, result: GroupResult, seconds: list[float]):
        start = time.perf_counter()
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in result.completions]
        graded = self.reward(texts, [self.dataset[result.key]] * len(texts))
        seconds[0] += time.perf_counter() - start
        return result, graded.scores, graded.reasons

    def _experience(self, kept: list) -> Experience:
        versions = {c.weight_version for result, _, _ in kept for c in result.completions}
        if versions != {version_name(self.served_step)}:  # a push can never land mid-batch (quiesce)
            raise RolloutError(f"a rollout batch came from weight versions {sorted(versions)}, expected only "
                               f"{version_name(self.served_step)!r}")
        g = self.cfg.grpo
        return build_experience([r.prompt for r, _, _ in kept], [r.completions for r, _, _ in kept],
                                [s for _, scores, _ in kept for s in scores],
                                [x for _, _, reasons in kept for x in reasons], self.cfg.advantage,
                                self.sampling.max_new_tokens, g.overlong_buffer, g.overlong_penalty,
                                g.mask_truncated, self.served_step)

    def quiesce(self, step: int) -> dict[str, str]:
        """Before the weights of ``step`` are pushed: wait for the batch in flight (the old
        weights finish it), then let the ranks start the export. Returns the servers the driver's
        streams have dropped so far, and why: rank 0 pushes to the others only."""
        try:
            if self._job is not None:
                self._job.result()
        except BaseException as e:
            self.handoff.fail(f"push/{step}", e)
            raise
        self.handoff.publish(f"push/{step}")
        return dict(self.engine.dropped) if isinstance(self.engine, FleetEngine) else {}

    def served(self, step: int, servers: list[str] | None = None) -> None:
        """The engine now serves the weights of ``step``; with SGLang on exactly ``servers``
        (rank 0's fleet after the push: a server that came back joins here now that it serves them)."""
        self.served_step = step
        if servers is not None and isinstance(self.engine, FleetEngine):
            self.engine.adopt(servers)

    # ------------------------------------------------------------------ evaluation and state

    def evaluate(self, index: int) -> dict[str, float]:
        """Greedy pass@1 (eval/accuracy) on eval.data, with eval.samples = k > 0 also avg@k and pass@k
        at eval.temperature; the same for each of eval.extra_data as eval/<name>_<split>/<metric>.
        Evaluation ``index`` of the run: its store key wakes the ranks."""
        cfg = self.cfg.eval
        try:
            if self._job is not None:
                self._job.result()  # on an idle engine, with torch's generator to itself
            sampling = EvalSampling(cfg.max_new_tokens or self.sampling.max_new_tokens, cfg.samples, cfg.temperature)
            metrics = {}
            for i, (name, result) in enumerate(self.eval_suite.run(self.engine, sampling).items()):
                primary = i == 0 and cfg.data is not None
                prefix = "eval/" if primary else f"eval/{name.replace(':', '_')}/"
                metrics |= {prefix + ("accuracy" if key == "pass@1" and primary else key): value
                            for key, value in accuracy(result).items()}
        except BaseException as e:
            self.handoff.fail(f"eval/{index}", e)
            raise
        finally:
            self._release()
        self.handoff.publish(f"eval/{index}")
        return metrics

    def probe(self) -> None:
        """Draw the weight-sync probe (rollout.mismatch): rollout.probe_prompts held-out prompts,
        the first eval split's (else the training data's) spread evenly, and the engine's answers
        on the weights it serves now; published as store key ``probe`` for every rank."""
        try:
            n, held_out = self.cfg.rollout.probe_prompts, next((s.prompts for s in self.eval_suite.sets), None)
            prompts = ([held_out[i] for i in spread(len(held_out), n)] if held_out else
                       [self.template.token_ids(self.dataset[i], self.tokenizer) for i in spread(len(self.dataset), n)])
            with torch.random.fork_rng():  # the same draw for the same seed, and the run's sampling as without it
                torch.manual_seed(self.cfg.run.seed)
                probe = ProbeBatch.answer(self.engine, prompts, self.cfg.rollout, real_vocab=len(self.tokenizer))
        except BaseException as e:
            self.handoff.fail("probe", e)
            raise
        finally:
            self._release()
        self.handoff.publish("probe", torch_bytes([probe.prompts, probe.responses]))

    def _release(self) -> None:
        """End a generation phase: the other ranks stop serving generation (generation_group)."""
        if self._split:
            self.engine.release()

    def save_state(self, directory: str, step: int) -> None:
        """Start writing what a checkpoint after ``step`` keeps of the rollout side to
        ``directory``/STATE_FILE, in a thread of this driver: the prompt position and a batch
        generated ahead (saved, not regenerated: its weights, step - 1's, are not in the
        checkpoint). The trainer ranks never hold it: not pickled to rank 0, not in megatron's
        common state, and training goes on while it is written. Both are taken now; the next batch
        (``start_batch``) moves the sampler but leaves this batch's tensors and lists as they are."""
        if self._job is not None:
            self._job.result()
        ahead = self._published[1].state_dict() if self._published and self._published[0] > step else None
        state = {"sampler": self.sampler.state_dict(), "batch_ahead": ahead}
        self._saving = self._saver.submit(_write_state, Path(directory) / STATE_FILE, state)

    def state_saved(self) -> dict[str, list]:
        """Wait until ``save_state``'s file is written: its manifest entry, {name: [size, xxh3-64]}."""
        saving, self._saving = self._saving, None
        return saving.result()

    def load_state(self, path: str) -> None:
        """Continue from a checkpoint's STATE_FILE (``path``, checksummed by the resume)."""
        state = torch.load(path, weights_only=True)
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:
            raise RolloutError(f"the checkpoint's prompt position does not fit this driver ({e}): data.seed or the "
                               f"training data changed since it was written") from None
        if state["batch_ahead"] is not None:
            self._restored = Experience.from_state_dict(state["batch_ahead"])

    def close(self) -> None:
        if self._batches is not None:
            self._batches.shutdown(wait=False, cancel_futures=True)
        self._grader.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=False, cancel_futures=True)
        for close in (self.engine.shutdown, self.eval_suite.close, self.reward.close):
            try:
                close()
            except Exception:  # closing must not mask the error that brought us here
                log.exception("while closing the rollout driver")


STATE_FILE = "rollout_state.pt"
"""The driver's file in a checkpoint (named in its manifest): the prompt position and the batch ahead."""


def _write_state(path: Path, state: dict) -> dict[str, list]:
    torch.save(state, path)
    return file_record(path)  # hashed here, as each rank's writer hashes its shards


def finished(fn, *args) -> Future:
    """``fn(*args)`` run now, as a Future holding its result or its exception (what a thread
    pool's job would hold once done)."""
    future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)
    return future


class DriverProcess:
    """A RolloutDriver in a process of its own, spawned here (rank 0); its methods are called over
    a pipe and return what the driver's return (``port``: its hand-off store's)."""

    def __init__(self, cfg: TrainConfig, hf_dir: str, dp_size: int):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout_s = cfg.rollout.handoff_timeout_s
        self.received_bytes = 0  # what the driver's replies brought into this process (rank 0), pickled
        self.proc = ctx.Process(target=_serve_driver, args=(child, cfg, hf_dir, dp_size), name="megadiv-driver")
        self.proc.start()
        child.close()
        self.port = self._reply("start")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self._conn.send((name, args, kwargs))
            return self._reply(name)
        return call

    def _reply(self, what: str):
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(1.0):
            if not self.proc.is_alive():
                raise RolloutError(f"the rollout driver process died (exit code {self.proc.exitcode}) during {what}")
            if time.monotonic() > deadline:
                raise RolloutError(f"the rollout driver did not answer {what} within rollout.handoff_timeout_s="
                                   f"{self.timeout_s:g} s")
        data = self._conn.recv_bytes()
        self.received_bytes += len(data)
        kind, value = pickle.loads(data)
        if kind == "error":
            raise RolloutError(f"rollout driver: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close", (), {}))
                self._conn.poll(60.0)
            except OSError:
                pass
            self.proc.join(30.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10.0)


def _serve_driver(conn, cfg: TrainConfig, hf_dir: str, dp_size: int) -> None:
    """The driver process: build the driver, then answer calls until ``close``."""
    from transformers import AutoTokenizer

    from megadiv.rollout.sglang_server import term_on_parent_death

    term_on_parent_death()
    torch.set_num_threads(1)  # decoding and bookkeeping only: leave the cores to the trainer
    driver = None
    try:
        handoff, port = Handoff.host(cfg.rollout.handoff_timeout_s)
        driver = RolloutDriver(cfg, hf_dir, AutoTokenizer.from_pretrained(hf_dir), handoff, dp_size)
        conn.send(("ok", port))
        while True:
            name, args, kwargs = conn.recv()
            if name == "close":
                break
            try:
                conn.send(("ok", getattr(driver, name)(*args, **kwargs)))
            except BaseException as e:  # handed to rank 0, which fails the run with it
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if driver is not None:
            driver.close()
        conn.send(("ok", None))


def version_name(step: int) -> str:
    """The engine's name for the weights of trainer step ``step`` (0: "default", the starting weights)."""
    return f"step-{step}" if step else "default"
