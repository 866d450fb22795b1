"""The sandbox's child side: started by ``megadiv.rewards.sandbox`` as ``python -S sandbox_child.py
RESULTS_FD CONTROL_FD``. Standard library only, never imports megadiv (it runs before any isolation exists).

Reads one JSON payload on stdin (program, the test operands to evaluate, limits, isolation), then::

    runner (host namespaces; child subreaper, dies with the caller)
      namespaces mode: unshare(net, pid, mount, ipc, uts), fork
        ns-init = PID 1 of the new PID namespace: builds a read-only root in a private tmpfs
          (/usr, /etc, /lib*, the Python installation bound read-only; fresh /proc; /dev with null,
          zero, urandom only; a size-capped writable tmpfs at /tmp), chroots into it, forks
          user process (see confine), cwd /tmp
        When ns-init exits the kernel kills every process left in the namespace.
      unsafe mode: fork
        user process (see confine), cwd a host temporary directory, audit hook as the file guard
      Either way the runner puts its child in the run's cgroup (when the caller made one) before
      the child goes on, and after it ends kills and reaps every process re-parented to it.

confine (both modes): rlimits, a fresh unprivileged uid/gid when started as root (no capabilities
left, checked), no_new_privs, not dumpable (its /proc/self/mem and fds become root's), a seccomp
filter, an environment built from nothing, every descriptor closed except the results pipe moved to
a number chosen by the caller and told to nobody.

Grading: the program cannot grade itself. For each test the caller sends only the operands it cannot
evaluate itself (the calls into the program, e.g. ``f(3)``), never the expected values; the user
process evaluates them and sends their values as plain data (JSON of builtin types, tagged), each
line carrying the run's nonce; the caller compares. What the harness uses is bound before the
program runs, so replacing builtins or modules does not change what it reports.

Control pipe (CONTROL_FD): start, child, setup_error, exit and ended events from trusted code only;
the user process closes it before the program runs.
"""
import ctypes
import errno
import json
import os
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
PR_SET_CHILD_SUBREAPER = 36

NEW_ROOT = "/tmp"  # the chroot is built on a tmpfs mounted here, in the private mount namespace only
# Read-only binds that make a usable system: dynamic libraries, /etc (locale, time zone), binaries.
SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "urandom", "random")
LIMIT_ERRNOS = {errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.ENOMEM}

_libc = ctypes.CDLL(None, use_errno=True)


def _call(fn, *args, what: str) -> None:
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int, what: str) -> None:
    _call(_libc.prctl, option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
          what=what)


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _call(_libc.mount, enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data),
          what=f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a caller killed mid-run leaves no sandbox behind)."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(pdeathsig)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


