"""The code sandbox: counting, forgery, hostile programs. Every attack must score 0 and leave the host unchanged.

Modes this machine offers:
- ``namespaces``: the default on Linux as root (namespaces + fresh uid + seccomp + rlimits + audit hook);
- ``namespaces-os``: the same without the audit hook, to show the OS-level guards hold alone;
- ``unsafe``: the explicit opt-in without namespaces (fresh uid, seccomp, rlimits, audit hook);
and the refusal path: ``auto`` where namespaces are unavailable (a child under
``setpriv --bounding-set -sys_admin``) must refuse every probe before it runs.

A hostile program's tests assert that its attack worked, so it scores 0 exactly when it failed;
the host is checked independently (files, processes, sockets, the caller's memory).
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from megadiv.rewards import SandboxError, SandboxLimits, run_sandboxed
from megadiv.rewards.code_reward import code_score
from megadiv.rewards.jail.seccomp import seccomp_program
from megadiv.rewards.sandbox import RUN_MARKER, STATUSES

ROOT_LINUX = sys.platform == "linux" and os.geteuid() == 0
MODES = {
    "namespaces": dict(isolation="namespaces"),
    "namespaces-os": dict(isolation="namespaces", audit_hook=False),
    "unsafe": dict(isolation="unsafe"),
}
needs_ns = pytest.mark.skipif(not ROOT_LINUX, reason="namespaces need root on Linux")
ALL_MODES = [pytest.param(m, marks=needs_ns) if m.startswith("namespaces") else m for m in MODES]
NS_MODES = [pytest.param(m, marks=needs_ns) for m in MODES if m.startswith("namespaces")]
SETPRIV = shutil.which("setpriv")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(300)


def run(program, tests, mode, timeout_s=10.0, setup="", **limits):
    # zombies of this process that earlier tests left (a child they did not wait for) are not this run's
    zombies_before = set(zombie_children())
    result = run_sandboxed(program, tests, timeout_s, setup=setup, limits=SandboxLimits(**MODES[mode], **limits))
    assert result.isolation == MODES[mode]["isolation"]
    assert marked_processes(result.run_id) == [], "a sandboxed process outlived run_sandboxed"
    assert set(zombie_children()) - zombies_before == set(), "run_sandboxed left a zombie"
    return result


# --------------------------------------------------------------------------- independent host checks


def marked_processes(run_id: str) -> list[int]:
    """Live processes that still carry the run's environment marker (a program may erase it:
    tests also look for their own unique command lines)."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and not _is_zombie(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def zombie_children() -> list[int]:
    me = str(os.getpid()).encode()
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == b"Z" and fields[1] == me:
            out.append(int(entry))
    return out


def live_cmdlines_containing(marker: str) -> list[str]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and not _is_zombie(int(entry)):
            found.append(cmd)
    return found


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Host:
    """What a probe might touch on the host, checked from outside the sandbox: files named with the
    probe's tag in the shared temporary directories and a world-writable scratch directory,
    a listening socket on loopback, a victim process, processes with the tag in their command line,
    the caller's memory."""

    def __init__(self, tmp_path):
        self.tag = uuid.uuid4().hex[:12]
        self.scratch = tmp_path
        os.chmod(tmp_path, 0o777)  # world-writable: only the sandbox can stop a write
        (tmp_path / f"keep-{self.tag}").write_text("host file")
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.victim = subprocess.Popen(["sleep", str(6_000_000 + random.randrange(1_000_000))])
        self.rss = rss_mb()

    def names(self) -> dict:
        return dict(tag=self.tag, scratch=str(self.scratch), port=self.port, victim=self.victim.pid,
                    keep=str(self.scratch / f"keep-{self.tag}"))

    def check(self, rss_slack_mb: float = 64.0) -> None:
        for d in ("/tmp", "/var/tmp", "/dev/shm", str(self.scratch), REPO):
            leaked = [n for n in os.listdir(d) if self.tag in n and not n.startswith("keep-")]
            assert leaked == [], f"files written outside the sandbox: {d}/{leaked}"
        keep = self.scratch / f"keep-{self.tag}"
        assert keep.read_text() == "host file"
        try:
            assert os.listxattr(keep) == [], "the sandbox set an extended attribute on a host file"
        except OSError:  # no xattr support on this filesystem
            pass
        self.listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection ever arrived
            self.listener.accept()
        assert self.victim.poll() is None, "the sandbox killed a host process"
        assert live_cmdlines_containing(self.tag) == [], "a process of the sandbox is still running"
        assert rss_mb() - self.rss < rss_slack_mb, "the caller's memory grew"

    def close(self):
        self.listener.close()
        self.victim.kill()
        self.victim.wait()


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path)
    yield h
    h.close()


# --------------------------------------------------------------------------- counting and basics


@pytest.mark.parametrize("mode", ALL_MODES)
def test_counts_each_assert(mode):
    program = "def add(a, b):\n    return a + b\nprint('hello from the program')\n"
    tests = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(2, 2) == 4"]
    r = run(program, tests, mode)
    assert (r.status, r.passed, r.total) == ("failed", 2, 3) and "AssertionError" in r.detail
    assert "hello from the program" in r.output
    assert run(program, [tests[0], tests[2]], mode).status == "passed"
    assert code_score(r, partial_credit=True) == (2 / 3, "wrong") and code_score(r, False) == (0.0, "wrong")


@pytest.mark.parametrize("mode", NS_MODES)
def test_values_survive_the_trip_with_python_equality(mode):
    program = """
import collections, math
def f(kind):
    return {'tuple': (1, 2), 'list': [1, 2], 'set': {3, 1}, 'dict': {(1, 'a'): [2.5, None]},
            'counter': collections.Counter('aab'), 'big': 3 ** 200, 'bytes': b'\\x00\\xff', 'nan': math.nan,
            'complex': 1 - 2j, 'nested': [[(1,)], {frozenset({1})}], 'neg': -5, 'true': True}[kind]
def match(text):
    import re
    return re.search('^a', text)
"""
    passing = ["assert f('tuple') == (1, 2)", "assert f('list') == [1, 2]", "assert f('set') == {1, 3}",
               "assert f('dict') == {(1, 'a'): [2.5, None]}", "assert f('counter') == {'a': 2, 'b': 1}",
               "assert f('big') == 3 ** 200", "assert f('bytes') == b'\\x00\\xff'", "assert f('nan') != f('nan')",
               "assert f('complex') == 1 - 2j", "assert f('nested') == [[(1,)], {frozenset({1})}]",
               "assert f('neg') == -5 and f('true') is True", "assert set(f('list')) == {2, 1}",
               "assert math.isclose(f('dict')[(1, 'a')][0], 2.5000001, rel_tol=1e-6)", "assert not f('list') == []",
               "assert match('abc')", "assert not match('bc')"]  # only the truth value is used: it crosses
    failing = ["assert f('tuple') == [1, 2]", "assert f('list') == (1, 2)", "assert f('true') == 'True'",
               "assert f('neg') < 'a'",  # list vs tuple stays unequal; int < str raises: failed
               "assert match('abc') != 1", "assert match('abc') == match('abc')"]  # not data: fails
    r = run(program, passing + failing, mode, setup="import math")
    assert (r.status, r.passed) == ("failed", len(passing)), r


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
    # A test that calls sys.exit counts as failed, and the following tests still run.
    r = run("import sys\ndef f():\n    sys.exit(0)\ndef ok():\n    return True", ["assert f()", "assert ok()"], mode)
    assert (r.status, r.passed) == ("failed", 1)


