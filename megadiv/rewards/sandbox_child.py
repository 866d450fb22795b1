"""The sandbox's child side: started by ``megadiv.rewards.sandbox`` as ``python -S sandbox_child.py
RESULTS_FD CONTROL_FD``. Standard library only, never imports megadiv (it runs before any isolation exists).

Reads one JSON payload on stdin (program, tests, limits, isolation), then:

namespaces mode (root on Linux)::

    runner (host namespaces) --unshare(net, pid, mount, ipc, uts)--> fork
      ns-init = PID 1 of the new PID namespace: builds a read-only root in a private tmpfs
        (/usr, /etc, /lib*, the Python installation bound read-only; fresh /proc; /dev with null,
        zero, urandom only; a size-capped writable tmpfs at /tmp), chroots into it, forks
        user process: rlimits, drops to a fresh unprivileged uid, no_new_privs, cwd /tmp,
          audit hook, then runs the program and the tests
      When ns-init exits the kernel kills every process left in the namespace.

fallback mode (no privileges or no namespaces): the runner forks the user process directly in a
host-made temporary directory; rlimits and the audit hook are the guards.

Two event pipes, JSON lines: RESULTS_FD gets program, test (one per assert) and done from the
user process; CONTROL_FD gets start, setup_error, user (its pid) and exit from trusted code only:
the user process closes it before the program runs, so a program cannot forge them.
"""
import ctypes
import errno
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

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


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _call(_libc.mount, enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data),
          what=f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a caller killed mid-run leaves no sandbox behind)."""
    parent = os.getppid()
    _call(_libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0, what="prctl(pdeathsig)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


class Channel:
    """Events to the host, one JSON object per line (each write well under PIPE_BUF, so atomic).
    Each carries the sender's pid: the host keeps test results from the user process only, not
    from processes it forked (which inherit the pipe and would otherwise report too)."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, **event) -> None:
        event["pid"] = os.getpid()
        line = json.dumps(event)
        if len(line) > 2048:
            event["msg"] = event.get("msg", "")[:512]
            line = json.dumps(event)
        os.write(self.fd, (line + "\n").encode())


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


def ns_init(p: dict, chan: Channel, ctl: Channel) -> int:
    """PID 1 of the sandbox: build the root, run the user process, reap everything, report its end."""
    try:
        build_root(p)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"namespace set-up failed: {e}")
        return 3
    pid = os.fork()
    if pid == 0:
        user_process(p, chan, ctl, workdir="/tmp")  # dies with this init: the kernel ends the namespace
    ctl.send(e="user", user=pid)
    return wait_user(pid, ctl, reap_all=True)


# --------------------------------------------------------------------------- user process


def wait_user(pid: int, ctl: Channel, reap_all: bool) -> int:
    """Wait for the user process (PID 1 also reaps re-parented orphans); report how it ended."""
    while True:
        try:
            got, status, usage = os.wait4(-1 if reap_all else pid, 0)
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


def user_process(p: dict, chan: Channel, ctl: Channel, workdir: str) -> None:
    """Confine this process, run the program and its tests, report each; never returns."""
    try:
        os.chdir(workdir)
        if p["isolation"] == "namespaces":
            set_limits(p, p["max_processes"])
            os.setgroups([])
            os.setresgid(p["uid"], p["uid"], p["uid"])
            os.setresuid(p["uid"], p["uid"], p["uid"])
            if os.getuid() != p["uid"] or os.geteuid() == 0:
                raise OSError(errno.EPERM, "could not drop privileges")
        else:
            # Without a fresh uid, RLIMIT_NPROC counts every task of this user, so allow only
            # max_processes - 1 more than exist now (root ignores RLIMIT_NPROC: see the audit hook).
            set_limits(p, count_own_tasks(os.getuid()) + p["max_processes"] - 1)
        _call(_libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, what="prctl(no_new_privs)")
        os.environ.clear()
        os.environ.update(p["env"], HOME=workdir, TMPDIR=workdir)
    except OSError as e:
        ctl.send(e="setup_error", msg=f"confinement failed: {e}")
        os._exit(3)
    os.closerange(3, chan.fd)  # the control pipe too: from here on only results can be written
    os.closerange(chan.fd + 1, 1 << 16)
    if p["audit_hook"]:
        sys.addaudithook(make_audit_hook(os.path.realpath(workdir), p["max_processes"] > 1))
    try:
        run_tests(p, chan)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
    except Exception:  # a hostile __str__
        return type(exc).__name__


