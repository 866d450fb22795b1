"""Runs that are stopped, killed, damaged or misconfigured (issue 17), each a real ``megadiv train``.

- SIGTERM and SIGINT to the launcher's PID alone, and SIGKILL of one rank, during a TP=2 run (and
  SIGTERM with grpo.overlap, a batch being generated in rank 0's background thread): no process of
  the run is alive 30 s later (by process group, by command line, and every process that descended
  from the launcher while it ran).
- A truncated file in the newest checkpoint, and a deleted newest checkpoint: the run resumes from
  the previous intact one and ends with the weights of an uninterrupted run.
- Bad inputs: each is refused before any rank starts, or reported as one line naming the rank and
  the file.
The launches are tiny (1-3 steps of the shrunk demo) and share runs between assertions.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.test_trainer import CONFIG, REPO, TINY, hf_weights, step_records
from tests.torchrun import cpu_tier_env

pytestmark = pytest.mark.slow

FAST = [*TINY, "eval.every=0", "eval.data.max_items=4", "eval.samples=0", "checkpoint.keep_last=3"]
# The one-process runs (the demo config is TP=2). The tiny model answers nothing right after 5
# warm-start steps; DAPO's overlong shaping (lengths 1-4 of 4 tokens score 0 to -1) gives every group
# reward variance, so each step moves the weights and equal final weights mean something.
TP1 = ["parallel.tensor_parallel=1", "grpo.overlong_buffer=3"]


def train_command(run_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "megadiv.cli", "train", str(CONFIG), f"run.output_dir={run_dir.parent}",
            f"run.name={run_dir.name}", f"model.hf_dir={run_dir.parent}/init", *FAST, *overrides, "--nproc", str(nproc)]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=cpu_tier_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"timed out after {timeout_s}s:\n{log.read_text()[-6000:]}")
    return proc.returncode, log.read_text(errors="replace")


def train(run_dir: Path, *overrides: str, nproc: int = 1, ok: bool = True) -> tuple[int, str]:
    log = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.log"
    rc, out = finish(start(train_command(run_dir, *overrides, nproc=nproc), log), log)
    if ok:
        assert rc == 0, f"megadiv train failed ({rc}):\n{out[-8000:]}"
    return rc, out


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{path} never appeared (rc {proc.poll()}):\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def run_processes(pgid: int, marker: str, known: list[psutil.Process]) -> list[str]:
    """Live (non-zombie) processes of a run: in its process group, with ``marker`` on their command
    line, or among the processes seen below the launcher."""
    found = {}
    for p in [*psutil.process_iter(["cmdline", "status"]), *known]:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(p.pid) == pgid or marker in " ".join(p.cmdline()) or p in known:
                found[p.pid] = " ".join(p.cmdline())[:160]
        except (psutil.Error, ProcessLookupError):
            continue
    return [f"{pid}: {cmd}" for pid, cmd in found.items()]


def assert_all_gone(proc: subprocess.Popen, marker: str, known: list[psutil.Process], within_s: float = 30) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if proc.poll() is not None and not run_processes(proc.pid, marker, known):
            return time.monotonic() - t0
        time.sleep(0.25)
    left = run_processes(proc.pid, marker, known)
    for p in [psutil.Process(int(s.split(":")[0])) for s in left]:
        p.kill()
    os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    pytest.fail(f"alive {within_s:.0f} s after the fault: launcher rc {proc.poll()}, processes {left}")


def command_line(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def ranks(launcher: subprocess.Popen) -> list[psutil.Process]:
    """torchrun's children (their own children, e.g. megatron's forked writers, share the command line)."""
    (torchrun,) = [p for p in psutil.Process(launcher.pid).children() if "torch.distributed.run" in command_line(p)]
    return [p for p in torchrun.children() if "megadiv.cli" in command_line(p)]


@pytest.mark.parametrize("fault,extra", [("SIGTERM", []), ("SIGINT", []), ("SIGKILL-rank", []),
                                         ("SIGTERM", ["grpo.overlap=true", "loss.tis_cap=2.0"])],
                         ids=["SIGTERM", "SIGINT", "SIGKILL-rank", "SIGTERM-overlap"])
def test_a_stopped_tp2_run_leaves_no_process(tmp_path, fault, extra):
    """The run is stopped once its first checkpoint exists (so megatron's writer helpers exist)."""
    run_dir = tmp_path / f"run-{fault.lower()}"
    log = tmp_path / "train.log"
    proc = start(train_command(run_dir, "grpo.steps=50", "parallel.tensor_parallel=2", *extra, nproc=2), log)
    known: list[psutil.Process] = []
    try:
        wait_for(run_dir / "checkpoints" / "step_000001" / "manifest.json", proc, log)
        # a second run cannot start in the live run directory
        rc, out = train(run_dir, "grpo.steps=50", "parallel.tensor_parallel=2", nproc=2, ok=False)
        assert rc == 2 and "is in use by pid" in out and str(run_dir) in out, out[-3000:]
        known = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks(proc)) == 2
        if fault == "SIGKILL-rank":
            rank1 = next(p for p in ranks(proc) if p.environ().get("LOCAL_RANK") == "1")
            rank1.send_signal(signal.SIGKILL)
        else:
            os.kill(proc.pid, getattr(signal, fault))
        seconds = assert_all_gone(proc, str(run_dir), known)
    finally:  # whatever failed above, leave nothing running
        for p in [*known, psutil.Process(proc.pid)] if proc.poll() is None else known:
            try:
                p.kill()
            except psutil.Error:
                pass
    _, out = finish(proc, log)
    print(f"{fault}: every process of the run gone {seconds:.1f} s after the fault")
    errors = [line for line in out.splitlines() if line.startswith("megadiv train:")]
    assert "Traceback" not in out, out[-4000:]
    if fault == "SIGKILL-rank":
        assert proc.returncode != 0
        assert errors == [f"megadiv train: local rank 1 was killed by SIGKILL; torchrun's report: "
                          f"{run_dir / 'logs' / 'torchrun.log'}"], out[-3000:]
    else:
        assert proc.returncode == 128 + getattr(signal, fault), out[-3000:]
        assert errors == [f"megadiv train: stopped by {fault}; the same command resumes from the newest complete "
                          f"checkpoint in {run_dir / 'checkpoints'}"], out[-3000:]
    # nothing half-written is taken for a checkpoint
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        assert ckpt.name.endswith(".partial") or (ckpt / "manifest.json").is_file()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An uninterrupted 3-step run (TP=1, one process) with a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "straight"
    train(run_dir, "grpo.steps=3", *TP1)
    return run_dir


