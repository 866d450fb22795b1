"""Run an untrusted program against assert-style tests in an isolated child process.

``run_sandboxed(program, tests)`` starts ``sandbox_child.py`` (the ``jail`` package, standard
library only) with an environment built from nothing and stdin empty, sends it the program and the
calls into it that the tests make (``megadiv.data.code_tests.plan_test``), and has the values that
come back graded by a clean interpreter (``grading.Judge``) under the run's deadline. The megadiv
package (whose data files hold the reference solutions) and the checkout it came from (whose
history holds them too) are unreadable to the program in every mode (``hidden_paths``). Isolation (docs/security.md has the threat model and what each mode does and does not guarantee):

- ``namespaces`` (Linux, root with CAP_SYS_ADMIN): new network (no interface up), PID, mount, IPC
  and UTS namespaces; a read-only root of /usr, /etc, /lib* and the Python installation; a
  size-capped tmpfs as the working directory; a fresh unprivileged uid per run.
- ``unsafe`` (explicit opt-in only): the program runs on the host, guarded by the fresh uid (when
  started as root), rlimits, seccomp (no socket() or socketpair() at all), Landlock where the kernel has it
  (system and Python paths read-only, /proc of its own process only) and a CPython audit hook.
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

import functools
import glob
import json
import math
import os
import secrets
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

from megadiv.data.code_tests import TestPlan, plan_test
from megadiv.rewards.grading import Judge, judge_results
from megadiv.rewards.sandbox_cgroup import PREFIX, make_cgroup, remove_cgroup, remove_tree, sweep_stale_once
from megadiv.rewards.sandbox_streams import CONTROL_BYTES, collect, control_events, parse_results, terminate

CHILD = str(Path(__file__).resolve().parent / "sandbox_child.py")
PACKAGE = str(Path(__file__).resolve().parents[1])
RUN_MARKER = "MEGADIV_SANDBOX_RUN"
STATUSES = ("passed", "failed", "timeout", "crashed", "limit")
# Fresh uids are drawn above every uid a distribution hands out (and below 2**31 for old tools).
_UID_RANGE = (1 << 20, (1 << 31) - 2)
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
                  program_names: Sequence[str] = (), limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``program``, then ``setup``, then grade each test in ``tests`` (one assert each):
    the sandbox evaluates only the calls into the program, the grader the rest (grading.py).
    ``program_names``: builtin names the tests call that are the program's (``Record.program_names``).

    Returns a result for any program whatsoever. Raises ValueError for a test that is not one
    assert statement or cannot be split (a dataset error) and SandboxError when the sandbox cannot run as ``limits``
    demand (auto and namespaces without namespaces: say what is missing and how to opt in to unsafe).
    Zero tests is a failure, never a pass. Returns within ``timeout_s`` plus clean-up.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    limits = limits or SandboxLimits()
    plans = [plan_test(t, setup, tuple(program_names)) for t in tests]
    isolation = _isolation(limits)
    if not plans:
        return SandboxResult("failed", 0, 0, "", "no tests: nothing to grade", isolation, "", 0.0)
    sweep_stale_once()
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


# Installation prefixes the sandbox grants besides the Python paths (/usr, with /usr/local inside).
SYSTEM_PREFIXES = ("/usr", "/")


def hidden_paths() -> list[str]:
    """Paths no sandboxed program may read: the megadiv package (its data files hold every
    reference solution) in use here and every copy of it (a directory or an egg) in any package
    directory of a granted prefix (this venv's, the base interpreter's, the system's ``dist-packages``,
    the user site), whatever the install, and the project the package in use was checked out in
    (``project_paths``)."""
    places = {*site.getsitepackages(), site.getusersitepackages(), *package_dirs((*SYSTEM_PREFIXES, *python_paths()))}
    copies = {os.path.realpath(path) for d in places for path in glob.glob(os.path.join(glob.escape(d), "megadiv*"))
              if os.path.basename(path) == "megadiv" and os.path.isdir(path) or path.endswith(".egg")}
    return sorted(copies | {PACKAGE} | set(project_paths(os.path.dirname(PACKAGE), python_paths())))


@functools.lru_cache(maxsize=16)
def package_dirs(prefixes: tuple[str, ...]) -> list[str]:
    """The site-packages and dist-packages directories of installation prefixes (cached: globbing
    them costs ~10 ms, each run asks; a new Python installation appears rarely in a process)."""
    patterns = ("lib*/python3*/*-packages", "local/lib*/python3*/*-packages")
    return [d for prefix in prefixes for pattern in patterns for d in glob.glob(os.path.join(glob.escape(prefix), pattern))]


PROJECT_MARKERS = (".git", "setup.py", "setup.cfg", "pyproject.toml")


def project_paths(root: str, granted: Sequence[str]) -> list[str]:
    """The checkout holding the package in use, when ``root`` is one (it has a ``.git`` or a build
    file): its history, build/ and sdists hold the reference solutions too. ``pip install -e
    git+...`` clones into ``<venv>/src/<name>``, inside the granted venv: the whole checkout is
    hidden. A checkout that holds a granted path itself (a ``.venv`` inside the project) is hidden
    entry by entry, all but the entries leading to the granted paths."""
    root = os.path.realpath(root)
    if not any(os.path.lexists(os.path.join(root, marker)) for marker in PROJECT_MARKERS):
        return []  # site-packages of a wheel install: nothing around the package is the project's
    inside = [g for g in map(os.path.realpath, granted) if g == root or g.startswith(root + "/")]
    if not inside:
        return [root]
    entries = (os.path.join(root, name) for name in os.listdir(root))
    return [e for e in entries if not any(g == e or g.startswith(e + "/") for g in inside)]


def child_env(run_id: str) -> dict[str, str]:
    """The whole environment of the sandbox: nothing is inherited from the caller."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",  # set iteration order, hence program output, is reproducible
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            RUN_MARKER: run_id}


