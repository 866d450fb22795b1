"""The CPython audit hook of the user process: the second layer under namespaces and unsafe mode's
guard for what Landlock does not cover (or everything, without Landlock). Not a boundary on its
own: native code bypasses it (docs/security.md)."""
import os


def make_audit_hook(workdir: str, allow_processes: bool):
    """Refuse every ``ctypes.*`` event (a foreign function cached before the hook raises only
    ``ctypes.call_function``), network use, writes outside ``workdir``, other processes' /proc
    entries, directories opened as descriptors (a ``dir_fd`` the hook could not see through) and
    (unless allowed) process creation."""
    blocked = frozenset({"socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
                         "socket.getaddrinfo", "os.kill", "os.killpg", "sqlite3.connect", "os.mkfifo", "os.mknod",
                         "os.setxattr", "os.removexattr", "sys.addaudithook"}
                        | ({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                            "subprocess.Popen", "os.startfile"} if not allow_processes else set()))
    blocked_imports = frozenset({"ctypes", "_ctypes", "_posixshmem", "_sqlite3", "_multiprocessing"}
                                | ({"_posixsubprocess"} if not allow_processes else set()))
    mutations = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                           "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"})
    listings = frozenset({"os.listdir", "os.scandir"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    own_proc = ("", "proc", str(os.getpid()))
    realpath, fsdecode, isdir, startswith = os.path.realpath, os.fsdecode, os.path.isdir, str.startswith

    def other_process(path) -> bool:
        """/proc itself or /proc/<pid>/... of another process (its environment, memory, command line)."""
        parts = tuple(realpath(fsdecode(path)).split("/"))
        return parts[:2] == ("", "proc") and (len(parts) == 2 or parts[2].isdigit() and parts[:3] != own_proc)

    def inside(path) -> bool:
        real = realpath(fsdecode(path))  # relative to the cwd, wherever the program moved it
        return real == "/dev/null" or real == workdir or startswith(real, workdir + "/")

    def hook(event, args):
        if event in blocked or startswith(event, "ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_imports:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return  # an already open descriptor
            if other_process(path):
                raise PermissionError(f"sandbox: reading {path!r} of another process")
            if isdir(path):  # a directory descriptor would let dir_fd-relative paths past this hook
                raise PermissionError(f"sandbox: opening the directory {path!r} as a descriptor")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in listings:
            if args and isinstance(args[0], (str, bytes, os.PathLike)) and other_process(args[0]):
                raise PermissionError("sandbox: listing /proc")
        elif event in mutations:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")
    return hook
