"""Run an untrusted program against assert-style tests in an isolated child process.

``run_sandboxed(program, tests)`` starts ``sandbox_child.py`` (standard library only) with an
environment built from nothing and stdin empty, sends it the program and the test operands to
evaluate (``grading.plan_test``), and grades the values that come back here (``grading.judge_test``).
Isolation (docs/security.md has the threat model and what each mode does and does not guarantee):

- ``namespaces`` (Linux, root with CAP_SYS_ADMIN): new network (no interface up), PID, mount, IPC
  and UTS namespaces; a read-only root of /usr, /etc, /lib* and the Python installation; a
  size-capped tmpfs as the working directory; a fresh unprivileged uid per run.
- ``unsafe`` (explicit opt-in only): the program runs on the host filesystem and network, guarded
  by the fresh uid (when started as root), rlimits, seccomp and a CPython audit hook. Not a boundary.
- ``auto`` (default): ``namespaces``, or a SandboxError saying what is missing and how to opt in to
  ``unsafe``. Nothing downgrades silently.

Every mode: never root (a fresh uid/gid when started as root, no capabilities, checked),
no_new_privs, not dumpable, a seccomp filter, rlimits, and a per-run cgroup v2 (cgroup.kill;
memory.max and pids.max when those controllers are enabled) where the cgroup hierarchy is writable.
Every stream from the sandbox is capped in bytes and line length (status ``limit``). Clean-up kills
by PID namespace, cgroup and subreaper, never by a marker the program can erase, reaps every
process before returning, and removes work directories in ``finally``; ones left by a killed
caller are swept at the first run of a process.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
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

from megadiv.rewards.grading import TestPlan, judge_test, plan_test

log = logging.getLogger(__name__)

CHILD = str(Path(__file__).resolve().parent / "sandbox_child.py")
RUN_MARKER = "MEGADIV_SANDBOX_RUN"
STATUSES = ("passed", "failed", "timeout", "crashed", "limit")
PREFIX = "megadiv-sandbox-"  # work directories and cgroups: PREFIX<owner pid>-<run id>
# Fresh uids are drawn above every uid a distribution hands out (and below 2**31 for old tools).
_UID_RANGE = (1 << 20, (1 << 31) - 2)
_CONTROL_BYTES = 1 << 16
OPT_IN = "reward.sandbox_isolation=unsafe (SandboxLimits(isolation='unsafe'))"


class SandboxError(RuntimeError):
    """The sandbox itself cannot run as configured (not the program's fault)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run resource limits and isolation choice."""

    memory_mb: int = 1024
    """Address-space limit of each sandboxed process (RLIMIT_AS); with a cgroup memory controller,
    also the run's total memory (memory.max = memory_mb x max_processes + tmpfs_mb)."""
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
    results_bytes: int = 4 << 20
    """Bytes of test results (the operands' values) a run may send; more: status 'limit'."""
    line_bytes: int = 256 << 10
    """Longest line on any stream (output or results); longer: status 'limit'."""
    isolation: Literal["auto", "namespaces", "unsafe"] = "auto"
    """auto: namespaces, or refuse with SandboxError; unsafe: explicit opt-in to weak isolation."""
    audit_hook: bool = True
    """Install the audit hook (unsafe mode's file and network guard; a second layer under namespaces)."""

    def __post_init__(self):
        for key in ("memory_mb", "max_processes", "max_open_files", "max_file_mb", "tmpfs_mb", "output_bytes",
                    "results_bytes", "line_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"sandbox.{key} must be >= 1, got {getattr(self, key)}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb must be >= 64 (the interpreter needs it), got {self.memory_mb}")
        if self.max_open_files < 16:
            raise ValueError(f"sandbox.max_open_files must be >= 16, got {self.max_open_files}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"sandbox.cpu_s must be >= 1, got {self.cpu_s}")
        if self.isolation not in ("auto", "namespaces", "unsafe"):
            raise ValueError(f"sandbox.isolation must be auto, namespaces or unsafe, got {self.isolation!r}")


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """passed (every assert), failed (some assert failed or raised, or there were no tests),
    timeout (wall clock or CPU time), crashed (the program did not load, ended the process before
    the tests finished, or the results were forged or corrupt), limit (memory, processes, files,
    output or results size)."""
    passed: int
    """Tests that passed; 0 whenever the results cannot be trusted (forged, corrupt, incomplete)."""
    total: int
    output: str
    """The program's stdout and stderr (capped)."""
    detail: str
    """Why, when not passed: the first failing assert's error, the signal, the limit."""
    isolation: str
    run_id: str
    """Per-run id: every sandboxed process starts with RUN_MARKER=<run_id> in its environment
    (for inspection only: clean-up never relies on it)."""
    elapsed_s: float


def run_sandboxed(program: str, tests: Sequence[str], timeout_s: float = 10.0, *, setup: str = "",
                  limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``program``, then ``setup``, then grade each test in ``tests`` (one assert each).

    Returns a result for any program whatsoever. Raises ValueError for a test that is not one
    assert statement (a dataset error) and SandboxError when the sandbox cannot run as ``limits``
    demand (auto and namespaces without namespaces: say what is missing and how to opt in to unsafe).
    Zero tests is a failure, never a pass. Returns within ``timeout_s`` plus clean-up.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    limits = limits or SandboxLimits()
    plans = [plan_test(t) for t in tests]
    isolation = _isolation(limits)
    if not plans:
        return SandboxResult("failed", 0, 0, "", "no tests: nothing to grade", isolation, "", 0.0)
    _sweep_stale_once()
    result, setup_error = _run(program, plans, setup, timeout_s, limits, isolation)
    if setup_error:
        raise SandboxError(_refusal(setup_error) if "unshare:" in setup_error else
                           f"sandbox set-up failed ({isolation}): {setup_error}")
    return result


def _refusal(why: str) -> str:
    return (f"sandbox: no real isolation for untrusted code here ({why}). Code rewards need Linux "
            "namespaces: run as root with CAP_SYS_ADMIN (e.g. docker run --cap-add SYS_ADMIN, or "
            "--privileged). To run programs anyway with weak isolation (host filesystem readable, "
            f"audit-hook guards only; see docs/security.md), opt in with {OPT_IN}.")


def _isolation(limits: SandboxLimits) -> str:
    if limits.isolation == "unsafe":
        return "unsafe"
    if sys.platform != "linux" or os.geteuid() != 0:
        raise SandboxError(_refusal("namespaces need root on Linux, this process runs as uid "
                                    f"{os.geteuid()} on {sys.platform}"))
    return "namespaces"


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


# --------------------------------------------------------------------------- cgroups


def _cgroup_base() -> Optional[str]:
    """This process's own cgroup v2 directory when it is writable, else None (cached)."""
    global _CGROUP_BASE
    if _CGROUP_BASE is False:
        try:
            with open("/proc/self/cgroup") as f:
                path = next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))
            with open("/proc/self/mountinfo") as f:
                mount = next(line.split()[4] for line in f if " - cgroup2 " in line)
            base = os.path.join(mount, path.lstrip("/"))
            _CGROUP_BASE = base if os.access(base, os.W_OK) and os.path.exists(base + "/cgroup.procs") else None
        except (OSError, StopIteration, IndexError):
            _CGROUP_BASE = None
    return _CGROUP_BASE


_CGROUP_BASE: object = False


def _make_cgroup(name: str, limits: SandboxLimits) -> Optional[str]:
    """A cgroup for one run: memory.max and pids.max where those controllers are enabled here."""
    base = _cgroup_base()
    if base is None:
        return None
    path = os.path.join(base, name)
    try:
        os.mkdir(path)
    except OSError as e:
        log.debug("sandbox: no per-run cgroup (%s)", e)
        return None
    settings = {"memory.max": (limits.memory_mb * limits.max_processes + limits.tmpfs_mb) << 20,
                "memory.swap.max": 0, "pids.max": limits.max_processes + 1}  # +1: the namespace init
    try:
        for key, value in settings.items():
            if os.path.exists(f"{path}/{key}"):
                with open(f"{path}/{key}", "w") as f:
                    f.write(str(value))
    except OSError:
        os.rmdir(path)
        raise
    return path


def _remove_cgroup(path: str, timeout_s: float = 5.0) -> None:
    """cgroup.kill everything in it, wait until it is empty, remove it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"{path}/cgroup.kill", "w") as f:
                f.write("1")
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes still dying
            if time.monotonic() > deadline:
                log.warning("sandbox: cgroup %s not empty after %.0f s", path, timeout_s)
                return
            time.sleep(0.005)


def _sweep_stale_once() -> None:
    """Remove work directories and cgroups left by callers that were killed (owner pid gone)."""
    global _SWEPT
    with _SWEEP_LOCK:
        if _SWEPT:
            return
        _SWEPT = True
    pattern = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+$")
    places = [(tempfile.gettempdir(), False)] + ([(_cgroup_base(), True)] if _cgroup_base() else [])
    for parent, is_cgroup in places:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if not m or _alive(int(m.group(1))):
                continue
            path = os.path.join(parent, name)
            if is_cgroup:
                _remove_cgroup(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            log.info("sandbox: removed stale %s", path)


_SWEEP_LOCK = threading.Lock()
_SWEPT = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# --------------------------------------------------------------------------- one run


def _run(program: str, plans: list[TestPlan], setup: str, timeout_s: float, limits: SandboxLimits,
         isolation: str) -> tuple[SandboxResult, Optional[str]]:
    run_id, nonce = secrets.token_hex(8), secrets.token_hex(16)
    name = f"{PREFIX}{os.getpid()}-{run_id}"
    uid = secrets.SystemRandom().randrange(*_UID_RANGE)
    start = time.monotonic()
    cgroup = workdir = proc = streams = None
    results_r = results_w = control_r = control_w = None
    try:
        cgroup = _make_cgroup(name, limits)
        if isolation == "unsafe":
            workdir = os.path.join(tempfile.gettempdir(), name)
            os.mkdir(workdir, 0o700)
            if os.geteuid() == 0:
                os.chown(workdir, uid, uid)
        payload = {
            "program": program, "setup": setup, "leaves": [list(p.leaves) for p in plans], "nonce": nonce,
            # a descriptor number the program is not told (results go nowhere else)
            "results_fd": 3 + secrets.randbelow(limits.max_open_files - 3),
            "isolation": isolation, "workdir": workdir, "uid": uid, "cgroup_procs": cgroup and cgroup + "/cgroup.procs",
            "python_paths": python_paths(), "site_packages": [p for p in site.getsitepackages() if os.path.isdir(p)],
            "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s or math.ceil(timeout_s) + 1,
            "max_processes": limits.max_processes, "max_open_files": limits.max_open_files,
            "max_file_mb": limits.max_file_mb, "tmpfs_mb": limits.tmpfs_mb, "audit_hook": limits.audit_hook,
            "env": child_env(run_id),
        }
        results_r, results_w = os.pipe()
        control_r, control_w = os.pipe()
        # -S: no site processing (the child adds site-packages itself, skipping .pth hooks such as
        # editable-install finders: 4x faster start-up); -B: no .pyc writes; -P: the script's
        # directory is not on sys.path.
        proc = subprocess.Popen([sys.executable, "-S", "-B", "-P", CHILD, str(results_w), str(control_w)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(results_w, control_w), env=payload["env"], cwd="/",
                                start_new_session=True)
        os.close(results_w)
        os.close(control_w)
        results_w = control_w = None
        try:
            proc.stdin.write(json.dumps(payload).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out_fd = proc.stdout.fileno()
        caps = {out_fd: limits.output_bytes, results_r: limits.results_bytes, control_r: _CONTROL_BYTES}
        streams, timed_out, overflow = _collect(proc, caps, limits.line_bytes, start + timeout_s)
    finally:
        if proc is not None:
            _terminate(proc, cgroup, control_r, streams[control_r] if streams else b"")
        if cgroup:
            _remove_cgroup(cgroup)
        for fd in (results_r, results_w, control_r, control_w):
            if fd is not None:
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    control = _control_events(streams[control_r])
    setup_error = next((ev.get("msg", "?") for ev in control if ev.get("e") == "setup_error"), None)
    status, passed, detail = _status(streams[results_r], nonce, plans, control, timed_out, overflow,
                                     payload["cpu_s"])
    text = streams[out_fd].decode("utf-8", "replace")
    return SandboxResult(status, passed, len(plans), text, detail, isolation, run_id,
                         time.monotonic() - start), setup_error


def _collect(proc: subprocess.Popen, caps: dict[int, int], line_cap: int, deadline: float):
    """Read every stream until the runner has exited and the streams are drained, the deadline
    passes, or a stream exceeds its byte cap or ``line_cap``. Memory stays within the caps.
    Returns ({fd: bytes}, timed_out, overflow: None or which stream overflowed)."""
    streams = {fd: bytearray() for fd in caps}
    line_len = dict.fromkeys(caps, 0)  # bytes since the last newline
    pidfd = os.pidfd_open(proc.pid)  # readable once the runner has exited
    sel = selectors.DefaultSelector()
    for fd in (*caps, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    timed_out, overflow, exited = False, None, False
    open_fds = set(caps)
    try:
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # Once the runner is gone (it reaps everything first) only buffered data is left.
            ready = sel.select(0 if exited else remaining)
            if not ready and exited:
                break
            for key, _ in ready:
                if key.fd == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    continue
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
                    continue
                room = caps[key.fd] - len(streams[key.fd])
                streams[key.fd] += data[:max(room, 0)]
                cut = data.rfind(b"\n")
                longest = max(line_len[key.fd] + (data.find(b"\n") if cut >= 0 else len(data)),
                              max((len(s) for s in data[:cut].split(b"\n")[1:]), default=0) if cut >= 0 else 0)
                line_len[key.fd] = len(data) - cut - 1 if cut >= 0 else line_len[key.fd] + len(data)
                if room < len(data) or longest > line_cap:
                    overflow = key.fd
                    break
            if overflow is not None:
                break
    finally:
        sel.close()
        os.close(pidfd)
    return {fd: bytes(buf) for fd, buf in streams.items()}, timed_out, overflow


def _control_events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn last line from a runner killed mid-write
        if isinstance(ev, dict):
            events.append(ev)
    return events


def _terminate(proc: subprocess.Popen, cgroup: Optional[str], control_r: int, control_seen: bytes) -> None:
    """End the run and reap the runner; afterwards no process of the run is left.

    The runner's child (the namespace init, or the program's process) is killed first: the runner,
    a child subreaper, then reaps it and everything re-parented to it and exits (in namespaces mode
    the kernel has already ended every process of the namespace). The cgroup catches anything else."""
    if proc.poll() is None:
        try:  # what the runner reported that _collect has not read yet
            os.set_blocking(control_r, False)
            control_seen += os.read(control_r, _CONTROL_BYTES)
        except OSError:
            pass
        child = next((ev.get("pid") for ev in _control_events(control_seen) if ev.get("e") == "child"), None)
        if isinstance(child, int) and child > 1:
            try:  # an unreaped child of a live runner: its pid cannot have been reused
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if cgroup:
            try:
                with open(f"{cgroup}/cgroup.kill", "w") as f:
                    f.write("1")
            except OSError:
                pass
        try:
            proc.wait(timeout=10 if child else 0.001)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner itself is stuck, or had no child yet
    proc.wait()
    proc.stdout.close()


def _status(raw_results: bytes, nonce: str, plans: list[TestPlan], control: list[dict], timed_out: bool,
            overflow, cpu_limit: int) -> tuple[str, int, str]:
    """(status, passed, detail) of one run. Results count only as a complete, well-formed stream:
    program, one test line per test in order, done, each with this run's nonce."""
    exit_ev = next((ev for ev in control if ev.get("e") == "exit"), {})
    sig = exit_ev.get("signal")
    if timed_out:
        return "timeout", 0, "wall-clock timeout"
    if overflow is not None:
        return "limit", 0, "output or results limit exceeded (bytes or line length)"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and exit_ev.get("cpu_s", 0) >= cpu_limit):
        return "timeout", 0, "CPU-time limit"
    if sig == signal.SIGXFSZ:
        return "limit", 0, "file-size limit"
    events, bad = _results(raw_results, nonce)
    if bad:
        return "crashed", 0, f"results stream forged or corrupt ({bad})"
    kinds = [ev.get("e") for ev in events]
    if not events or kinds[0] != "program":
        return "crashed", 0, f"the process was killed by signal {sig}" if sig else "the process died before the program ran"
    if not events[0].get("ok"):
        kind = events[0].get("kind")
        return ("limit" if kind == "limit" else "crashed"), 0, str(events[0].get("msg", ""))[:300]
    tests = events[1:]
    done = bool(tests) and tests[-1].get("e") == "done"
    if done:
        tests = tests[:-1]
    if any(ev.get("e") != "test" or ev.get("i") != i for i, ev in enumerate(tests)) or len(tests) > len(plans):
        return "crashed", 0, "results stream forged or corrupt (out of order)"
    if not done or len(tests) != len(plans) or tests and events[-1].get("count") != len(plans):
        why = f"killed by signal {sig}" if sig else "the program ended the process before the tests finished"
        return "crashed", 0, why
    passed, first_bad, limit = 0, "", None
    for plan, ev in zip(plans, tests):
        if "v" in ev:
            ok, why = judge_test(plan, ev["v"])
        else:
            ok, why = False, str(ev.get("msg", ""))[:300]
            limit = limit or (why if ev.get("kind") == "limit" else None)
        passed += ok
        first_bad = first_bad or why
    if limit:
        return "limit", 0, limit
    if passed == len(plans):
        return "passed", passed, ""
    return "failed", passed, first_bad


def _results(raw: bytes, nonce: str) -> tuple[list[dict], str]:
    """Parse the results stream; (events, '') or ([], why it cannot be trusted). Never raises."""
    events = []
    lines = raw.split(b"\n")
    if lines[-1]:
        return [], "a torn last line"
    for n, line in enumerate(lines[:-1]):
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError) as e:
            return [], f"line {n}: not JSON ({type(e).__name__})"
        if not isinstance(ev, dict) or ev.get("n") != nonce:
            return [], f"line {n}: not from the harness"
        events.append(ev)
    return events, ""
