"""No egress from the sandbox, `unsafe` mode included: listeners set up here (UDP on loopback, unix
stream and datagram sockets in a world-writable directory) receive nothing from a hostile program,
and no program reads another process's /proc entry.

The probe tries the socket module, then raw system calls through every foreign function it can
find (those the harness looked up before the program ran, found by walking the heap; ctypes'
own; a fresh CDLL), then /proc through a directory descriptor. Modes: ``auto`` (namespaces),
``unsafe`` and ``unsafe`` without the audit hook (seccomp and Landlock alone). The same probe run
outside the sandbox reaches every listener, so the test is not vacuous.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from megadiv.rewards import SandboxLimits, run_sandboxed

ROOT_LINUX = sys.platform == "linux" and os.geteuid() == 0
MODES = {"auto": dict(isolation="auto"), "unsafe": dict(isolation="unsafe"),
         "unsafe-os": dict(isolation="unsafe", audit_hook=False)}
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 syscall numbers")]

PROBE = """
import gc, os, socket, struct
UDP_PORT, STREAM_PATH, DGRAM_PATH, VICTIM, MARK = {port}, {stream!r}, {dgram!r}, {victim}, b'{mark}'
PAYLOAD = b'pwned-{port}'
UDP_ADDR = struct.pack('<HH4s8x', 2, socket.htons(UDP_PORT), bytes([127, 0, 0, 1]))

def unix_addr(path):
    return struct.pack('<H', 1) + path.encode() + b'\\0'

def with_socket_module():
    hits = []
    for family, kind, addr in ((socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', UDP_PORT)),
                               (socket.AF_UNIX, socket.SOCK_STREAM, STREAM_PATH),
                               (socket.AF_UNIX, socket.SOCK_DGRAM, DGRAM_PATH)):
        try:
            s = socket.socket(family, kind)
            if kind == socket.SOCK_DGRAM:
                s.sendto(PAYLOAD, addr)
            else:
                s.connect(addr)
                s.sendall(PAYLOAD)
            hits.append(('socket module', family, kind))
        except Exception:
            pass
    return hits

def foreign_functions():
    try:
        objects = gc.get_objects()
    except Exception:  # the audit hook refuses it; without the hook, the heap is the program's to walk
        objects = []
    found = [o for o in objects if type(o).__name__ in ('_FuncPtr', 'CFunctionType')]
    for lib in [o for o in objects if type(o).__name__ in ('CDLL', 'PyDLL')]:
        try:
            found.append(lib.syscall)
        except Exception:
            pass
    try:
        import ctypes
        found.append(ctypes.CDLL(None).syscall)
    except Exception:
        pass
    return found

def with_raw_syscalls():
    hits = []
    for fn in foreign_functions():
        for family, kind, addr in ((2, 2, UDP_ADDR), (1, 1, unix_addr(STREAM_PATH)), (1, 2, unix_addr(DGRAM_PATH))):
            try:
                fd = fn(41, family, kind, 0)  # socket
                if fd < 0:
                    continue
                if kind == 2:
                    sent = fn(44, fd, PAYLOAD, len(PAYLOAD), 0, addr, len(addr))  # sendto
                else:
                    sent = fn(42, fd, addr, len(addr)) == 0 and fn(44, fd, PAYLOAD, len(PAYLOAD), 0, None, 0)
                if sent and sent > 0:
                    hits.append(('syscall', family, kind))
            except Exception:
                pass
    return hits

def with_proc():
    hits = []
    for how in (lambda: os.open(f'{{VICTIM}}/cmdline', os.O_RDONLY, dir_fd=os.open('/proc', os.O_RDONLY)),
                lambda: os.open(f'proc/{{VICTIM}}/cmdline', os.O_RDONLY, dir_fd=os.open('/', os.O_RDONLY)),
                lambda: os.open(f'/proc/{{VICTIM}}/cmdline', os.O_RDONLY)):
        try:
            if MARK in os.read(how(), 4096):
                hits.append('cmdline')
        except Exception:
            pass
    try:
        if str(VICTIM) in os.listdir('/proc'):
            hits.append('listdir')
    except Exception:
        pass
    return hits

def attack():
    hits = with_socket_module() + with_raw_syscalls() + with_proc()
    print('reached:', hits)
    return hits != []
"""


class Listeners:
    """A UDP socket on loopback and unix stream/datagram sockets any uid could reach."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="megadiv-egress-", dir="/tmp")
        os.chmod(self.dir, 0o777)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stream.bind(os.path.join(self.dir, "stream.sock"))
        self.stream.listen(8)
        self.dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram.bind(os.path.join(self.dir, "dgram.sock"))
        for name in ("stream.sock", "dgram.sock"):
            os.chmod(os.path.join(self.dir, name), 0o777)
        for s in (self.udp, self.stream, self.dgram):
            s.setblocking(False)
        self.mark = str(7_000_000 + self.udp.getsockname()[1])  # in the victim's command line only
        self.victim = subprocess.Popen(["sleep", self.mark])

    def source(self) -> str:
        return PROBE.format(port=self.udp.getsockname()[1], stream=self.stream.getsockname(),
                            dgram=self.dgram.getsockname(), victim=self.victim.pid, mark=self.mark)

    def received(self) -> list[str]:
        got = []
        for name, s in (("udp", self.udp), ("unix datagram", self.dgram)):
            while True:
                try:
                    s.recv(4096)
                    got.append(name)
                except BlockingIOError:
                    break
        while True:
            try:
                conn, _ = self.stream.accept()
                conn.close()
                got.append("unix stream")
            except BlockingIOError:
                break
        return got

    def close(self):
        for s in (self.udp, self.stream, self.dgram):
            s.close()
        self.victim.kill()
        self.victim.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def listeners():
    ls = Listeners()
    yield ls
    ls.close()


def test_the_probe_reaches_every_listener_outside_the_sandbox(listeners):
    out = subprocess.run([sys.executable, "-c", listeners.source() + "\nattack()"], capture_output=True, text=True,
                         timeout=60)
    assert "syscall" in out.stdout and "cmdline" in out.stdout, out
    assert sorted(set(listeners.received())) == ["udp", "unix datagram", "unix stream"]


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.skipif(
    m == "auto" and not ROOT_LINUX, reason="auto needs root on Linux")) for m in MODES])
def test_no_udp_no_unix_socket_no_proc_of_others(mode, listeners):
    r = run_sandboxed(listeners.source(), ["assert attack()"], 30.0, limits=SandboxLimits(**MODES[mode]))
    assert (r.status, r.passed) == ("failed", 0), r
    assert "reached: []" in r.output, r.output
    assert listeners.received() == []
