"""``megadiv train --nproc N``: run the job under torchrun on this machine and own its whole lifetime.

The launcher's PID is the one schedulers and operators signal (SLURM, systemd, ``kill PID``,
Ctrl-C). It forwards the first SIGTERM/SIGINT to torchrun, which passes it to every rank; the ranks
abandon the step and exit within seconds (megadiv.trainer.lifecycle). A second signal, or a job
still alive EXIT_GRACE_S after the first, gets SIGKILL. The launcher is a child subreaper (Linux
prctl): any helper orphaned by a dying rank (a checkpoint writer, an SGLang server, a reward
worker) is re-parented to it, and it kills every remaining descendant before it returns. Should
the launcher itself be killed, torchrun gets SIGTERM (parent-death signal) and stops the ranks.

torchrun's own failure report (its logging and its ChildFailedError traceback) goes to
``run_dir/logs/torchrun.log``; the console gets the ranks' one-line errors, or one line from the
launcher when a rank died without a word (killed by a signal).
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from megadiv.trainer.lifecycle import EXIT_GRACE_S, STOP_SIGNALS, adopt_orphans, die_with_parent

# torchrun's log lines: "E1201 02:50:00.123000 4242 torch/distributed/elastic/...py:869] text"
TORCHRUN_LINE = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S+:\d+\] ")
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
RANK_STOPPED = "megadiv train: stopped by "  # a rank's own line; the launcher says why it was stopped


def launch(nproc: int, train_args: list[str], run_dir: Path) -> int:
    """Run ``megadiv train *train_args`` on ``nproc`` local ranks; returns the exit code."""
    log_path = run_dir / "logs" / "torchrun.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    adopt_orphans()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megadiv.cli", "train", *train_args]
    # torchrun in its own session: a terminal's Ctrl-C reaches the launcher alone, which forwards it once
    # and SIGTERM for it should the launcher itself be killed (SIGKILL cannot be relayed)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    received: list[int] = []
    report = _StderrFilter(proc.stderr, log_path)

    def forward(signum, frame):
        received.append(signum)
        report.quiet = True  # torchrun's shutdown chatter goes to the log; the launcher says what happened
        _signal_tree(proc.pid, signum if len(received) == 1 else signal.SIGKILL, only_root=len(received) == 1)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    reader = threading.Thread(target=report.run, daemon=True)
    reader.start()
    try:
        deadline = None
        while proc.poll() is None:
            time.sleep(0.2)
            if received and deadline is None:
                deadline = time.monotonic() + EXIT_GRACE_S + 5  # the ranks' own watchdog, plus torchrun's exit
            if deadline is not None and time.monotonic() > deadline:
                _signal_tree(proc.pid, signal.SIGKILL, only_root=False)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _kill_descendants()  # also closes the stderr pipe that orphaned helpers inherited
        reader.join(timeout=5)
    if received:
        name = signal.Signals(received[0]).name
        print(f"megadiv train: stopped by {name}; the same command resumes from the newest complete checkpoint "
              f"in {run_dir / 'checkpoints'}", file=sys.stderr, flush=True)
        return 128 + received[0]
    if proc.returncode:
        print(_failure_line(report, proc.returncode, log_path), file=sys.stderr, flush=True)
    return proc.returncode


def _failure_line(report: _StderrFilter, returncode: int, log_path: Path) -> str:
    """The cause: a rank killed by a signal (the others' errors are its echoes), else the first
    rank's own error line."""
    code, rank = report.worker_failure or (0, None)
    if code < 0:
        return f"megadiv train: local rank {rank} was killed by {signal.Signals(-code).name}; torchrun's report: {log_path}"
    if report.rank_errors:
        return report.rank_errors[0]
    return f"megadiv train: torchrun failed with exit code {returncode}; its report: {log_path}"


class _StderrFilter:
    """Copies the job's stderr to ours, diverting torchrun's own lines to its log file, and the
    ranks' one-line errors too (the launcher prints the cause once the job has ended). After a
    stop signal, a worker failure or a rank error, everything goes to the log."""

    def __init__(self, stream, log_path: Path):
        self.stream, self.log_path = stream, log_path
        self.quiet = False
        self.worker_failure: tuple[int, int] | None = None
        self.rank_errors: list[str] = []

    def run(self) -> None:
        with open(self.log_path, "ab") as log:
            for raw in iter(self.stream.readline, b""):
                line = raw.decode(errors="replace")
                failed = WORKER_FAILED.search(line)
                if failed and self.worker_failure is None:
                    self.worker_failure = (int(failed.group(1)), int(failed.group(2)))
                if line.startswith("megadiv train: rank") and " failed at step " in line:
                    self.rank_errors.append(line.rstrip("\n"))
                if TORCHRUN_LINE.match(line) and "closing signal" in line:
                    self.quiet = True  # torchrun tears the job down; what follows are its consequences
                if not (TORCHRUN_LINE.match(line) or line.startswith(RANK_STOPPED) or self.worker_failure
                        or self.quiet or self.rank_errors):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    log.write(raw)
                    log.flush()


def _signal_tree(pid: int, sig: int, only_root: bool) -> None:
    """``sig`` to torchrun (which relays it to the ranks), or to it and every descendant."""
    try:
        root = psutil.Process(pid)
        targets = [root] if only_root else [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in targets:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _kill_descendants(grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL, every process still below the launcher (orphans re-parented to it; the
    ranks are gone by now, these are helpers, some of which ignore SIGTERM)."""
    children = psutil.Process().children(recursive=True)
    for p in children:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
