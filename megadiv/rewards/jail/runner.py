"""The process tree of one run, started by ``megadiv.rewards.sandbox`` as ``python -S
sandbox_child.py RESULTS_FD CONTROL_FD`` with one JSON payload on stdin::

    runner (host namespaces; child subreaper, dies with the caller)
      namespaces mode: unshare(net, pid, mount, ipc, uts), fork
        ns-init = PID 1 of the new PID namespace: builds the read-only root (namespace.py),
          chroots into it, forks the user process; when it exits the kernel ends the namespace
      unsafe mode: fork the user process, cwd a host temporary directory
      Either way the runner puts its child in the run's cgroup (when the caller made one) before
      the child goes on, and after it ends kills and reaps every process re-parented to it.

user process: confine (confine.py), drop the cached foreign functions, close every descriptor but
the results pipe (moved to a number the caller chose and told nobody), install the audit hook,
run the program and report the calls' values (harness.py).

Control pipe (CONTROL_FD): start, child, setup_error, exit and ended events from trusted code only;
the user process closes it before the program runs.
"""
import json
import os
import signal
import sys

from .audit import make_audit_hook
from .confine import confine
from .harness import run_tests
from .landlock import SYSTEM_PATHS
from .libc import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    PR_SET_CHILD_SUBREAPER,
    call,
    die_with_parent,
    forget,
    libc,
    prctl,
)
from .namespace import build_root


class Channel:
    """Control events to the caller, one JSON object per line (each well under PIPE_BUF: atomic)."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, **event) -> None:
        if len(event.get("msg", "")) > 512:
            event["msg"] = event["msg"][:512]
        os.write(self.fd, (json.dumps(event) + "\n").encode())


def ns_init(p: dict, results_fd: int, ctl: Channel) -> int:
    """PID 1 of the sandbox: build the root, run the user process, reap everything, report its end."""
    try:
        build_root(p)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"namespace set-up failed: {e}")
        return 3
    pid = os.fork()
    if pid == 0:
        user_process(p, results_fd, ctl, workdir="/tmp")  # dies with this init: the kernel ends the namespace
    return wait_user(pid, ctl)


def user_process(p: dict, results_fd: int, ctl: Channel, workdir: str) -> None:
    """Confine this process, run the program and its tests, report each; never returns."""
    try:
        confine(p, workdir)
        if results_fd != p["results_fd"]:  # dup3 refuses equal numbers
            os.dup2(results_fd, p["results_fd"], inheritable=False)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"confinement failed: {e}")
        os._exit(3)
    fd = p["results_fd"]
    os.closerange(3, fd)  # the control pipe too: from here on only results can be written
    os.closerange(fd + 1, 1 << 16)
    del sys.argv[1:]
    forget()  # no foreign function of the set-up survives into the program's reach
    if p["audit_hook"]:
        # the paths extension modules may come from: read-only in both modes (never the work dir)
        native_roots = tuple(os.path.realpath(path) for path in SYSTEM_PATHS + tuple(p["python_paths"]))
        sys.addaudithook(make_audit_hook(os.path.realpath(workdir), p["max_processes"] > 1, native_roots))
    try:
        run_tests(p["program"], p["setup"], p["leaves"], fd, p["nonce"])
    finally:
        os._exit(0)


def wait_user(pid: int, ctl: Channel) -> int:
    """Wait for the user process, reaping whatever else is re-parented here; report how it ended."""
    while True:
        try:
            got, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return 4
        if got == pid:
            break
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    ctl.send(e="exit", signal=sig, code=os.WEXITSTATUS(status) if not sig else None,
             cpu_s=usage.ru_utime + usage.ru_stime)
    return 0


def reap_all(scan: bool) -> None:
    """Kill and reap every process left under this subreaper (orphans are re-parented here; in
    namespaces mode they are the namespace init's, so there is nothing to scan for)."""
    me = str(os.getpid()).encode()
    while True:
        for entry in os.listdir("/proc") if scan else ():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if entry.isdigit() and f.read().rsplit(b")", 1)[1].split()[1] == me:
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError):
                continue
        try:
            os.wait()
        except ChildProcessError:
            return


def main() -> int:
    results_fd, ctl = int(sys.argv[1]), Channel(int(sys.argv[2]))
    p = json.loads(sys.stdin.buffer.read())
    sys.path.extend(d for d in p["site_packages"] if d not in sys.path)  # started with -S
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)  # the program's stdin is empty
    os.close(devnull)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    die_with_parent()
    prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(child subreaper)")
    namespaces = p["isolation"] == "namespaces"
    if namespaces:
        try:
            call(libc.unshare, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                 what="unshare")
        except OSError as e:
            ctl.send(e="setup_error", msg=str(e))
            return 3
    ctl.send(e="start", isolation=p["isolation"])
    gate_r, gate_w = os.pipe()  # the child waits here until it is in the run's cgroup
    pid = os.fork()  # namespaces: the first child of an unshared PID namespace is its PID 1
    if pid == 0:
        os.close(gate_w)
        die_with_parent()
        ready = os.read(gate_r, 1)
        os.close(gate_r)
        if ready != b"1":
            os._exit(3)
        if namespaces:
            os._exit(ns_init(p, results_fd, ctl))
        user_process(p, results_fd, ctl, workdir=p["workdir"])
    os.close(gate_r)
    ctl.send(e="child", pid=pid)
    try:
        if p["cgroup_procs"]:
            with open(p["cgroup_procs"], "w") as f:
                f.write(str(pid))
        os.write(gate_w, b"1")
    except OSError as e:
        ctl.send(e="setup_error", msg=f"joining the run's cgroup failed: {e}")
    os.close(gate_w)
    if namespaces:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status) & 0xFF
    else:
        code = wait_user(pid, ctl)
    reap_all(scan=not namespaces)
    ctl.send(e="ended")
    return code


