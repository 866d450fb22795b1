"""The caller's side of a run's streams: bounded reading of output, results and control pipes,
ending the run, and parsing the untrusted results stream (never raises)."""
from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import time
from typing import Optional

from megadiv.rewards.grading import small_object

CONTROL_BYTES = 1 << 16  # the trusted control pipe's cap
# A test's values as the harness's C encoder writes them (separators "," and ":", keys in order).
_VALUE_LINE = re.compile(rb'\{"e":"test","i":(\d{1,9}),"v":')
# The longest event without values: a kind and a message the harness cuts at 300 characters
# (each at most 6 bytes once ASCII-escaped), the nonce, the keys.
ENVELOPE_BYTES = 4096


def collect(proc: subprocess.Popen, caps: dict[int, int], line_cap: int, deadline: float):
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


def control_events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn last line from a runner killed mid-write
        if isinstance(ev, dict):
            events.append(ev)
    return events


def terminate(proc: subprocess.Popen, cgroup: Optional[str], control_r: int, control_seen: bytes) -> None:
    """End the run and reap the runner; afterwards no process of the run is left.

    The runner's child (the namespace init, or the program's process) is killed first: the runner,
    a child subreaper, then reaps it and everything re-parented to it and exits (in namespaces mode
    the kernel has already ended every process of the namespace). The cgroup catches anything else."""
    if proc.poll() is None:
        try:  # what the runner reported that _collect has not read yet
            os.set_blocking(control_r, False)
            control_seen += os.read(control_r, CONTROL_BYTES)
        except OSError:
            pass
        child = next((ev.get("pid") for ev in control_events(control_seen) if ev.get("e") == "child"), None)
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


def parse_results(raw: bytes, nonce: str, n_tests: int) -> tuple[list[dict], str]:
    """The events of the results stream; (events, '') or ([], why it cannot be trusted). Never raises.

    The trainer's CPU is the program's only through this function (the run's deadline does not
    bound it), so it is linear in the stream with C-speed steps only, and checks shape before
    content: at most the ``n_tests + 2`` lines the harness sends, each ending with this run's
    nonce exactly as the harness encodes it. A test's values are not parsed here: a line
    ``{"e":"test","i":K,"v":...`` keeps its value text as ``v_json`` for the grader's interpreter,
    which decodes it under the run's deadline and memory limit (grading.Judge). The other events
    (program, a failed test, done) are small flat objects, parsed here."""
    lines = raw.split(b"\n")
    if lines[-1]:
        return [], "a torn last line"
    lines.pop()
    if len(lines) > n_tests + 2:
        return [], f"{len(lines)} lines for {n_tests} tests"
    suffix = b',"n":"' + nonce.encode() + b'"}'
    events = []
    for n, line in enumerate(lines):
        if not line.endswith(suffix):
            return [], f"line {n}: not from the harness"
        value = _VALUE_LINE.match(line)
        if value is not None:
            events.append({"e": "test", "i": int(value.group(1)), "v_json": line[value.end():-len(suffix)]})
            continue
        if len(line) > ENVELOPE_BYTES:
            return [], f"line {n}: longer than any event without values"
        try:
            ev = json.loads(line, object_pairs_hook=small_object)
        except (ValueError, RecursionError) as e:
            return [], f"line {n}: not JSON ({type(e).__name__})"
        if not isinstance(ev, dict) or any(isinstance(v, (list, dict)) for v in ev.values()):
            return [], f"line {n}: not an event of the harness"
        events.append(ev)
    return events, ""
