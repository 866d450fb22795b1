"""The code sandbox: counting, and hostile programs that must score 0 and leave the host unchanged.

Each hostile program runs under every isolation mode this machine offers:
- ``namespaces``: the default on Linux as root (namespaces + fresh uid + rlimits + audit hook);
- ``namespaces-os``: the same without the audit hook, to show the OS-level guards hold alone;
- ``fallback``: rlimits + audit hook only (what runs without root or namespaces).
A hostile program's tests assert that its attack worked, so it scores 0 exactly when it failed.

Fork-bomb safety: a real (exponential) bomb runs only under a fresh uid whose RLIMIT_NPROC the
kernel enforces, and only after a linear probe has shown that limit holding; in fallback mode as
root (where RLIMIT_NPROC does not bind) only the linear probe runs, capped at 20 forks.
"""
import os
import socket
import sys
import uuid

import pytest

from megadiv.rewards import SandboxLimits, run_sandboxed
from megadiv.rewards.code_reward import code_score
from megadiv.rewards.sandbox import marked_processes

ROOT_LINUX = sys.platform == "linux" and os.geteuid() == 0
MODES = {
    "namespaces": dict(isolation="namespaces"),
    "namespaces-os": dict(isolation="namespaces", audit_hook=False),
    "fallback": dict(isolation="fallback"),
}
needs_ns = pytest.mark.skipif(not ROOT_LINUX, reason="namespaces need root on Linux")
ALL_MODES = [pytest.param(m, marks=needs_ns) if m.startswith("namespaces") else m for m in MODES]
NS_MODES = [pytest.param(m, marks=needs_ns) for m in MODES if m.startswith("namespaces")]

pytestmark = pytest.mark.timeout(180)


def run(program, tests, mode, timeout_s=10.0, **limits):
    result = run_sandboxed(program, tests, timeout_s, limits=SandboxLimits(**MODES[mode], **limits))
    assert result.isolation == ("fallback" if mode == "fallback" else "namespaces")
    assert marked_processes(result.run_id) == [], "a sandboxed process outlived run_sandboxed"
    return result


def live_cmdlines_containing(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd)
    return found


# --------------------------------------------------------------------------- counting


@pytest.mark.parametrize("mode", ALL_MODES)
def test_counts_each_assert(mode):
    program = "def add(a, b):\n    return a + b\nprint('hello from the program')\n"
    tests = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(2, 2) == 4"]
    r = run(program, tests, mode)
    assert (r.status, r.passed, r.total) == ("failed", 2, 3) and "AssertionError" in r.detail
    assert "hello from the program" in r.output
    assert run(program, [tests[0], tests[2]], mode).status == "passed"
    assert code_score(r, partial_credit=True) == (2 / 3, "wrong") and code_score(r, False) == (0.0, "wrong")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_broken_empty_and_wrong_programs_score_zero(mode):
    tests = ["assert add(1, 2) == 3"]
    cases = {"def add(a, b) return a + b": "crashed",  # syntax error
             "": "failed",  # empty: NameError in the test
             "def add(a, b):\n    return a - b": "failed",
             "import os\nos._exit(0)": "crashed",  # ends the process before the tests
             "raise SystemExit(0)": "crashed",
             "def add(a, b):\n    return input()": "failed"}  # stdin is empty: EOFError
    for program, status in cases.items():
        r = run(program, tests, mode)
        assert (r.status, r.passed) == (status, 0), (program, r)
        assert code_score(r, partial_credit=True)[0] == 0.0
    # A test that calls sys.exit counts as failed, and the following asserts still run.
    r = run("import sys\ndef f():\n    sys.exit(0)", ["f()", "assert True"], mode)
    assert (r.status, r.passed) == ("failed", 1)


# --------------------------------------------------------------------------- hostile programs


@pytest.mark.parametrize("mode", ALL_MODES)
def test_infinite_loop_and_sleep_time_out(mode):
    r = run("def f():\n    while True:\n        pass", ["assert f()"], mode, timeout_s=1.0)
    assert (r.status, r.passed) == ("timeout", 0)
    r = run("import time\ntime.sleep(1000)", ["assert True"], mode, timeout_s=1.0)
    assert r.status == "timeout"
    # The CPU-time limit fires on its own when the wall clock allows more.
    r = run("while True:\n    pass", ["assert True"], mode, timeout_s=30.0, cpu_s=1)
    assert (r.status, r.detail) == ("timeout", "CPU-time limit")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_memory_bomb_hits_the_limit(mode):
    r = run("x = bytearray(8 * 2**30)", ["assert True"], mode, memory_mb=512)
    assert r.status == "limit" and "MemoryError" in r.detail
    r = run("def f():\n    hog = []\n    while True:\n        hog.append(bytearray(2**24))", ["assert f()"], mode,
            memory_mb=512)
    assert (r.status, r.passed) == ("limit", 0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_process_creation_is_refused_by_default(mode):
    r = run("import os\nwhile True:\n    os.fork()", ["assert True"], mode)
    assert r.status in ("limit", "crashed") and r.passed == 0
    r = run("import subprocess\ndef f():\n    return subprocess.Popen(['sleep', '1']).pid > 0", ["assert f()"], mode)
    assert r.status in ("limit", "failed", "crashed") and r.passed == 0  # the hook refuses the import


LINEAR_PROBE = """
import os, time
def forks():
    made = 0
    for _ in range(20):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    print('forks made:', made)
    return made
"""


@pytest.mark.parametrize("mode", NS_MODES)
def test_fork_bomb_is_bounded_and_killed(mode):
    # Linear probe first: with max_processes=4 exactly 3 children can exist (the program is the 4th).
    r = run(LINEAR_PROBE, ["assert forks() == 3"], mode, max_processes=4)
    assert r.status == "passed" and "forks made: 3" in r.output, r
    # Only now the real bomb: every process forks forever; the kernel caps the uid at 4 tasks, the
    # deadline kills the group and the PID namespace takes every survivor with it.
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", ["assert True"],
            mode, timeout_s=2.0, max_processes=4)
    assert r.status == "timeout" and r.passed == 0


