"""One prepared GPU verification run: every GPU path of megadiv checked in one device call.

    bash tools/gpu_check.sh OUT_DIR [--only ITEM,ITEM] [--budget SECONDS] [--smoke]

First the wheels carried in ``.whl/`` (tools/gpu_wheels.sh) are installed into a target folder
that every item's PYTHONPATH starts with, and the working tree and those wheels are byte-compiled
(compileall, all cores) so that no item compiles them again; then each item runs in its own
process (new session, under coreutils ``timeout`` with its own budget, the whole group killed
afterwards), so that an item that fails, hangs or crashes never stops the others or the report.
Budgets sum to less than the run's budget (default 540 s: a device call runs at most 600 s), and
an item never gets more than what is left of it. An item writes what it has measured so far as
it goes (``write_partial``): an item cut at its budget, or failing half-way, reports those
figures, marked ``partial``.

Items (docs/performance.md, "GPU verification", says what each measures and its tolerance):
  gpu_tests          pytest -m gpu, one process per test module under the module's own budget
                     (GPU_TEST_BUDGETS), outcomes written per test: counts per module and in all,
                     failures, skip reasons; a module cut at its budget reports the tests that finished
  divergence_bench   benchmarks/bench_divergence.py --device cuda at 16,384 tokens x 151,936
                     vocabulary, bf16, TP=1: megadiv log-prob + entropy + k3-clip and full-vocab
                     ProbL2 against megatron-core's vocab_parallel_cross_entropy (CUDA events,
                     warm-up excluded, medians, raw samples, peak memory)
  vocab_parallel_trainer
                     the same at the trainer's shapes: float32 logits, 4,608 x 37,984
  no_host_sync       torch.cuda.set_sync_debug_mode("error") around the divergence library's
                     forward + backward passes (with a planted .item() that must be caught)
  gpt_step_mfu       megatron-core GPTModel (megadiv's builder, local spec), bf16, ~1.1B
                     parameters: training step time and MFU = 6 N tokens / time / 989 TFLOP/s
  actor_train_step   megadiv's Policy.train_step at the same shape and tokens: tokens/s, MFU, and
                     its peak memory against megadiv plan's figure
  weight_sync_rates  weight export (Policy.export_buckets) GB/s and CUDA-IPC hand-off GB/s
  async_checkpoint   the trainer's async checkpoint save: blocking and total seconds, a training
                     step during the write, a bit-exact reload
  bf16_probe         the post-sync probe's mean |delta log p|, embedded engine vs trainer at the
                     same bf16 weights, on real text and on random tokens
  grpo_demo          3 GRPO steps of the tiny demo (examples/tiny/grpo.yaml, TP=1) on the GPU
                     with the embedded engine, through ``megadiv train``
  deepspeed_bf16     the DeepSpeed policy in bf16 at ZeRO-0, 1 and 3, three Adam steps each of
                     the same batch and GRPO loss (tests/dist/deepspeed_policy.py:bf16_stages)
  padding_invariance one SGD step with the model input padded to a multiple of 16 (FP8's rule)
                     against none, megatron's local layers (tests/dist/device_placement.py)
  transformer_engine, sglang_cuda
                     whether those packages import here; they cannot be carried (too large), so
                     on the verification machine they report ``skipped: not carried``
Without CUDA every GPU item is ``skipped`` with its reason. ``--smoke`` runs the items at toy
shapes on whatever device there is (a CPU too, except no_host_sync), to test this script's own
code; its figures mean nothing.

Report ``OUT_DIR/gpu_check.json`` (schema 3)::

    {"schema": 3, "started": ISO time, "wall_s": s, "budget_s": s, "smoke": bool,
     "environment": {python, torch, cuda, gpu, packages, ...},
     "wheels": {"status": ..., "reason": ..., "figures": {wheels, target, bytes}},
     "precompile": {"status": ..., "figures": {paths, wall_s}},
     "unverified": [{"feature": str, "why": str}, ...]   # GPU paths this run cannot reach
     "items": {NAME: {"status": "passed" | "failed" | "skipped", "reason": str | null,
                      "figures": {...}, "samples": {...}, "wall_s": s, "budget_s": s,
                      "partial": true (a cut or failed item's figures so far),
                      "log_tail": str (failed items only)}}}

and ``OUT_DIR/gpu_check.log`` (every item's output). Exit code: 0 when no item failed, 1 when one
did, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = Path(tempfile.gettempdir()) / "megadiv-gpu-site"   # where the carried wheels are installed
SCHEMA = 3
DEFAULT_BUDGET_S = 540
INSTALL_BUDGET_S = 20             # pip from 12 local wheels: seconds
PRECOMPILE_BUDGET_S = 30          # compileall of the working tree and the wheels, all cores
SMOKE_BUDGET_SCALE = 8           # --smoke on a busy 2-core CPU: imports alone take a minute or two
H200_BF16_DENSE_FLOPS = 989e12   # NVIDIA H200 SXM datasheet: dense bf16 tensor core (1,979 with sparsity)

# Why a package cannot travel with a device call (at most 64 MiB of files in all).
NOT_CARRIED = {
    "deepspeed": "not carried: DeepSpeed is not importable (run tools/gpu_wheels.sh here and carry .whl)",
    "transformer_engine": "not carried: Transformer Engine's CUDA 13 core wheel is 276 MB, over the 64 MiB "
                          "a device call carries (the FP8 test needs it)",
    "sglang": "not carried: SGLang needs its CUDA kernels (sgl-kernel, a 373 MB wheel) and torch 2.14.1; the "
              "machine has torch 2.11 and takes 64 MiB per call",
    "megatron": "not carried: megatron-core is not importable (run tools/gpu_wheels.sh here and carry .whl)",
}
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class Item:
    name: str
    budget_s: int
    needs: tuple[str, ...]   # checked in order: "megatron", "transformer_engine", "sglang", "cuda"
    smoke_on_cpu: bool = True  # whether --smoke runs it without CUDA


# Budgets (estimates: no item has run on a GPU yet; each report's wall_s per item sets the next):
# 485 s in all, plus at most 20 s of wheel installation, 30 s of compileall and 5 s for the report,
# inside the default 540 s (a device call runs at most 600 s).
ITEMS = [
    Item("gpu_tests", 85, ("cuda",)),
    Item("divergence_bench", 35, ("megatron", "cuda")),
    Item("vocab_parallel_trainer", 25, ("megatron", "cuda")),
    Item("no_host_sync", 20, ("cuda",), smoke_on_cpu=False),
    Item("gpt_step_mfu", 40, ("megatron", "cuda")),
    Item("actor_train_step", 50, ("megatron", "cuda")),
    Item("weight_sync_rates", 35, ("megatron", "cuda")),
    Item("async_checkpoint", 45, ("megatron", "cuda")),
    Item("bf16_probe", 30, ("megatron", "cuda")),
    Item("grpo_demo", 45, ("megatron", "cuda")),
    Item("deepspeed_bf16", 45, ("deepspeed", "cuda")),
    Item("padding_invariance", 20, ("megatron", "cuda")),
    Item("transformer_engine", 5, ("transformer_engine", "cuda"), smoke_on_cpu=False),
    Item("sglang_cuda", 5, ("sglang", "cuda"), smoke_on_cpu=False),
]

# What no run of this script on the verification machine (one H200, its own image, 64 MiB of
# carried files) can reach, and why; items skipped in a run are added to the report's list.
UNVERIFIED = [
    ("Transformer Engine layer spec and FP8 GEMMs (tests/test_models_gpu.py, the FP8 cases of "
     "tests/test_policy_gpu.py)", "Transformer Engine is not in the image and its CUDA 13 core wheel is 276 MB, "
     "over the 64 MiB a device call carries"),
    ("packed sequences (grpo.pack_sequences: THD with Transformer Engine attention, the packed case of "
     "tests/test_token_budget_gpu.py)", "needs Transformer Engine (above)"),
    ("SGLang server on a GPU: launch flags (--dtype, --attention-backend), the colocated memory share, "
     "CUDA-IPC weight sync (tests/test_weight_sync_gpu.py)", "SGLang needs sgl-kernel (373 MB) and torch 2.14.1; "
     "the image has torch 2.11 and a call carries 64 MiB"),
    ("NCCL weight broadcast to SGLang servers (rollout.sync_method distributed)",
     "needs SGLang on the GPU (above) and a second GPU"),
    ("TP, PP or DP > 1 over NCCL, sequence parallelism, the distributed optimizer across GPUs",
     "the machine has one GPU"),
    ("multi-node launch on GPUs (examples/launch/multinode.sh, slurm.sbatch)", "one machine, no SLURM"),
    ("apex fused kernels, and with them gradient_accumulation_fusion (models/builder.py turns it on where "
     "apex's fused_weight_gradient_mlp_cuda imports)", "apex is not on PyPI and not in the image (a CUDA source build)"),
    ("CUDA_DEVICE_MAX_CONNECTIONS=1 for TP comm overlap (cli/train.py, TP > 1), the interleaved schedule (VPP) "
     "over NCCL p2p (unbatched at PP=2)", "the machine has one GPU"),
    ("the GPU lock's versions (requirements-gpu.txt: torch 2.14.1, Transformer Engine 2.11, sglang 0.5.23) "
     "and docker/Dockerfile: its pip steps under NGC's /etc/pip/constraint.txt, the image's NCCL preloaded "
     "into /opt/sglang and compared, rollout.server_python's default /opt/sglang/bin/python",
     "the checks run on the image's torch 2.11 with the carried wheels; no Docker or registry there (the "
     "constraint check ran offline against release-note pins only: tests/test_gpu_lock.py)"),
]


def missing(item: Item, cuda: bool, smoke: bool) -> str | None:
    """The reason ``item`` cannot run here, or None."""
    for need in item.needs:
        if need == "cuda":
            if not cuda and not (smoke and item.smoke_on_cpu):
                return NO_CUDA
        elif importlib.util.find_spec("megatron.core" if need == "megatron" else need) is None:
            return NOT_CARRIED[need]
    return None


# --------------------------------------------------------------------------- the items
# Each runs in a child process (``gpu_check.py --item NAME``) and returns {figures, samples,
# status?, reason?}; an exception or a non-zero exit makes the item 'failed'.

def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The gpu-marked test modules and each one's budget in seconds (pytest's start-up included):
# estimates, as nobody has timed them on a GPU; the report gives each module's wall time for the
# next run to set them by. A module that is not listed gets DEFAULT_MODULE_BUDGET_S.
GPU_TEST_BUDGETS = {
    "tests/test_divergence_losses.py": 10,
    "tests/test_models_gpu.py": 8,           # Transformer Engine absent: skips
    "tests/test_policy_gpu.py": 25,
    "tests/test_token_budget_gpu.py": 15,
    "tests/test_vocab_parallel_gpu.py": 15,
    "tests/test_weight_sync_gpu.py": 8,      # SGLang absent: skips
}
DEFAULT_MODULE_BUDGET_S = 15


def gpu_test_modules() -> list[str]:
    """The test modules that use the ``gpu`` mark (``pytest.mark.gpu`` anywhere in their code, not
    in a string), found by parsing them: collecting all of tests/ to select them (``pytest -m
    gpu``) imports some eighty modules first."""
    def marks_gpu(path: Path) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
                   and n.value.attr == "mark" for n in ast.walk(ast.parse(path.read_text())))
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if marks_gpu(p))


def item_gpu_tests(work: Path, smoke: bool, deadline: float) -> dict:
    """``pytest -m gpu``, one process per test module under the module's own budget (and what is
    left of the item's), each test's outcome written as it comes (tools/pytest_outcomes.py), so a
    module cut at its budget still reports the tests that finished, and the counts so far are
    written after every module for the orchestrator to report should the item itself be cut."""
    modules, figures = gpu_test_modules(), {"modules": {}}
    for module in modules:
        budget = GPU_TEST_BUDGETS.get(module, DEFAULT_MODULE_BUDGET_S) * (SMOKE_BUDGET_SCALE if smoke else 1)
        left = deadline - time.time() - 2          # 2 s to write the result
        if left < 3:
            figures["modules"][module] = {"status": "not run: no time left in the item's budget", "budget_s": budget}
            continue
        outcomes = work / (module.replace("/", "_") + ".jsonl")
        # no per-test timeout: the module's budget cuts it, and the tests that finished are reported
        cmd = [sys.executable, "-m", "pytest", module, "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider",
               "-p", "pytest_outcomes", f"--outcomes={outcomes}"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(REPO / "tools"), os.environ.get("PYTHONPATH")] if p))
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        try:
            rc, cut = proc.wait(timeout=min(budget, left)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, cut = proc.wait(), True
        figures["modules"][module] = {**module_outcomes(outcomes), "exit_code": rc, "cut": cut,
                                      "wall_s": round(time.monotonic() - start, 2), "budget_s": budget}
        figures |= total_outcomes(figures["modules"])
        write_partial(work, {"figures": figures})
    figures |= total_outcomes(figures["modules"])
    cut = [m for m, r in figures["modules"].items() if r.get("cut") or "exit_code" not in r]
    # pytest exits 5 when a module's gpu-marked tests were all deselected
    crashed = [m for m, r in figures["modules"].items() if r.get("exit_code") not in (None, 0, 1, 5) and not r["cut"]]
    if figures["failed"] or figures["errors"] or cut or crashed:
        return {"status": "failed", "figures": figures,
                "reason": f"{figures['failed']} failed, {figures['errors']} errors"
                          + (f"; cut at their budget or not run: {', '.join(cut)}" if cut else "")
                          + (f"; pytest crashed in {', '.join(crashed)}" if crashed else "")}
    if not figures["passed"]:
        return {"status": "skipped", "reason": "no gpu-marked test ran (all skipped or none collected)",
                "figures": figures}
    return {"figures": figures}


def module_outcomes(path: Path) -> dict:
    """Counts, failures and skip reasons from one module's outcome lines (tools/pytest_outcomes.py)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skip_reasons = [], {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        rec = json.loads(line)
        outcome = {"error": "errors"}.get(rec["outcome"], rec["outcome"])
        counts[outcome] += 1
        if outcome == "skipped":
            skip_reasons[rec["message"]] = skip_reasons.get(rec["message"], 0) + 1
        elif outcome != "passed":
            failures.append(f"{rec['nodeid']} ({rec['when']}): {rec['message']}")
    return {**counts, "failures": failures, "skip_reasons": skip_reasons}


