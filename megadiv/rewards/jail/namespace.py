"""``namespaces`` mode: the read-only root the program sees, built by the namespace's init."""
import os

from .landlock import DEVICES, SYSTEM_PATHS
from .libc import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT, mount

NEW_ROOT = "/tmp"  # the chroot is built on a tmpfs mounted here, in the private mount namespace only


def build_root(p: dict) -> None:
    """In fresh mount/PID namespaces, as root: assemble a read-only root under NEW_ROOT, chroot.

    /usr, /etc, /lib* and the Python installation are bound read-only; every hidden directory
    inside them (the megadiv package and its checkout: they hold the reference solutions) is
    covered by an empty read-only tmpfs; /proc is this PID namespace's; /dev has null, zero, urandom and random;
    /tmp is a size-capped, noexec tmpfs owned by the program's uid."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    # Everything is looked up and opened before the tmpfs covers NEW_ROOT (/tmp): a Python path under
    # /tmp (a virtualenv there) is bound through its descriptor, not silently missed.
    links, binds, covers = [], [], []  # (dest, link target); (path, real, O_PATH fd); tmpfs over hidden
    for path in SYSTEM_PATHS + tuple(p["python_paths"]):
        real = os.path.realpath(path)
        if os.path.islink(path) and path in SYSTEM_PATHS:  # merged /usr: recreate /bin -> usr/bin
            links.append((NEW_ROOT + path, os.readlink(path)))
            continue
        if not os.path.exists(path) or any(real == b or real.startswith(b.rstrip("/") + "/") for _, b, _ in binds):
            continue  # absent, or already reachable (e.g. a venv's lib64 -> lib once the venv is bound)
        binds.append((path, real, os.open(real, os.O_PATH | os.O_CLOEXEC)))
    hidden_dirs = [h for h in map(os.path.realpath, p["hidden"]) if os.path.isdir(h)]
    for hidden in hidden_dirs:
        if any(hidden.startswith(outer.rstrip("/") + "/") for outer in hidden_dirs):
            continue  # inside another hidden directory (the package inside its checkout): covered with it
        for path, real, _ in binds:
            if hidden == real or hidden.startswith(real.rstrip("/") + "/"):
                covers.append(NEW_ROOT + path + hidden[len(real):])
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    # The program's /tmp first: a Python path under /tmp is then bound inside it, not covered by it.
    os.makedirs(NEW_ROOT + "/tmp")
    uid = p["uid"]
    # noexec: nothing the program writes can be mapped executable (an extension module, a binary)
    mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={p['tmpfs_mb']}m,nr_inodes=4096,mode=700,uid={uid},gid={uid}")
    for dest, target in links:
        os.symlink(target, dest)
    for path, _, fd in binds:
        dest = NEW_ROOT + path
        os.makedirs(dest, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", dest, None, MS_BIND)
        mount(None, dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for dest in covers:
        mount("tmpfs", dest, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=1,mode=555")
    os.makedirs(NEW_ROOT + "/proc")
    mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace only
    os.makedirs(NEW_ROOT + "/dev")
    for dev in DEVICES:
        open(f"{NEW_ROOT}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{NEW_ROOT}/dev/{dev}", None, MS_BIND)
    os.chroot(NEW_ROOT)
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the skeleton itself
