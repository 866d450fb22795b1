"""``megadiv train --nproc N``: run the job under torchrun on this machine and own its whole lifetime.

The launcher's PID is the one schedulers and operators signal (SLURM, systemd, ``kill PID``,
Ctrl-C). It forwards the first SIGTERM/SIGINT to torchrun, which passes it to every rank; the ranks
abandon the step and exit within seconds (megadiv.trainer.lifecycle). A second signal, or a job
still alive EXIT_GRACE_S after the first, gets SIGKILL. The launcher is a child subreaper (Linux
prctl): any helper orphaned by a dying rank (a checkpoint writer, an SGLang server, a reward
worker) is re-parented to it, and it kills every remaining descendant before it returns. Should
the launcher itself be killed, torchrun gets SIGTERM (parent-death signal) and stops the ranks.

torchrun's own failure report (its logging and its ChildFailedError traceback) goes to
``run_dir/logs/torchrun.log``. The console gets one line naming the first rank to die and how
(its own one-line error, or the signal that killed it and whether memory ran out:
megadiv.cli.rank_deaths), then the other ranks' errors, which follow from it. A log that
cannot be written (a full disk) is noted in that line; the launcher goes on without it.

Each rank computes with ``threads_per_rank(nproc)`` OpenMP threads (megadiv.parallel.threads: the
usable cores // nproc, or OMP_NUM_THREADS when set), passed to torchrun as OMP_NUM_THREADS.

``max_restarts`` (``megadiv train --max-restarts N``) is torchrun's: after a failure the ranks are
started again and resume from the newest intact checkpoint; the launcher says why, one line per
restart. A restarted rank 0 refuses to go on when the failed attempt wrote no checkpoint
(megadiv.trainer.checkpoint.check_restart), so a failure before the first checkpoint is not
retried.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from megadiv.cli.rank_deaths import MONITOR_INTERVAL_S, RankWatcher
from megadiv.parallel.threads import threads_per_rank
from megadiv.trainer.lifecycle import (
    EXIT_GRACE_S,
    STOP_SIGNALS,
    RestartRefused,
    adopt_orphans,
    die_with_parent,
    free_space,
)

# torchrun's log lines: "E1201 02:50:00.123000 4242 torch/distributed/elastic/...py:869] text"
TORCHRUN_LINE = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S+:\d+\] ")
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
RANK_STOPPED = "megadiv train: stopped by "  # a rank's own line; the launcher says why it was stopped
POLL_S = 0.05  # how often the launcher looks at the ranks (a dead one stays visible MONITOR_INTERVAL_S)


def launch(nproc: int, train_args: list[str], run_dir: Path, max_restarts: int = 0) -> int:
    """Run ``megadiv train *train_args`` on ``nproc`` local ranks, restarting the job up to
    ``max_restarts`` times after a failure (torchrun's --max-restarts; the ranks resume from the
    newest intact checkpoint). The caller holds the run directory's lock. Returns the exit code."""
    log_path = run_dir / "logs" / "torchrun.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    adopt_orphans()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S}",
           "-m", "megadiv.cli", "train", *train_args]
    # torchrun in its own session: a terminal's Ctrl-C reaches the launcher alone, which forwards it once
    # and SIGTERM for it should the launcher itself be killed (SIGKILL cannot be relayed)
    # the cores shared out over the ranks (megadiv.parallel.threads), unless OMP_NUM_THREADS is set
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True, env=env,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    received: list[int] = []
    report = _StderrFilter(proc.stderr, log_path)
    watcher = RankWatcher(proc.pid)

    def forward(signum, frame):
        received.append(signum)
        report.quiet = True  # torchrun's shutdown chatter goes to the log; the launcher says what happened
        _signal_tree(proc.pid, signum if len(received) == 1 else signal.SIGKILL, only_root=len(received) == 1)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    reader = threading.Thread(target=report.run, daemon=True)
    reader.start()
    restarts, refused = 0, False
    try:
        deadline = None
        while proc.poll() is None:
            time.sleep(POLL_S)
            if watcher.poll() and not received:  # torchrun started the ranks again after a failure
                restarts += 1
                print(f"megadiv train: {_cause(watcher, report)}; restart {restarts} of {max_restarts}: the "
                      f"ranks resume from the newest intact checkpoint", file=sys.stderr, flush=True)
                watcher.new_attempt()
                report.new_attempt()
            if report.refused_restart and not received:  # a rank found the failed attempt saved nothing
                refused = True
                _signal_tree(proc.pid, signal.SIGTERM, only_root=True)  # torchrun would only start it again
                report.refused_restart = False
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
    if proc.returncode or refused:
        watcher.poll()
        where = f"{log_path}" + (f" (incomplete: {report.log_error})" if report.log_error else "")
        lines = [f"megadiv train: {_cause(watcher, report)}; torchrun's report: {where}"]
        lines += [f"  then {line.removeprefix('megadiv train: ')}" for line in report.rank_errors
                  if line != report.primary_error(watcher)]
        print("\n".join(lines), file=sys.stderr, flush=True)
    return 1 if refused else proc.returncode


