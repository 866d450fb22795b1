"""megadiv.progress: plain lines in a log (a pipe), a tqdm bar on a terminal (a pty), rank 0 only."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from megadiv.progress import Progress

PHASE = """
from megadiv.progress import Progress
with Progress("phase", total=4, unit="step") as bar:
    for _ in range(4):
        bar.update()
"""
FAILING = """
from megadiv.progress import Progress
with Progress("phase", total=4, unit="step") as bar:
    bar.update()
    raise SystemExit(3)
"""


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_log_gets_plain_lines_with_rate_and_eta():
    lines = _run(PHASE, MEGADIV_PROGRESS_INTERVAL_S="0", RANK="0").stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "phase: 1/4 step (25%)", "phase: 2/4 step (50%)", "phase: 3/4 step (75%)", "phase: 4/4 step (100%)"]
    assert all(" step/s | elapsed " in line for line in lines)
    assert all(" | eta " in line for line in lines[:3]) and lines[-1].endswith(" | done")
    assert "\r" not in "".join(lines)


def test_default_interval_prints_the_first_and_the_last_line():
    lines = _run(PHASE, RANK="0").stdout.splitlines()
    assert lines[0].startswith("phase: 1/4 step (25%) | ") and lines[-1].startswith("phase: 4/4 step (100%) | ")
    assert lines[-1].endswith(" | done") and len(lines) in (2, 3, 4)


def test_a_failed_phase_says_where_it_stopped():
    result = _run(FAILING, MEGADIV_PROGRESS_INTERVAL_S="0", RANK="0")
    assert result.returncode == 3
    assert result.stdout.splitlines()[-1].startswith("phase: 1/4 step (25%) | ")
    assert result.stdout.splitlines()[-1].endswith(" | stopped")


def test_only_rank_zero_prints_and_off_silences():
    assert _run(PHASE, MEGADIV_PROGRESS_INTERVAL_S="0", RANK="1").stdout == ""
    assert _run(PHASE, MEGADIV_PROGRESS_INTERVAL_S="0", RANK="0", MEGADIV_PROGRESS="off").stdout == ""


def test_a_terminal_gets_a_tqdm_bar():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 x 0
    try:
        proc = subprocess.Popen([sys.executable, "-c", PHASE], stdout=follower, stderr=subprocess.PIPE,
                                env={**os.environ, "RANK": "0"})
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0
    finally:
        os.close(leader)
    screen = b"".join(chunks).decode()
    assert "phase: 100%" in screen and "4/4" in screen and "step/s" in screen and "\r" in screen


def test_unknown_total_and_bad_interval():
    class Log(list):
        def write(self, text):
            self.append(text)

        def flush(self):
            pass

    log = Log()
    with Progress("import", unit="tensor", file=log, interval_s=0) as bar:
        bar.update(3)
    text = "".join(log)
    assert text.startswith("import: 3 tensor | ") and " eta " not in text and text.rstrip().endswith("done")
    os.environ["MEGADIV_PROGRESS_INTERVAL_S"] = "soon"
    try:
        with pytest.raises(ValueError, match="MEGADIV_PROGRESS_INTERVAL_S must be a number"):
            Progress("x", 1)
    finally:
        del os.environ["MEGADIV_PROGRESS_INTERVAL_S"]


@pytest.mark.slow
def test_a_training_log_shows_the_progress_of_each_long_phase(tmp_path):
    """One rank, TP=1: the weight loads, warm start, the evaluations, the checkpoint saves, then a
    resumed launch's checkpoint load, each with its plain progress lines in the captured
    (non-terminal) output."""
    from tests.test_trainer import megadiv_train

    run = tmp_path / "run"
    common = ["parallel.tensor_parallel=1", "eval.every=1", "eval.samples=0", "checkpoint.every=1"]
    out = megadiv_train(run, "grpo.steps=1", *common, nproc=1)
    for phase in (f"loading weights from {run}/init: ", "warm start: 5/5 step (100%) | ",
                  f"loading weights from {run}/sft: ", "evaluating arithmetic:test: 20/20 response (100%) | ",
                  "saving checkpoint step 1: "):
        assert any(line.startswith(phase) and line.endswith(" | done") for line in out.splitlines()), phase
    out = megadiv_train(run, "grpo.steps=2", *common, nproc=1)
    assert any(line.startswith("loading checkpoint step_000001: ") and " MiB (" in line and line.endswith(" | done")
               for line in out.splitlines())
    # the second save is measured against the first checkpoint's size, so it has a percentage
    assert any(line.startswith("saving checkpoint step 2: ") and "%) | " in line for line in out.splitlines())