def test_zero_tests_is_a_failure_and_tests_must_be_asserts():
    r = run_sandboxed("def f():\n    return 1", [], 5.0, limits=SandboxLimits(isolation="unsafe"))
    assert (r.status, r.passed, r.total) == ("failed", 0, 0) and code_score(r, partial_credit=True) == (0.0, "wrong")
    for bad in ("f()", "assert f(\n", "assert f()\nassert g()"):
        with pytest.raises(ValueError, match="assert|not valid"):
            run_sandboxed("", [bad], 5.0, limits=SandboxLimits(isolation="unsafe"))
    # A test that calls nothing of the program would pass any program (issue 40).
    with pytest.raises(ValueError, match="makes no call into the program"):
        run_sandboxed("", ["assert pow(2, 3) == 8"], 5.0, limits=SandboxLimits(isolation="unsafe"))


# --------------------------------------------------------------------------- forgery

WRONG = "def add(a, b):\n    return a - b\n"  # every forgery below defends this wrong function
FORGE_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
FORGERIES = {
    "results_fd": WRONG + """
import os, json
lines = [json.dumps(ev) + '\\n' for ev in (
    {'e': 'program', 'ok': True}, {'e': 'test', 'i': 0, 'ok': True}, {'e': 'test', 'i': 1, 'ok': True},
    {'e': 'test', 'i': 0, 'v': [3]}, {'e': 'test', 'i': 1, 'v': [4]}, {'e': 'done', 'count': 2})]
for fd in range(3, 1024):
    for line in lines:
        try:
            os.write(fd, line.encode())
        except OSError:
            break
""",
    "results_fd_then_exit": WRONG + """
import os, json
for fd in range(3, 1024):
    try:
        for i, v in enumerate([3, 4]):
            os.write(fd, (json.dumps({'e': 'test', 'i': i, 'v': [v], 'n': ''}) + '\\n').encode())
        os.write(fd, b'{"e": "done", "count": 2}\\n')
    except OSError:
        pass
os._exit(0)
""",
    "builtins_exec_compile_eval": WRONG + """
import builtins
real_compile = builtins.compile
builtins.exec = lambda *a, **k: None
builtins.eval = lambda *a, **k: True
builtins.compile = lambda src, *a, **k: real_compile('True', '<forged>', 'eval')
""",
    "patch_harness_via_main": WRONG + """
import sys, json
main = sys.modules['__main__']
for name in ('run_tests', 'make_encoder', 'kind_of', 'describe', 'judge', 'user_process'):
    if hasattr(main, name):
        setattr(main, name, lambda *a, **k: True)
if hasattr(main, 'Channel'):
    main.Channel.send = lambda self, **ev: None
json.dumps = lambda *a, **k: '{"e": "test", "ok": true}'
import json.encoder
json.encoder.c_make_encoder = None
""",
    "always_true_eq": """
class Yes:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
    def __bool__(self):
        return True
def add(a, b):
    return Yes()
""",
    "int_subclass_eq": """
class Liar(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return Liar(0)
""",
    "frame_walk": WRONG + """
import sys
def add(a, b, _real=add):
    frame = sys._getframe(1)
    while frame is not None:
        for key, value in list(frame.f_locals.items()):
            if key == 'leaves':  # make the harness evaluate something else than add(...)
                for test in value:
                    test[:] = ['True' for _ in test]
            if key == 'send':
                try:
                    value(e='test', i=0, v=[3])
                except Exception:
                    pass
        frame = frame.f_back
    return _real(a, b)
""",
}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_every_forgery_scores_zero(mode, forgery, host):
    r = run(FORGERIES[forgery], FORGE_TESTS, mode)
    assert r.passed == 0 and code_score(r, partial_credit=True)[0] == 0.0, r
    assert r.status in ("failed", "crashed"), r
    host.check()


def test_forged_results_in_the_callers_parser_score_zero():
    """The caller's stream checks and judge on their own: a results stream without the nonce, out
    of order, short, or with values that are not data is never a pass."""
    from megadiv.data.code_tests import plan_test
    from megadiv.rewards.grading import Judge, judge_results
    from megadiv.rewards.sandbox import _status

    plans = [plan_test(t) for t in FORGE_TESTS]
    good = [{"e": "program", "ok": True}, {"e": "test", "i": 0, "v": [3]}, {"e": "test", "i": 1, "v": [4]},
            {"e": "done", "count": 2}]

    def status(events, nonce="N"):  # the lines as the harness's encoder writes them
        raw = "".join(json.dumps({**ev, "n": nonce}, separators=(",", ":")) + "\n" for ev in events).encode()
        state, detail, tests = _status(raw, "N", len(plans), [{"e": "exit", "signal": 0}], False, None, 10)
        if tests is None:
            return state, 0
        judge = Judge.acquire(256)
        try:
            return judge_results(plans, tests, judge, "", time.monotonic() + 60)[:2]
        finally:
            judge.release()

    assert status(good) == ("passed", 2)
    assert status(good, nonce="M") == ("crashed", 0)
    assert status(good[:3]) == ("crashed", 0)  # no done
    assert status(good[:2] + good[1:]) == ("crashed", 0)  # a test twice
    assert status([good[0], good[2], good[1], good[3]]) == ("crashed", 0)
    assert status(good[:3] + [{"e": "done", "count": 1}]) == ("crashed", 0)
    assert status([good[0], {"e": "test", "i": 0, "v": [{"T": "object", "v": True}]}, good[2], good[3]]) == ("failed", 1)
    assert status([good[0], {"e": "test", "i": 0, "v": 3}, good[2], good[3]]) == ("failed", 1)
    # A results object with many keys is refused before any dict is built from it (hash flooding).
    wide = {"e": "program", "ok": True, **{f"k{k}": k for k in range(20)}}
    assert status([wide, *good[1:]]) == ("crashed", 0)
    assert status([good[0], {**good[1], "k": 1}, good[2], good[3]]) == ("crashed", 0)  # extra key: not JSON values
    assert status([{"e": "program", "ok": [True]}, *good[1:]]) == ("crashed", 0)  # events are flat
    raw = "".join(json.dumps({**ev, "n": "N"}) + "\n" for ev in good).encode()  # another encoder's spacing
    assert _status(raw, "N", 2, [{"e": "exit", "signal": 0}], False, None, 10)[0] == "crashed"