def run_tests(p: dict, chan: Channel) -> None:
    # __name__ is not "__main__", so a program's `if __name__ == "__main__":` demo code does not run.
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        exec(compile(p["program"], "<program>", "exec"), scope)
        if p["setup"]:
            exec(compile(p["setup"], "<test setup>", "exec"), scope)
    except BaseException as e:  # SystemExit too: the program must not end the harness
        chan.send(e="program", ok=False, kind=kind_of(e), msg=describe(e))
        return
    chan.send(e="program", ok=True)
    for i, test in enumerate(p["tests"]):
        try:
            exec(compile(test, f"<test {i}>", "exec"), scope)
            chan.send(e="test", i=i, ok=True)
        except BaseException as e:
            chan.send(e="test", i=i, ok=False, kind=kind_of(e), msg=describe(e))
    chan.send(e="done")


def make_audit_hook(workdir: str, allow_processes: bool):
    """Refuse network use, writes outside ``workdir``, native-code escapes and (unless allowed)
    process creation. The OS-level guards are the real boundary where namespaces exist; this
    hook is the guard in fallback mode and a second layer otherwise (CPython audit hooks are not
    a security boundary on their own: see docs/data_and_rewards.md)."""
    blocked = {"socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
               "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.kill", "os.killpg"}
    if not allow_processes:
        blocked |= {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                    "subprocess.Popen", "os.startfile"}
    blocked_imports = {"ctypes", "_ctypes", "_posixsubprocess"} if not allow_processes else {"ctypes", "_ctypes"}
    mutations = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                 "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    allowed_write = {"/dev/null"}
    own_proc = f"/proc/{os.getpid()}"

    def other_process(path) -> bool:
        """/proc/<pid>/... of another process (its environment, memory, command line)."""
        if isinstance(path, int):
            return False
        real = os.path.realpath(os.fsdecode(path))
        parts = real.split("/")
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and real.split("/")[:3] != \
            own_proc.split("/")

    def inside(path) -> bool:
        if isinstance(path, int):  # an already open descriptor
            return True
        path = os.fsdecode(path)
        real = os.path.realpath(path)  # relative to the current directory, wherever the program moved it
        return real in allowed_write or real == workdir or real.startswith(workdir + "/")

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_imports:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is not None and other_process(path):
                raise PermissionError(f"sandbox: reading {path!r} of another process")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in mutations:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")
    return hook


# --------------------------------------------------------------------------- runner


def main() -> int:
    chan, ctl = Channel(int(sys.argv[1])), Channel(int(sys.argv[2]))
    p = json.loads(sys.stdin.buffer.read())
    sys.path.extend(d for d in p["site_packages"] if d not in sys.path)  # started with -S
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)  # the program's stdin is empty
    os.close(devnull)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    die_with_parent()
    if p["isolation"] == "namespaces":
        try:
            _call(_libc.unshare, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                  what="unshare")
        except OSError as e:
            ctl.send(e="setup_error", msg=str(e))
            return 3
        ctl.send(e="start", isolation="namespaces")
        pid = os.fork()  # the first child of an unshared PID namespace is its PID 1
        if pid == 0:
            die_with_parent()
            os._exit(ns_init(p, chan, ctl))
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) & 0xFF
    ctl.send(e="start", isolation="fallback")
    pid = os.fork()
    if pid == 0:
        die_with_parent()
        user_process(p, chan, ctl, workdir=p["workdir"])
    ctl.send(e="user", user=pid)
    return wait_user(pid, ctl, reap_all=False)


if __name__ == "__main__":
    sys.exit(main())