def _cause(watcher: RankWatcher, report: _StderrFilter) -> str:
    """The first rank to die and how (its own one-line error when it left one), else torchrun's word."""
    own = report.primary_error(watcher)
    first = watcher.first_death()
    if own is not None:
        return own.removeprefix("megadiv train: ")
    if first is not None:
        return watcher.describe(first)
    code, rank = report.worker_failure or (0, None)
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    if rank is not None:
        return f"rank {rank} exited with code {code}"
    return "torchrun failed"


class _StderrFilter:
    """Copies the job's stderr to ours, diverting torchrun's own lines to its log file, and the
    ranks' one-line errors too (the launcher prints the cause once the job has ended). After a
    stop signal, a worker failure or a rank error, everything goes to the log until torchrun
    starts the ranks again. A log that cannot be written (a full disk) is given up, never the
    copying: a reader that stopped would block the ranks on a full pipe."""

    def __init__(self, stream, log_path: Path):
        self.stream, self.log_path = stream, log_path
        self.quiet = False
        self.worker_failure: tuple[int, int] | None = None
        self.rank_errors: list[str] = []
        self.log_error: str | None = None
        self.refused_restart = False

    def new_attempt(self) -> None:
        self.quiet, self.worker_failure, self.rank_errors = False, None, []

    def primary_error(self, watcher: RankWatcher) -> str | None:
        """The one-line error of the first rank to die; when it left none (killed), None; when the
        ranks' deaths were not seen, the first error line."""
        first = watcher.first_death()
        if first is None:
            return self.rank_errors[0] if self.rank_errors else None
        return next((e for e in self.rank_errors if e.startswith(f"megadiv train: rank {first.rank} failed ")), None)

    def run(self) -> None:
        log = self._open_log()
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace")
            failed = WORKER_FAILED.search(line)
            if failed and self.worker_failure is None:
                self.worker_failure = (int(failed.group(1)), int(failed.group(2)))
            if line.startswith("megadiv train: rank") and " failed at step " in line:
                self.rank_errors.append(line.rstrip("\n"))
                self.refused_restart |= f" {RestartRefused.__name__}: " in line
            if TORCHRUN_LINE.match(line) and "closing signal" in line:
                self.quiet = True  # torchrun tears the job down; what follows are its consequences
            if not (TORCHRUN_LINE.match(line) or line.startswith(RANK_STOPPED) or self.worker_failure
                    or self.quiet or self.rank_errors):
                sys.stderr.write(line)
                sys.stderr.flush()
            elif log is not None:
                log = self._write(log, raw)

    def _open_log(self):
        try:
            return open(self.log_path, "ab")
        except OSError as e:
            self.log_error = f"{e.strerror or e}; {free_space(self.log_path)}"
            return None

    def _write(self, log, raw: bytes):
        """Write ``raw`` to the log; on an error, close it and return None (the rest is not logged)."""
        try:
            log.write(raw)
            log.flush()
            return log
        except OSError as e:
            self.log_error = f"{e.strerror or e}; {free_space(self.log_path)}"
            try:
                log.close()
            except OSError:
                pass
            return None


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
