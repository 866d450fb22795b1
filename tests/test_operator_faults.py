"""Faults an operator meets (issue 27), each a real ``megadiv train`` ending in one true line.

- A same-size corruption of the newest checkpoint (4 KB overwritten mid-file): check-config and
  train name the file, the run resumes from the previous intact checkpoint, to the same weights.
- A full disk at a save (a 20 MB tmpfs, where one can be mounted): one line naming the checkpoint
  and the free space, no traceback, the earlier checkpoints intact.
- Two launches at once into one run directory: one runs, the other is refused in one line before
  anything is written.
- ``--max-restarts 1`` and a rank killed once: the job restarts, resumes and ends with the weights
  of an uninterrupted run; a rank killed before the first checkpoint is not retried.
- A rank killed by the kernel's OOM killer (moved into a memory cgroup of 4 MiB, where one can be
  made): named as that rank, SIGKILL, likely out of memory.
SIGKILL of one rank of a TP=2 run, named as that rank and signal: tests/test_faults.py.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megadiv.trainer.checkpoint import checkpoint_problem
from tests.test_faults import (
    FAST,
    TP1,
    assert_same_final_weights,
    check_config,
    command_line,
    copy_run,
    finish,
    start,
    straight,
    train,
    train_command,
    wait_for,
)
from tests.test_trainer import CONFIG

pytestmark = pytest.mark.slow
assert straight  # the module-scoped fixture of tests/test_faults.py: an uninterrupted 3-step run


def megadiv_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("megadiv train:")]


def test_a_same_size_corruption_is_named_and_the_previous_checkpoint_taken(straight, capsys):
    run_dir = copy_run(straight, "corrupted")
    newest, previous = run_dir / "checkpoints" / "step_000003", run_dir / "checkpoints" / "step_000002"
    damaged = newest / "__0_0.distcp"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:  # dd conv=notrunc: 4 KB in the middle, inverted
        f.seek(size // 2)
        block = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    assert damaged.stat().st_size == size
    where = [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", f"model.hf_dir={run_dir.parent}/init"]
    rc, err = check_config(capsys, "check-config", str(CONFIG), *FAST, *TP1, "grpo.steps=3", *where)
    assert rc == 0, err
    assert f"megadiv: skipping checkpoint {newest}: __0_0.distcp has xxh3_64 " in err
    assert "(corrupted on disk after the save: same size, other bytes)" in err
    assert f"megadiv: resumes from {previous}" in err
    _, out = train(run_dir, "grpo.steps=3", *TP1)
    assert f"skipping checkpoint {newest}: __0_0.distcp has xxh3_64 " in out
    assert f"resumed from {previous} at step 2" in out and "Traceback" not in out
    assert_same_final_weights(straight, run_dir)


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root with CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], timeout=30)


def fill(disk: Path, leave_bytes: int) -> None:
    """Write a file until the file system is full, then free ``leave_bytes`` of it. Unbuffered: a
    buffered writer keeps what the full disk refused and flushes it again at truncate and close,
    which fail with ENOSPC in turn (seen once in CI, depending on how many bytes were left)."""
    chunk = b"\0" * (1 << 20)
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)  # a raw write: part of the chunk where that is what fits
        except OSError as e:
            assert e.errno == errno.ENOSPC
        f.truncate(max(0, f.tell() - leave_bytes))


def test_a_full_disk_at_a_save_is_one_line_and_spares_the_earlier_checkpoints(tmpfs, tmp_path):
    """The disk fills after the second checkpoint (200 KB left: the metrics still fit, the next
    checkpoint, 1.7 MB at TP=2, does not)."""
    run_dir = tmpfs / "run"
    log = tmp_path / "train.log"  # the console, off the full disk
    proc = start(train_command(run_dir, "grpo.steps=30", nproc=2), log)
    wait_for(run_dir / "checkpoints" / "step_000002" / "manifest.json", proc, log)
    fill(tmpfs, leave_bytes=200_000)
    rc, out = finish(proc, log)
    (line,) = megadiv_lines(out)
    assert rc == 1 and "Traceback" not in out and "Exception in thread" not in out, out[-4000:]
    assert f"DiskError: cannot write checkpoint {run_dir / 'checkpoints'}/step_" in line, line
    assert "No space left on device; " in line and " free of 21.0 MB on the file system of " in line, line
    noise = [x for x in out.splitlines() if any(w in x for w in ("rror", "xception", "Traceback"))
             and not x.startswith(("megadiv train: ", "  then "))]
    assert noise == [], out[-4000:]  # the cause once, no echo of it from a library or a thread
    for step in (1, 2):
        assert checkpoint_problem(run_dir / "checkpoints" / f"step_{step:06d}") is None


def test_two_launches_at_once_leave_the_live_run_alone(tmp_path):
    """Launched one second apart: the first launcher holds the lock before any rank starts, the
    second is refused in one line and writes nothing (no rank log, nothing in torchrun.log)."""
    run_dir = tmp_path / "run"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start(train_command(run_dir, "grpo.steps=2", nproc=2), first_log)
    deadline = time.monotonic() + 300
    while not (run_dir / ".lock").is_file() or not (run_dir / ".lock").read_text():
        assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-4000:]
        time.sleep(0.05)
    assert (run_dir / ".lock").read_text().startswith(f"pid {first.pid} ")  # the launcher, not a rank
    time.sleep(1)
    second = start(train_command(run_dir, "grpo.steps=2", nproc=2), second_log)
    rc, out = finish(second, second_log)
    lines = [x for x in out.splitlines() if x.startswith("megadiv")]
    assert rc == 2 and len(lines) == 1, out[-3000:]
    assert lines[0].startswith(f"megadiv: invalid config: run directory {run_dir} is in use by pid {first.pid} ")
    rc, out = finish(first, first_log)
    assert rc == 0, out[-4000:]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["attempt.json", "torchrun.log"]


def rank_processes(launcher: subprocess.Popen, timeout_s: float = 300) -> list[psutil.Process]:
    """The job's ranks (torchrun's children), once they exist."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        for p in psutil.Process(launcher.pid).children():
            if "torch.distributed.run" in command_line(p):
                ranks = [r for r in p.children() if "megadiv.cli" in command_line(r)]
                if ranks:
                    return ranks
        time.sleep(0.05)
    pytest.fail("the ranks never started")