class Channel:
    """Control events to the caller, one JSON object per line (each well under PIPE_BUF: atomic)."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, **event) -> None:
        if len(event.get("msg", "")) > 512:
            event["msg"] = event["msg"][:512]
        os.write(self.fd, (json.dumps(event) + "\n").encode())


# --------------------------------------------------------------------------- seccomp

# Denied system calls (EPERM), by architecture: debugging other processes or reading memory behind
# Python's back, namespaces and mounts, kernel attack surface a program never needs (io_uring, bpf,
# keyrings, perf, module loading, kexec), and clock/system administration. clone3 answers ENOSYS
# so that libc falls back to clone, whose flags the filter can see (clone3 passes them in memory).
_DENY_NAMES = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
               "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
               "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
               "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd",
               "keyctl", "add_key", "request_key", "perf_event_open",
               "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
               "open_by_handle_at", "name_to_handle_at", "syslog", "acct", "quotactl", "reboot",
               "swapon", "swapoff", "settimeofday", "clock_settime", "adjtimex", "personality")
_SYSCALLS = {
    # AUDIT_ARCH_X86_64: arch/x86/entry/syscalls/syscall_64.tbl
    0xC000003E: dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, pidfd_getfd=438, kcmp=312,
                     mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308,
                     open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                     mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
                     bpf=321, userfaultfd=323, keyctl=250, add_key=248, request_key=249, perf_event_open=298,
                     kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313, delete_module=176,
                     open_by_handle_at=304, name_to_handle_at=303, syslog=103, acct=163, quotactl=179,
                     reboot=169, swapon=167, swapoff=168, settimeofday=164, clock_settime=227, adjtimex=159,
                     personality=135, clone=56, clone3=435, prctl=157),
    # AUDIT_ARCH_AARCH64: include/uapi/asm-generic/unistd.h
    0xC00000B7: dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438, kcmp=272,
                     mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268,
                     open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                     mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
                     bpf=280, userfaultfd=282, keyctl=219, add_key=217, request_key=218, perf_event_open=241,
                     kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106,
                     open_by_handle_at=265, name_to_handle_at=264, syslog=116, acct=89, quotactl=60,
                     reboot=142, swapon=224, swapoff=225, settimeofday=170, clock_settime=112, adjtimex=171,
                     personality=92, clone=220, clone3=435, prctl=167),
}
_MACHINE_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# (CLONE_NEWTIME is unshare/clone3 only: for clone its bit is part of the exit signal; unshare is denied.)
_CLONE_NS_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_KILL, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000


def seccomp_program(arch: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions over struct seccomp_data {int nr; u32 arch;
    u64 ip; u64 args[6]} (args[i] low word at 16 + 8 i, little-endian)."""
    nr = _SYSCALLS[arch]
    body: list = [(_LD_ABS, 0, 0, 0)]  # A = nr
    if arch == 0xC000003E:
        body.append((_JGE, "kill", 0, 0x40000000))  # x32 ABI numbers: refuse the whole alias table
    body += [(_JEQ, "eperm", 0, nr[name]) for name in _DENY_NAMES]
    body.append((_JEQ, "enosys", 0, nr["clone3"]))
    # prctl: no un-setting of the parent-death signal, no becoming dumpable again.
    body += [(_JEQ, 0, 4, nr["prctl"]), (_LD_ABS, 0, 0, 16), (_JEQ, "eperm", 0, PR_SET_PDEATHSIG),
             (_JEQ, "eperm", 0, PR_SET_DUMPABLE), (_RET, 0, 0, _ALLOW)]
    # clone: processes and threads yes, new namespaces no.
    body += [(_JEQ, 0, 3, nr["clone"]), (_LD_ABS, 0, 0, 16), (_JSET, "eperm", 0, _CLONE_NS_FLAGS),
             (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ALLOW)]
    prog = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL)] + body
    labels = {"eperm": len(prog), "enosys": len(prog) + 1, "kill": len(prog) + 2}
    prog += [(_RET, 0, 0, _ERRNO | errno.EPERM), (_RET, 0, 0, _ERRNO | errno.ENOSYS), (_RET, 0, 0, _KILL)]
    # Jumps are relative to the next instruction; labels resolve to their absolute position.
    return [(code, labels[jt] - i - 1 if isinstance(jt, str) else jt,
             labels[jf] - i - 1 if isinstance(jf, str) else jf, k) for i, (code, jt, jf, k) in enumerate(prog)]


def install_seccomp() -> None:
    arch = _MACHINE_ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(errno.ENOSYS, f"no seccomp syscall table for {os.uname().machine}")
    prog = seccomp_program(arch)
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    _call(_libc.prctl, PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.byref(fprog), ctypes.c_ulong(0),
          ctypes.c_ulong(0), what="prctl(seccomp filter)")  # SECCOMP_MODE_FILTER; needs no_new_privs


# --------------------------------------------------------------------------- landlock (unsafe mode)

_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446  # same on every arch
_LL_READ = 1 << 0 | 1 << 2 | 1 << 3  # execute, read_file, read_dir
_LL_DEVICE = 1 << 1 | 1 << 2  # write_file, read_file
# Every filesystem right each Landlock ABI can handle (1: bits 0-12; 2: + refer; 3: + truncate;
# 5: + ioctl_dev); net (ABI 4): bind and connect TCP; scopes (ABI 6): abstract unix sockets, signals.
_LL_FS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}