# --------------------------------------------------------------------------- never raise, never balloon


@pytest.mark.parametrize("mode", ALL_MODES)
def test_recursion_payload_and_huge_streams_are_limits(mode, host):
    # 100 kB of '[' on every descriptor: once raised RecursionError out of run_sandboxed; now a
    # results stream refused by its shape before any line is parsed: forged or corrupt, 0.
    r = run("import os\nfor fd in range(1, 1024):\n    try:\n        os.write(fd, b'[' * 100_000 + b'\\n')\n"
            "    except OSError:\n        pass\ndef add(a, b):\n    return a + b", FORGE_TESTS, mode)
    assert (r.status, r.passed) == ("crashed", 0) and "forged or corrupt" in r.detail, r
    # 256 MiB on every descriptor: bounded memory here, no deadline overrun.
    start = time.monotonic()
    r = run("import os\nchunk = b'x' * (1 << 20) + b'\\n'\nfor fd in range(1, 1024):\n    try:\n"
            "        for _ in range(256):\n            os.write(fd, chunk)\n    except OSError:\n        pass\n"
            + WRONG, FORGE_TESTS, mode, timeout_s=10.0)
    assert r.status == "limit" and r.passed == 0 and len(r.output) <= (1 << 20), r
    assert time.monotonic() - start < 10.0 + 5.0
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 1000 + '\\n')", ["assert ok()"], mode,
            output_bytes=100_000)
    assert r.status == "limit" and len(r.output) == 100_000
    r = run("print('y' * 300_000)", ["assert ok()"], mode)  # one line over line_bytes (256 KiB)
    assert r.status == "limit"
    host.check()