def total_outcomes(modules: dict) -> dict:
    total = {k: sum(m.get(k, 0) for m in modules.values()) for k in ("passed", "failed", "errors", "skipped")}
    total["failures"] = [f for m in modules.values() for f in m.get("failures", [])]
    total["skip_reasons"] = {}
    for m in modules.values():
        for reason, n in m.get("skip_reasons", {}).items():
            total["skip_reasons"][reason] = total["skip_reasons"].get(reason, 0) + n
    return total


def write_partial(work: Path, result: dict) -> None:
    """What an item has so far, in its result's form ({figures, samples}): reported, marked
    ``partial``, should the item be cut at its budget or fail before it returns. Written atomically."""
    tmp = work / "partial.json.tmp"
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(work / "partial.json")


BENCH_SMOKE = ["--tokens", "256", "--vocab-per-rank", "1000", "--trials", "2"]


def item_divergence_bench(work: Path, smoke: bool, deadline: float) -> dict:
    """benchmarks/bench_divergence.py on this device, TP=1, bf16 logits at 16,384 x 151,936."""
    return bench_divergence(work, "bfloat16", BENCH_SMOKE if smoke else
                            ["--tokens", "16384", "--vocab-per-rank", "151936", "--trials", "10"])


def item_vocab_parallel_trainer(work: Path, smoke: bool, deadline: float) -> dict:
    """The same benchmark at the shapes the trainer hands the kernel: float32 logits (the actor
    upcasts its bf16 logit shard before the kernel, policy/megatron.py) of 4,608 positions x
    37,984 vocabulary rows (Qwen3's 151,936 over TP=4), against megatron's cross entropy."""
    return bench_divergence(work, "float32", BENCH_SMOKE if smoke else
                            ["--tokens", "4608", "--vocab-per-rank", "37984", "--trials", "10"])