def install_landlock(p: dict, workdir: str) -> int:
    """Unsafe mode: a kernel-enforced filesystem and network policy where Landlock exists (Linux
    5.13+, unprivileged): read and execute the system and Python paths only, write the working
    directory and /dev/null only; no TCP bind/connect (ABI 4+); no signals to processes outside
    (ABI 6+); /proc readable only to a fresh uid (whose view of other processes is closed).
    Returns the ABI used, 0 when the kernel has no Landlock (the audit hook remains)."""
    syscall = _libc.syscall
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
        rules = [(path, _LL_READ) for path in SYSTEM_PATHS + tuple(p["python_paths"])]
        rules += [(f"/dev/{dev}", _LL_DEVICE) for dev in DEVICES] + [(workdir, fs)]
        if p["fresh_uid"]:  # /proc: other processes' entries are closed to a fresh uid anyway
            rules.append(("/proc", _LL_READ))
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent here
            try:
                regular = not os.path.isdir(path)
                # A rule on a file may only grant file rights (execute, write, read, truncate, ioctl).
                allowed = access & fs & ((1 << 0 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15) if regular else ~0)
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


# --------------------------------------------------------------------------- namespaces


def build_root(p: dict) -> None:
    """In fresh mount/PID namespaces, as root: assemble a read-only root under NEW_ROOT, chroot."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    bound = []  # real paths already visible in the new root
    for path in SYSTEM_PATHS + tuple(p["python_paths"]):
        real, dest = os.path.realpath(path), NEW_ROOT + path
        if os.path.islink(path) and path in SYSTEM_PATHS:  # merged /usr: recreate /bin -> usr/bin
            os.symlink(os.readlink(path), dest)
            continue
        if not os.path.exists(path) or any(real == b or real.startswith(b.rstrip("/") + "/") for b in bound):
            continue  # absent, or already reachable (e.g. a venv's lib64 -> lib once the venv is bound)
        os.makedirs(dest, mode=0o755, exist_ok=True)
        _mount(real, dest, None, MS_BIND)
        _mount(None, dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        bound.append(real)
    os.makedirs(NEW_ROOT + "/proc")
    _mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace only
    os.makedirs(NEW_ROOT + "/dev")
    for dev in DEVICES:
        open(f"{NEW_ROOT}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{NEW_ROOT}/dev/{dev}", None, MS_BIND)
    os.makedirs(NEW_ROOT + "/tmp")
    uid = p["uid"]
    _mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={p['tmpfs_mb']}m,nr_inodes=4096,mode=700,uid={uid},gid={uid}")
    os.chroot(NEW_ROOT)
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the skeleton itself


def ns_init(p: dict, results_fd: int, ctl: Channel) -> int:
    """PID 1 of the sandbox: build the root, run the user process, reap everything, report its end."""
    try:
        build_root(p)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"namespace set-up failed: {e}")
        return 3
    pid = os.fork()
    if pid == 0:
        user_process(p, results_fd, ctl, workdir="/tmp")  # dies with this init: the kernel ends the namespace
    return wait_user(pid, ctl)


# --------------------------------------------------------------------------- user process


def wait_user(pid: int, ctl: Channel) -> int:
    """Wait for the user process, reaping whatever else is re-parented here; report how it ended."""
    while True:
        try:
            got, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return 4
        if got == pid:
            break
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    ctl.send(e="exit", signal=sig, code=os.WEXITSTATUS(status) if not sig else None,
             cpu_s=usage.ru_utime + usage.ru_stime)
    return 0


def set_limits(p: dict, nproc: int) -> None:
    cpu = p["cpu_s"]
    mb = 1 << 20
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL at hard
                            (resource.RLIMIT_AS, p["memory_mb"] * mb, p["memory_mb"] * mb),
                            (resource.RLIMIT_NPROC, nproc, nproc),
                            (resource.RLIMIT_NOFILE, p["max_open_files"], p["max_open_files"]),
                            (resource.RLIMIT_FSIZE, p["max_file_mb"] * mb, p["max_file_mb"] * mb),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))


def count_own_tasks(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is ``uid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    total += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return total


def effective_capabilities() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


# Unsafe mode as root: the fresh uid can read only world-readable files, and a Python installed
# under a private directory (pyenv under /root) is not; the modules programs commonly use are
# imported before the uid changes (namespaces mode binds the installation into a readable root).
PRELOAD = ("array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
           "fractions", "functools", "heapq", "itertools", "math", "operator", "random", "re", "statistics",
           "string", "textwrap", "typing", "unicodedata")


def confine(p: dict, workdir: str) -> None:
    """rlimits, never root, no capabilities, no_new_privs, not dumpable, seccomp, a fresh environment."""
    os.chdir(workdir)
    p["fresh_uid"] = os.geteuid() == 0
    if p["isolation"] == "unsafe" and p["fresh_uid"]:
        for name in PRELOAD:
            __import__(name)
    if os.geteuid() == 0:
        # A fresh uid per run: RLIMIT_NPROC binds (the kernel does not apply it to root) and nothing
        # of the host is writable by it. Changing every uid away from 0 clears all capabilities.
        set_limits(p, p["max_processes"])
        os.setgroups([])
        os.setresgid(p["uid"], p["uid"], p["uid"])
        os.setresuid(p["uid"], p["uid"], p["uid"])
    else:
        # Unprivileged caller: RLIMIT_NPROC counts every task of this user, so allow only
        # max_processes - 1 more than exist now.
        set_limits(p, count_own_tasks(os.getuid()) + p["max_processes"] - 1)
    if 0 in os.getresuid() or 0 in os.getresgid() or effective_capabilities() != 0:
        raise OSError(errno.EPERM, "could not drop root or capabilities")
    die_with_parent()  # again: changing uids cleared it (the seccomp filter keeps the program from doing so)
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(no_new_privs)")
    _prctl(PR_SET_DUMPABLE, 0, "prctl(dumpable)")  # /proc/self/{mem,fd,environ} become root's
    if p["isolation"] == "unsafe":
        p["landlock_abi"] = install_landlock(p, workdir)
    install_seccomp()
    os.environ.clear()
    os.environ.update(p["env"], HOME=workdir, TMPDIR=workdir)


def user_process(p: dict, results_fd: int, ctl: Channel, workdir: str) -> None:
    """Confine this process, run the program and its tests, report each; never returns."""
    try:
        confine(p, workdir)
        if results_fd != p["results_fd"]:  # dup3 refuses equal numbers
            os.dup2(results_fd, p["results_fd"], inheritable=False)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"confinement failed: {e}")
        os._exit(3)
    fd = p["results_fd"]
    os.closerange(3, fd)  # the control pipe too: from here on only results can be written
    os.closerange(fd + 1, 1 << 16)
    del sys.argv[1:]
    if p["audit_hook"]:
        sys.addaudithook(make_audit_hook(os.path.realpath(workdir), p["max_processes"] > 1))
    try:
        run_tests(p["program"], p["setup"], p["leaves"], fd, p["nonce"])
    finally:
        os._exit(0)


def run_tests(program: str, setup: str, leaves: list, fd: int, nonce: str) -> None:
    """Run the program and the setup, then evaluate each test's operands and report their values.

    Everything used after the program has run is bound here first: a program that replaces
    builtins.exec, compile, json or os functions, or rebinds this module's globals, changes nothing
    the harness does. It can still make its own functions return anything: that is its answer."""
    from json.encoder import c_make_encoder, encode_basestring_ascii

    exec_, eval_, compile_, write, flush = exec, eval, compile, os.write, (sys.stdout.flush, sys.stderr.flush)
    len_, str_encode, join, enumerate_, BaseException_ = len, str.encode, "".join, enumerate, BaseException
    kind_of_, describe_ = kind_of, describe
    # The C encoder alone (json.dumps's Python layers are patchable); its input below holds only
    # exact builtin types, so it calls no Python code.
    dumps = c_make_encoder(None, None, encode_basestring_ascii, None, ":", ",", False, False, True)
    encode = make_encoder()

    def send(**event):
        event["n"] = nonce
        data = str_encode(join(dumps(event, 0)) + "\n")
        while data:
            data = data[write(fd, data):]

    # __name__ is not "__main__", so a program's `if __name__ == "__main__":` demo code does not run.
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        exec_(compile_(program, "<program>", "exec"), scope)
        if setup:
            exec_(compile_(setup, "<test setup>", "exec"), scope)
    except BaseException_ as e:  # SystemExit too: the program must not end the harness
        send(e="program", ok=False, kind=kind_of_(e), msg=describe_(e))
        return
    finally:
        for f in flush:
            f()
    send(e="program", ok=True)
    for i, sources in enumerate_(leaves):
        try:
            values = [eval_(compile_(src, f"<test {i}>", "eval"), scope) for src in sources]
        except BaseException_ as e:
            send(e="test", i=i, kind=kind_of_(e), msg=describe_(e))
            continue
        encoded = encode(values)
        if encoded is None:
            send(e="test", i=i, kind="error", msg="a value is not plain data (or too large or deep)")
        else:
            send(e="test", i=i, v=encoded)
    for f in flush:
        f()
    send(e="done", count=len_(leaves))


def make_encoder(max_nodes: int = 200_000, max_depth: int = 64):
    """encode(value) -> plain JSON data, or None when the value is not builtin data or too big.

    Tagged so that Python equality survives the trip: lists stay JSON arrays; tuples, sets,
    frozensets, dicts, bytes, complex and big ints become {"T": tag, "v": ...}. Subclasses of
    builtin types are read through the base type's own methods (an overridden __iter__ or
    __eq__ is never called); any other object is not data and crosses as its truth value only
    (``bool(obj)``, the program's own answer, as if it had returned a bool), equal to nothing.
    Iterative: no recursion to exhaust."""
    type_, len_, hex_, list_, enumerate_ = type, len, hex, list, enumerate
    dict_items, set_iter, fz_iter, list_copy = dict.items, set.__iter__, frozenset.__iter__, list.copy
    tuple_get, int_int, float_float, str_str = tuple.__getitem__, int.__int__, float.__float__, str.__str__
    bytes_hex, bytearray_hex, isinstance_ = bytes.hex, bytearray.hex, isinstance
    real, imag = complex.real.__get__, complex.imag.__get__
    truth, BaseException_ = bool, BaseException
    full = slice(None)
    big = 1 << 53

    def encode(value):
        root = [None]
        todo = [(value, root, 0, 0)]  # (object, output container, index in it, depth)
        nodes = 0
        while todo:
            obj, out, at, depth = todo.pop()
            nodes += 1
            if nodes > max_nodes or depth > max_depth:
                return None
            t = type_(obj)
            items = None
            if obj is None or t is bool or t is str:
                out[at] = obj
            elif isinstance_(obj, int):
                n = int_int(obj)
                out[at] = n if -big < n < big else {"T": "int", "v": hex_(n)}
            elif isinstance_(obj, float):
                out[at] = float_float(obj)
            elif isinstance_(obj, str):
                out[at] = str_str(obj)
            elif isinstance_(obj, complex):
                out[at] = {"T": "complex", "v": [real(obj), imag(obj)]}
            elif isinstance_(obj, (bytes, bytearray)):
                out[at] = {"T": "bytes", "v": (bytes_hex if isinstance_(obj, bytes) else bytearray_hex)(obj)}
            elif isinstance_(obj, list):
                items = list_copy(obj)
                out[at] = node = [None] * len_(items)
            elif isinstance_(obj, tuple):
                items = tuple_get(obj, full)
                node = [None] * len_(items)
                out[at] = {"T": "tuple", "v": node}
            elif isinstance_(obj, (set, frozenset)):
                items = list_((set_iter if isinstance_(obj, set) else fz_iter)(obj))
                node = [None] * len_(items)
                out[at] = {"T": "set" if isinstance_(obj, set) else "frozenset", "v": node}
            elif isinstance_(obj, dict):
                pairs = list_(dict_items(obj))
                node = [None] * (2 * len_(pairs))
                items = [x for pair in pairs for x in pair]
                out[at] = {"T": "dict", "v": node}
            else:  # not data: only its truth value crosses (an assert may test just that)
                try:
                    out[at] = {"T": "object", "v": truth(obj)}
                except BaseException_:
                    return None
            if items is not None:
                todo.extend((item, node, k, depth + 1) for k, item in enumerate_(items))
        return root[0]
    return encode


def kind_of(exc: BaseException) -> str:
    """fail (assertion), limit (a resource limit was hit) or error (anything else)."""
    if isinstance(exc, AssertionError):
        return "fail"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in LIMIT_ERRNOS):
        return "limit"
    return "error"


def describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:  # a hostile __str__
        return "an exception whose description failed"


def make_audit_hook(workdir: str, allow_processes: bool):
    """Refuse network use, writes outside ``workdir``, native-code escapes and (unless allowed)
    process creation. A second layer in namespaces mode and the file/network guard of unsafe mode;
    not a security boundary on its own (see docs/security.md)."""
    blocked = frozenset({"socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
                         "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.kill",
                         "os.killpg", "sqlite3.connect", "os.mkfifo", "os.mknod", "os.setxattr",
                         "os.removexattr", "sys.addaudithook"}
                        | ({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                            "subprocess.Popen", "os.startfile"} if not allow_processes else set()))
    blocked_imports = frozenset({"ctypes", "_ctypes", "_posixshmem", "_sqlite3", "_multiprocessing"}
                                | ({"_posixsubprocess"} if not allow_processes else set()))
    mutations = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                           "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    own_proc = ("", "proc", str(os.getpid()))

    def other_process(path) -> bool:
        """/proc/<pid>/... of another process (its environment, memory, command line)."""
        parts = tuple(os.path.realpath(os.fsdecode(path)).split("/"))
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[:3] != own_proc

    def inside(path) -> bool:
        real = os.path.realpath(os.fsdecode(path))  # relative to the cwd, wherever the program moved it
        return real == "/dev/null" or real == workdir or real.startswith(workdir + "/")

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_imports:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return  # an already open descriptor
            if other_process(path):
                raise PermissionError(f"sandbox: reading {path!r} of another process")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            # A relative path may be resolved against a dir_fd the hook cannot see: only absolute
            # paths are judged, relative writes must resolve inside from the cwd.
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in mutations:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")
    return hook


# --------------------------------------------------------------------------- runner


def reap_all(scan: bool) -> None:
    """Kill and reap every process left under this subreaper (orphans are re-parented here; in
    namespaces mode they are the namespace init's, so there is nothing to scan for)."""
    me = str(os.getpid()).encode()
    while True:
        for entry in os.listdir("/proc") if scan else ():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if entry.isdigit() and f.read().rsplit(b")", 1)[1].split()[1] == me:
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError):
                continue
        try:
            os.wait()
        except ChildProcessError:
            return


def main() -> int:
    results_fd, ctl = int(sys.argv[1]), Channel(int(sys.argv[2]))
    p = json.loads(sys.stdin.buffer.read())
    sys.path.extend(d for d in p["site_packages"] if d not in sys.path)  # started with -S
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)  # the program's stdin is empty
    os.close(devnull)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    die_with_parent()
    _prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(child subreaper)")
    namespaces = p["isolation"] == "namespaces"
    if namespaces:
        try:
            _call(_libc.unshare, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                  what="unshare")
        except OSError as e:
            ctl.send(e="setup_error", msg=str(e))
            return 3
    ctl.send(e="start", isolation=p["isolation"])
    gate_r, gate_w = os.pipe()  # the child waits here until it is in the run's cgroup
    pid = os.fork()  # namespaces: the first child of an unshared PID namespace is its PID 1
    if pid == 0:
        os.close(gate_w)
        die_with_parent()
        ready = os.read(gate_r, 1)
        os.close(gate_r)
        if ready != b"1":
            os._exit(3)
        if namespaces:
            os._exit(ns_init(p, results_fd, ctl))
        user_process(p, results_fd, ctl, workdir=p["workdir"])
    os.close(gate_r)
    ctl.send(e="child", pid=pid)
    try:
        if p["cgroup_procs"]:
            with open(p["cgroup_procs"], "w") as f:
                f.write(str(pid))
        os.write(gate_w, b"1")
    except OSError as e:
        ctl.send(e="setup_error", msg=f"joining the run's cgroup failed: {e}")
    os.close(gate_w)
    if namespaces:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status) & 0xFF
    else:
        code = wait_user(pid, ctl)
    reap_all(scan=not namespaces)
    ctl.send(e="ended")
    return code


if __name__ == "__main__":
    sys.exit(main())
