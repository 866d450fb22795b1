"""Steps/s of ``megadiv train`` with and without ``grpo.overlap`` (one-step off-policy), and where the time goes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_overlap.py --engines sglang --steps 8 --repeats 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_overlap.py --probe              # the contention probe

Each row is the real loop (``megadiv train`` under torchrun, 1 rank, TP=1) on the tiny arithmetic
task with a random model (no warm start, no evaluation), launched serially and with
``grpo.overlap=true``, alternately ``--repeats`` times (so that a change of the machine's load
falls on both); all with ``loss.tis_cap=2`` (the overlapped loss needs it). The figure is the
median of ``time/step`` (a step's wall clock: generation exposed + train + sync) over steps 2..
of every launch of that mode, step 1 being serial in both. Printed: steps/s of both modes, the
speed-up (and each launch pair's), the component medians, the bound the serial components allow
on 2 cores, (rollout + reward + train + sync) / (max(rollout + reward, train) + sync), and the
overlapped training phase over the serial one (1.00: generation beside it costs training
nothing). ``--prompts``, ``--samples``, ``--new-tokens`` set the generation's size and
``--hidden``/``--layers`` the model's: the default shape makes generation and training take
similar times on 2 cores. The machine's load average is printed before and after.

What can overlap: with the SGLang server, generation runs in the server's processes while the
rank trains, so on 2 cores (1 rank + 1 server) a step can approach max(rollout, train) instead of
their sum. The embedded engine generates in a thread of the rank's own process: the GIL and the
one core the rank uses are shared, so on CPU that row shows the semantics' cost, not a gain.

``--probe``: in one process, the trainer's policy (1 rank, TP=1) and the rollout driver with a
launched SGLang server, on the same shape; trials interleaved ``--repeats`` times (median): the
training phase (one update) alone and while the driver generates the next batch beside it
(``start_batch``, as the overlapped loop does), each also with a pi_old forward pass of its own
(what the overlapped step paid before it used the training forward's log-probs), and the
generation alone and beside training; wall seconds and the training thread's CPU seconds (CPU
time is insensitive to other jobs' load: it rises only with cache or memory-bandwidth
contention). ``--pin`` adds the same trials with the rank on core 0 and the server's processes on
the others.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "grpo.yaml"


def run_train(run_dir: Path, overrides: list[str], timeout_s: float) -> list[dict]:
    """One ``megadiv train`` launch; its per-step records (metrics.jsonl)."""
    cmd = [sys.executable, "-m", "megadiv.cli", "train", str(CONFIG), f"run.output_dir={run_dir.parent}",
           f"run.name={run_dir.name}", f"model.hf_dir={run_dir}/init", *overrides, "--nproc", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, the rank and the server it launched
        out, _ = proc.communicate()
        raise SystemExit(f"megadiv train timed out after {timeout_s:.0f}s:\n{out[-4000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"megadiv train failed ({proc.returncode}):\n{out[-6000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step" in r]


def median_of(runs: list[list[dict]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for records in runs for r in records[1:])  # step 1 is serial


PHASES = ("step", "rollout", "reward", "rollout_wait", "train", "sync")


def shape_overrides(args: argparse.Namespace) -> list[str]:
    rows = args.prompts * args.samples
    return [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={4 * args.hidden}",
            f"model.num_layers={args.layers}", "parallel.tensor_parallel=1", "warm_start.sft_steps=0",
            "eval.data=null", "eval.every=0", "checkpoint.every=0", "checkpoint.export_hf=false",
            f"grpo.steps={args.steps}", f"grpo.prompts_per_step={args.prompts}", f"rollout.n_samples={args.samples}",
            f"advantage.group_size={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
            "grpo.mini_batches=1", f"grpo.micro_batch_size={rows}", "loss.tis_cap=2.0"]


def engine_overrides(engine: str) -> list[str]:
    return [f"rollout.engine={engine}"] + (["rollout.sync_method=distributed"] if engine == "sglang" else [])


def loop(args: argparse.Namespace, tmp: Path) -> None:
    for engine in args.engines:
        runs = {False: [], True: []}
        for i in range(args.repeats):
            for overlap in (False, True):
                records = run_train(tmp / f"{engine}-{int(overlap)}-{i}", shape_overrides(args) + engine_overrides(engine)
                                    + [f"grpo.overlap={str(overlap).lower()}"], args.timeout)
                assert [r["step"] for r in records] == list(range(1, args.steps + 1))
                assert all(r["rollout/staleness"] == (min(r["step"] - 1, 1) if overlap else 0) for r in records)
                runs[overlap].append(records)
        t = {overlap: {k: median_of(runs[overlap], f"time/{k}") for k in PHASES} for overlap in runs}
        for overlap, name in ((False, "serial"), (True, "overlapped")):
            m = t[overlap]
            print(f"{engine:8s} {name:10s}: {1 / m['step']:.3f} steps/s (median step {m['step']:.2f} s: rollout "
                  f"{m['rollout']:.2f}, reward {m['reward']:.2f}, waited for it {m['rollout_wait']:.2f}, train "
                  f"{m['train']:.2f}, sync {m['sync']:.2f})", flush=True)
        pairs = [median_of([s], "time/step") / median_of([o], "time/step") for s, o in zip(runs[False], runs[True])]
        s = t[False]
        bound = (s["rollout"] + s["reward"] + s["train"] + s["sync"]) / (
            max(s["rollout"] + s["reward"], s["train"]) + s["sync"])
        print(f"{engine:8s} speed-up {s['step'] / t[True]['step']:.2f}x steps/s (launch pairs: "
              f"{', '.join(f'{x:.2f}x' for x in pairs)}); bound from the serial components {bound:.2f}x; "
              f"overlapped train / serial train {t[True]['train'] / s['train']:.2f}", flush=True)


def probe(args: argparse.Namespace, tmp: Path) -> None:
    """The contention probe (module docstring): runs in this process, as a world of one rank."""
    import threading
    import time

    import psutil
    from transformers import AutoTokenizer

    from megadiv import parallel
    from megadiv.config import ModelConfig, load_config, to_dict
    from megadiv.policy.objectives import grpo_objective
    from megadiv.trainer.backend import make_policy
    from megadiv.trainer.config import TrainConfig
    from megadiv.trainer.driver import RolloutDriver
    from megadiv.trainer.handoff import Handoff, ReplicaRows, from_torch_bytes
    from megadiv.trainer.warm_start import starting_checkpoint

    cfg = load_config(TrainConfig, CONFIG, shape_overrides(args) + engine_overrides("sglang") + [
        f"run.output_dir={tmp}", "run.name=probe", f"model.hf_dir={tmp}/init", "grpo.overlap=true"])
    info = parallel.initialize(cfg.parallel, cfg.run.seed)
    start_dir = starting_checkpoint(cfg, tmp / "probe", info)
    actor = make_policy(cfg, ModelConfig(**{**to_dict(cfg.model), "hf_dir": start_dir}), "actor", cfg.optim, 1000)
    tokenizer = AutoTokenizer.from_pretrained(start_dir)
    store, port = Handoff.host(cfg.rollout.handoff_timeout_s)
    driver = RolloutDriver(cfg, start_dir, tokenizer, store, dp_size=1)
    handoff = Handoff.connect("127.0.0.1", port, cfg.rollout.handoff_timeout_s)  # the rank's side

    def collect() -> tuple[ReplicaRows, dict]:
        """Batch 1 again (started with driver.start_batch(1)): its rows and metrics."""
        metrics = from_torch_bytes(handoff.wait("batch/1"))
        rows = ReplicaRows.decode(handoff.take("batch/1/0"))
        handoff.store.delete_key("batch/1/status")  # the next start_batch(1) publishes it anew
        return rows, metrics

    objective, mbs = grpo_objective(cfg.loss), cfg.grpo.micro_batch_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    driver.start_batch(1)
    batch = collect()[0].to_batch(pad_id)
    (member,) = driver.engine.members.values()
    server = [psutil.Process(member.server.proc.pid)]
    server += server[0].children(recursive=True)
    everything = set(os.sched_getaffinity(0))

    def pin(on: bool) -> None:
        cores = sorted(everything)
        for proc, where in [(psutil.Process(), {cores[0]})] + [(p, set(cores[1:])) for p in server]:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, where if on else everything)

    def train(own_forward: bool) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        batch.logp_old = actor.log_probs(batch, mbs) if own_forward else None
        actor.train_step(batch, objective, mbs)
        return time.perf_counter() - wall, time.thread_time() - cpu

    results: dict[str, list[tuple[float, ...]]] = {}
    train(False)  # warm-up: Adam's moments
    for _ in range(args.repeats):
        for pinned in (False, True) if args.pin else (False,):
            pin(pinned)
            where = " (pinned)" if pinned else ""
            driver.start_batch(1)
            gen = collect()[1]["time/rollout"]
            results.setdefault(f"generation alone{where}", []).append((gen,))
            for own_forward in (False, True):
                what = "train + own pi_old forward" if own_forward else "train (one update)"
                results.setdefault(f"{what} alone{where}", []).append(train(own_forward))
                driver.start_batch(1)   # generate batch 1 again, beside training, as the overlapped loop does
                wall_cpu = train(own_forward)
                beside = collect()[1]["time/rollout"]
                results.setdefault(f"{what} beside generation{where}", []).append(wall_cpu)
                results.setdefault(f"generation beside training{where}", []).append((beside,))
            threading.Event().wait(0.5)
    pin(False)
    driver.close()
    parallel.shutdown()
    print(f"probe: median of {args.repeats} interleaved trials; wall s, training thread CPU s")
    for name, values in results.items():
        cols = [statistics.median(v[i] for v in values) for i in range(len(values[0]))]
        print(f"  {name:56s} wall {cols[0]:.3f}" + (f"  cpu {cols[1]:.3f}" if len(cols) > 1 else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["sglang", "embedded"], choices=["sglang", "embedded"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="launches of each mode, alternating (--probe: trials)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    ap.add_argument("--probe", action="store_true", help="the in-process contention probe instead of the launches")
    ap.add_argument("--pin", action="store_true", help="--probe: also pinned (the rank on core 0, the server beside)")
    args = ap.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin needs 2 cores or more")

    print(f"shape: {args.prompts} prompts x {args.samples} samples x <= {args.new_tokens} new tokens, model hidden "
          f"{args.hidden} x {args.layers} layers, 1 rank (TP=1)" + ("" if args.probe else
          f", {args.steps} steps x {args.repeats} launches per mode; medians over steps 2..{args.steps}"))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="megadiv-bench-overlap-") as tmp:
        (probe if args.probe else loop)(args, Path(tmp))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