def test_a_rank_killed_once_under_max_restarts_finishes_as_an_uninterrupted_run(straight, tmp_path):
    run_dir = straight.parent / "restarted"
    log = tmp_path / "train.log"
    proc = start([*train_command(run_dir, "grpo.steps=3", *TP1), "--max-restarts", "1"], log)
    (rank,) = rank_processes(proc)
    first_checkpoint = run_dir / "checkpoints" / "step_000001" / "manifest.json"
    while not first_checkpoint.exists():  # then kill it at once, mid-run (steps 2-3 and their saves remain)
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.01)
    rank.send_signal(signal.SIGKILL)
    rc, out = finish(proc, log)
    assert rc == 0, out[-6000:]
    (restart_line,) = [x for x in megadiv_lines(out) if "restart 1 of 1" in x]
    assert restart_line.startswith("megadiv train: rank 0 was killed by SIGKILL ("), restart_line
    assert restart_line.endswith("; restart 1 of 1: the ranks resume from the newest intact checkpoint")
    resumed = [x for x in out.splitlines() if x.startswith(f"resumed from {run_dir / 'checkpoints'}/step_")]
    assert len(resumed) == 1 and "Traceback" not in out, out[-4000:]
    assert_same_final_weights(straight, run_dir)


def test_a_failure_before_the_first_checkpoint_is_not_retried(tmp_path):
    run_dir = tmp_path / "early"
    log = tmp_path / "train.log"
    proc = start([*train_command(run_dir, "grpo.steps=3", "checkpoint.every=0", *TP1), "--max-restarts", "5"], log)
    (rank,) = rank_processes(proc)
    wait_for(run_dir / "logs" / "attempt.json", proc, log)  # written at the start of the attempt, before step 1
    rank.send_signal(signal.SIGKILL)
    rc, out = finish(proc, log)
    lines = megadiv_lines(out)
    assert rc == 1 and len(lines) == 2, out[-4000:]
    assert "restart 1 of 5" in lines[0]
    assert lines[1].startswith("megadiv train: rank 0 failed at step 0: RestartRefused: restart 1: not retrying, the "
                               "failed attempt wrote no checkpoint after step 0"), lines[1]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*[0-9]"))
    assert os.path.isfile(run_dir / "logs" / "torchrun.log")


@pytest.fixture
def small_memory_cgroup():
    """A child of this process's cgroup-v1 memory cgroup limited to 4 MiB (root only)."""
    line = next((x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x), None)
    if line is None:
        pytest.skip("no cgroup-v1 memory controller here")
    cgroup = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/") / f"megadiv-test-oom-{os.getpid()}"
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(4 << 20))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here ({e.strerror})")
    yield cgroup
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.5)


def test_a_rank_killed_by_the_oom_killer_is_named_as_out_of_memory(small_memory_cgroup, tmp_path):
    """Rank 1 is moved into a 4 MiB memory cgroup mid-run: its next allocations exceed the limit
    and the kernel's OOM killer sends it SIGKILL, counted in that cgroup's oom_kill."""
    run_dir = tmp_path / "oom"
    log = tmp_path / "train.log"
    proc = start(train_command(run_dir, "grpo.steps=50", nproc=2), log)
    wait_for(run_dir / "checkpoints" / "step_000001" / "manifest.json", proc, log)
    (rank1,) = [p for p in rank_processes(proc) if p.environ().get("LOCAL_RANK") == "1"]
    (small_memory_cgroup / "cgroup.procs").write_text(str(rank1.pid))
    rc, out = finish(proc, log)
    (line,) = megadiv_lines(out)
    # the evidence: the cgroup's count (when the launcher polled the rank after the move) or the kernel log
    assert rc == 1 and line.startswith("megadiv train: rank 1 was killed by SIGKILL (likely out of memory: "), line
    counted = re.search(rf"oom_kill in {re.escape(str(small_memory_cgroup))}/memory.oom_control went (\d+) -> (\d+)\)",
                        line)  # (a helper forked by the rank may have been killed first: the count may pass 1)
    assert (counted and int(counted.group(1)) < int(counted.group(2))
            or f"the kernel log says the OOM killer killed PID {rank1.pid}" in line), line
