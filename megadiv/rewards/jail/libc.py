"""The libc calls the child needs (prctl, mount, unshare, syscall), bound once at start-up.

``forget()`` drops every foreign function looked up here before the program runs: a cached
function pointer is callable without a new ``dlsym``, so it must not outlive the set-up (the audit
hook refuses every ``ctypes.*`` event as well)."""
import ctypes
import os
import signal

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
    """Drop the foreign functions CDLL cached as attributes (prctl, syscall, mount, ...)."""
    for name in [n for n in vars(libc) if not n.startswith("_")]:
        delattr(libc, name)