def bench_divergence(work: Path, dtype: str, shape: list[str]) -> dict:
    """benchmarks/bench_divergence.py on this device, TP=1; its JSON becomes the figures."""
    cuda = device().type == "cuda"
    out = work / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "benchmarks" / "bench_divergence.py"), "--device", "cuda" if cuda else "cpu",
           "--dtype", dtype, *shape, "--json", str(out)]
    rc = subprocess.call(cmd, cwd=REPO)
    if rc or not out.exists():
        return {"status": "failed", "reason": f"bench_divergence.py exited with {rc}"}
    report = json.loads(out.read_text())
    rows = report.pop("rows")
    figures = {**report, "rows": {r["label"]: {"median_ms": r["time_s"]["median"] * 1e3,
                                               "time_x_megatron_ce": r["time_x_baseline"],
                                               "peak_mib": r["peak_bytes"] / 2**20,
                                               "peak_x_megatron_ce": r["peak_x_baseline"]} for r in rows}}
    return {"figures": figures, "samples": {r["label"]: r["samples_s"] for r in rows}}


def item_no_host_sync(work: Path, smoke: bool, deadline: float) -> dict:
    import torch

    return no_host_sync(torch.device("cuda"), *((2, 8, 64) if smoke else (8, 256, 32768)))


CONTROL = "control: a planted .item() is caught"


def no_host_sync(dev, seqs: int, length: int, vocab: int) -> dict:
    """Each check runs once untimed (lazy CUDA initialisation), then again in sync-debug 'error'
    mode, where any operation that makes the host wait for the GPU raises. The control proves the
    watcher is on: its planted .item() must raise."""
    import torch

    planted = _runs_without_sync(lambda: torch.ones(1, device=dev).item())
    verdicts = {CONTROL: True if planted is not True else "not caught: the planted .item() ran without an error"}
    for name, run in sync_checks(dev, seqs, length, vocab).items():
        run()   # warm-up: cuBLAS handles, allocator growth, kernel loading
        verdicts[name] = _runs_without_sync(run)
    failed = [name for name, ok in verdicts.items() if ok is not True]
    figures = {"verdict": "no host synchronisation" if not failed else "host synchronisation found",
               "checks": verdicts, "shape": [seqs * length, vocab]}
    if failed:
        return {"status": "failed", "reason": "; ".join(f"{n}: {verdicts[n]}" for n in failed), "figures": figures}
    return {"figures": figures}


def sync_checks(dev, seqs: int, length: int, vocab: int) -> dict:
    """Forward + backward passes of the divergence library as the trainer runs them, on float32
    logits [seqs * length, vocab] (TP=1: no collectives), each on a fresh copy of the inputs;
    each returns the logits leaf, whose .grad the backward filled."""
    import torch

    from megadiv.divergence import vocab_parallel as vp
    from megadiv.divergence.losses import PolicyLossConfig, aggregation_denominator, compute_policy_loss
    from megadiv.divergence.registry import get_divergence

    g = torch.Generator(dev).manual_seed(0)
    logits = 3 * torch.randn(seqs * length, vocab, generator=g, device=dev)     # [tokens, vocab]
    ref = logits + 0.1 * torch.randn(seqs * length, vocab, generator=g, device=dev)
    target = torch.randint(0, vocab, (seqs * length,), generator=g, device=dev)
    adv = torch.randn(seqs, generator=g, device=dev)
    mask = (torch.rand(seqs, length, generator=g, device=dev) < 0.9).float()
    cfg = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.05, delta_high=0.07,
                           dual_clip_c=3.0, tis_cap=2.0, loss_agg="seq-mean-token-mean")

    def log_prob_entropy(inplace: bool):
        def run():
            z = logits.clone().requires_grad_()
            lp, ent = vp.log_probs_and_entropy(z, target, inplace_backward=inplace)
            (lp.sum() + 1e-3 * ent.sum()).backward()
            return z
        return run

    def policy_loss():   # the trainer's chain: logits -> log-probs + entropy -> policy loss -> backward
        z = logits.clone().requires_grad_()
        lp, ent = vp.log_probs_and_entropy(z, target, inplace_backward=True)
        lp, ent = lp.view(seqs, length), ent.view(seqs, length)
        old = lp.detach() + 0.01
        loss, _ = compute_policy_loss(cfg, lp, old, adv, mask, logp_ref=old - 0.02, logp_rollout=old + 0.01,
                                      entropy=ent.detach(), denominator=1.0)
        (loss / aggregation_denominator(mask, cfg.loss_agg, None)).backward()
        return z

    def regulariser(name: str, consume_base: bool):
        measure = get_divergence(name, consume_base=consume_base)

        def run():
            z = logits.clone().requires_grad_()
            measure(z, ref.clone()).mean().backward()
            return z
        return run

    return {
        "log_probs_and_entropy (in-place backward)": log_prob_entropy(True),
        "log_probs_and_entropy (out of place)": log_prob_entropy(False),
        "k3-clip policy loss chain": policy_loss,
        "full_prob_l2 (consume_base)": regulariser("full_prob_l2", True),
        "full_kl": regulariser("full_kl", False),
    }


