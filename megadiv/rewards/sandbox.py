"""Run an untrusted program against assert-style tests in an isolated child process.

``run_sandboxed(program, tests)`` starts ``sandbox_child.py`` (standard library only) with a
scrubbed environment and stdin closed, sends it the program, and collects one event per test
assert on a private pipe. Isolation, strongest available first:

- ``namespaces`` (Linux, root): new network namespace (no interfaces up: no network at all), new
  PID namespace (every process the program starts dies with it), new mount namespace with a
  read-only root built from /usr, /etc, /lib* and the Python installation, a fresh size-capped
  tmpfs as the working directory, a fresh unprivileged uid per run (so RLIMIT_NPROC binds, and
  nothing of the host is writable), no_new_privs.
- ``fallback`` (no root or no namespaces): a fresh host temporary directory, rlimits, and an
  audit hook that refuses sockets, writes outside the directory, reads of other processes'
  /proc entries and process creation. Weaker: see docs/data_and_rewards.md.

Both: rlimits on CPU time, address space, processes, open files and file size; a wall-clock
deadline after which the whole process group is killed; output capped. Every sandboxed process
carries a per-run environment marker; before returning, ``run_sandboxed`` kills any process that
still has it (one that left the process group) and waits until none is left.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

log = logging.getLogger(__name__)

CHILD = str(Path(__file__).resolve().parent / "sandbox_child.py")
RUN_MARKER = "MEGADIV_SANDBOX_RUN"
STATUSES = ("passed", "failed", "timeout", "crashed", "limit")
# Fresh uids are drawn above every uid a distribution hands out (and below 2**31 for old tools).
_UID_RANGE = (1 << 20, (1 << 31) - 2)


class SandboxError(RuntimeError):
    """The sandbox itself cannot run as configured (not the program's fault)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run resource limits and isolation choice."""

    memory_mb: int = 1024
    """Address-space limit of each sandboxed process (RLIMIT_AS)."""
    cpu_s: Optional[int] = None
    """CPU-time limit (RLIMIT_CPU); None: ceil(timeout_s) + 1."""
    max_processes: int = 1
    """Processes and threads the program may have, itself included (1: it cannot start any)."""
    max_open_files: int = 64
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    tmpfs_mb: int = 64
    """Size of the working directory (namespaces mode; a tmpfs in memory)."""
    output_bytes: int = 1 << 20
    """stdout + stderr kept; a program that writes more is stopped with status 'limit'."""
    isolation: Literal["auto", "namespaces", "fallback"] = "auto"
    """auto: namespaces when available, else fallback (with a warning, once)."""
    audit_hook: bool = True
    """Install the audit hook (the fallback's main guard; a second layer under namespaces)."""

    def __post_init__(self):
        for key in ("memory_mb", "max_processes", "max_open_files", "max_file_mb", "tmpfs_mb", "output_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"sandbox.{key} must be >= 1, got {getattr(self, key)}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb must be >= 64 (the interpreter needs it), got {self.memory_mb}")
        if self.max_open_files < 16:
            raise ValueError(f"sandbox.max_open_files must be >= 16, got {self.max_open_files}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"sandbox.cpu_s must be >= 1, got {self.cpu_s}")
        if self.isolation not in ("auto", "namespaces", "fallback"):
            raise ValueError(f"sandbox.isolation must be auto, namespaces or fallback, got {self.isolation!r}")


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """passed (every assert), failed (some assert failed or raised), timeout (wall clock or CPU
    time), crashed (the program did not load, or the process died), limit (memory, processes,
    files, output)."""
    passed: int
    """Test asserts that passed (counted one by one, also when the run ends early)."""
    total: int
    output: str
    """The program's stdout and stderr (capped)."""
    detail: str
    """Why, when not passed: the first failing assert's error, the signal, the limit."""
    isolation: str
    run_id: str
    """Per-run marker: every sandboxed process has RUN_MARKER=<run_id> in its environment."""
    elapsed_s: float


_unavailable_lock = threading.Lock()
_namespaces_unavailable: Optional[str] = None  # why namespaces failed here (auto mode stops trying)


def run_sandboxed(program: str, tests: Sequence[str], timeout_s: float = 10.0, *, setup: str = "",
                  limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``program``, then ``setup``, then each test in ``tests`` (one assert each) in a sandbox.

    Never raises for anything the program does; raises SandboxError when the sandbox cannot be set
    up as ``limits`` demand. Returns within ``timeout_s`` plus clean-up.
    """
    global _namespaces_unavailable
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    limits = limits or SandboxLimits()
    isolation = _isolation(limits)
    result, setup_error = _run(program, list(tests), setup, timeout_s, limits, isolation)
    if setup_error and isolation == "namespaces" and limits.isolation == "auto":
        with _unavailable_lock:
            if _namespaces_unavailable is None:
                log.warning("sandbox: namespaces unavailable (%s); using the weaker fallback isolation", setup_error)
            _namespaces_unavailable = setup_error
        result, setup_error = _run(program, list(tests), setup, timeout_s, limits, "fallback")
    if setup_error:
        raise SandboxError(f"sandbox set-up failed ({isolation}): {setup_error}")
    return result


def _isolation(limits: SandboxLimits) -> str:
    can = sys.platform == "linux" and os.geteuid() == 0
    if limits.isolation == "namespaces" and not can:
        raise SandboxError("sandbox.isolation='namespaces' needs root on Linux")
    mode = limits.isolation
    if mode == "auto":
        mode = "namespaces" if can and _namespaces_unavailable is None else "fallback"
    if mode == "fallback" and os.geteuid() == 0 and (limits.max_processes > 1 or not limits.audit_hook):
        # The kernel does not apply RLIMIT_NPROC to root: only the audit hook stops a fork bomb.
        raise SandboxError("fallback isolation as root cannot bound process creation: it needs "
                           "max_processes=1 and audit_hook=True (or namespaces)")
    return mode


def python_paths() -> list[str]:
    """Directories the sandboxed interpreter needs, shortest first (so parents are bound first)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}
    return sorted((p for p in paths if os.path.isdir(p)), key=len)


def child_env(run_id: str) -> dict[str, str]:
    """The whole environment of the sandbox: nothing is inherited from the caller."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",  # set iteration order, hence program output, is reproducible
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            RUN_MARKER: run_id}


def _run(program, tests, setup, timeout_s, limits, isolation) -> tuple[SandboxResult, Optional[str]]:
    run_id = secrets.token_hex(8)
    workdir = tempfile.mkdtemp(prefix="megadiv-sandbox-") if isolation == "fallback" else None
    env = child_env(run_id)
    payload = {
        "program": program, "tests": tests, "setup": setup, "isolation": isolation, "workdir": workdir,
        "uid": secrets.SystemRandom().randrange(*_UID_RANGE), "python_paths": python_paths(),
        "site_packages": [p for p in site.getsitepackages() if os.path.isdir(p)],
        "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s or math.ceil(timeout_s) + 1,
        "max_processes": limits.max_processes, "max_open_files": limits.max_open_files,
        "max_file_mb": limits.max_file_mb, "tmpfs_mb": limits.tmpfs_mb, "audit_hook": limits.audit_hook,
        "env": env,
    }
    start = time.monotonic()
    results_r, results_w = os.pipe()
    control_r, control_w = os.pipe()
    try:
        # -S: no site processing (the child adds site-packages itself, skipping .pth hooks such as
        # editable-install finders: 4x faster start-up); -B: no .pyc writes; -P: the script's
        # directory is not on sys.path.
        proc = subprocess.Popen([sys.executable, "-S", "-B", "-P", CHILD, str(results_w), str(control_w)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(results_w, control_w), env=env, cwd=workdir or "/",
                                start_new_session=True)
    except BaseException:
        os.close(results_r)
        os.close(control_r)
        raise
    finally:
        os.close(results_w)
        os.close(control_w)
    try:
        try:
            proc.stdin.write(json.dumps(payload).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out_fd = proc.stdout.fileno()
        streams, timed_out, overflow = _collect(proc, (results_r, control_r), start + timeout_s,
                                                limits.output_bytes)
    finally:
        _kill_group(proc)
        os.close(results_r)
        os.close(control_r)
        proc.stdout.close()
        # A runner that exited by itself in namespaces mode waited for the namespace's init, whose
        # exit waits for every process in the namespace: nothing is left. Otherwise (killed at the
        # deadline, or fallback mode) sweep by marker and wait until nothing is left.
        if isolation == "fallback" or proc.returncode != 0:
            kill_marked(run_id)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    output, results, control = streams[out_fd], _events(streams[results_r]), _events(streams[control_r])
    setup_error = next((ev["msg"] for ev in control if ev.get("e") == "setup_error"), None)
    status, passed, detail = _status(results, control, len(tests), timed_out, overflow, payload["cpu_s"])
    text = output.decode("utf-8", "replace")
    return SandboxResult(status, passed, len(tests), text, detail, isolation, run_id,
                         time.monotonic() - start), setup_error


def _collect(proc: subprocess.Popen, event_fds: tuple[int, ...], deadline: float, cap: int):
    """Read the program's output and the event pipes until the runner has exited and the pipes are
    drained, the deadline passes, or the output exceeds ``cap``.
    Returns ({fd: bytes}, timed_out, overflow)."""
    out_fd = proc.stdout.fileno()
    streams = {fd: bytearray() for fd in (out_fd, *event_fds)}
    pidfd = os.pidfd_open(proc.pid)  # readable once the runner has exited
    sel = selectors.DefaultSelector()
    for fd in (*streams, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    timed_out = overflow = exited = False
    open_fds = set(streams)
    try:
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # Once the runner is gone only buffered data is left: a stray process (fallback mode)
            # may hold the pipes open forever, so stop when they fall silent.
            ready = sel.select(0 if exited else remaining)
            if not ready and exited:
                break
            for key, _ in ready:
                if key.fd == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    continue
                data = os.read(key.fd, 1 << 16)
                if data:
                    streams[key.fd] += data
                else:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
            if len(streams[out_fd]) > cap:
                overflow = True
                del streams[out_fd][cap:]
                break
    finally:
        sel.close()
        os.close(pidfd)
    return {fd: bytes(buf) for fd, buf in streams.items()}, timed_out, overflow


def _events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn line from a process killed mid-write
        if isinstance(ev, dict):
            events.append(ev)
    return events


def _status(results: list[dict], control: list[dict], total: int, timed_out: bool, overflow: bool,
            cpu_limit: int) -> tuple[str, int, str]:
    """(status, passed, detail) of one run. ``control`` comes from trusted code; of ``results``
    only the user process's own events count (processes it forked inherit the pipe)."""
    user = next((ev.get("user") for ev in control if ev.get("e") == "user"), None)
    results = [ev for ev in results if ev.get("pid") == user]
    tests = {ev["i"]: ev for ev in results if ev.get("e") == "test" and isinstance(ev.get("i"), int)}
    passed = sum(1 for i, ev in tests.items() if ev.get("ok") and 0 <= i < total)
    program = next((ev for ev in results if ev.get("e") == "program"), None)
    exit_ev = next((ev for ev in control if ev.get("e") == "exit"), {})
    sig = exit_ev.get("signal")
    first_bad = next((ev for _, ev in sorted(tests.items()) if not ev.get("ok")), None)
    limit_ev = next((ev for ev in results if ev.get("kind") == "limit"), None)
    if timed_out:
        return "timeout", passed, "wall-clock timeout"
    if overflow:
        return "limit", passed, "output limit exceeded"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and exit_ev.get("cpu_s", 0) >= cpu_limit):
        return "timeout", passed, "CPU-time limit"
    if sig == signal.SIGXFSZ:
        return "limit", passed, "file-size limit"
    if limit_ev is not None:
        return "limit", passed, limit_ev.get("msg", "resource limit")
    if program is None or not program.get("ok"):
        return "crashed", passed, (program or {}).get("msg", "the process died before the program ran")
    if sig or not any(ev.get("e") == "done" for ev in results):
        return "crashed", passed, (f"the process was killed by signal {sig}" if sig else
                                   "the program ended the process before the tests finished")
    if passed == total:
        return "passed", passed, ""
    return "failed", passed, first_bad.get("msg", "") if first_bad else "missing test results"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the runner's process group (in namespaces mode that ends the PID namespace too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def marked_processes(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries this run's marker (zombies excluded)."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, IndexError):
            continue
    return pids


def kill_marked(run_id: str, rounds: int = 200) -> None:
    """Kill every live process of this run and wait (up to ``rounds`` x 10 ms) until none is left."""
    for _ in range(rounds):
        pids = marked_processes(run_id)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.warning("sandbox: processes of run %s survived %d kill rounds", run_id, rounds)