# --------------------------------------------------------------------------- one run


def _run(program: str, plans: list[TestPlan], setup: str, timeout_s: float, limits: SandboxLimits,
         isolation: str) -> tuple[SandboxResult, Optional[str]]:
    run_id, nonce = secrets.token_hex(8), secrets.token_hex(16)
    name = f"{PREFIX}{os.getpid()}-{run_id}"
    uid = secrets.SystemRandom().randrange(*_UID_RANGE)
    start = time.monotonic()
    cgroup = workdir = proc = streams = None
    results_r = results_w = control_r = control_w = None
    judge = Judge.acquire(limits.memory_mb)  # when none is idle, a new one starts while the sandbox does
    try:
        # memory.max: every process of the run plus the tmpfs; pids.max: + 1 for the namespace init
        cgroup = make_cgroup(name, (limits.memory_mb * limits.max_processes + limits.tmpfs_mb) << 20,
                             limits.max_processes + 1)
        if isolation == "unsafe":
            workdir = os.path.join(tempfile.gettempdir(), name)
            os.mkdir(workdir, 0o700)
            if os.geteuid() == 0:
                os.chown(workdir, uid, uid)
        payload = {
            "program": program, "setup": setup, "nonce": nonce,
            "leaves": [[[leaf, truth] for leaf, truth in zip(p.leaves, p.truth_only)] for p in plans],
            # a descriptor number the program is not told (results go nowhere else)
            "results_fd": 3 + secrets.randbelow(limits.max_open_files - 3),
            "isolation": isolation, "workdir": workdir, "uid": uid, "cgroup_procs": cgroup and cgroup + "/cgroup.procs",
            "python_paths": python_paths(), "hidden": hidden_paths(), "site_packages": [p for p in site.getsitepackages() if os.path.isdir(p)],
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
        caps = {out_fd: limits.output_bytes, results_r: limits.results_bytes, control_r: CONTROL_BYTES}
        streams, timed_out, overflow = collect(proc, caps, limits.line_bytes, start + timeout_s)
    finally:
        if proc is not None:
            terminate(proc, cgroup, control_r, streams[control_r] if streams else b"")
        if cgroup:
            remove_cgroup(cgroup)
        for fd in (results_r, results_w, control_r, control_w):
            if fd is not None:
                os.close(fd)
        if workdir:
            remove_tree(workdir)
    control = control_events(streams[control_r])
    setup_error = next((ev.get("msg", "?") for ev in control if ev.get("e") == "setup_error"), None)
    try:
        status, detail, tests = _status(streams[results_r], nonce, len(plans), control, timed_out, overflow,
                                        payload["cpu_s"])
        passed = 0
        if tests is not None:
            status, passed, detail = judge_results(plans, tests, judge, setup, start + timeout_s)
    except Exception as e:  # noqa: BLE001 - a score for any program: whatever it sent that breaks grading is 0
        judge.healthy = False
        status, passed, detail = "crashed", 0, f"grading failed on the program's results ({type(e).__name__})"
    finally:
        judge.release()
    text = streams[out_fd].decode("utf-8", "replace")
    return SandboxResult(status, passed, len(plans), text, detail, isolation, run_id,
                         time.monotonic() - start), setup_error


def _status(raw_results: bytes, nonce: str, n_tests: int, control: list[dict], timed_out: bool,
            overflow, cpu_limit: int) -> tuple[str, str, Optional[list[dict]]]:
    """(status, detail, None) of a run that did not reach its verdicts, or ("", "", the test events)
    to judge. Results count only as a complete, well-formed stream: program, one test line per test
    in order, done, each with this run's nonce."""
    exit_ev = next((ev for ev in control if ev.get("e") == "exit"), {})
    sig = exit_ev.get("signal")
    if timed_out:
        return "timeout", "wall-clock timeout", None
    if overflow is not None:
        return "limit", "output or results limit exceeded (bytes or line length)", None
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and exit_ev.get("cpu_s", 0) >= cpu_limit):
        return "timeout", "CPU-time limit", None
    if sig == signal.SIGXFSZ:
        return "limit", "file-size limit", None
    events, bad = parse_results(raw_results, nonce, n_tests)
    if bad:
        return "crashed", f"results stream forged or corrupt ({bad})", None
    kinds = [ev.get("e") for ev in events]
    if not events or kinds[0] != "program":
        return "crashed", f"the process was killed by signal {sig}" if sig else "the process died before the program ran", None
    if not events[0].get("ok"):
        kind = events[0].get("kind")
        return ("limit" if kind == "limit" else "crashed"), str(events[0].get("msg", ""))[:300], None
    tests = events[1:]
    done = bool(tests) and tests[-1].get("e") == "done"
    if done:
        tests = tests[:-1]
    if any(ev.get("e") != "test" or ev.get("i") != i for i, ev in enumerate(tests)) or len(tests) > n_tests:
        return "crashed", "results stream forged or corrupt (out of order)", None
    if not done or len(tests) != n_tests or tests and events[-1].get("count") != n_tests:
        why = f"killed by signal {sig}" if sig else "the program ended the process before the tests finished"
        return "crashed", why, None
    return "", "", tests