def _runs_without_sync(fn) -> bool | str:
    """True when ``fn`` ran with no host synchronisation, else the first line of the error."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        return str(e).strip().splitlines()[0][:300] if str(e).strip() else "RuntimeError"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True


# A Llama-3.2-1B-like layer stack (hidden 2048, 16 layers, 32 heads / 8 KV heads, SwiGLU 8192)
# with a 32,000 vocabulary, untied: 1.10B parameters. 8 x 1,024 tokens per step.
GPT_1B = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
              vocab_size=32000, max_position_embeddings=1024)
GPT_SMOKE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                 vocab_size=128, max_position_embeddings=32)


def item_gpt_step_mfu(work: Path, smoke: bool, deadline: float) -> dict:
    """Forward (with the loss: megatron's vocab-parallel cross entropy) + backward + gradient
    finalisation + Adam step, timed with CUDA events after 2 warm-up steps. MFU counts 6 N flops
    per token (N: all parameters, embeddings included; attention-score flops not counted)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from benchmarks.timing import summary, time_region
    from megadiv import parallel
    from megadiv.config import ModelConfig, ParallelConfig
    from megadiv.models.builder import build_model

    dev = parallel.initialize(ParallelConfig(), seed=1).device
    shape = GPT_SMOKE if smoke else GPT_1B
    batch, seq = (2, 16) if smoke else (8, 1024)
    model = build_model(ModelConfig(**shape, params_dtype="bfloat16", transformer_impl="local"), load_weights=False)
    ddp = DistributedDataParallel(config=model.config, module=model.chunks[0],
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0), [ddp])
    n_params = sum(p.numel() for p in ddp.parameters())
    g = torch.Generator(dev).manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq + 1), generator=g, device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)

    def step():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(inputs, positions, None, labels=labels).mean()   # [batch, seq] token losses
        loss.backward()
        finalize_model_grads([ddp])
        optimizer.step()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    samples = time_region(step, warmup=2, repeats=3 if smoke else 6, device=dev)
    step_s = summary(samples)["median"]
    flops = 6 * n_params * batch * seq
    figures = {"parameters": n_params, "shape": shape, "micro_batch": batch, "seq_len": seq,
               "tokens_per_step": batch * seq, "dtype": "bfloat16", "layer_spec": "megatron local (no TE)",
               "step_ms": summary([s * 1e3 for s in samples]), "achieved_tflops": flops / step_s / 1e12,
               "peak_tflops_used": H200_BF16_DENSE_FLOPS / 1e12,
               "mfu": flops / step_s / H200_BF16_DENSE_FLOPS,
               "flops_per_step": flops, "mfu_formula": "6 * parameters * tokens / step time / 989 TFLOP/s"}
    if dev.type == "cuda":
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        figures["gpu"] = torch.cuda.get_device_name()
        n = 8192                     # the machine's own ceiling: a large bf16 matrix product, random data
        a, b = (torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
        mm = summary(time_region(lambda: a @ b, warmup=3, repeats=10, device=dev))["median"]
        figures["matmul_8192_tflops"] = 2 * n**3 / mm / 1e12
        figures["mfu_vs_matmul"] = flops / step_s / (2 * n**3 / mm)
    parallel.shutdown()
    return {"figures": figures, "samples": {"step_s": samples}}


def _policy_batch(rows: int, prompt: int, response: int, vocab: int, dev):
    """GRPO rows of random tokens: ``prompt`` + ``response`` tokens each, advantages +-1."""
    import torch

    from megadiv.policy.batches import SequenceBatch

    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return SequenceBatch.pack([draw(prompt) for _ in range(rows)], [draw(response) for _ in range(rows)], pad_id=0,
                              advantages=torch.tensor([(-1.0) ** i for i in range(rows)]))


def _actor(shape: dict, total_steps: int = 10):
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.policy.megatron import Policy

    return Policy(ModelConfig(**shape, params_dtype="bfloat16", transformer_impl="local"), ParallelConfig(), "actor",
                  OptimConfig(optimizer="adam", lr=1e-5), total_steps)


# actor_train_step fails when the measured peak exceeds the plan by more than this: the planner
# counts the local spec's activations within 25% (models/plan.py, checked on CPU); a plan that low
# would let a run it calls fitting run out of memory
PLAN_TOLERANCE = 1.25


def item_actor_train_step(work: Path, smoke: bool, deadline: float) -> dict:
    """megadiv's actor step, Policy.train_step (GRPO clip objective, megatron DDP, Adam, bf16, local
    spec), at gpt_step_mfu's shape and tokens per step (8 rows of 256 prompt + 768 response
    tokens), so that the two compare: the trainer's step against the bare GPT step. MFU by the same
    6 N tokens formula. Then the step's peak memory against ``megadiv plan``'s figure for this
    model, layout and micro-batch (activations counted for the local spec, no reserve)."""
    import torch

    from benchmarks.timing import summary, time_region
    from megadiv import parallel
    from megadiv.config import ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.models.plan import Layout, Workload, plan_layout
    from megadiv.policy.objectives import grpo_objective

    dev = parallel.initialize(ParallelConfig(), seed=1).device
    shape = GPT_SMOKE if smoke else GPT_1B
    rows, prompt, response = (2, 4, 12) if smoke else (8, 256, 768)
    actor = _actor(shape)
    n_params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    batch = _policy_batch(rows, prompt, response, shape["vocab_size"], dev)
    tokens = batch.tokens.numel()                      # [rows, prompt + response]
    work_plan = Workload(micro_batch_size=rows, seq_len=batch.tokens.shape[1], logit_positions=response,
                         params_dtype="bfloat16", optimizer="adam", spec="local", reserve_bytes=0)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if dev.type == "cuda" else 0
    plan = plan_layout(actor.model.arch, Layout(tp=1, pp=1, dp=1), work_plan, gpu_bytes)
    figures = {"parameters": n_params, "shape": shape, "rows": rows, "prompt_tokens": prompt,
               "response_tokens": response, "tokens_per_step": tokens, "micro_batch_size": rows,
               "planned_bytes": plan.worst.total, "planned_components": plan.worst.components}
    write_partial(work, {"figures": figures})
    objective = grpo_objective(PolicyLossConfig())
    metrics = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    samples = time_region(lambda: metrics.append(actor.train_step(batch, objective, micro_batch_size=rows)),
                          warmup=1, repeats=2 if smoke else 4, device=dev)
    step_s = summary(samples)["median"]
    flops = 6 * n_params * tokens
    figures |= {"step_ms": summary([s * 1e3 for s in samples]), "tokens_per_s": tokens / step_s,
                "response_tokens_per_s": rows * response / step_s, "achieved_tflops": flops / step_s / 1e12,
                "mfu": flops / step_s / H200_BF16_DENSE_FLOPS, "skipped_steps": sum(m["skipped"] for m in metrics),
                "mfu_formula": "6 * parameters * tokens / step time / 989 TFLOP/s (as gpt_step_mfu)"}
    problems = [f"{figures['skipped_steps']:.0f} steps skipped (gradients not finite)"] if figures["skipped_steps"] else []
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        figures |= {"peak_bytes": peak, "peak_x_planned": peak / plan.worst.total}
        if peak > PLAN_TOLERANCE * plan.worst.total:
            problems.append(f"peak memory {peak / 2**30:.2f} GiB is over {PLAN_TOLERANCE} x the plan's "
                            f"{plan.worst.total / 2**30:.2f} GiB")
    parallel.shutdown()
    out = {"figures": figures, "samples": {"step_s": samples}}
    return out | ({"status": "failed", "reason": "; ".join(problems)} if problems else {})


def item_weight_sync_rates(work: Path, smoke: bool, deadline: float) -> dict:
    """The two halves of a weight push to a server on the trainer's GPU (rollout.sync_method
    tensor, what auto picks for a colocated server) at the 1.10B shape, bf16: export
    (Policy.export_buckets: fresh Hugging Face tensors in rollout.bucket_bytes buckets, second
    pass timed; GB/s) and the CUDA-IPC hand-off: each bucket as serialize_bucket sends it (an IPC
    handle per tensor, the GPU named by its UUID) to another process, which opens it as SGLang's
    update_weights_from_tensor does (open_bucket), copies every tensor into memory of its own and
    answers before the next bucket is sent (GB/s of the whole model). serialize_bucket is
    CUDA-only: on a CPU the buckets' tensors travel through shared memory instead."""
    import torch
    import torch.multiprocessing as mp

    from megadiv import parallel
    from megadiv.config import ModelConfig, ParallelConfig
    from megadiv.policy.megatron import Policy
    from megadiv.rollout.config import RolloutConfig
    from megadiv.rollout.weight_sync import serialize_bucket

    dev = parallel.initialize(ParallelConfig(), seed=1).device
    shape = GPT_SMOKE if smoke else GPT_1B
    bucket_bytes = (64 << 10) if smoke else RolloutConfig().bucket_bytes
    policy = Policy(ModelConfig(**shape, params_dtype="bfloat16", transformer_impl="local"), ParallelConfig(),
                    "reference")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    exports = []
    for _ in range(2):                                  # the first pass warms up
        sync()
        start = time.perf_counter()
        buckets = list(policy.export_buckets(bucket_bytes))
        sync()
        exports.append(time.perf_counter() - start)
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
    figures = {"bytes": sum(sizes), "buckets": len(buckets), "tensors": sum(map(len, buckets)),
               "bucket_bytes": bucket_bytes, "device": dev.type, "export_s": exports[-1],
               "export_gb_per_s": sum(sizes) / exports[-1] / 1e9}
    write_partial(work, {"figures": figures})
    send = serialize_bucket if dev.type == "cuda" else (lambda bucket: bucket)
    ctx = mp.get_context("spawn")
    inbox, answers = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_handoff_receiver, args=(inbox, answers), daemon=True)
    receiver.start()
    try:
        inbox.put(send([("warm-up", torch.ones(1, device=dev))]))   # the receiver's CUDA context
        answers.get(timeout=120)
        start = time.perf_counter()
        for bucket, size in zip(buckets, sizes):
            inbox.put(send(bucket))
            if answers.get(timeout=120) != size:
                return {"status": "failed", "reason": "the receiver copied another size than sent", "figures": figures}
        handoff = time.perf_counter() - start
    finally:
        inbox.put(None)
        receiver.join(timeout=30)
    figures |= {"handoff_s": handoff, "handoff_gb_per_s": sum(sizes) / handoff / 1e9,
                "handoff": "serialize_bucket: a CUDA-IPC handle per tensor" if dev.type == "cuda"
                           else "CPU shared memory"}
    parallel.shutdown()
    return {"figures": figures}