def test_fork_probe_in_fallback_makes_no_process():
    r = run(LINEAR_PROBE, ["assert forks() == 3"], "fallback")
    assert r.status == "failed" and "forks made: 0" in r.output


@pytest.mark.parametrize("mode", ALL_MODES)
def test_cannot_write_outside_the_working_directory(mode, tmp_path):
    os.chmod(tmp_path, 0o777)  # world-writable: only the sandbox can stop the write
    tag = uuid.uuid4().hex
    outside = [str(tmp_path / "escape.txt"), f"/tmp/megadiv-escape-{tag}", f"/var/tmp/megadiv-escape-{tag}",
               f"/dev/shm/megadiv-escape-{tag}", os.path.join(os.path.dirname(__file__), f"escape-{tag}")]
    program = f"""
import os
def escape():
    wrote = []
    for path in {outside!r}:
        try:
            with open(path, 'w') as f:
                f.write('pwned')
            wrote.append(path)
        except OSError:
            pass
    try:
        os.remove({str(tmp_path / 'keep.txt')!r})
        wrote.append('removed')
    except OSError:
        pass
    home = os.getcwd()
    try:  # a relative path after moving out of the working directory
        os.chdir({str(tmp_path)!r})
        with open('relative.txt', 'w') as f:
            f.write('pwned')
        wrote.append('relative')
    except OSError:
        pass
    finally:
        os.chdir(home)
    return wrote
def inside():
    with open('scratch.txt', 'w') as f:
        f.write('ok')
    return open('scratch.txt').read() == 'ok'
"""
    (tmp_path / "keep.txt").write_text("host file")
    r = run(program, ["assert inside()", f"assert escape() == {outside + ['removed', 'relative']!r}"], mode)
    assert (r.status, r.passed) == ("failed", 1)  # writing inside works, escaping does not
    for path in outside + [str(tmp_path / "relative.txt")]:
        assert not os.path.exists(path), path
    assert (tmp_path / "keep.txt").read_text() == "host file"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_cannot_read_the_callers_environment(mode, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MEGADIV_TEST_SECRET", secret)
    program = """
import os
def leak():
    seen = [repr(dict(os.environ))]
    for pid in ['self', '1', str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                seen.append(f.read().decode(errors='replace'))
        except OSError:
            pass
    text = ' '.join(seen)
    print(text)
    return text
"""
    r = run(program, [f"assert {secret!r} in leak()"], mode)
    assert (r.status, r.passed) == ("failed", 0)
    assert secret not in r.output and "HOME" in r.output  # it did read its own environment


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_network_to_the_host(mode):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        program = f"""
import socket
def connect():
    with socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:
        s.sendall(b'hello')
    return True
"""
        r = run(program, ["assert connect()"], mode)
        assert (r.status, r.passed) == ("failed", 0)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection ever arrived
            listener.accept()


@pytest.mark.parametrize("mode", NS_MODES)
def test_background_processes_die_with_the_sandbox(mode):
    # Processes allowed: the program starts a detached `sleep` and a double-forked daemon that drops
    # the sandbox's environment marker; both must be gone when run_sandboxed returns.
    a, b = str(4_000_000 + uuid.uuid4().int % 1_000_000), str(5_000_000 + uuid.uuid4().int % 1_000_000)
    program = f"""
import os, subprocess
def spawn():
    subprocess.Popen(['sleep', '{a}'], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execve('/bin/sleep', ['sleep', '{b}'], {{}})
        os._exit(0)
    os.wait()
    print('spawned')
    return True
"""
    r = run(program, ["assert spawn()"], mode, max_processes=8)
    assert r.status == "passed" and "spawned" in r.output, r
    assert live_cmdlines_containing(f"sleep {a}") == [] and live_cmdlines_containing(f"sleep {b}") == []


@pytest.mark.parametrize("mode", ALL_MODES)
def test_cannot_signal_other_processes_and_output_is_capped(mode):
    r = run("import os\ndef f():\n    os.kill(os.getppid(), 9)\n    return True", ["assert f()"], mode)
    assert (r.status, r.passed) == ("failed", 0)
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", ["assert True"], mode, output_bytes=100_000)
    assert r.status == "limit" and len(r.output) == 100_000


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.parametrize("mode", ALL_MODES)
def test_sandbox_dies_with_a_killed_caller(mode):
    import subprocess
    import time

    caller = subprocess.Popen([sys.executable, "-c", (
        "from megadiv.rewards import SandboxLimits, run_sandboxed\n"
        f"run_sandboxed('import time\\ntime.sleep(1000)', ['assert True'], 600.0, "
        f"limits=SandboxLimits(**{MODES[mode]!r}))")])
    try:
        expected = 2 if mode == "fallback" else 3  # runner, (namespace init,) program
        deadline = time.monotonic() + 60
        while len(_descendants(caller.pid)) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        sandbox = _descendants(caller.pid)
        assert len(sandbox) == expected, "the sandbox did not start"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid) for pid in sandbox) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in sandbox if os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)] == []


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True
