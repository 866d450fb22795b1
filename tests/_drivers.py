"""Shared by the tests of the drivers above ``megadiv train`` (es, sweep): kill a driver mid-way."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable


def kill_group_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """SIGKILL ``proc``'s process group (started with ``start_new_session``: the driver and the run it
    is training) as soon as ``ready()`` holds; fail if the driver exits first or ``what`` takes over
    ``timeout_s`` seconds."""
    deadline = time.time() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
            assert time.time() < deadline, f"{what} did not happen in {timeout_s:.0f} s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