def _handoff_receiver(inbox, answers) -> None:
    """The server's side of the hand-off (a spawned process, as a server is one): open each
    bucket, copy its tensors into memory of its own, wait for the copies, answer with the bytes."""
    import torch

    while (payload := inbox.get()) is not None:
        bucket = open_bucket(payload) if isinstance(payload, str) else payload
        own = [t.clone() for _, t in bucket]
        if own[0].is_cuda:
            torch.cuda.synchronize()
        answers.put(sum(t.numel() * t.element_size() for t in own))
        del bucket, own                                 # release the handles before the next bucket


def open_bucket(payload: str) -> list:
    """A serialize_bucket payload opened as SGLang 0.5.23's update_weights_from_tensor opens it
    (no sglang here): unpickled with torch's rebuild_cuda_tensor taught to take a GPU's UUID for
    its device index, which is what sglang/srt/utils/patch_torch.py patches in."""
    import base64
    import pickle

    import torch
    import torch.multiprocessing.reductions as reductions

    from megadiv.rollout.weight_sync import _DEVICE_ARG, device_uuid

    original = reductions.rebuild_cuda_tensor
    index = {device_uuid(i): i for i in range(torch.cuda.device_count())}

    def rebuild(*args):
        return original(*args[:_DEVICE_ARG], index[args[_DEVICE_ARG]], *args[_DEVICE_ARG + 1:])

    reductions.rebuild_cuda_tensor = rebuild            # the global the payload names
    try:
        return pickle.loads(base64.b64decode(payload))
    finally:
        reductions.rebuild_cuda_tensor = original


# async_checkpoint's model: gpt_step_mfu's layers, 4 of 16 (0.34B parameters; weights, fp32 main
# parameters and Adam moments, ~5.5 GB to write), so that the save fits the item's budget
GPT_CKPT = GPT_1B | {"num_layers": 4}


def item_async_checkpoint(work: Path, smoke: bool, deadline: float) -> dict:
    """The trainer's checkpoint saver (trainer/checkpoint.py: megatron's async torch_dist save,
    the writer forked) on an actor after one Adam step: the seconds save() blocks training and
    the seconds until the checkpoint is sealed, with a training step running while it is
    written (as in a run: the staged copy must not see it); then the checkpoint loaded back,
    which must restore every weight, fp32 main parameter and Adam moment bit for bit."""
    import torch

    from megadiv import parallel
    from megadiv.config import ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.policy.objectives import grpo_objective
    from megadiv.trainer.checkpoint import CheckpointSaver, load_checkpoint

    dev = parallel.initialize(ParallelConfig(), seed=1).device
    shape = GPT_SMOKE if smoke else GPT_CKPT
    actor = _actor(shape)
    batch = _policy_batch(2, 4, 12, shape["vocab_size"], dev) if smoke else \
        _policy_batch(4, 256, 768, shape["vocab_size"], dev)
    objective = grpo_objective(PolicyLossConfig())
    actor.train_step(batch, objective, micro_batch_size=len(batch))     # Adam's moments exist from here
    saved = _training_state(actor)
    saver = CheckpointSaver(work / "run", keep_last=1, parallel=ParallelConfig())
    saver.save(1, actor, {"step": 1})
    stepped = actor.train_step(batch, objective, micro_batch_size=len(batch))   # while the writer writes
    moved = sum(not torch.equal(t, now) for t, now in zip(saved.values(), _training_state(actor).values()))
    ((step, timing),) = saver.wait()
    path = saver.final(step)
    figures = {"parameters": sum(p.numel() for c in actor.chunks for p in c.parameters()), "shape": shape,
               "checkpoint_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
               **{k.removeprefix("checkpoint/"): v for k, v in timing.items()},
               "step_during_write_skipped": stepped["skipped"], "tensors_the_step_changed": moved}
    figures["write_gb_per_s"] = figures["checkpoint_bytes"] / figures["total_s"] / 1e9
    write_partial(work, {"figures": figures})
    start = time.perf_counter()
    trainer_state = load_checkpoint(path, actor)
    figures["load_s"] = time.perf_counter() - start
    loaded = _training_state(actor)
    differ = [name for name, t in saved.items() if not torch.equal(t, loaded[name])]
    figures |= {"tensors_compared": len(saved), "tensors_differing": len(differ), "bit_exact": not differ,
                "trainer_state": trainer_state}
    parallel.shutdown()
    if not moved:       # the reload would restore what was there anyway: it proves nothing
        return {"status": "failed", "figures": figures, "reason": "the step during the write changed no tensor"}
    if differ or trainer_state != {"step": 1}:
        return {"status": "failed", "figures": figures,
                "reason": f"the reloaded checkpoint differs: {len(differ)} of {len(saved)} tensors "
                          f"({', '.join(differ[:5])}), trainer state {trainer_state}"}
    return {"figures": figures}


def _training_state(actor) -> dict:
    """Copies of every weight, and of each optimizer's fp32 main parameters and Adam moments, by name."""
    import torch

    from megadiv.trainer.checkpoint import _parts

    state = {f"weight {name}": p.detach().clone() for c in actor.chunks for name, p in c.named_parameters()}
    for i, part in enumerate(_parts(actor.optimizer)):
        inner = part.optimizer
        for j, p in enumerate(q for group in inner.param_groups for q in group["params"]):
            state[f"optimizer {i} main {j}"] = p.detach().clone()
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value):
                    state[f"optimizer {i} {key} {j}"] = value.clone()
    return state


# The probe's real text: a held-out prompt and an answer in the form a policy generates.
PROBE_TEXT = [
    ("A baker sells muffins for $3 each and cookies for $2 each. On Saturday she sold 24 muffins and "
     "twice as many cookies. How much money did she make?",
     " She sold 24 * 2 = 48 cookies, which made 48 * 2 = $96. The muffins made 24 * 3 = $72. In all "
     "she made 96 + 72 = $168. The answer is 168."),
    ("Tom reads 15 pages of his book every evening. The book has 240 pages. After 9 evenings, how many "
     "pages does he still have to read?",
     " In 9 evenings Tom reads 9 * 15 = 135 pages. He still has 240 - 135 = 105 pages to read. "
     "The answer is 105."),
]
# bf16_probe's model: a Qwen2 of random weights (the machine holds no pretrained checkpoint and a
# call carries 64 MiB), hidden 1024, 8 layers, in bf16; 4,096 vocabulary rows, of which the BPE
# (trained on make_tiny_model's small corpus) uses ~570, so real text never reaches most of them
PROBE_MODEL = dict(hidden=1024, heads=16, kv_heads=4, ffn=2816, layers=8, vocab=4096)
PROBE_SMOKE = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=301)


def item_bf16_probe(work: Path, smoke: bool, deadline: float) -> dict:
    """The post-sync probe's figure (rollout/mismatch.py: mean |engine log p - trainer log p|) at
    the same bf16 weights before any training, the embedded engine (transformers) against the
    trainer (megatron, bf16): on the probe a run builds (held-out prompts and the engine's own
    answers, ProbeBatch.answer), on fixed real text, and on uniformly random ids of the whole
    embedding (what the probe drew before it read text); beside the limit a run would derive from
    that step-0 baseline (mismatch.probe_limit: max(probe_floor, probe_factor x baseline), refused
    above probe_max_limit). The figure the defaults are checked against; no pass/fail beyond finite
    figures and the run's own refusal."""
    import math

    import torch
    from transformers import AutoTokenizer

    from megadiv import parallel
    from megadiv.config import ModelConfig, ParallelConfig
    from megadiv.models.tiny import make_tiny_model
    from megadiv.policy.megatron import Policy
    from megadiv.rollout import WeightSyncError
    from megadiv.rollout.config import RolloutConfig
    from megadiv.rollout.embedded import EmbeddedEngine
    from megadiv.rollout.mismatch import ProbeBatch, probe_limit, probe_mismatch
    from megadiv.trainer.grpo import _probe_logprobs

    dev = parallel.initialize(ParallelConfig(), seed=1).device
    hf_dir = str(make_tiny_model(work / "probe-model", "qwen2", tokenizer="bpe", init_std=0.02, dtype="bfloat16",
                                 **(PROBE_SMOKE if smoke else PROBE_MODEL)))
    engine = EmbeddedEngine(hf_dir)                     # the checkpoint's bf16 on a GPU (float32 on a CPU)
    trainer = Policy(ModelConfig(hf_dir=hf_dir, params_dtype="bfloat16", transformer_impl="local"), ParallelConfig(),
                     "reference")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    cfg = RolloutConfig()
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(0, trainer.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    probes = {"run_probe": ProbeBatch.answer(engine, [tok.encode(q) for q, _ in PROBE_TEXT], cfg, len(tok)),
              "real_text": ProbeBatch([tok.encode(q) for q, _ in PROBE_TEXT], [tok.encode(a) for _, a in PROBE_TEXT]),
              "random_tokens": ProbeBatch([draw(16) for _ in range(4)], [draw(16) for _ in range(4)])}
    figures = {"engine_dtype": str(next(engine.model.parameters()).dtype), "trainer_dtype": "torch.bfloat16",
               "device": dev.type, "model": PROBE_SMOKE if smoke else PROBE_MODEL, "weights": "random, std 0.02",
               "probe_floor": cfg.probe_floor, "probe_factor": cfg.probe_factor, "probe_max_limit": cfg.probe_max_limit}
    for name, probe in probes.items():
        report = probe_mismatch(engine, probe, _probe_logprobs(trainer, probe), "step 0")
        figures[name] = {"mean_abs": report.mean_abs, "max_abs": report.max_abs, "tokens": report.tokens}
        write_partial(work, {"figures": figures})
    try:
        figures["run_limit"] = probe_limit(figures["run_probe"]["mean_abs"], cfg)
    except WeightSyncError as e:
        figures["run_limit"] = None
        return {"status": "failed", "reason": f"a run would refuse this baseline: {e}", "figures": figures}
    finally:
        parallel.shutdown()
    if not all(math.isfinite(figures[n][k]) for n in probes for k in ("mean_abs", "max_abs")):
        return {"status": "failed", "reason": "a probe figure is not finite", "figures": figures}
    return {"figures": figures}


def item_grpo_demo(work: Path, smoke: bool, deadline: float) -> dict:
    """``megadiv train examples/tiny/grpo.yaml`` with overrides: TP=1 (one GPU), 3 GRPO steps,
    a 20-step supervised warm start (the demo's 250 only raise the starting accuracy)."""
    runs = work / "runs"
    overrides = {"parallel.tensor_parallel": 1, "grpo.steps": 3, "warm_start.sft_steps": 20, "eval.every": 0,
                 "checkpoint.every": 0, "run.output_dir": runs, "model.hf_dir": runs / "tiny-grpo" / "init"}
    if smoke:
        overrides |= {"grpo.steps": 1, "warm_start.sft_steps": 2, "warm_start.sft_batch_size": 16,
                      "grpo.prompts_per_step": 4, "grpo.micro_batch_size": 16, "eval.samples": 0,
                      "eval.data.arithmetic_test_size": 8}
    start = time.perf_counter()
    run_dir = runs / "tiny-grpo"
    proc = subprocess.Popen([sys.executable, "-m", "megadiv.cli", "train", "examples/tiny/grpo.yaml",
                             *(f"{k}={v}" for k, v in overrides.items())], cwd=REPO)
    while proc.poll() is None:      # the steps so far, for the report should the budget cut the run
        time.sleep(2)
        samples = _demo_samples(run_dir)
        write_partial(work, {"figures": {"steps_so_far": len(samples.get("reward/mean", [])),
                                         "wall_s_so_far": time.perf_counter() - start}, "samples": samples})
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"status": "failed", "reason": f"megadiv train exited with {proc.returncode}"}
    summary_json = json.loads((run_dir / "summary.json").read_text())
    figures = {"steps": summary_json["steps"], "skipped_steps": summary_json["skipped_steps"],
               "accuracy_before": summary_json["accuracy_before"], "accuracy_after": summary_json["accuracy_after"],
               "wall_s_including_warm_start": wall, "device": device().type}
    return {"figures": figures, "samples": _demo_samples(run_dir)}


def _demo_samples(run_dir: Path) -> dict:
    """Per GRPO step of the demo's metrics.jsonl: phase times, reward, loss, probe difference."""
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:    # the line being written while the run goes on
            continue
        if any(k.startswith("time/") for k in record):
            steps.append(record)
    keys = sorted({k for s in steps for k in s if k.startswith("time/")})
    keys += ["reward/mean", "loss/total", "sync/probe_abs_diff_max"]
    return {key: [s.get(key) for s in steps] for key in keys} if steps else {}


def _tiny_model(work: Path) -> str:
    """The CPU tests' tiny Qwen2 (hidden 64, 3 layers, head dim 16, vocab 301), written to ``work``."""
    from megadiv.models.tiny import make_tiny_model

    return str(make_tiny_model(work / "qwen2", "qwen2", tokenizer="bpe", vocab=301, hidden=64, heads=4, kv_heads=2,
                               ffn=128, layers=3))


def _rank_body(work: Path, target: str, args: dict) -> dict:
    """``target`` on one rank under tests/torchrun.py (a fresh torchrun in a session of its own:
    kill_item_processes takes it down with the item), on the GPU when there is one."""
    from tests.torchrun import run_torchrun

    (result,) = run_torchrun(target, 1, timeout_s=600, args=args, cuda=device().type == "cuda")
    return result


