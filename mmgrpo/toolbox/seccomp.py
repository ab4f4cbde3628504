"""Seccomp filters for the python tool's sandbox, compiled by libseccomp (the library bubblewrap, Docker,
Flatpak and systemd use to write theirs), through ctypes: no compiler and no Python package needed, only
``libseccomp.so.2`` (Debian and Ubuntu install it with apt itself).

Two filters, both "allow everything except", each denied call failing with ``EPERM`` (``ENOSYS`` for
``clone3``, so that the C library falls back to ``clone``, whose flags a filter can read):

- ``outer_filter()``: loaded by bubblewrap (``--seccomp FD``) just before it starts the interpreter. It
  denies what model-written code never needs and what an escape would: debugging or reading other
  processes (``ptrace``, ``process_vm_*``, ``pidfd_*``, ``kcmp``), namespaces and mounts (``unshare``,
  ``setns``, ``mount`` and the new mount API, ``pivot_root``, ``chroot``, ``clone`` with namespace flags),
  kernel surfaces with a history of bugs (``bpf``, ``userfaultfd``, ``io_uring_*``, ``perf_event_open``,
  ``keyctl``, ``add_key``, ``request_key``), handles to files by inode (``open_by_handle_at``), and the
  machine's settings (modules, ``kexec``, ``reboot``, swap, clock, host name, ``acct``, ``quotactl``).
  It also refuses ``memfd_create`` and ``modify_ldt`` (nothing the tool runs uses them), System V IPC
  (``shm*``, ``msg*``, ``sem*``: unsized in a new ipc namespace, and ``shmat(SHM_EXEC)`` an executable
  page, new native code), and ``socket``/``socketpair`` of any
  family but ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` (``EAFNOSUPPORT``): the network namespace is empty,
  but ``AF_VSOCK`` is not namespaced (the way to the host and the hypervisor) and ``AF_NETLINK``,
  ``AF_PACKET`` and the rest are kernel surfaces the code never needs.
  System calls of another architecture (32-bit ``int 0x80`` on x86-64) kill the process.
- ``inner_filter()``: loaded by the sandbox's bootstrap on itself once the interpreter is up (its
  extension modules loaded), before the code runs: no ``execve``/``execveat`` (no other program can be
  started) and no ``mmap``/``mprotect``/``pkey_mprotect`` asking for ``PROT_EXEC`` (no new native code
  can be mapped: not a shared object written into the working directory, not one from the standard
  library tree). This is what a ``noexec`` working directory would give, and more: bubblewrap 0.8 cannot
  mount its tmpfs ``noexec``. No ``prctl(PR_SET_DUMPABLE)``: the bootstrap made itself non-dumpable just
  before (its ``/proc/<pid>/mem`` cannot be opened for writing), and the code cannot undo it.

Filters are compiled once per process and passed as bytes (classic BPF, ``struct sock_filter`` records).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

OUTER_DENY = (
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    "kcmp",
    # namespaces, mounts, the root
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr",
    # kernel surfaces
    "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open",
    "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "uselib", "personality",
    # the machine
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "iopl", "ioperm", "vhangup",
    # new native code, old kernel surfaces
    "memfd_create", "modify_ldt",
    # System V IPC: a new ipc namespace has no size limit (kernel.shmall), its objects outlive the process
    # that made them and without a cgroup nothing counts them; nothing in the standard library uses them
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
    "semtimedop", "semctl",
    # the rest of what Docker's default profile refuses a container without capabilities (docs/sandbox.md):
    # memory placement, another process's memory advice, and calls that old kernels had and new ones lack
    "get_mempolicy", "set_mempolicy", "set_mempolicy_home_node", "mbind", "migrate_pages", "move_pages",
    "process_madvise", "fanotify_init", "quotactl_fd", "sysfs", "ustat", "_sysctl", "create_module",
    "get_kernel_syms", "query_module", "nfsservctl", "getpmsg", "putpmsg", "afs_syscall", "tuxcall",
    "security", "vserver",
)  # fmt: skip
"""System calls the outer filter refuses (names unknown on this architecture are skipped)."""
NAMESPACE_FLAGS = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00020000
"""CLONE_NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWNS: a ``clone`` asking for any is refused."""
INNER_DENY = ("execve", "execveat")
PROT_EXEC = 0x4
PR_SET_DUMPABLE = 4
SOCKET_FAMILIES = (1, 2, 10)
"""AF_UNIX, AF_INET, AF_INET6: the only ``socket``/``socketpair`` domains the outer filter allows."""

_ALLOW = 0x7FFF0000
_ATTR_OPTIMIZE = 8  # SCMP_FLTATR_CTL_OPTIMIZE
_CMP_EQ = 4
_CMP_GE = 5
_CMP_MASKED_EQ = 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class SeccompUnavailable(RuntimeError):
    """libseccomp is not installed (or not usable) on this machine."""


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(
            f"libseccomp is not installed ({e}): apt-get install libseccomp2 (dnf install libseccomp)"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    return lib


def _compile(rules: list[tuple[str, int, list[tuple]]]) -> bytes:
    """BPF bytes of a default-allow filter with ``rules``: (system call, action, [(arg index, mask)...]),
    a rule matching when every listed argument has a bit of its mask set (``arg & mask == mask`` for a
    one-bit mask; multi-bit masks are split into one rule per bit). An entry (arg index, "==" or ">=",
    value) instead matches when the argument compares so with the value (one rule of its own)."""
    lib = _lib()
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        # a binary tree of system call numbers instead of a list (libseccomp >= 2.5; older ones keep the list)
        lib.seccomp_attr_set(ctx, _ATTR_OPTIMIZE, 2)
        for name, action, args in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a system call on this architecture
            if not args:
                _add(lib, ctx, action, nr, [])
                continue
            for index, mask, *value in args:
                if value:
                    op = _CMP_EQ if mask == "==" else _CMP_GE
                    _add(lib, ctx, action, nr, [_ArgCmp(index, op, value[0], 0)])
                    continue
                for bit in range(64):
                    if mask >> bit & 1:
                        _add(lib, ctx, action, nr, [_ArgCmp(index, _CMP_MASKED_EQ, 1 << bit, 1 << bit)])
        fd = os.memfd_create("mmgrpo-seccomp", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def _add(lib: ctypes.CDLL, ctx: int, action: int, nr: int, cmps: list[_ArgCmp]) -> None:
    array = (_ArgCmp * max(len(cmps), 1))(*cmps)
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
    if rc != 0:
        raise SeccompUnavailable(f"seccomp_rule_add failed for system call {nr}: {os.strerror(-rc)}")


@functools.lru_cache(maxsize=1)
def outer_filter() -> bytes:
    """The filter bubblewrap loads before starting the interpreter (see the module's docstring)."""
    eperm = _errno_action(errno.EPERM)
    rules = [(name, eperm, []) for name in OUTER_DENY]
    rules.append(("clone3", _errno_action(errno.ENOSYS), []))
    rules.append(("clone", eperm, [(0, NAMESPACE_FLAGS)]))
    # every domain but 1, 2 and 10, as a 64-bit register: 0, 3..9, and >= 11 (upper bits set included)
    others = [(0, "==", n) for n in range(SOCKET_FAMILIES[-1]) if n not in SOCKET_FAMILIES]
    others.append((0, ">=", SOCKET_FAMILIES[-1] + 1))
    rules += [(name, _errno_action(errno.EAFNOSUPPORT), others) for name in ("socket", "socketpair")]
    return _compile(rules)


@functools.lru_cache(maxsize=1)
def inner_filter() -> bytes:
    """The filter the bootstrap loads on itself before the code runs (see the module's docstring)."""
    eperm = _errno_action(errno.EPERM)
    rules = [(name, eperm, []) for name in INNER_DENY]
    rules += [(name, eperm, [(2, PROT_EXEC)]) for name in ("mmap", "mprotect", "pkey_mprotect")]
    rules.append(("prctl", eperm, [(0, "==", PR_SET_DUMPABLE)]))  # the bootstrap made itself non-dumpable
    return _compile(rules)


def problem() -> str | None:
    """Why the filters cannot be built here, or None."""
    try:
        outer_filter()
        inner_filter()
    except SeccompUnavailable as e:
        return str(e)
    return None