def copy_run(src: Path, name: str) -> Path:
    dst = src.parent / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.lock"))
    for f in ("summary.json", "curves.png"):
        (dst / f).unlink()
    return dst


def hf_weights_of(hf_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}


def assert_same_final_weights(a: Path, b: Path) -> None:
    wa, wb = hf_weights(a), hf_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_skips_a_truncated_newest_checkpoint(straight):
    run_dir = copy_run(straight, "truncated")
    newest, previous = run_dir / "checkpoints" / "step_000003", run_dir / "checkpoints" / "step_000002"
    damaged = newest / "__0_0.distcp"
    size = damaged.stat().st_size
    os.truncate(damaged, size // 2)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # a torn last line (killed mid-write)
    _, out = train(run_dir, "grpo.steps=3", *TP1)
    assert (f"skipping checkpoint {newest}: __0_0.distcp is {size // 2} bytes, the manifest says {size} "
            f"(truncated or overwritten)") in out
    assert f"resumed from {previous} at step 2" in out
    assert_same_final_weights(straight, run_dir)
    start, end = hf_weights_of(straight / "sft"), hf_weights(straight)
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the 3 steps did train
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3]  # truncated to step 2 on resume, torn line gone
    assert (run_dir / "curves.png").stat().st_size > 0
    assert json.loads((run_dir / "hf" / "megadiv_step.json").read_text()) == {"step": 3}
    # a training checkpoint converts as docs/models.md shows, to the weights the run exported
    converted = run_dir.parent / "converted"
    subprocess.run([sys.executable, "-m", "megadiv.cli", "convert", "megatron-to-hf", "--ckpt-dir",
                    str(straight / "checkpoints" / "step_000003"), "--hf-template", str(straight / "sft"),
                    "--out", str(converted)], cwd=REPO, check=True, timeout=600, capture_output=True,
                   env=cpu_tier_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    converted_weights = hf_weights_of(converted)
    exported = hf_weights(straight)
    assert converted_weights.keys() == exported.keys()
    assert all(torch.equal(converted_weights[k], exported[k]) for k in exported)


def test_resume_after_the_newest_checkpoint_was_deleted_and_extending_reexports(straight):
    run_dir = copy_run(straight, "deleted")
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")  # 'latest' still names it
    _, out = train(run_dir, "grpo.steps=3", *TP1)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} at step 2" in out
    assert_same_final_weights(straight, run_dir)
    # a finished run extended by one step: hf/ and summary.json both move to step 4
    _, out = train(run_dir, "grpo.steps=4", *TP1)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000003'} at step 3" in out
    assert json.loads((run_dir / "hf" / "megadiv_step.json").read_text()) == {"step": 4}
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    old, new = hf_weights(straight), hf_weights(run_dir)
    assert any(not torch.equal(old[k], new[k]) for k in old)
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]


