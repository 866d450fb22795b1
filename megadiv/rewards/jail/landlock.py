"""Unsafe mode's kernel-enforced policy where Landlock exists (Linux 5.13+, unprivileged).

Read and execute: the system and Python paths, minus the hidden paths (the megadiv package, whose
data files hold every reference solution). Landlock only adds rights, so a granted directory that
contains a hidden path is granted entry by entry instead, down to the hidden path's siblings.
Write: the working directory and /dev/null. /proc: this process's own entry only (a directory
descriptor on /proc cannot list or read other processes), without its net tables (the host's
sockets). No TCP bind/connect (ABI 4+); no signals to processes outside and no abstract unix
sockets (ABI 6+).
"""
import ctypes
import os
import struct

from .libc import libc

SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "urandom", "random")
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446  # same on every arch
_LL_READ = 1 << 0 | 1 << 2 | 1 << 3  # execute, read_file, read_dir
_LL_DEVICE = 1 << 1 | 1 << 2  # write_file, read_file
_LL_FILE_RIGHTS = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15  # the rights a rule on a file may carry
# Every filesystem right each Landlock ABI can handle (1: bits 0-12; 2: + refer; 3: + truncate;
# 5: + ioctl_dev); net (ABI 4): bind and connect TCP; scopes (ABI 6): abstract unix sockets, signals.
_LL_FS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}


def readable_paths(roots, hidden) -> list[str]:
    """Real paths that cover ``roots`` except everything at or under a ``hidden`` path: a root
    holding a hidden path is replaced by its entries, recursively (only along the hidden paths)."""
    hidden = [os.path.realpath(h) for h in hidden]
    out: list[str] = []

    def add(path: str) -> None:
        real = os.path.realpath(path)
        if not os.path.exists(real) or real in out:
            return
        if any(real == h or real.startswith(h.rstrip("/") + "/") for h in hidden):
            return  # hidden itself (or reached through a link into it)
        if any(h.startswith(real.rstrip("/") + "/") for h in hidden) and os.path.isdir(real):
            for name in sorted(os.listdir(real)):
                add(os.path.join(real, name))
            return
        out.append(real)

    for root in roots:
        add(root)
    return out


def own_proc_paths(pid: int) -> list[str]:
    """This process's /proc entry, granted entry by entry without its ``net`` directories (the
    process's and each thread's): unsafe mode shares the host's network namespace, whose socket
    tables (tcp, udp, unix) they show. Symlinks (cwd, exe, root) get no rule: opened through
    O_PATH a rule would follow them (``root`` is /)."""
    own = f"/proc/{pid}"
    paths = []
    for name in os.listdir(own):
        path = f"{own}/{name}"
        if name == "task":
            paths += [f"{path}/{tid}/{entry}" for tid in os.listdir(path) for entry in os.listdir(f"{path}/{tid}")
                      if entry != "net" and not os.path.islink(f"{path}/{tid}/{entry}")]
        elif name != "net" and not os.path.islink(path):
            paths.append(path)
    return paths


def install_landlock(p: dict, workdir: str) -> int:
    """Restrict this process (and its future children). Returns the ABI used, 0 when the kernel
    has no Landlock (the audit hook remains the only file guard: docs/security.md)."""
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._VERSION
    if abi < 1:
        return 0
    fs = _LL_FS[max(k for k in _LL_FS if k <= abi)]
    attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = syscall(_SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        rules = [(path, _LL_READ) for path in readable_paths(SYSTEM_PATHS + tuple(p["python_paths"]), p["hidden"])]
        rules += [(f"/dev/{dev}", _LL_DEVICE) for dev in DEVICES] + [(workdir, fs)]
        rules += [(path, _LL_READ) for path in own_proc_paths(os.getpid())]  # nothing of other processes
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent here
            try:
                allowed = access & fs & (_LL_FILE_RIGHTS if not os.path.isdir(path) else ~0)
                rule = struct.pack("=Qi", allowed, fd)
                if syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, ctypes.c_uint32(0)) != 0:  # path_beneath
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if syscall(_SYS_LANDLOCK_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi
