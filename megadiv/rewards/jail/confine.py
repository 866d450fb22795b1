"""Confinement of the user process: rlimits, never root, no capabilities, no_new_privs, not
dumpable, Landlock (unsafe mode), seccomp, an environment built from nothing."""
import errno
import os
import resource

from .landlock import install_landlock
from .libc import PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, die_with_parent, prctl
from .seccomp import install_seccomp


def set_limits(p: dict, nproc: int) -> None:
    cpu = p["cpu_s"]
    mb = 1 << 20
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL at hard
                            (resource.RLIMIT_AS, p["memory_mb"] * mb, p["memory_mb"] * mb),
                            (resource.RLIMIT_NPROC, nproc, nproc),
                            (resource.RLIMIT_NOFILE, p["max_open_files"], p["max_open_files"]),
                            (resource.RLIMIT_FSIZE, p["max_file_mb"] * mb, p["max_file_mb"] * mb),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))


def count_own_tasks(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is ``uid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    total += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return total


def effective_capabilities() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


# Unsafe mode as root: the fresh uid can read only world-readable files, and a Python installed
# under a private directory (pyenv under /root) is not; the modules programs commonly use are
# imported before the uid changes (namespaces mode binds the installation into a readable root).
# socket and struct too, so that a program reaches the socket() guards rather than an ImportError.
PRELOAD = ("array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
           "fractions", "functools", "heapq", "itertools", "math", "operator", "random", "re", "socket",
           "statistics", "string", "struct", "textwrap", "typing", "unicodedata")



def confine(p: dict, workdir: str) -> None:
    """rlimits, never root, no capabilities, no_new_privs, not dumpable, seccomp, a fresh environment."""
    os.chdir(workdir)
    p["fresh_uid"] = os.geteuid() == 0
    if p["isolation"] == "unsafe" and p["fresh_uid"]:
        for name in PRELOAD:
            __import__(name)
    if os.geteuid() == 0:
        # A fresh uid per run: RLIMIT_NPROC binds (the kernel does not apply it to root) and nothing
        # of the host is writable by it. Changing every uid away from 0 clears all capabilities.
        set_limits(p, p["max_processes"])
        os.setgroups([])
        os.setresgid(p["uid"], p["uid"], p["uid"])
        os.setresuid(p["uid"], p["uid"], p["uid"])
    else:
        # Unprivileged caller: RLIMIT_NPROC counts every task of this user, so allow only
        # max_processes - 1 more than exist now.
        set_limits(p, count_own_tasks(os.getuid()) + p["max_processes"] - 1)
    if 0 in os.getresuid() or 0 in os.getresgid() or effective_capabilities() != 0:
        raise OSError(errno.EPERM, "could not drop root or capabilities")
    die_with_parent()  # again: changing uids cleared it (the seccomp filter keeps the program from doing so)
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(no_new_privs)")
    prctl(PR_SET_DUMPABLE, 0, "prctl(dumpable)")  # /proc/self/{mem,fd,environ} become root's
    if p["isolation"] == "unsafe":
        p["landlock_abi"] = install_landlock(p, workdir)
    install_seccomp()
    os.environ.clear()
    os.environ.update(p["env"], HOME=workdir, TMPDIR=workdir)