def check_config(capsys, *args: str) -> tuple[int, str]:
    from megadiv.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def test_bad_inputs_fail_before_launch_or_in_one_line(straight, tmp_path, capsys):
    """Each bad input of issue 17: refused by check-config (and so by train, which runs the same
    checks before starting any rank), in one line naming the file; NaN weights, found only when a
    rank loads them, as one line naming the rank and the file."""
    base = [str(CONFIG), *FAST, f"run.output_dir={tmp_path}", f"model.hf_dir={tmp_path}/init"]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("grpo:\n  steps: 3\n  micro_batch_size: [8\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    model = straight / "sft"
    broken_config, broken_weights = tmp_path / "broken-config", tmp_path / "broken-weights"
    for d in (broken_config, broken_weights):
        shutil.copytree(model, d)
    (broken_config / "config.json").write_text((model / "config.json").read_text()[:40])
    os.truncate(broken_weights / "model.safetensors", (model / "model.safetensors").stat().st_size - 100)
    model_keys = ["warm_start.make_model=none", "warm_start.sft_steps=0"]
    cases = {  # what -> (arguments, text the one line must hold)
        "YAML syntax": ([str(bad_yaml)], f"{bad_yaml}:4:1: YAML syntax error"),
        "missing data file": (["data.name=jsonl", f"data.path={tmp_path}/none.jsonl"], f"{tmp_path}/none.jsonl"),
        "empty data file": (["data.name=jsonl", f"data.path={empty}"], f"{empty} holds no records"),
        "unwritable output": ([f"run.output_dir={not_a_dir}/runs"], f"{not_a_dir} is not a directory"),
        "truncated config.json": ([f"model.hf_dir={broken_config}", *model_keys],
                                  f"{broken_config / 'config.json'}"),
        "truncated safetensors": ([f"model.hf_dir={broken_weights}", *model_keys],
                                  f"{broken_weights / 'model.safetensors'}: cannot read it"),
        "resume at another PP": ([f"run.output_dir={straight.parent}", f"run.name={straight.name}",
                                  f"model.hf_dir={straight.parent}/init", "parallel.pipeline_parallel=2"],
                                 "was written with parallel.pipeline_parallel=1 (now 2)"),
    }
    for what, (args, expected) in cases.items():
        rc, err = check_config(capsys, "check-config", *base, *args)
        lines = [line for line in err.splitlines() if line.startswith("megadiv")]
        assert rc == 2 and len(lines) == 1 and expected in lines[0], (what, err)
    rc, err = check_config(capsys, "train", *base, "--nproc", "0")
    assert rc == 2 and "argument --nproc: must be >= 1, got 0" in err
    # the same refusal from train, before any rank starts (no torchrun in the output, in seconds)
    rc, out = train(straight, "parallel.tensor_parallel=1", "parallel.pipeline_parallel=2", nproc=2, ok=False)
    lines = [line for line in out.splitlines() if line.startswith("megadiv")]
    assert rc == 2 and len(lines) == 1 and "was written with parallel.pipeline_parallel=1 (now 2)" in lines[0], out
    assert "Traceback" not in out and "ChildFailedError" not in out

    nan_model = tmp_path / "nan-model"
    shutil.copytree(model, nan_model)
    from safetensors.torch import save_file

    weights = load_file(nan_model / "model.safetensors")
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, nan_model / "model.safetensors", metadata={"format": "pt"})
    rc, out = train(tmp_path / "nan-run", f"model.hf_dir={nan_model}", *model_keys, "parallel.tensor_parallel=2",
                    nproc=2, ok=False)
    lines = [line for line in out.splitlines() if "NaN" in line]
    assert rc == 1 and len(lines) == 1, out[-4000:]
    assert lines[0].startswith("megadiv train: rank ") and " failed at step 0: " in lines[0]
    assert f"{nan_model / 'model.safetensors'}: tensor {name} holds NaN or Inf values" in lines[0]
    assert "Traceback" not in out and "traceback in " in lines[0]
