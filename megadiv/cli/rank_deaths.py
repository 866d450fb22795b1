"""Which rank of a local job died first, and how: the launcher's answer to "why did my run stop?".

When one rank dies, its peers fail a moment later in a collective ("Connection reset by peer")
and torchrun reports whichever failure it polled first, often a peer's. The launcher watches the
ranks itself (``RankWatcher.poll``, every 50 ms): a dead rank stays a zombie until torchrun reaps
it (torchrun polls once a second, ``MONITOR_INTERVAL_S``), and a zombie's wait status is in
field 52 of /proc/PID/stat. The first rank seen dead is the cause; a rank killed by a signal
outranks one that exited with an error in the same poll (a peer's error is the echo of a death).

Out of memory: the kernel's OOM killer sends SIGKILL and counts it in the memory cgroup's
``oom_kill`` (cgroup v2 ``memory.events``, v1 ``memory.oom_control``; the watcher reads each rank's
own cgroup at every poll, so a count that grew by its death is the evidence) and in the kernel log
("Killed process PID"); an address-space limit (RLIMIT_AS) makes allocations fail, which aborts C++
code (SIGABRT). Each is used when readable.
"""
from __future__ import annotations

import re
import resource
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

MONITOR_INTERVAL_S = 1.0  # torchrun's --monitor-interval: how long a dead rank stays a zombie at most


@dataclass(frozen=True)
class RankDeath:
    rank: int
    pid: int
    wait_status: int | None  # as waitpid(2) reports it; None when torchrun reaped the rank first
    seen_at: int  # the watcher's poll count when it was seen dead

    @property
    def signal(self) -> int | None:
        if self.wait_status is None or not self.wait_status & 0x7F:
            return None
        return self.wait_status & 0x7F

    @property
    def exit_code(self) -> int | None:
        return None if self.wait_status is None or self.signal else (self.wait_status >> 8) & 0xFF


class RankWatcher:
    """Notes when each rank of the job below ``torchrun_pid`` dies, with its wait status."""

    def __init__(self, torchrun_pid: int):
        self.torchrun_pid = torchrun_pid
        self.ranks: dict[int, tuple[int, psutil.Process]] = {}  # pid -> (local rank, process)
        self.deaths: list[RankDeath] = []
        self.polls = 0
        self.oom_counts: dict[int, tuple[Path, int]] = {}  # pid -> (its cgroup's OOM record, the count)

    def poll(self) -> bool:
        """Look at the ranks once; True (and nothing noted) when torchrun has started new ranks
        after a death: a restart, which the caller reports before calling ``new_attempt``."""
        try:
            children = psutil.Process(self.torchrun_pid).children()
        except psutil.Error:
            children = []
        fresh = [p for p in children if p.pid not in self.ranks]
        if fresh and self.deaths:
            return True
        for p in fresh:
            try:
                self.ranks[p.pid] = (int(p.environ()["LOCAL_RANK"]), p)
            except (psutil.Error, KeyError, ValueError):
                continue
        self.polls += 1
        dead = {d.pid for d in self.deaths}
        for pid, (rank, p) in self.ranks.items():
            if pid in dead:
                continue
            status = _zombie_wait_status(pid)
            if status is not None or not p.is_running():
                self.deaths.append(RankDeath(rank, pid, status, self.polls))
            elif (count := oom_kills(pid)) is not None:
                self.oom_counts[pid] = count
        return False

    def new_attempt(self) -> None:
        """torchrun restarted the workers: forget the old ranks."""
        self.ranks.clear()
        self.deaths.clear()
        self.oom_counts.clear()

    def first_death(self) -> RankDeath | None:
        """The first rank seen dead (a signal death first among those seen in the same poll)."""
        if not self.deaths:
            return None
        first_poll = min(d.seen_at for d in self.deaths)
        same_poll = [d for d in self.deaths if d.seen_at == first_poll]
        return min(same_poll, key=lambda d: (d.signal is None, d.rank))

    def describe(self, death: RankDeath) -> str:
        """'rank 1 was killed by SIGKILL (likely out of memory: ...)' or 'rank 0 exited with code 1'."""
        if death.signal is not None:
            name = signal.Signals(death.signal).name
            return f"rank {death.rank} was killed by {name}" + self._memory_note(death)
        if death.exit_code is not None:
            return f"rank {death.rank} exited with code {death.exit_code}"
        return f"rank {death.rank} died (its exit status was collected by torchrun first)"

    def _memory_note(self, death: RankDeath) -> str:
        if death.signal == signal.SIGKILL:
            record, before = self.oom_counts.get(death.pid, (None, None))
            now = _oom_count(record) if record is not None else None
            if now is not None and now > before:
                return (f" (likely out of memory: the kernel's OOM killer, oom_kill in {record} went "
                        f"{before} -> {now})")
            if _kernel_log_mentions_oom_kill(death.pid):
                return f" (likely out of memory: the kernel log says the OOM killer killed PID {death.pid})"
            return (" (by a person, a scheduler or the kernel's OOM killer; " +
                    ("its cgroup's oom_kill count did not change)" if now is not None else "no OOM record readable)"))
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if death.signal == signal.SIGABRT and soft != resource.RLIM_INFINITY:
            return f" (likely out of memory: an allocation beyond RLIMIT_AS={soft} bytes aborts)"
        if death.signal == signal.SIGXCPU:
            return " (the CPU-time limit, RLIMIT_CPU)"
        return ""


def _zombie_wait_status(pid: int) -> int | None:
    """The wait status of a dead, not yet reaped process (/proc/PID/stat field 52, Linux >= 3.5)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields 3.. (the command name may hold spaces)
    if fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    return int(fields[49])


def oom_kills(pid: int) -> tuple[Path, int] | None:
    """(file, count) of OOM kills in the memory cgroup of process ``pid``, when readable."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            record = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            record = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        count = _oom_count(record)
        if count is not None:
            return record, count
    return None


def _oom_count(record: Path) -> int | None:
    try:
        found = re.search(r"^oom_kill (\d+)$", record.read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _kernel_log_mentions_oom_kill(pid: int) -> bool:
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(rf"Killed process {pid}\b", log) is not None
