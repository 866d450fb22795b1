"""How many intra-op (OpenMP) threads a rank computes with: the usable cores shared by the ranks on
this machine, unless OMP_NUM_THREADS says otherwise.

    threads per rank = max(1, usable cores // local ranks)     (OMP_NUM_THREADS, when set, wins)

Usable cores are the CPUs this process may run on (its affinity mask: taskset, a cgroup cpuset),
capped by a cgroup v2 CPU quota (cpu.max). ``megadiv train --nproc N`` passes the figure to
torchrun's ranks as OMP_NUM_THREADS (torchrun's own default is 1 per rank); a ``megadiv train``
without torchrun applies it to itself. A CPU SGLang server a rank launches gets the cores the
ranks leave (``server_threads``). More threads than cores (ranks x threads > cores) make
OpenMP threads wait for each other on every operation: docs/performance.md, Threads.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores() -> int:
    """CPUs of this process's affinity mask, capped by a cgroup v2 CPU quota (rounded up)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = CPU_MAX.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def threads_per_rank(local_ranks: int, environ=os.environ) -> int:
    """OMP_NUM_THREADS when set (a positive integer), else usable cores // local ranks (at least 1)."""
    given = environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, usable_cores() // max(1, local_ranks))


def server_threads(environ=os.environ) -> int:
    """OpenMP threads for a CPU rollout server (SGLang) that a rank launches beside this machine's
    ranks: the usable cores the ranks leave, at least one.

        server threads = max(1, usable cores - local ranks x threads per rank)

    Local ranks: torchrun's LOCAL_WORLD_SIZE (1 without torchrun); threads per rank as above. The
    server would otherwise inherit the rank's OMP_NUM_THREADS and, beside ranks that already hold
    every core, oversubscribe them (docs/performance.md, Threads)."""
    local = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, usable_cores() - local * threads_per_rank(local, environ))