def item_deepspeed_bf16(work: Path, smoke: bool, deadline: float) -> dict:
    """DeepSpeed bf16 at ZeRO-0, 1 and 3 (tests/test_deepspeed_policy.py runs the same body on a
    CPU against float32): each step applied and finite, weights bf16 on the device, gradients
    accumulated in fp32 at ZeRO >= 1 (megadiv's data_types.grad_accum_dtype), per-step figures,
    and how far ZeRO-3 lies from ZeRO-0. Every stage keeps fp32 master weights (ZeRO-0 in
    DeepSpeed's FP16_UnfusedOptimizer); ZeRO-0 keeps bf16 gradients, as DeepSpeed refuses fp32
    accumulation there (docs/deepspeed.md), so after the first step they part."""
    hf_dir, res, figures, problems = _tiny_model(work), {}, {}, []
    for stage in (0, 1, 3):     # a launch per stage: an item cut at its budget reports the stages done
        res |= _rank_body(work, "tests.dist.deepspeed_policy:bf16_stages", {"hf_dir": hf_dir, "stages": (stage,)})
        run = res[stage]
        steps = run["steps"]
        figures[f"zero{stage}"] = {"device": run["device"], "dtypes": run["dtypes"], "wall_s": run["wall_s"],
                                   "loss": [s["loss/total"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
                                   "skipped": [s["skipped"] for s in steps], "optimizer": run["optimizer"],
                                   "grad_accum_dtype": run["grad_accum_dtype"]}
        if stage and run["grad_accum_dtype"] != "torch.float32":
            problems.append(f"ZeRO-{stage}: gradients accumulate in {run['grad_accum_dtype']}, not float32")
        if run["dtypes"] != ["torch.bfloat16"] or run["device"].split(":")[0] != device().type:
            problems.append(f"ZeRO-{stage}: weights {run['dtypes']} on {run['device']}")
        if any(s["skipped"] or s["loss/total"] != s["loss/total"] or s["grad_norm"] != s["grad_norm"] for s in steps):
            problems.append(f"ZeRO-{stage}: a step was skipped or not finite")
        write_partial(work, {"figures": figures})
    zero0, zero3 = res[0], res[3]
    figures["first_step_loss_zero3_minus_zero0"] = zero3["steps"][0]["loss/total"] - zero0["steps"][0]["loss/total"]
    figures["weights_max_abs_diff_zero3_vs_zero0"] = max(float((w - zero0["weights"][k]).abs().max())
                                                         for k, w in zero3["weights"].items())
    if problems:
        return {"status": "failed", "reason": "; ".join(problems), "figures": figures}
    return {"figures": figures}


# padding_invariance's limits on a GPU. cuBLAS picks its kernels (tile shapes, split-K) by the
# matrix shape, so the padded and the plain float32 products sum in other orders: observed-size
# reassociation error is ~1e-6 relative per product (not yet measured), carried through three
# layers and a softmax. A padding bug (a pad token attended to, positions shifted, a loss-mask
# slip) moves log-probs by O(0.1) and gradients by O(1) relative, far above these.
PADDING_TOL_GPU = {"logp": 1e-4, "grad": 1e-3, "metric": 1e-4}
PADDING_TOL_CPU = {"logp": 1e-6, "grad": 1e-5, "metric": 1e-6}   # tests/test_device_placement.py's


def item_padding_invariance(work: Path, smoke: bool, deadline: float) -> dict:
    """One SGD step with the model input padded to a multiple of 16 against none, megatron's
    local layers, float32, compared in float64: on a CPU at tests/test_device_placement.py's
    tolerances, on a GPU at PADDING_TOL_GPU (other shapes, other cuBLAS kernels)."""
    res = _rank_body(work, "tests.dist.device_placement:padding_invariance",
                     {"hf_dir": _tiny_model(work), "model": {"transformer_impl": "local"}})
    plain, padded = res[1], res[16]
    logp = float((padded["logp"].double() - plain["logp"].double()).abs().max())
    grad = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
               for a, b in zip(padded["grads"], plain["grads"]))
    keys = ("loss/total", "loss/policy", "loss/kl", "entropy")
    metric = max(abs(padded["metrics"][k] - plain["metrics"][k]) / max(abs(plain["metrics"][k]), 1e-7) for k in keys)
    tol = PADDING_TOL_GPU if device().type == "cuda" else PADDING_TOL_CPU
    figures = {"seq_len": plain["seq_len"], "multiple": 16, "logp_max_abs_diff": logp,
               "grad_max_rel_diff": grad, "metric_max_rel_diff": metric, "tolerances": tol}
    if logp > tol["logp"] or grad > tol["grad"] or metric > tol["metric"]:
        return {"status": "failed", "reason": f"padding changed the step: log-probs {logp:.2e}, gradients "
                                              f"{grad:.2e}, metrics {metric:.2e} (limits {tol})",
                "figures": figures}
    return {"figures": figures}


def _import_check(module: str):
    def run(work: Path, smoke: bool, deadline: float) -> dict:
        importlib.import_module(module)
        name = {"transformer_engine": "transformer-engine"}.get(module, module)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"figures": {"version": version, "note": "imports on this machine; its tests run in gpu_tests"}}
    return run


RUNNERS = {
    "gpu_tests": item_gpu_tests,
    "divergence_bench": item_divergence_bench,
    "vocab_parallel_trainer": item_vocab_parallel_trainer,
    "no_host_sync": item_no_host_sync,
    "gpt_step_mfu": item_gpt_step_mfu,
    "actor_train_step": item_actor_train_step,
    "weight_sync_rates": item_weight_sync_rates,
    "async_checkpoint": item_async_checkpoint,
    "bf16_probe": item_bf16_probe,
    "grpo_demo": item_grpo_demo,
    "deepspeed_bf16": item_deepspeed_bf16,
    "padding_invariance": item_padding_invariance,
    "transformer_engine": _import_check("transformer_engine"),
    "sglang_cuda": _import_check("sglang"),
}


def run_item_here(name: str, result: Path, work: Path, smoke: bool, deadline: float) -> int:
    """Child-process entry: run one item (``deadline``: time.time() at which its budget ends),
    write its result JSON."""
    out = RUNNERS[name](work, smoke, deadline)
    result.write_text(json.dumps(out, default=str))
    return 0


# --------------------------------------------------------------------------- the orchestrator

def install_wheels(wheel_dir: Path, cuda: bool, budget_s: float) -> dict:
    """pip-install ``wheel_dir/*.whl`` into SITE (the device README's command), only on a CUDA
    machine: the wheels are cp312 builds for it; elsewhere this environment's packages serve."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        return {"status": "skipped", "reason": "no wheels in .whl/ (tools/gpu_wheels.sh makes them)"}
    if not cuda:
        return {"status": "skipped", "reason": f"{NO_CUDA}: the carried wheels are for the GPU machine; this "
                                               f"environment's packages are used"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"pip install timed out after {budget_s:.0f} s"}
    if proc.returncode:
        return {"status": "failed", "reason": f"pip install exited with {proc.returncode}",
                "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    sys.path.insert(0, str(SITE))      # for the orchestrator's find_spec checks
    importlib.invalidate_caches()
    return {"status": "passed", "figures": {"wheels": [w.name for w in wheels], "target": str(SITE),
                                            "bytes": sum(w.stat().st_size for w in wheels)}}


def precompile(paths: list[Path], budget_s: float) -> dict:
    """Byte-compile ``paths`` once, in parallel: every item is a new process that imports megadiv,
    its tests and the carried wheels (installed --no-compile) afresh, and without .pyc files each
    would compile those sources again (pytest alone compiles every test module it collects)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, paths)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"compileall timed out after {budget_s:.0f} s (items compile as they import)"}
    figures = {"paths": [str(p) for p in paths], "wall_s": round(time.monotonic() - start, 2)}
    if proc.returncode:   # a file that does not compile fails its item too: say so, carry on
        return {"status": "failed", "reason": f"compileall exited with {proc.returncode}",
                "log_tail": (proc.stdout + proc.stderr)[-3000:], "figures": figures}
    return {"status": "passed", "figures": figures}


