"""The sandbox's child side, standard library only (it runs before any isolation exists and never
imports megadiv): ``megadiv/rewards/sandbox_child.py`` puts this directory on ``sys.path`` and runs
``jail.runner.main``. One concept per module:

- ``libc``: the few libc calls (prctl, mount, unshare) and the parent-death signal;
- ``runner``: the process tree (runner, namespace init, user process), reaping, the control pipe;
- ``namespace``: the read-only root of ``namespaces`` mode, with the megadiv package masked;
- ``confine``: rlimits, the fresh uid, no_new_privs, Landlock and seccomp, applied to the user process;
- ``seccomp``: the BPF filter; ``landlock``: unsafe mode's filesystem, network and /proc policy;
- ``audit``: the CPython audit hook (ctypes, sockets, writes outside, directories as descriptors);
- ``harness``: runs the program and reports the values of the calls into it as plain data.
"""
