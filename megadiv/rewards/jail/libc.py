"""The libc calls the child needs (prctl, mount, unshare, syscall), bound once at start-up.

``forget()`` drops every resolved foreign function before the program runs: calling one raises no
audit event on Python 3.11 (only resolving one does: ``ctypes.dlopen``/``dlsym``, which the audit
hook refuses with every other ``ctypes.*`` event), so none may stay within the program's reach."""
import ctypes
import gc
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
PR_SET_CHILD_SUBREAPER = 36

libc = ctypes.CDLL(None, use_errno=True)


def call(fn, *args, what: str) -> None:
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int, what: str) -> None:
    call(libc.prctl, option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
         what=what)


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    call(libc.mount, enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data),
         what=f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a caller killed mid-run leaves no sandbox behind)."""
    parent = os.getppid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(pdeathsig)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def forget() -> None:
    """Drop every resolved foreign function: those ``libc`` cached as attributes (prctl, syscall,
    mount, ...) and those ctypes' modules hold (memmove, memset, string_at, wstring_at, cast). Nothing else
    references them, so they are freed here. Not a boundary (a program can still build a function
    pointer from an address it computes); seccomp and Landlock are (docs/security.md)."""
    for library in (libc, ctypes.pythonapi):
        vars(library).clear()
    for module in [m for name, m in sys.modules.items() if name == "ctypes" or name.startswith("ctypes.")]:
        space = vars(module)  # ctypes._endian re-exports memmove and memset
        for name in [n for n, v in space.items() if isinstance(v, (ctypes._CFuncPtr, ctypes.CDLL))]:
            del space[name]
    gc.collect()  # the ones held in reference cycles
