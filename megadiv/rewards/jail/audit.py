"""The CPython audit hook of the user process: the second layer under namespaces and unsafe mode's
guard for what Landlock does not cover (or everything, without Landlock). Not a boundary on its
own: native code bypasses it (docs/security.md says what it does and does not guard).

The program runs in the same interpreter as the hook, so the hook keeps nothing a program can
rebind: no closure cells (writable through ``cell.cell_contents``) and no global or builtin
lookups (``builtins.isinstance = ...`` would change them). Its state is its own ``__defaults__``:
a tuple of frozensets, strings and C functions, none of which Python code can change, and setting
its own or its helpers' ``__defaults__``/``__code__`` is an audit event it refuses. The events that reach
arbitrary objects (the gc functions find the hook and the interpreter's list of hooks) and a
subinterpreter (which has no hooks of its own) are refused too. tests/test_sandbox.py's
test_audit_hook_cannot_be_switched_off checks that no global is read and the attacks fail.
"""
import os
import stat

# Events the hook refuses whatever their arguments. The second line reaches every object (the hook,
# the interpreter's list of hooks) or starts an interpreter without this hook.
ALWAYS_REFUSED = frozenset({
    "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "os.kill", "os.killpg", "sqlite3.connect", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr",
    "sys.addaudithook", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "cpython.PyInterpreterState_New",
    "sys.settrace", "sys.setprofile", "sys._current_frames", "sys._current_exceptions"})
# Attributes that hand out a frame (audited reads): the traceback of any refused event holds the
# hook's own frame, whose locals hold the hook. With them and sys._getframe refused, and no tracer
# or profiler allowed (a tracer sees and rewrites the locals of every frame it traces, the hook's
# too once its __cantrace__ is set, an attribute set that raises no event), no Python code of the
# program can reach a frame of the hook.
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                            "subprocess.Popen", "os.startfile"})
# Test and interpreter modules of the standard library that reach raw memory or other interpreters.
REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes", "_ctypes_test", "_posixshmem", "_sqlite3", "_multiprocessing",
                             "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
                             "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz"})
