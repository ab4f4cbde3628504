"""The python tool's boundary: bubblewrap (``bwrap``, the sandbox Flatpak uses), set up so that model-written
code gets nothing it could use to get out.

``boundary()`` probes once per process what this machine offers and returns a :class:`Boundary`, or the one
line saying what is missing (``problem()``): ``bwrap`` not installed, user namespaces refused, libseccomp
missing, no interpreter the sandbox user may read. ``Boundary.command(...)`` is the command line of one run:

- **user**: bwrap's new user namespace maps the sandbox's uid 65534 to an unprivileged uid outside: the
  trainer's own uid, or, when the trainer runs as root, uid 65534 (``setpriv`` drops to it, all
  capabilities and groups cleared, before bwrap starts). Nothing inside is root, and no file is writable
  by owner override: the code has no capabilities. Further user namespaces are disabled.
- **namespaces**: new pid, ipc, uts, cgroup and network namespaces (no interface but a loopback that is
  down: no connection to anything, the host's 127.0.0.1 and abstract Unix sockets included); a new mount
  namespace whose root is an empty tmpfs holding only:
- **files**: ``/usr`` read-only (the system's shared libraries; nothing there can be executed, see the inner
  seccomp filter), the interpreter's prefix read-only when it lives elsewhere, with every ``site-packages``
  and ``dist-packages`` folder covered by an empty tmpfs (only the standard library can be imported);
  a minimal ``/dev`` (:data:`DEVICES` and a private ``/dev/shm``, a tmpfs of :func:`shm_bytes`; no ``pts``,
  no ``tty``) and no ``/proc`` at all (its files told the host's block devices, bind sources and kernel
  version, and ``/proc/<pid>/mem`` writes another process's memory); the working directory ``/sandbox``, a
  tmpfs of the rest of ``disk_mb``, writable, which disappears with the namespace (nothing is written on the
  host's disk, so there is nothing to clean up). These two are the only writable mounts, sized with or
  without a cgroup: the root's tmpfs, ``/dev`` and the hiding tmpfs are remounted read-only. No ``/etc``,
  ``/home``, ``/root``, ``/tmp`` or project folder exists inside.
- **life**: ``--die-with-parent`` (SIGKILL when bwrap or the trainer dies), a new session (no terminal),
  and ``--as-pid-1``: the namespace's pid 1 is the sandbox's own bootstrap (not bwrap's init, which would be
  dumpable and unfiltered), which takes every process of the namespace with it when the code's process ends.
- **system calls**: the outer seccomp filter of :mod:`mmgrpo.toolbox.seccomp` (no ptrace, pidfd, mount,
  namespaces, bpf, keyctl, io_uring, ...).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field

from mmgrpo.toolbox import seccomp

SANDBOX_UID = 65534
"""The uid inside the sandbox, and outside it when the trainer runs as root (``nobody`` on most systems)."""
WORKDIR = "/sandbox"
DEVICES = ("null", "zero", "full", "random", "urandom")
"""The only device files inside (bound from the host's /dev)."""
INSTALL_HINT = "apt-get install bubblewrap (dnf install bubblewrap; pacman -S bubblewrap)"


@dataclass(frozen=True)
class Interpreter:
    """The Python the sandbox runs and the folders it needs (read on the host, once)."""

    executable: str
    prefixes: tuple[str, ...]
    package_dirs: tuple[str, ...]  # site-packages / dist-packages folders to hide


@dataclass(frozen=True)
class Boundary:
    bwrap: str
    setpriv: str | None  # set when the trainer is root: the sandbox runs as SANDBOX_UID outside too
    interpreter: Interpreter
    links: tuple[tuple[str, str], ...] = field(default=())  # (target, path) symlinks such as /lib -> usr/lib

    def command(self, *, code_fd: int, seccomp_fd: int, disk_bytes: int, args: list[str]) -> list[str]:
        """The command line of one run: bwrap (behind setpriv as root) around ``interpreter args``; the
        program is copied from ``code_fd`` to /sandbox/main.py and the outer filter read from ``seccomp_fd``."""
        argv = [
            self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for target, path in self.links:
            argv += ["--symlink", target, path]
        for prefix in self.interpreter.prefixes:
            if not prefix.startswith("/usr/"):
                argv += ["--ro-bind", prefix, prefix]
        for folder in self.interpreter.package_dirs:
            argv += ["--perms", "0555", "--tmpfs", folder]
        shm = shm_bytes(disk_bytes)
        # no /proc (nothing the code needs; it showed the host's devices, bind sources, kernel and every
        # process's memory file) and a /dev of five devices: no devpts (ptys are a host-wide count), no tty
        argv += ["--perms", "0755", "--tmpfs", "/dev"]
        for name in DEVICES:
            argv += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
        argv += [
            "--size", str(shm), "--perms", "1777", "--tmpfs", "/dev/shm",
            "--size", str(disk_bytes - shm), "--perms", "0700", "--tmpfs", WORKDIR, "--chdir", WORKDIR,
            "--file", str(code_fd), f"{WORKDIR}/main.py",
        ]  # fmt: skip
        # every other writable mount read-only, last (bwrap runs these in order): the root's and /dev's
        # tmpfs have no size, and the hiding tmpfs' owner (the sandbox's uid) could chmod them writable
        for folder in ("/", "/dev", *self.interpreter.package_dirs):
            argv += ["--remount-ro", folder]
        argv += [
            "--seccomp", str(seccomp_fd),
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
            "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8",
            "--", self.interpreter.executable, *args,
        ]  # fmt: skip
        if self.setpriv is not None:
            uid = str(SANDBOX_UID)
            argv = [
                self.setpriv,
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--",
                *argv,
            ]
        return argv


def shm_bytes(disk_bytes: int) -> int:
    """The size of the sandbox's ``/dev/shm``: an eighth of the disk budget, at most 16 MiB, whole pages; the
    working directory gets the rest, so that everything the code can write is ``disk_bytes`` together."""
    return max(4096, min(disk_bytes // 8, 16 << 20) // 4096 * 4096)


class Unavailable(RuntimeError):
    """The boundary cannot be set up on this machine; the message is one line saying what to install or change."""


@functools.lru_cache(maxsize=1)
def boundary() -> Boundary:
    """What this machine offers (probed once per process); :class:`Unavailable` with the reason otherwise."""
    found = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin:" + os.environ.get("PATH", ""))
    if found is None:
        raise Unavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
    problem = seccomp.problem()
    if problem is not None:
        raise Unavailable(problem)
    setpriv = None
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if setpriv is None:
            raise Unavailable("setpriv (util-linux) is missing: apt-get install util-linux")
    interpreter = _interpreter(as_other_user=setpriv is not None)
    links = tuple(
        (os.readlink(p).lstrip("/"), p) for p in ("/bin", "/lib", "/lib64", "/sbin") if os.path.islink(p)
    )
    made = Boundary(found, setpriv, interpreter, links)
    _probe(made)
    return made


def problem() -> str | None:
    """Why the boundary cannot be set up here (one line), or None."""
    try:
        boundary()
    except Unavailable as e:
        return str(e)
    return None


def _interpreter(*, as_other_user: bool) -> Interpreter:
    """The trainer's own interpreter when the sandbox user can read it; else the system's python3."""
    candidates = [os.path.realpath(sys.executable)]
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is not None:
        candidates.append(os.path.realpath(system))
    for exe in candidates:
        if as_other_user and not _world_readable(exe):
            continue
        info = _describe(exe)
        if info is None:
            continue
        prefixes = tuple(sorted({os.path.realpath(p) for p in info["prefixes"]}))
        if as_other_user and not all(_world_readable(p) for p in prefixes):
            continue
        hide = {os.path.realpath(p) for p in info["packages"]}
        hide |= {
            os.path.join(d, f)
            for d in ("/usr/lib/python3", "/usr/local/lib/python3")
            for f in ("dist-packages",)
        }
        for folder in ("/usr/lib", "/usr/local/lib", *(os.path.join(p, "lib") for p in prefixes)):
            if os.path.isdir(folder):
                for name in os.listdir(folder):
                    if name.startswith("python3"):
                        hide |= {
                            os.path.join(folder, name, sub) for sub in ("site-packages", "dist-packages")
                        }
        visible = ("/usr/", *(p.rstrip("/") + "/" for p in prefixes))
        dirs = sorted(d for d in hide if os.path.isdir(d) and d.startswith(visible))
        return Interpreter(exe, prefixes, tuple(dirs))
    who = f"uid {SANDBOX_UID}" if as_other_user else "this user"
    raise Unavailable(
        f"no Python interpreter that {who} can read for the sandbox: {candidates[0]} sits in a folder closed "
        "to other users (the trainer runs as root); install the system's python3 (apt-get install "
        "python3-minimal), or make the interpreter's folders readable by others"
    )


def _world_readable(path: str) -> bool:
    """Whether another user can reach ``path`` (every parent folder searchable by others, the file readable)."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(2, len(parts)):
        folder = "/".join(parts[:i])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _describe(executable: str) -> dict | None:
    code = (
        "import json, sys, sysconfig\n"
        "p = sysconfig.get_paths()\n"
        "print(json.dumps({'prefixes': [sys.base_prefix, sys.base_exec_prefix],"
        " 'packages': [p['purelib'], p['platlib']]}))"
    )
    try:
        done = subprocess.run(
            [executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30
        )
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _probe(made: Boundary) -> None:
    """Start one sandbox that prints its uid: Unavailable with the reason when bwrap cannot."""
    code_fd = memfd(b"")
    filter_fd = memfd(seccomp.outer_filter())
    try:
        argv = made.command(
            code_fd=code_fd,
            seccomp_fd=filter_fd,
            disk_bytes=1 << 20,
            args=["-I", "-S", "-c", "import os; print(os.getuid())"],
        )
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=(code_fd, filter_fd))
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"bubblewrap could not start: {e}") from None
    finally:
        os.close(code_fd)
        os.close(filter_fd)
    if done.returncode != 0 or done.stdout.strip() != str(SANDBOX_UID):
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        hint = ""
        if "namespace" in why.lower() or "permission" in why.lower():
            hint = (
                " (unprivileged user namespaces are refused here: sysctl kernel.unprivileged_userns_clone=1 and "
                "user.max_user_namespaces > 0; on Ubuntu 24.04 kernel.apparmor_restrict_unprivileged_userns=0 or an "
                "AppArmor profile for bwrap; in Docker, --security-opt seccomp=unconfined or a profile allowing clone "
                "with CLONE_NEWUSER)"
            )
        raise Unavailable(f"bubblewrap cannot create the sandbox: {why}{hint}")


def memfd(data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start (inheritable: for pass_fds)."""
    fd = os.memfd_create("mmgrpo-sandbox", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
