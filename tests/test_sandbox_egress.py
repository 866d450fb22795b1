"""No egress from the sandbox, `unsafe` mode included: listeners set up here (UDP on loopback, unix
stream and datagram sockets in a world-writable directory) receive nothing from a hostile program,
and no program reads another process's /proc entry.

The probe tries the socket module, socketpair(AF_UNIX, SOCK_DGRAM) + sendto a host path (through the
socket module and through a copy of the _socket extension the program writes to its work dir and
loads from there), then raw system calls through every foreign function it can
find (those the harness looked up before the program ran, found by walking the heap; ctypes'
own; a fresh CDLL), then /proc through a directory descriptor. Modes: ``auto`` (namespaces),
``unsafe`` and ``unsafe`` without the audit hook (seccomp and Landlock alone). The same probe run
outside the sandbox reaches every listener, so the test is not vacuous.
"""
import _socket
import importlib.machinery
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
import gc, os, socket, struct, sys
UDP_PORT, STREAM_PATH, DGRAM_PATH, VICTIM, MARK = {port}, {stream!r}, {dgram!r}, {victim}, b'{mark}'
SOCKET_SO = {socket_so!r}  # the interpreter's own _socket extension (hex): a prebuilt module
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

def with_socketpair(module):  # an unnamed unix datagram pair, then sendto a host path: no socket()
    try:
        a, b = module.socketpair(module.AF_UNIX, module.SOCK_DGRAM)
        if a.sendto(PAYLOAD, DGRAM_PATH) > 0:
            return [('socketpair', module.__name__)]
    except Exception as e:
        print('socketpair through', module.__name__, 'failed:', type(e).__name__, e)
    return []

def extension_socket():  # native code loaded from the work dir raises no ctypes event
    import _frozen_importlib, _imp
    path = os.path.abspath('_socket' + {suffix!r})
    with open(path, 'wb') as f:
        f.write(bytes.fromhex(SOCKET_SO))
    try:
        module = _imp.create_dynamic(_frozen_importlib.ModuleSpec('_socket', None, origin=path))
    except Exception as e:
        print('extension module refused:', type(e).__name__, e)
        return []
    return with_socketpair(module)

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
        try:  # socketpair(AF_UNIX, SOCK_DGRAM), then sendto the host's datagram socket
            import ctypes
            pair = ctypes.create_string_buffer(8)
            if fn(53, 1, 2, 0, pair) == 0:
                addr = unix_addr(DGRAM_PATH)
                fd = struct.unpack('<ii', pair.raw)[0]
                if fn(44, fd, PAYLOAD, len(PAYLOAD), 0, addr, len(addr)) > 0:
                    hits.append(('syscall socketpair', 1, 2))
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
    hits = with_socket_module() + with_socketpair(socket) + extension_socket() + with_raw_syscalls() + with_proc()
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
        with open(_socket.__file__, "rb") as f:
            socket_so = f.read().hex()  # the program may not read the interpreter's files (unsafe, fresh uid)
        return PROBE.format(port=self.udp.getsockname()[1], stream=self.stream.getsockname(),
                            dgram=self.dgram.getsockname(), victim=self.victim.pid, mark=self.mark,
                            socket_so=socket_so, suffix=importlib.machinery.EXTENSION_SUFFIXES[0])

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
    out = subprocess.run([sys.executable, "-"], input=listeners.source() + "\nattack()", capture_output=True,
                         text=True, timeout=60, cwd=listeners.dir)
    assert "syscall" in out.stdout and "cmdline" in out.stdout, out
    assert "('socketpair', 'socket')" in out.stdout and "('socketpair', '_socket')" in out.stdout, out
    assert "syscall socketpair" in out.stdout, out
    assert sorted(set(listeners.received())) == ["udp", "unix datagram", "unix stream"]


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.skipif(
    m == "auto" and not ROOT_LINUX, reason="auto needs root on Linux")) for m in MODES])
def test_no_udp_no_unix_socket_no_proc_of_others(mode, listeners):
    r = run_sandboxed(listeners.source(), ["assert attack()"], 30.0, limits=SandboxLimits(**MODES[mode]))
    assert (r.status, r.passed) == ("failed", 0), r
    assert "reached: []" in r.output, r.output
    assert listeners.received() == []
    if MODES[mode].get("audit_hook", True):  # a prebuilt extension module from the work dir: refused
        assert "extension module refused: PermissionError sandbox: loading the extension module" in r.output
    else:  # loaded (unsafe without the hook), its socketpair refused by seccomp
        assert "socketpair through _socket failed: PermissionError" in r.output, r.output