def run_item(item: Item, timeout_s: float, log, env: dict, smoke: bool) -> dict:
    """Run ``item`` in a child process under ``timeout`` (SIGTERM at the budget, so that torchrun
    can stop its ranks; SIGKILL 10 s later), with a hard limit of our own in case ``timeout`` is
    missing or ignored; its result, or why there is none, with what it wrote as partial results
    (write_partial) when it was cut or failed before returning."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{item.name}-") as work:
        work = Path(work)
        result = work / "result.json"
        cmd = [sys.executable, "-u", str(Path(__file__)), "--item", item.name, "--result", str(result),
               "--work", str(work), "--deadline", f"{time.time() + timeout_s:.1f}"] + (["--smoke"] if smoke else [])
        if shutil.which("timeout"):
            cmd = ["timeout", "--kill-after=10", str(int(timeout_s))] + cmd
        log.write(f"\n===== {item.name} (budget {timeout_s:.0f} s): {' '.join(cmd)}\n")
        log.flush()
        tail_start = log.tell()
        before = _descendants()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s + 15)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            kill_item_processes(proc, before)   # torchrun ranks, pytest children, servers: nothing outlives it
        log.flush()
        out = item_outcome(rc, timeout_s, work)
    if out["status"] == "failed":
        with open(log.name, "rb") as f:
            f.seek(tail_start)
            out["log_tail"] = f.read()[-4000:].decode(errors="replace")
    return out


def item_outcome(rc: int, timeout_s: float, work: Path) -> dict:
    """An item's result from its exit code and its work folder: its result.json, or why there is
    none, then with its partial.json (write_partial), marked ``partial``, when it left no figures."""
    result = work / "result.json"
    if rc in (124, 137):
        out = {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s (its budget)"}
    elif rc or not result.exists():
        out = {"status": "failed", "reason": f"exited with {rc} before reporting (see log_tail)"}
    else:
        out = json.loads(result.read_text())
        out.setdefault("status", "passed")
    if "figures" not in out and (work / "partial.json").exists():
        partial = json.loads((work / "partial.json").read_text())
        out |= {k: partial[k] for k in ("figures", "samples") if k in partial} | {"partial": True}
    return out


def become_subreaper() -> None:
    """Make this process the Linux child subreaper of its descendants: an orphan (torchrun, which
    tests/torchrun.py starts in a session of its own, after the budget killed the item that
    started it) is re-parented here instead of to init, so kill_item_processes still finds it."""
    if sys.platform.startswith("linux"):
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def kill_item_processes(proc: subprocess.Popen, before: set[int]) -> None:
    """SIGKILL the item's process group, and every other descendant of this process that was not
    there before the item started (``before``): processes started in a new session (torchrun and
    its ranks, servers) are outside the item's group but still below this process, directly or,
    orphaned, through become_subreaper. They hold the GPU for the next item otherwise."""
    import psutil

    strays = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in strays:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(strays, timeout=10)   # reaps those re-parented here


def environment(cuda: bool) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": cuda, "host": platform.node(), "cpus": os.cpu_count()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "gpu_count": torch.cuda.device_count(),
                "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}"}
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            env["nvidia_smi"] = f"unavailable: {e}"
    packages = {}
    for name in ("megatron-core", "transformers", "math-verify", "transformer-engine", "sglang", "triton"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    env["packages"] = packages
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = None
    return env


def write_report(out_dir: Path, report: dict) -> Path:
    """Write the report atomically (a reader never sees half a file); rewritten after every item."""
    path = out_dir / "gpu_check.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    return path


def run_all(out_dir: Path, only: list[str] | None, budget_s: float, smoke: bool) -> int:
    import torch

    started = time.monotonic()
    deadline = started + budget_s
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    report = {"schema": SCHEMA, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "wall_s": None, "budget_s": budget_s, "smoke": smoke, "environment": {}, "wheels": {}, "precompile": {},
              "unverified": [{"feature": feature, "why": why} for feature, why in UNVERIFIED], "items": {}}
    wheels = install_wheels(REPO / ".whl", cuda, min(INSTALL_BUDGET_S, budget_s))
    report["wheels"] = wheels
    report["precompile"] = precompile([REPO / d for d in ("megadiv", "tests", "benchmarks", "tools")]
                                      + ([SITE] if wheels["status"] == "passed" else []),
                                      min(PRECOMPILE_BUDGET_S, budget_s))
    report["environment"] = environment(cuda)
    # TF32 override off, as docker/Dockerfile sets it: an NGC-based machine image sets it to 1, which
    # runs every float32 matmul in TF32 and would move the float32 comparisons by ~1e-3
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in ([str(SITE)] if wheels["status"] == "passed" else [])
                                        + [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    print(f"[gpu_check] wheels: {wheels['status']}" + (f" ({wheels['reason']})" if wheels.get("reason") else ""),
          flush=True)
    with open(out_dir / "gpu_check.log", "w") as log:
        for item in ITEMS:
            if only is not None and item.name not in only:
                continue
            left = deadline - time.monotonic() - 5          # 5 s to write the report at the end
            budget = item.budget_s * (SMOKE_BUDGET_SCALE if smoke else 1)
            reason = missing(item, cuda, smoke)
            if reason is None and left < 10:
                reason = f"no time left in the {budget_s:.0f} s budget"
            item_start = time.monotonic()
            if reason is not None:
                result = {"status": "skipped", "reason": reason}
            else:
                print(f"[gpu_check] {item.name}: running (budget {min(budget, left):.0f} s)", flush=True)
                try:
                    result = run_item(item, min(budget, left), log, env, smoke)
                except Exception as e:      # the report must survive anything one item does
                    result = {"status": "failed", "reason": f"gpu_check could not run it: {e!r}"}
            result = {"status": result["status"], "reason": result.get("reason"),
                      "figures": result.get("figures", {}), "samples": result.get("samples", {}),
                      "wall_s": round(time.monotonic() - item_start, 2), "budget_s": budget,
                      **{k: result[k] for k in ("partial", "log_tail") if k in result}}
            report["items"][item.name] = result
            if result["status"] == "skipped":
                report["unverified"].append({"feature": f"item {item.name}", "why": result["reason"]})
            report["wall_s"] = round(time.monotonic() - started, 2)
            write_report(out_dir, report)
            print(f"[gpu_check] {item.name}: {result['status']}"
                  + (f" ({result['reason']})" if result["reason"] else "") + f" [{result['wall_s']:.1f} s]", flush=True)
    report["wall_s"] = round(time.monotonic() - started, 2)
    path = write_report(out_dir, report)
    print(f"[gpu_check] report: {path} ({report['wall_s']:.0f} s)", flush=True)
    return 1 if any(r["status"] == "failed" for r in report["items"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, help="where gpu_check.json and gpu_check.log go")
    parser.add_argument("--only", default=None, help=f"comma-separated items, of: {','.join(i.name for i in ITEMS)}")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on any device (tests this script)")
    parser.add_argument("--item", choices=list(RUNNERS), help=argparse.SUPPRESS)    # child-process entry
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.item:
        return run_item_here(args.item, args.result, args.work, args.smoke, args.deadline)
    if args.out_dir is None:
        parser.error("OUT_DIR is required")
    become_subreaper()
    only = None
    if args.only:
        only = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(only) - {i.name for i in ITEMS})
        if unknown:
            parser.error(f"unknown item(s) {', '.join(unknown)}; items: {', '.join(i.name for i in ITEMS)}")
    if args.budget <= 0:
        parser.error(f"--budget must be > 0, got {args.budget}")
    return run_all(args.out_dir, only, args.budget, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