def _junk(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    n = rng.choice([0, 1, 7, 4095, 4096, 70_000, 300_000, 5_000_000])
    if kind == 0:
        return rng.randbytes(n)
    if kind == 1:
        return b"[" * n + b"\n"
    if kind == 2:
        return b"{" * n + b"\n"
    if kind == 3:
        return (json.dumps({"e": "test", "i": rng.randrange(-2, 4), "v": [rng.randrange(10)], "ok": True,
                            "n": rng.choice(["", "0" * 32, None])}) + "\n").encode() * max(1, n // 64)
    if kind == 4:
        return b"\n" * n
    return ("\udcff" * 3 + "é" * n).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("mode", NS_MODES[:1] + ["unsafe"])
def test_property_any_junk_on_any_stream_returns_a_result(mode):
    """Generated junk written to stdout, stderr and every other descriptor, at random points
    (before the tests, from inside a test, then exiting or not): always a SandboxResult, never a
    pass for the wrong function, the caller's memory bounded."""
    rng = random.Random(1234)
    rss0 = rss_mb()
    for case in range(24):
        chunks = [(rng.choice([1, 2, -1]), _junk(rng)) for _ in range(rng.randrange(1, 4))]
        exit_after = rng.random() < 0.3
        where = rng.choice(["top", "test"])
        body = (f"import os\nCHUNKS = {chunks!r}\n"
                "def spray():\n    for fd, data in CHUNKS:\n        for d in ([fd] if fd > 0 else range(3, 512)):\n"
                "            try:\n                os.write(d, data)\n            except OSError:\n                pass\n"
                + ("    os._exit(0)\n" if exit_after else ""))
        program = body + WRONG + ("spray()\n" if where == "top" else
                                  "_add = add\ndef add(a, b):\n    spray()\n    return _add(a, b)\n")
        r = run(program, FORGE_TESTS, mode, timeout_s=20.0)
        assert r.status in STATUSES and r.passed == 0 and code_score(r, True)[0] == 0.0, (case, r.status, r.detail)
    assert rss_mb() - rss0 < 64


# --------------------------------------------------------------------------- resources


@pytest.mark.parametrize("mode", ALL_MODES)
def test_infinite_loop_and_sleep_time_out(mode):
    r = run("def f():\n    while True:\n        pass", ["assert f()"], mode, timeout_s=1.0)
    assert (r.status, r.passed) == ("timeout", 0)
    r = run("import time\ntime.sleep(1000)", ["assert ok()"], mode, timeout_s=1.0)
    assert r.status == "timeout"
    # The CPU-time limit fires on its own when the wall clock allows more.
    r = run("while True:\n    pass", ["assert ok()"], mode, timeout_s=30.0, cpu_s=1)
    assert (r.status, r.detail) == ("timeout", "CPU-time limit")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_memory_bomb_hits_the_limit(mode):
    r = run("x = bytearray(8 * 2**30)", ["assert ok()"], mode, memory_mb=512)
    assert r.status == "limit" and "MemoryError" in r.detail
    r = run("def f():\n    hog = []\n    while True:\n        hog.append(bytearray(2**24))", ["assert f()"], mode,
            memory_mb=512)
    assert (r.status, r.passed) == ("limit", 0)


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


@pytest.mark.parametrize("mode", ALL_MODES)
def test_process_creation_is_refused_by_default_and_bounded_when_allowed(mode):
    r = run(LINEAR_PROBE, ["assert forks() == 0"], mode)  # max_processes=1: no child at all
    assert r.status == "passed" and "forks made: 0" in r.output, r
    # With max_processes=4 exactly 3 children can exist under the run's fresh uid.
    r = run(LINEAR_PROBE, ["assert forks() == 3"], mode, max_processes=4)
    assert r.status == "passed" and "forks made: 3" in r.output, r
    # Only now the real bomb: the kernel caps the uid at 4 tasks, the deadline kills it all.
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            ["assert ok()"], mode, timeout_s=2.0, max_processes=4)
    assert r.status == "timeout" and r.passed == 0


# --------------------------------------------------------------------------- the host stays untouched

# Each probe: a program whose test asserts that the attack worked. {tag}, {scratch}, {port},
# {victim} and {keep} come from the Host fixture.
PROBES = {
    "env_read": """
import os
def attack():
    seen = [repr(dict(os.environ))]
    for pid in ['self', '1', str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:
        try:
            with open(f'/proc/{{pid}}/environ', 'rb') as f:
                seen.append(f.read().decode(errors='replace'))
        except OSError:
            pass
    return 'MEGADIV_TEST_SECRET' in ' '.join(seen)
""",
    "write_outside": """
import os
def attack():
    wrote = 0
    for path in ['{scratch}/w-{tag}', '/tmp/w-{tag}', '/var/tmp/w-{tag}', '/dev/shm/w-{tag}']:
        try:
            with open(path, 'w') as f:
                f.write('pwned')
            wrote += 1
        except OSError:
            pass
    try:
        os.remove('{keep}')
        wrote += 1
    except OSError:
        pass
    return wrote > 0
""",
    "dir_fd_variants": """
import os
def attack():
    done = 0
    for d in ['{scratch}', '/tmp', '/dev/shm', '/var/tmp']:
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        for op in (lambda: os.close(os.open('o-{tag}', os.O_WRONLY | os.O_CREAT, dir_fd=dfd)),
                   lambda: os.mkdir('m-{tag}', dir_fd=dfd),
                   lambda: os.symlink('/etc/passwd', 's-{tag}', dir_fd=dfd),
                   lambda: os.link('/proc/self/exe', 'l-{tag}', dst_dir_fd=dfd),
                   lambda: os.rename('keep-{tag}', 'r-{tag}', src_dir_fd=dfd, dst_dir_fd=dfd)):
            try:
                op()
                done += 1
            except OSError:
                pass
    return done > 0
""",
    "loopback_connect": """
import socket
def attack():
    with socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:
        s.sendall(b'hello')
    return True
""",
    "kill_host_process": """
import os, signal
def attack():
    hits = 0
    for how in (lambda: os.kill({victim}, 9), lambda: os.killpg(os.getpgid({victim}), 9),
                lambda: signal.pidfd_send_signal(os.pidfd_open({victim}), 9), lambda: os.kill(-1, 9)):
        try:
            how()
            hits += 1
        except OSError:
            pass
    return hits > 0
""",
    "sqlite3": """
import sqlite3
def attack():
    db = sqlite3.connect('{scratch}/db-{tag}.sqlite')
    db.execute('create table t (x)')
    db.commit()
    return True
""",
    "shm_open": """
from multiprocessing import shared_memory
def attack():
    shm = shared_memory.SharedMemory(name='shm-{tag}', create=True, size=4096)
    shm.close()  # not unlinked: a leftover segment if it reached the host's /dev/shm
    return True
""",
    "mkfifo_mknod": """
import os, stat
def attack():
    made = 0
    for path, mode, dev in (('{scratch}/fifo-{tag}', stat.S_IFIFO | 0o666, 0), ('/tmp/fifo-{tag}', stat.S_IFIFO | 0o666, 0),
                            ('mem-{tag}', stat.S_IFCHR | 0o666, os.makedev(1, 1))):
        try:
            os.mknod(path, mode, dev)
            made += 1
        except OSError:
            pass
    try:
        os.mkfifo('/dev/shm/fifo-{tag}')
        made += 1
    except OSError:
        pass
    return made > 0
""",
    "setxattr": """
import os
def attack():
    os.setxattr('{keep}', 'user.pwned', b'{tag}')
    return True
""",
    "leftover_daemon": """
import os, ctypes
def attack():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # clear PDEATHSIG
            except Exception:
                pass
            os.execve('/bin/sleep', ['sleep', '7{tag_digits}'], {{}})
        os._exit(0)
    os.wait()
    return True
""",
    "io_uring_and_friends": """
import ctypes, errno
def attack():
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    ok = []
    # io_uring_setup, unshare(CLONE_NEWUSER), clone(CLONE_NEWUSER | SIGCHLD), bpf, keyctl,
    # perf_event_open, ptrace(PTRACE_TRACEME), mount
    for nr, args in ((425, (8, params)), (272, (0x10000000,)), (56, (0x10000000 | 17, 0, 0, 0, 0)), (321, (0, 0, 0)),
                     (250, (0, 0)), (298, (0, 0, -1, -1, 0)), (101, (0, 0, 0, 0)), (165, (0, 0, 0, 0, 0))):
        if libc.syscall(nr, *args) >= 0:
            ok.append(nr)
        elif ctypes.get_errno() != errno.EPERM:
            ok.append((nr, ctypes.get_errno()))
    print('allowed:', ok)
    return ok != []
""",
}


def _probe_source(name: str, host: Host) -> str:
    digits = str(int(host.tag, 16) % 10**9)
    return PROBES[name].format(tag_digits=digits, **host.names())


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_probe_is_contained(mode, probe, host, monkeypatch):
    """The host is unchanged after every probe. Probes against host paths may "succeed" on the
    sandbox's private /tmp (namespaces mode): contained. Those in MUST_FAIL may not succeed at all."""
    if probe == "io_uring_and_friends" and os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    if mode == "unsafe" and probe in UNSAFE_NOT_CONTAINED:
        pytest.skip(f"unsafe mode does not contain {probe} (docs/security.md)")
    monkeypatch.setenv("MEGADIV_TEST_SECRET", host.tag)
    r = run(_probe_source(probe, host), ["assert attack()"], mode, max_processes=8 if probe == "leftover_daemon" else 1)
    if probe in MUST_FAIL:
        assert r.passed == 0, (r.status, r.detail, r.output)
    if probe == "leftover_daemon":  # the daemon may start; it must be gone when run_sandboxed returns
        assert live_cmdlines_containing("sleep 7" + str(int(host.tag, 16) % 10**9)) == []
    if probe == "io_uring_and_friends" and mode == "namespaces-os":
        assert "allowed: []" in r.output  # every call was refused with EPERM by seccomp
    host.check()


MUST_FAIL = {"env_read", "loopback_connect", "kill_host_process", "io_uring_and_friends", "setxattr"}
def _landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


# unsafe mode runs on the host's filesystem: without Landlock, what only the audit hook guards it misses.
UNSAFE_NOT_CONTAINED = set() if _landlock_abi() >= 1 else {"dir_fd_variants", "mkfifo_mknod"}


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_leftovers_in_dev_shm_tmp_or_cgroups(mode):
    before_tmp = {n for n in os.listdir("/tmp") if n.startswith(f"megadiv-sandbox-{os.getpid()}-")}
    r = run("import os\nopen('x', 'w').write('y')\ndef f():\n    return os.getcwd()", ["assert f() == '/'"], mode)
    assert r.status == "failed"
    after_tmp = {n for n in os.listdir("/tmp") if n.startswith(f"megadiv-sandbox-{os.getpid()}-")}
    assert after_tmp == before_tmp == set()
    from megadiv.rewards.sandbox_cgroup import cgroup_base

    if cgroup_base():
        assert [n for n in os.listdir(cgroup_base()) if n.startswith(f"megadiv-sandbox-{os.getpid()}-")] == []


@pytest.mark.parametrize("mode", ALL_MODES)
def test_never_root_no_capabilities(mode):
    program = """
import os
def who():
    with open('/proc/self/status') as f:
        caps = [l.split()[1] for l in f if l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs', 'Seccomp:'))]
    print(os.getresuid(), os.getresgid(), os.getgroups(), caps)
    return [min(os.getresuid()) > 0, min(os.getresgid()) > 0, os.getgroups(), caps]
"""
    r = run(program, ["assert who() == [True, True, [], ['0000000000000000', '0000000000000000', '1', '2']]"], mode)
    assert r.status == "passed", (r.detail, r.output)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_program_runs_in_the_runs_cgroup(mode):
    from megadiv.rewards.sandbox_cgroup import cgroup_base

    if not cgroup_base():
        pytest.skip("no writable cgroup v2 here: rlimits only")
    program = "def where():\n    return [l for l in open('/proc/self/cgroup') if l.startswith('0::')][0]"
    r = run(program, [f"assert where().startswith('0::') and 'megadiv-sandbox-{os.getpid()}-' in where()"], mode)
    assert r.status == "passed", (r.detail, r.output)


def test_seccomp_program_is_well_formed():
    for arch in (0xC000003E, 0xC00000B7):
        prog = seccomp_program(arch)
        assert len(prog) < 256
        for i, (code, jt, jf, _) in enumerate(prog):
            if code & 0x07 == 0x05:  # BPF_JMP: targets stay inside the program
                assert 0 <= jt and 0 <= jf and i + 1 + max(jt, jf) < len(prog)
        assert prog[-1][0] == 0x06 and prog[2] == (0x06, 0, 0, 0x80000000)  # wrong arch: killed


# --------------------------------------------------------------------------- no silent downgrade


REFUSAL_DRIVER = """
import json, sys
from megadiv.rewards import SandboxError, SandboxLimits, run_sandboxed
out = {}
for name, program in json.loads(sys.stdin.read()).items():
    try:
        run_sandboxed(program, ['assert attack()'], 10.0)
        out[name] = 'ran'
    except SandboxError as e:
        out[name] = 'refused: ' + str(e)
r = run_sandboxed('import os\\ndef who():\\n    return os.getresuid()', ['assert min(who()) > 0'], 10.0,
                  limits=SandboxLimits(isolation='unsafe'))
out['unsafe'] = [r.status, r.detail]
print(json.dumps(out))
"""


@pytest.mark.skipif(not (ROOT_LINUX and SETPRIV), reason="needs root and setpriv")
def test_auto_refuses_without_namespaces_and_unsafe_runs_without_root(host, monkeypatch):
    """Under setpriv --bounding-set -sys_admin (root, but unshare is refused) auto refuses every
    probe before it runs, with an error naming what is missing and the opt-in; unsafe runs
    programs as a non-root uid."""
    monkeypatch.setenv("MEGADIV_TEST_SECRET", host.tag)
    programs = {name: _probe_source(name, host) for name in PROBES} | {
        f"forgery_{name}": src + "\ndef attack():\n    return add(1, 2) == 3" for name, src in FORGERIES.items()}
    proc = subprocess.run([SETPRIV, "--bounding-set", "-sys_admin", sys.executable, "-c", REFUSAL_DRIVER],
                          input=json.dumps(programs), capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("unsafe") == ["passed", ""]
    assert set(out) == set(programs)
    for name, verdict in out.items():
        assert verdict.startswith("refused: sandbox: no real isolation"), (name, verdict)
        assert "Operation not permitted" in verdict and "CAP_SYS_ADMIN" in verdict
        assert "reward.sandbox_isolation=unsafe" in verdict
    host.check()


def test_auto_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="namespaces need root.*reward.sandbox_isolation=unsafe"):
        run_sandboxed("", ["assert ok()"], 5.0)


def test_code_reward_warns_every_unsafe_batch(caplog):
    from megadiv.data.datasets import Record
    from megadiv.rewards import RewardConfig, build_reward

    reward = build_reward(RewardConfig(name="code", sandbox_isolation="unsafe", workers=1))
    try:
        rec = Record(id="x", prompt="add", tests=("assert add(1, 2) == 3",))
        for _ in range(2):
            out = reward(["```python\ndef add(a, b):\n    return a + b\n```"], [rec])
            assert out.scores == [1.0]
        assert sum("sandbox_isolation=unsafe" in m for m in caplog.messages) == 2
    finally:
        reward.close()


# --------------------------------------------------------------------------- clean-up


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
def test_sandbox_dies_with_a_killed_caller_and_its_leftovers_are_swept(mode):
    caller = subprocess.Popen([sys.executable, "-c", (
        "from megadiv.rewards import SandboxLimits, run_sandboxed\n"
        f"run_sandboxed('import time\\ntime.sleep(1000)', ['assert ok()'], 600.0, "
        f"limits=SandboxLimits(**{MODES[mode]!r}))")], env={**os.environ, "PYTHONPATH": REPO})
    try:
        expected = 3 if mode == "unsafe" else 4  # the grader, runner, (namespace init,) program
        deadline = time.monotonic() + 60
        while len(_descendants(caller.pid)) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        sandbox = _descendants(caller.pid)
        assert len(sandbox) == expected, "the sandbox did not start"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 30
    while any(not _is_zombie(pid) for pid in sandbox) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in sandbox if not _is_zombie(pid)] == []
    # The killed caller's work directory and cgroup are swept by the next process's first run.
    stale = f"megadiv-sandbox-{caller.pid}-"
    subprocess.run([sys.executable, "-c", "from megadiv.rewards import SandboxLimits, run_sandboxed\n"
                    f"run_sandboxed('', ['assert ok()'], 10.0, limits=SandboxLimits(**{MODES[mode]!r}))"],
                   check=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert [n for n in os.listdir("/tmp") if n.startswith(stale)] == []
    from megadiv.rewards.sandbox_cgroup import cgroup_base

    if cgroup_base():
        assert [n for n in os.listdir(cgroup_base()) if n.startswith(stale)] == []


# --------------------------------------------------------------------------- issue 40

DEEP_FORGERY = """
import os, sys, json
frame = sys._getframe()
while frame is not None and 'nonce' not in frame.f_locals:  # the harness's run_tests
    frame = frame.f_back
nonce, fd = frame.f_locals['nonce'], frame.f_locals['fd']
deep = 'x'
for _ in range(DEPTH):
    deep = [deep]
for ev in ({'e': 'program', 'ok': True}, {'e': 'test', 'i': 0, 'v': [deep]}, {'e': 'test', 'i': 1, 'v': [4]},
           {'e': 'done', 'count': 2}):
    os.write(fd, (json.dumps({**ev, 'n': nonce}, separators=(',', ':')) + '\\n').encode())
os._exit(0)
"""
# The forgeries need the harness's frames: with the audit hook on they are out of reach.
HOOK_OFF = [pytest.param("namespaces-os", {}, marks=needs_ns), ("unsafe", {"audit_hook": False})]


@pytest.mark.parametrize("mode", [pytest.param("namespaces", marks=needs_ns), "unsafe"])
def test_the_harness_frames_are_out_of_reach_with_the_hook(mode):
    r = run(WRONG + DEEP_FORGERY.replace("DEPTH", "400"), FORGE_TESTS, mode)
    assert (r.status, r.passed) == ("crashed", 0) and "sys._getframe is not allowed" in r.detail, r


@pytest.mark.parametrize(("mode", "hook"), HOOK_OFF)
def test_forged_deep_stream_with_the_nonce_scores_zero_and_raises_nothing(mode, hook):
    # The forged stream is complete and carries the nonce; only its depth gives it away (to the
    # grader's interpreter, which alone parses values). 985 levels: the red team's.
    for depth in (400, 985):
        r = run(WRONG + DEEP_FORGERY.replace("DEPTH", str(depth)), FORGE_TESTS, mode, **hook)
        assert (r.status, r.passed) == ("crashed", 0) and "deeper" in r.detail, (depth, r)


def test_deep_values_are_parsed_by_the_grader_only():
    from megadiv.data.code_tests import plan_test
    from megadiv.rewards.grading import Judge, judge_results
    from megadiv.rewards.jail.harness import make_encoder
    from megadiv.rewards.sandbox_streams import parse_results

    def line(values) -> bytes:
        return json.dumps({"e": "test", "i": 0, "v": values, "n": "N"}, separators=(",", ":")).encode() + b"\n"

    def verdict(values):
        events, why = parse_results(line(values), "N", 1)
        assert why == "" and events[0]["v_json"] == json.dumps(values, separators=(",", ":")).encode()
        judge = Judge.acquire(256)
        try:
            return judge_results([plan_test("assert f(1) == ()")], events, judge, "", time.monotonic() + 60)
        finally:
            judge.release()

    deep = "x"
    for _ in range(200):
        deep = [deep]
    assert verdict([deep])[:2] == ("crashed", 0) and "deeper" in verdict([deep])[2]
    value = ()  # the deepest value the harness's encoder sends: 64 nested tuples
    for _ in range(63):
        value = (value,)
    assert verdict(make_encoder()([value]))[:2] == ("failed", 0)
    assert verdict(make_encoder()([()]))[:2] == ("passed", 1)


# A complete forged stream (hook off: the harness's frames give the nonce and descriptor away)
# whose every value line is as long as the line cap allows: 16 lines of ~250 KiB.
WIDE_FORGERY = """
import os, sys, json
def add(a, b):
    frame = sys._getframe()
    while 'nonce' not in frame.f_locals:
        frame = frame.f_back
    nonce, fd = frame.f_locals['nonce'], frame.f_locals['fd']
    # the harness sent the program line before this first call
    events = [{'e': 'test', 'i': i, 'v': [[0] * 125_000]} for i in range(14)] + [{'e': 'done', 'count': 14}]
    for ev in events:
        os.write(fd, (json.dumps({**ev, 'n': nonce}, separators=(',', ':')) + '\\n').encode())
    os._exit(0)
"""


@pytest.mark.parametrize(("mode", "hook"), HOOK_OFF)
def test_a_forged_stream_costs_the_caller_little_cpu(mode, hook):
    """The caller checks the stream's shape with C-speed steps and leaves values to the grader's
    interpreter: 3.5 MiB of forged values cost this thread about what a trivial run does (they
    cost 2.3 s here when the caller parsed and depth-walked them)."""
    tests = [f"assert add({k}, 1) == {k + 1}" for k in range(14)]
    run("def add(a, b):\n    return a + b", tests, mode, **hook)  # the grader's interpreter warm, as in training
    start = time.thread_time()
    baseline = run("def add(a, b):\n    return a + b", tests, mode, **hook)
    trivial = time.thread_time() - start
    start = time.thread_time()
    r = run(WIDE_FORGERY, tests, mode, **hook)
    forged = time.thread_time() - start
    assert baseline.status == "passed" and (r.status, r.passed) == ("failed", 0), r
    assert forged < trivial + 0.25, (forged, trivial)


def _sysv_ids() -> set[str]:
    ids = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            ids |= {f"{kind}:{line.split()[1]}" for line in f.readlines()[1:]}
    return ids


SYSV_PROBE = """
import ctypes
def attack():
    libc = ctypes.CDLL(None, use_errno=True)
    made = []
    for name, args in (('shmget', (0, 16 << 20, 0o1666)), ('msgget', (0, 0o1666)), ('semget', (0, 1, 0o1666))):
        if getattr(libc, name)(*args) >= 0:
            made.append(name)
    if libc.mq_open(b'/mq-probe', 0o100 | 0o2, 0o666, None) >= 0:  # O_CREAT | O_RDWR (glibc 2.34+ has it)
        made.append('mq_open')
        libc.mq_unlink(b'/mq-probe')
    print('created:', made)
    return made != []
"""


@pytest.mark.parametrize("mode", ALL_MODES + ["unsafe-os"])
def test_no_sysv_ipc_object_outlives_a_run(mode, monkeypatch):
    """Unsafe mode shares the host's IPC namespace: seccomp refuses shmget/msgget/semget/mq_open
    (checked with the audit hook off, where ctypes reaches them)."""
    monkeypatch.setitem(MODES, "unsafe-os", dict(isolation="unsafe", audit_hook=False))
    before = _sysv_ids()
    r = run(SYSV_PROBE, ["assert attack()"], mode)
    assert r.passed == 0, (r.status, r.detail, r.output)
    if mode.endswith("-os"):
        assert "created: []" in r.output, r.output
    assert _sysv_ids() - before == set()


VENV_DRIVER = """
from megadiv.rewards import SandboxLimits, run_sandboxed
r = run_sandboxed('import numpy\\ndef f():\\n    return int(numpy.arange(4).sum())', ['assert f() == 6'], 60.0,
                  limits=SandboxLimits(isolation='namespaces'))
print(r.status, r.detail)
"""


@needs_ns
def test_a_venv_under_tmp_imports_numpy_in_namespaces_mode(tmp_path):
    import sysconfig

    import numpy

    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site_dir = next(venv.glob("lib/python3*/site-packages"))
    source = os.path.dirname(os.path.dirname(numpy.__file__))
    for name in os.listdir(source):
        if name == "numpy" or name.startswith("numpy.libs") or name.startswith("numpy-"):
            shutil.copytree(os.path.join(source, name), site_dir / name, symlinks=True)
    assert sysconfig.get_paths()["purelib"] != str(site_dir)
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", VENV_DRIVER], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "passed", proc.stdout


# Each step tries to switch the audit hook off from pure Python; then the program calls libc through ctypes.
SWITCH_OFF_PROBE = '''
import builtins, gc, os, sys

def closures():
    """Find the hook by gc and rebind its closure cells, defaults and code to harmless values."""
    for f in gc.get_objects():
        if type(f).__name__ == "function" and f.__code__.co_name == "hook":
            for cell in f.__closure__ or ():
                if isinstance(cell.cell_contents, frozenset):
                    cell.cell_contents = frozenset()
                elif cell.cell_contents is str.startswith:
                    cell.cell_contents = lambda *a: False
            f.__defaults__ = tuple(frozenset() if isinstance(d, frozenset) else d for d in f.__defaults__ or ())

def hook_list():
    """Empty the interpreter's list of audit hooks, found by what it holds."""
    for o in gc.get_objects():
        if type(o) is list and any(type(x).__name__ == "function" and x.__code__.co_name == "hook" for x in o):
            o.clear()

def referrers():
    for o in gc.get_referrers(sys.addaudithook) + gc.get_referents(sys.modules):
        pass

def rebind_helpers():
    """The hook's helpers: their defaults and code, and the module globals the hook was made from."""
    import jail.audit
    jail.audit.ALWAYS_REFUSED = frozenset()
    jail.audit.resolve.__code__ = (lambda path, *rest: "/tmp").__code__
    del jail.audit.resolve.__defaults__

def rebind_proc_check():
    import jail.audit
    jail.audit.refused_proc.__defaults__ = (lambda *a: False,) * 5

def subinterpreter():
    import _xxsubinterpreters as interpreters
    interpreters.run_string(interpreters.create(), "import ctypes; ctypes.CDLL(None).getpid()")

def testcapi():
    import _testcapi

def patched_builtins():
    import posixpath
    builtins.isinstance = lambda *a: True
    builtins.PermissionError = Warning
    posixpath.realpath = lambda p, *a, **k: "/tmp"

def traced():
    """The traceback of a refused event holds the hook's frame, whose locals hold the hook: make it
    traceable and install a tracer that rewrites its ``event`` on every call."""
    try:
        os.kill(1, 0)
    except Exception as e:
        tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    hook = tb.tb_frame.f_locals["guarded"][0]
    hook.__cantrace__ = True
    trace_hook(hook.__code__)

def trace_hook(code):
    def tracer(frame, what, arg):
        if frame.f_code is code and what == "call":
            frame.f_locals["event"] = "harmless"
        return tracer
    sys.settrace(tracer)

def untraced_tracer():
    """A tracer without the hook's code in hand: every frame's ``event`` rewritten."""
    trace_hook(None)

def profiler():
    sys.setprofile(lambda frame, what, arg: None)

def getframe():
    """sys._getframe from a PathLike's __fspath__, which the hook calls: its frame, running."""
    class Path:
        def __fspath__(self):
            frames.append(sys._getframe(1))
            return "/etc/hostname"
    frames = []
    open(Path()).close()
    frames[0].f_locals["workdir"] = "/"

STEPS = (closures, hook_list, referrers, rebind_helpers, rebind_proc_check, subinterpreter, testcapi, traced,
         untraced_tracer, profiler, getframe, patched_builtins)

def attack():
    for step in STEPS:
        try:
            step()
            print(step.__name__, "done")
        except BaseException as e:
            print(step.__name__, "refused:", type(e).__name__, e)
    import ctypes
    return ctypes.CDLL(None).getpid() > 0
'''


def test_audit_hook_reads_no_global_and_holds_no_cell():
    """Its state is its defaults (tuples, frozensets, strings, C functions): nothing to rebind."""
    import dis

    from megadiv.rewards.jail.audit import any_under, make_audit_hook, refused_proc, resolve

    def codes(code):
        yield code
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                yield from codes(const)

    hook = make_audit_hook("/tmp", False, ("/usr",))
    for function in (hook, resolve, refused_proc, any_under):
        assert function.__code__.co_freevars == () and function.__closure__ is None
        assert [i.argval for c in codes(function.__code__) for i in dis.get_instructions(c)
                if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF")] == []
        assert all(type(d) in (str, int, tuple, frozenset, type) or callable(d) and not hasattr(d, "__code__")
                   or d in (resolve, refused_proc, any_under) for d in function.__defaults__ or ())
    assert hook.__defaults__[-1] == (hook, resolve, refused_proc, any_under)  # the functions whose state it guards
    for path in ("/proc/self", "/proc/thread-self/status", "/usr/bin/../lib64/./x", "relative/x", b"/proc/1", "/"):
        assert resolve(path) == os.fsdecode(os.path.realpath(path))


@pytest.mark.parametrize("mode", [pytest.param("namespaces", marks=needs_ns), "unsafe"])
def test_audit_hook_cannot_be_switched_off(mode):
    """gc finds the hook and the list of hooks, a cell or default rebinds its state, a
    subinterpreter has no hook, a traceback or _getframe hands out its frame, a tracer rewrites
    its locals: each is refused, and ctypes stays refused after all of them."""
    r = run(SWITCH_OFF_PROBE, ["assert attack()"], mode)
    assert (r.status, r.passed) == ("failed", 0), r
    assert "ctypes.dlopen is not allowed" in r.detail, r
    for step in ("closures", "hook_list", "referrers", "rebind_helpers", "rebind_proc_check", "subinterpreter",
                 "testcapi", "traced", "untraced_tracer", "profiler"):
        assert f"{step} refused: PermissionError sandbox:" in r.output, (step, r.output)
    assert "getframe refused: ValueError sandbox: sys._getframe" in r.output, r.output


NET_TABLES_PROBE = """
import os
def attack():
    seen = []
    tids = []
    try:
        tids = os.listdir('/proc/self/task')
    except OSError:
        pass
    paths = [f'{{base}}/{{table}}' for base in ['/proc/self/net', '/proc/net', '/proc/thread-self/net']
             + [f'/proc/self/task/{{t}}/net' for t in tids] for table in ('tcp', 'tcp6', 'unix')]
    for path in paths:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        if {port_hex!r} in text or {unix!r} in text:
            seen.append(path)
    try:
        fd = os.open('/proc/self', os.O_RDONLY | os.O_DIRECTORY)
        if {port_hex!r} in os.read(os.open('net/tcp', os.O_RDONLY, dir_fd=fd), 1 << 20).decode():
            seen.append('dir_fd net/tcp')
    except OSError:
        pass
    print('seen:', seen)
    return seen != []
"""


@pytest.mark.parametrize("mode", ALL_MODES + ["unsafe-os"])
def test_proc_net_tables_show_no_host_socket(mode, host, monkeypatch, tmp_path):
    """/proc/self/net lists the sockets of the network namespace: the host's in unsafe mode. A
    listener on loopback and a unix socket here stay out of every table the program can read."""
    monkeypatch.setitem(MODES, "unsafe-os", dict(isolation="unsafe", audit_hook=False))
    unix_path = str(tmp_path / f"listener-{host.port}.sock")  # not named with the tag: host.check looks for that
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.bind(unix_path)
        unix.listen(1)
        port_hex = f"0100007F:{host.port:04X}"
        with open("/proc/self/net/tcp") as f:  # here, both are in the tables
            assert port_hex in f.read()
        with open("/proc/self/net/unix") as f:
            assert unix_path in f.read()
        r = run(NET_TABLES_PROBE.format(port_hex=port_hex, unix=unix_path), ["assert attack()"], mode)
    assert (r.status, r.passed) == ("failed", 0), r
    assert "seen: []" in r.output, r.output
    host.check()


# --------------------------------------------------------------------------- issue 51

# Memory no rlimit counts: memfds (RLIMIT_FSIZE caps each, RLIMIT_NOFILE their number) and pipe
# buffers grown with F_SETPIPE_SZ. The test asserts that more than 64 MiB (the run's RLIMIT_AS
# below) was held outside the address space.
MEMORY_BESIDE_RLIMIT_PROBE = """
import os
try:
    import fcntl
except ImportError:  # unsafe mode as root: a fresh uid cannot read a Python installed under /root
    fcntl = None
CHUNK = b'x' * (1 << 20)
def held():
    total, keep = 0, []
    for _ in range(40):
        try:
            fd = os.memfd_create('hold')
            keep.append(fd)
            for _ in range(8):
                total += os.write(fd, CHUNK)
        except OSError as e:
            print('memfd:', type(e).__name__, e)
            break
    for _ in range(20):
        try:
            r, w = os.pipe()
            keep += [r, w]
        except OSError as e:
            print('pipe:', type(e).__name__, e)
            break
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except (OSError, AttributeError) as e:
            print('grow pipe:', type(e).__name__, e)
        os.set_blocking(w, False)
        try:
            while True:
                total += os.write(w, CHUNK[:65536])
        except BlockingIOError:
            pass
    print('held', total >> 20, 'MiB in', len(keep), 'descriptors')
    return total
"""


@pytest.mark.parametrize("mode", ALL_MODES)
def test_memfd_and_pipe_memory_is_bounded(mode):
    r = run(MEMORY_BESIDE_RLIMIT_PROBE, ["assert held() > 64 << 20"], mode, memory_mb=64)
    assert (r.status, r.passed) == ("failed", 0), r
    assert "memfd: PermissionError" in r.output, r.output
    assert "grow pipe: PermissionError" in r.output or "'NoneType' object has no attribute" in r.output, r.output


# A tree as deep as the recursion limit allows twice over, built bottom-up (mkdir + rename: every
# path stays short, so the audit hook allows each step); its full path is far past PATH_MAX.
DEEP_TREE_PROBE = """
import os
def nest(depth):
    os.mkdir('a')
    for _ in range(depth):
        os.mkdir('b')
        os.rename('a', 'b/a')
        os.rename('b', 'a')
    os.chmod('a', 0)  # and the top of it unreadable
    return depth
"""


def _deep_tree(root: str, depth: int, outside: str) -> None:
    """``depth`` nested directories under ``root`` (built through descriptors: past PATH_MAX), a
    file, a link to ``outside`` and a side branch every 100 levels, every 500th level mode 000."""
    fd = os.open(root, os.O_RDONLY)
    for level in range(depth):
        os.mkdir("d", dir_fd=fd)
        if level % 100 == 0:
            os.symlink(outside, "link", dir_fd=fd)
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
            os.makedirs(f"/proc/self/fd/{fd}/side/x")
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        if level % 500 == 0:
            os.chmod("d", 0, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def test_remove_tree_removes_a_2000_deep_tree_without_following_links(tmp_path):
    from megadiv.rewards.sandbox_cgroup import remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host file")
    root = tmp_path / "work"
    root.mkdir()
    _deep_tree(str(root), 2000, str(outside))
    assert remove_tree(str(root)) is True
    assert not root.exists() and (outside / "keep").read_text() == "host file"
    assert remove_tree(str(root)) is True  # already gone
    link = tmp_path / "link"
    link.symlink_to(outside)
    assert remove_tree(str(link)) is True and not link.exists() and (outside / "keep").exists()


def test_the_sweep_removes_a_deep_stale_work_dir(tmp_path, monkeypatch):
    """A killed caller's work dir holding a 2,000-deep tree: swept, nothing raised (before, every
    later process's first run raised RecursionError here)."""
    from megadiv.rewards import sandbox_cgroup

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{sandbox_cgroup.PREFIX}{dead.pid}-0123abcd"
    stale.mkdir()
    _deep_tree(str(stale), 2000, str(tmp_path))
    monkeypatch.setattr(sandbox_cgroup.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(sandbox_cgroup, "_SWEPT", False)
    monkeypatch.setattr(sandbox_cgroup, "cgroup_base", lambda: None)
    sandbox_cgroup.sweep_stale_once()
    assert not stale.exists()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_2000_deep_tree_in_the_work_dir_is_removed_and_raises_nothing(mode):
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("megadiv-sandbox-")}
    r = run(DEEP_TREE_PROBE, ["assert nest(2000) == 0"], mode, timeout_s=30.0)
    assert (r.status, r.passed) == ("failed", 0), r  # it ran to its test: the tree was built
    after = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("megadiv-sandbox-")}
    assert after <= before, after - before