# A function's code and defaults: what the hook and its helper hold.
FUNCTION_STATE = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
MUTATIONS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                       "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"})
LISTINGS = frozenset({"os.listdir", "os.scandir"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def resolve(path, as_str=str.__str__, decode=bytes.decode, fspath=os.fspath, getcwd=os.getcwd, lstat=os.lstat,
            readlink=os.readlink, is_link=stat.S_ISLNK, str_type=str, bytes_type=bytes, isinstance_=isinstance,
            os_error=OSError, rpartition=str.rpartition, split=str.split, startswith=str.startswith):
    """The absolute path with every symlink resolved, as os.path.realpath gives it, built from C
    functions only (posixpath's own are Python code whose module globals a program can rebind).
    A str or bytes subclass is read as the plain value (its own methods are never called)."""
    if not isinstance_(path, (str_type, bytes_type)):
        path = fspath(path)  # a PathLike: its __fspath__ is program code, which may answer differently
    path = decode(path, "utf-8", "surrogateescape") if isinstance_(path, bytes_type) else as_str(path)
    todo = split(path if startswith(path, "/") else getcwd() + "/" + path, "/")[::-1]
    done, hops = "", 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            done = rpartition(done, "/")[0]
            continue
        candidate = done + "/" + part
        try:
            mode = lstat(candidate).st_mode
        except os_error:
            done = candidate  # absent: the rest is taken as written
            continue
        if is_link(mode) and hops < 40:  # 40: the kernel's own limit on links in one lookup
            hops += 1
            target = readlink(candidate)
            if startswith(target, "/"):
                done = ""
            todo += split(target, "/")[::-1]
        else:
            done = candidate
    return done or "/"


def refused_proc(real, own_proc, startswith=str.startswith, split=str.split, isdigit=str.isdigit, len_=len):
    """``real`` (a resolved path) is /proc itself, /proc/<pid>/... of another process (its
    environment, memory, command line), or this process's own ``net`` directories (unsafe mode
    shares the host's network namespace: its tcp, udp and unix tables)."""
    if real == "/proc":
        return True
    if not startswith(real, "/proc/"):
        return False
    parts = split(real, "/")  # ["", "proc", pid, entry, ...]
    if not isdigit(parts[2]):
        return False  # /proc/meminfo, /proc/sys/...: not a process's
    if real != own_proc and not startswith(real, own_proc + "/"):
        return True
    return len_(parts) > 3 and (parts[3] == "net" or parts[3] == "task" and len_(parts) > 5 and parts[5] == "net")


def any_under(real, roots, startswith):
    """``real`` is one of ``roots`` or inside one (no global lookups: it runs inside the hook)."""
    for root in roots:
        if real == root or startswith(real, root + "/"):
            return True
    return False


def make_audit_hook(workdir: str, allow_processes: bool, native_roots: tuple[str, ...]):
    """Refuse every ``ctypes.*`` event (a foreign function cached before the hook raises only
    ``ctypes.call_function``), network use, writes outside ``workdir``, other processes' /proc
    entries and its own /proc net tables, directories opened as descriptors (a ``dir_fd`` the
    hook could not see through), extension modules from anywhere but the read-only ``native_roots``
    (resolved system and Python paths, less any that holds the writable ``workdir``), (unless allowed) process
    creation, and whatever would reach or rebind the hook itself: its frames (tracebacks,
    ``sys._getframe``, tracers and profilers), the gc functions, its code and defaults."""
    refused = ALWAYS_REFUSED | (frozenset() if allow_processes else PROCESS_EVENTS)
    # a root holding the work dir would grant what the program writes there ("/", or namespaces'
    # /tmp); a root inside it (a venv under namespaces' /tmp) is a read-only bind
    native_roots = tuple(root for root in native_roots if workdir != root and not workdir.startswith(root.rstrip("/") + "/"))
    refused_imports = REFUSED_IMPORTS | (frozenset() if allow_processes else frozenset({"_posixsubprocess"}))
    own_proc = f"/proc/{os.getpid()}"

    def hook(event, args, refused=refused, refused_imports=refused_imports, function_state=FUNCTION_STATE,
             mutations=MUTATIONS, listings=LISTINGS, write_flags=WRITE_FLAGS, workdir=workdir,
             own_proc=own_proc, resolve=resolve, refused_proc=refused_proc, deny=PermissionError,
             startswith=str.startswith, as_str=str.__str__, isinstance_=isinstance, int_type=int, str_type=str,
             path_types=(str, bytes, os.PathLike), stat_=os.stat, is_dir=stat.S_ISDIR, os_error=OSError, len_=len,
             frame_attributes=FRAME_ATTRIBUTES, native_roots=native_roots, any_under=any_under, no_frame=ValueError,
             guarded=()):
        # Any exception here (a program's str subclass failing in as_str, say) refuses the event.
        if event in refused or startswith(event, "ctypes."):
            raise deny("sandbox: " + event + " is not allowed")
        if event == "import":
            if as_str(args[0]) in refused_imports:
                raise deny("sandbox: importing " + as_str(args[0]) + " is not allowed")
            if args[1] is not None:  # an extension module's file (_imp.create_dynamic): native code
                real = resolve(args[1])
                if not any_under(real, native_roots, startswith):
                    raise deny("sandbox: loading the extension module " + real + " is not allowed")
        elif event == "sys._getframe":
            # ValueError, what a too-deep _getframe raises: namedtuple, typing and enum catch it
            raise no_frame("sandbox: sys._getframe is not allowed")
        elif event == "object.__getattr__":
            if as_str(args[1]) in frame_attributes:
                raise deny("sandbox: reading " + as_str(args[1]) + " is not allowed")
        elif event == "object.__setattr__" or event == "object.__delattr__":
            # only the hook's own functions: libraries (numpy) set other functions' __defaults__
            for function in guarded:
                if args[0] is function and as_str(args[1]) in function_state:
                    raise deny("sandbox: setting " + as_str(args[1]) + " is not allowed")
        elif event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int_type):
                return  # an already open descriptor
            real = resolve(path)
            if refused_proc(real, own_proc):
                raise deny("sandbox: reading " + real)
            try:
                directory = is_dir(stat_(real).st_mode)
            except os_error:
                directory = False
            if directory:  # a directory descriptor would let dir_fd-relative paths past this hook
                raise deny("sandbox: opening the directory " + real + " as a descriptor")
            writing = (isinstance_(mode, str_type) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
                       or (flags or 0) & write_flags != 0)
            if writing and real != "/dev/null" and real != workdir and not startswith(real, workdir + "/"):
                raise deny("sandbox: writing " + real + " outside the working directory")
        elif event in listings:
            if len_(args) and isinstance_(args[0], path_types):
                real = resolve(args[0])
                if refused_proc(real, own_proc):
                    raise deny("sandbox: listing " + real)
        elif event in mutations:
            for path in args[:2]:
                if isinstance_(path, path_types):
                    real = resolve(path)
                    if real != workdir and not startswith(real, workdir + "/"):
                        raise deny("sandbox: " + event + " on " + real + " outside the working directory")
    # Its last default: the functions whose code and defaults it holds, itself included (set before
    # it is installed; no closure cell holds it).
    hook.__defaults__ = hook.__defaults__[:-1] + ((hook, resolve, refused_proc, any_under),)
    return hook
