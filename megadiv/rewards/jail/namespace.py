"""``namespaces`` mode: the read-only root the program sees, built by the namespace's init."""
import os

from .landlock import DEVICES, SYSTEM_PATHS
from .libc import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT, mount

NEW_ROOT = "/tmp"  # the chroot is built on a tmpfs mounted here, in the private mount namespace only


def build_root(p: dict) -> None:
    """In fresh mount/PID namespaces, as root: assemble a read-only root under NEW_ROOT, chroot.

    /usr, /etc, /lib* and the Python installation are bound read-only; every hidden path inside
    them (the megadiv package: its data files hold the reference solutions) is covered by an
    empty read-only tmpfs; /proc is this PID namespace's; /dev has null, zero, urandom and random;
    /tmp is a size-capped tmpfs owned by the program's uid."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    bound = []  # (path in the new root, real path) already visible
    for path in SYSTEM_PATHS + tuple(p["python_paths"]):
        real, dest = os.path.realpath(path), NEW_ROOT + path
        if os.path.islink(path) and path in SYSTEM_PATHS:  # merged /usr: recreate /bin -> usr/bin
            os.symlink(os.readlink(path), dest)
            continue
        if not os.path.exists(path) or any(real == b or real.startswith(b.rstrip("/") + "/") for _, b in bound):
            continue  # absent, or already reachable (e.g. a venv's lib64 -> lib once the venv is bound)
        os.makedirs(dest, mode=0o755, exist_ok=True)
        mount(real, dest, None, MS_BIND)
        mount(None, dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        bound.append((path, real))
    for hidden in map(os.path.realpath, p["hidden"]):
        for path, real in bound:
            if os.path.isdir(hidden) and (hidden == real or hidden.startswith(real.rstrip("/") + "/")):
                mount("tmpfs", NEW_ROOT + path + hidden[len(real):], "tmpfs",
                      MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=1,mode=555")
    os.makedirs(NEW_ROOT + "/proc")
    mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace only
    os.makedirs(NEW_ROOT + "/dev")
    for dev in DEVICES:
        open(f"{NEW_ROOT}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{NEW_ROOT}/dev/{dev}", None, MS_BIND)
    os.makedirs(NEW_ROOT + "/tmp")
    uid = p["uid"]
    mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={p['tmpfs_mb']}m,nr_inodes=4096,mode=700,uid={uid},gid={uid}")
    os.chroot(NEW_ROOT)
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the skeleton itself
