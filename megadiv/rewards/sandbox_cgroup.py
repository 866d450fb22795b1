"""Per-run cgroups v2 (cgroup.kill; memory.max and pids.max where those controllers are enabled),
removal of work directories, and the sweep of what a killed caller left behind (work directories
and cgroups named ``PREFIX<owner pid>-<run id>`` whose owner is gone)."""
from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

PREFIX = "megadiv-sandbox-"  # work directories and cgroups: PREFIX<owner pid>-<run id>


def cgroup_base() -> Optional[str]:
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


def make_cgroup(name: str, memory_bytes: int, pids: int) -> Optional[str]:
    """A cgroup for one run: memory.max and pids.max where those controllers are enabled here."""
    base = cgroup_base()
    if base is None:
        return None
    path = os.path.join(base, name)
    try:
        os.mkdir(path)
    except OSError as e:
        log.debug("sandbox: no per-run cgroup (%s)", e)
        return None
    settings = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": pids}
    try:
        for key, value in settings.items():
            if os.path.exists(f"{path}/{key}"):
                with open(f"{path}/{key}", "w") as f:
                    f.write(str(value))
    except OSError:
        os.rmdir(path)
        raise
    return path


def remove_cgroup(path: str, timeout_s: float = 5.0) -> None:
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


def sweep_stale_once() -> None:
    """Remove work directories and cgroups left by callers that were killed (owner pid gone)."""
    global _SWEPT
    with _SWEEP_LOCK:
        if _SWEPT:
            return
        _SWEPT = True
    pattern = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+$")
    places = [(tempfile.gettempdir(), False)] + ([(cgroup_base(), True)] if cgroup_base() else [])
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
                remove_cgroup(path)
            else:
                remove_tree(path)
            log.info("sandbox: removed stale %s", path)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything under it; whether it is gone. Never raises.

    The tree is the program's (unsafe mode's work directory): as deep as it liked (mkdir + rename
    build one bottom-up, past PATH_MAX and past the recursion limit that made shutil.rmtree raise
    RecursionError), with directories it made unreadable. So: iterative, one directory descriptor
    open at a time, every step relative to its parent's descriptor (no path is ever longer than a
    name), links never followed, each directory made accessible to its owner before it is read.
    Time and memory grow with the entries, which the run's deadline bounds."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:  # not a directory (or a link to one): remove the entry itself
        try:
            os.unlink(path)
            return True
        except OSError as e:
            log.warning("sandbox: cannot remove %s (%s)", path, e)
            return False
    # trail[k]: the names of the subdirectories of the directory open at depth k still to remove;
    # its last name is the one descended into.
    trail: list[list[str]] = []
    try:
        while True:
            subdirs = []
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            subdirs.append(entry.name)
                        else:
                            os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass  # left in place: the rmdir above it fails and says so
            if subdirs:
                child = _enter(subdirs[-1], fd)
                trail.append(subdirs)
                os.close(fd)
                fd = child
                continue
            while trail:  # climb until a directory still has subdirectories to visit
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(trail[-1].pop(), dir_fd=fd)
                if trail[-1]:
                    child = _enter(trail[-1][-1], fd)
                    os.close(fd)
                    fd = child
                    break
                trail.pop()
            else:
                os.close(fd)
                fd = -1
                os.rmdir(path)
                return True
    except OSError as e:
        log.warning("sandbox: cannot remove %s (%s)", path, e)
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _enter(name: str, parent: int) -> int:
    """Open the subdirectory ``name`` of ``parent``, first made readable and writable by its owner
    (the program may have taken those rights away; a caller of another uid needs none of them)."""
    os.chmod(name, stat.S_IRWXU, dir_fd=parent)  # a directory (scandir said so, not following links)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


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
