"""How a rank starts, stops and fails: the run-directory lock, signals, helpers that die with their
parent, and errors reported as one line.

    guard = RunGuard(run_dir, rank)
    with guard:                  # lock (rank 0), SIGTERM/SIGINT -> RunInterrupted, helpers die with us
        ... guard.step = step    # the step named in a failure line
    # an exception leaves as RankFailure: one line (rank, step, error, file); traceback in logs/rank<R>.log

Signals: SIGTERM or SIGINT raises RunInterrupted in the main thread at the next Python
instruction, so the current step is abandoned (a checkpoint being written stays ``step_N.partial``
and is never taken for a complete one). Python drops an exception raised inside some callbacks
(at-fork hooks, finalizers: a signal during megatron's forking checkpoint writer lands there) and
reports it to ``sys.unraisablehook``; ours raises it again in the main thread. A rank blocked in C
code (a collective waiting for a peer that already left) cannot run the handler at all: a
watchdog thread woken by the same signal exits the process EXIT_GRACE_S after it, whatever it is
doing. Forked children (megatron's writers) take the default action on these signals and die with
the rank.
"""
from __future__ import annotations

import _thread
import ctypes
import fcntl
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from megadiv.config import ConfigError

EXIT_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LOCK_FILE = ".lock"

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``sig`` when the thread that created it dies (even by SIGKILL)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(sig))


def adopt_orphans() -> None:
    """Linux: descendants orphaned below this process are re-parented to it (not to init), so it
    can find and stop them."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1)


def start_helper() -> None:
    """In a helper process that serves its rank (a multiprocessing server): ignore stop signals, which
    torchrun sends to the rank's whole process group and which the rank itself handles, and die
    with the rank. Stopping first would break the rank's last calls into it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


def _forked_child() -> None:
    """In a process forked by a rank: no inherited stop handler or wakeup pipe; die with the rank."""
    signal.set_wakeup_fd(-1)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent()


class RunLocked(ConfigError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock``; the kernel drops it when the holder dies, so a
    crashed or killed run never leaves a stale lock."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLocked(f"run directory {self.path.parent} is in use by {holder} (lock {self.path}); wait "
                            f"for that run to end or choose another run.name") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def check_free(self) -> None:
        """Raise RunLocked if a live run holds the directory (acquire and release at once)."""
        if self.path.parent.is_dir():
            self.acquire()
            self.release()


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or weight that the run cannot go on with."""


class RunInterrupted(BaseException):
    """A stop signal arrived (BaseException, like KeyboardInterrupt: ``except Exception`` must not
    swallow it)."""

    def __init__(self, signum: int, step: int = 0):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step


class RankFailure(Exception):
    """What a failed rank reports: one line, the traceback being in ``log_path``."""


class RunGuard:
    """See the module docstring. ``rank`` is the global rank; rank 0 holds the lock."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = Path(run_dir), rank
        self.step = 0
        self.signalled: int | None = None  # set by the watchdog as soon as a stop signal arrives
        self.lock = RunLock(run_dir)
        self._previous: dict[int, object] = {}
        self._previous_unraisablehook = sys.unraisablehook

    def __enter__(self) -> RunGuard:
        if self.rank == 0:
            self.lock.acquire()
        os.register_at_fork(after_in_child=_forked_child)
        self._install_signal_handlers()
        return self

    def __exit__(self, kind, error, tb) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = self._previous_unraisablehook
        self.lock.release()
        if isinstance(error, Exception) and self.signalled:  # a consequence of the stop (a helper or peer gone)
            raise RunInterrupted(self.signalled, self.step) from error
        if isinstance(error, RunInterrupted):
            error.step = self.step
        if error is None or isinstance(error, (RunInterrupted, RankFailure)) or not isinstance(error, Exception):
            return False
        raise RankFailure(self._report(error)) from error

    def _report(self, error: Exception) -> str:
        """Write the traceback to logs/rank<R>.log; return the one line for the console."""
        log_path = self.run_dir / "logs" / f"rank{self.rank}.log"
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} step {self.step}\n")
                f.write("".join(traceback.format_exception(error)))
            where = f"traceback in {log_path}"
        except OSError as e:  # a full or read-only disk must not hide the original error
            where = f"traceback not written ({e})"
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" (raised at {frame.filename}:{frame.lineno})" if frame else ""
        message = " ".join(str(error).split()) or type(error).__name__
        return f"megadiv train: rank {self.rank} failed at step {self.step}: {type(error).__name__}: {message}{at}; {where}"

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)  # the C handler writes the signal number
        threading.Thread(target=self._watchdog, args=(read_fd,), name="megadiv-stop-watchdog", daemon=True).start()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        sys.unraisablehook = self._on_unraisable

    def _on_unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, RunInterrupted):  # dropped: raise it again, outside that callback
            threading.Timer(0.05, _thread.interrupt_main, args=(unraisable.exc_value.signum,)).start()
        else:
            self._previous_unraisablehook(unraisable)

    def _on_signal(self, signum: int, frame) -> None:
        raise RunInterrupted(signum)

    def _watchdog(self, read_fd: int) -> None:
        while True:
            signum = os.read(read_fd, 1)[0]
            if signum in STOP_SIGNALS:
                break
        self.signalled = signum
        time.sleep(EXIT_GRACE_S)
        os.write(2, f"megadiv train: rank {self.rank} still running {EXIT_GRACE_S:.0f} s after "
                    f"{signal.Signals(signum).name} (blocked in a collective); exiting now\n".encode())
        os._exit(128 + signum)
