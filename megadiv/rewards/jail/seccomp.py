"""The seccomp filter every sandboxed process runs under (installed by ``confine``; needs no_new_privs)."""
import ctypes
import errno
import os
import struct

from .libc import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_SET_DUMPABLE,
    PR_SET_PDEATHSIG,
    PR_SET_SECCOMP,
    call,
    libc,
)

# Denied system calls (EPERM), by architecture: debugging other processes or reading memory behind
# Python's back, namespaces and mounts, kernel attack surface a program never needs (io_uring, bpf,
# keyrings, perf, module loading, kexec), clock/system administration, and socket() of every
# family: no network, no unix-domain socket of the host, no vsock or netlink (a program needs none;
# unsafe mode has no network namespace, so this is its network guard below the audit hook).
# socketpair and every call that addresses or serves a socket (connect, bind, listen, accept,
# sendto, sendmsg, sendmmsg): socketpair(AF_UNIX, SOCK_DGRAM) + sendto(<host path>) reached the
# host's unix sockets in unsafe mode (Landlock does not mediate it), and a program has no socket
# these calls could legitimately serve. memfd_create/memfd_secret: anonymous files whose pages no
# rlimit counts (RLIMIT_AS does not, and there may be no cgroup memory controller); pipes stay at
# their default 64 KiB (fcntl F_SETPIPE_SZ refused), so descriptors hold at most
# max_open_files x 64 KiB.
# SysV IPC and POSIX message queues: in unsafe mode they are the host's (no IPC namespace) and their
# objects outlive the run (pinned memory no rlimit bounds), so none may be created or reached.
# clone3 answers ENOSYS so that libc falls back to clone, whose flags the filter can see (clone3
# passes them in memory).
_DENY_NAMES = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
               "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
               "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
               "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd",
               "keyctl", "add_key", "request_key", "perf_event_open",
               "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
               "open_by_handle_at", "name_to_handle_at", "syslog", "acct", "quotactl", "reboot",
               "swapon", "swapoff", "settimeofday", "clock_settime", "adjtimex", "personality", "socket",
               "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
               "semtimedop", "semctl", "mq_open", "mq_unlink",
               "socketpair", "connect", "bind", "listen", "accept", "accept4", "sendto", "sendmsg", "sendmmsg",
               "memfd_create", "memfd_secret")
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
                     personality=135, socket=41, shmget=29, shmat=30, shmctl=31, msgget=68, msgsnd=69,
                     msgrcv=70, msgctl=71, semget=64, semop=65, semtimedop=220, semctl=66, mq_open=240,
                     mq_unlink=241, socketpair=53, connect=42, bind=49, listen=50, accept=43, accept4=288,
                     sendto=44, sendmsg=46, sendmmsg=307, memfd_create=319, memfd_secret=447, fcntl=72,
                     clone=56, clone3=435, prctl=157),
    # AUDIT_ARCH_AARCH64: include/uapi/asm-generic/unistd.h
    0xC00000B7: dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438, kcmp=272,
                     mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268,
                     open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                     mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
                     bpf=280, userfaultfd=282, keyctl=219, add_key=217, request_key=218, perf_event_open=241,
                     kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106,
                     open_by_handle_at=265, name_to_handle_at=264, syslog=116, acct=89, quotactl=60,
                     reboot=142, swapon=224, swapoff=225, settimeofday=170, clock_settime=112, adjtimex=171,
                     personality=92, socket=198, shmget=194, shmat=196, shmctl=195, msgget=186, msgsnd=189,
                     msgrcv=188, msgctl=187, semget=190, semop=193, semtimedop=192, semctl=191, mq_open=180,
                     mq_unlink=181, socketpair=199, connect=203, bind=200, listen=201, accept=202,
                     accept4=242, sendto=206, sendmsg=211, sendmmsg=269, memfd_create=279, memfd_secret=447,
                     fcntl=25, clone=220, clone3=435, prctl=167),
}
_MACHINE_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# (CLONE_NEWTIME is unshare/clone3 only: for clone its bit is part of the exit signal; unshare is denied.)
_CLONE_NS_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
F_SETPIPE_SZ = 1031  # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 7)
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
    # fcntl: everything but growing a pipe's buffer.
    body += [(_JEQ, 0, 3, nr["fcntl"]), (_LD_ABS, 0, 0, 24), (_JEQ, "eperm", 0, F_SETPIPE_SZ), (_RET, 0, 0, _ALLOW)]
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
    call(libc.prctl, PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.byref(fprog), ctypes.c_ulong(0),
          ctypes.c_ulong(0), what="prctl(seccomp filter)")  # SECCOMP_MODE_FILTER; needs no_new_privs


