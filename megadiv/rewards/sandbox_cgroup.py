"""Per-run cgroups v2 (cgroup.kill; memory.max and pids.max where those controllers are enabled)
and the sweep of what a killed caller left behind (work directories and cgroups named
``PREFIX<owner pid>-<run id>`` whose owner is gone)."""
from __future__ import annotations

import logging
import os
import re
import shutil
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
