"""The weak sandbox (``weak_sandbox: true``), the python tool's engine before bubblewrap: ``unshare`` user,
network, IPC and pid namespaces where they work (and a size-limited tmpfs working directory in a mount
namespace), resource limits per process, the process-group kill and the Python guard. Not a boundary
against code that tries to get out (docs/sandbox.md); kept for machines without bubblewrap, where a
config accepts it explicitly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from mmgrpo.toolbox.sandbox_child import BOOTSTRAP, EXIT_MEMORY, EXIT_SETUP
from mmgrpo.toolbox.supervise import SandboxResult, finished, remove_tree, signal_reason, supervise

_UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--ipc", "--pid", "--fork", "--kill-child")
# in a mount namespace too: a size-limited tmpfs on the working directory, then the bootstrap
_TMPFS = (
    "--mount",
    "--",
    "/bin/sh",
    "-c",
    'mount -t tmpfs -o "size=${1}m,mode=700" mmgrpo-sandbox "$2" && cd "$2" || exit 97; shift 2; exec "$@"',
    "sh",
)
ISOLATION_LEVELS = ("tmpfs", "namespaces", "none")
_isolation: str | None = None
_isolation_lock = threading.Lock()


def isolation_level() -> str:
    """The OS-level isolation this machine allows (checked once per process): ``"tmpfs"`` when
    ``unshare --user --map-root-user --net --ipc --pid --fork --mount`` and a tmpfs mount work, ``"namespaces"``
    when only the namespaces do, ``"none"`` when ``unshare`` is missing or refused (e.g. user namespaces turned
    off, or a container's seccomp profile)."""
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            _isolation = "none"
            if shutil.which("unshare") is not None and os.path.exists("/bin/sh"):
                with tempfile.TemporaryDirectory(prefix="mmgrpo-sandbox-probe-") as probe:
                    for level, command in (
                        ("tmpfs", [*_UNSHARE, *_TMPFS, "1", probe, "true"]),
                        ("namespaces", [*_UNSHARE, "true"]),
                    ):
                        if _succeeds(command):
                            _isolation = level
                            break
            if _isolation == "none":
                warnings.warn(
                    "mmgrpo.toolbox.sandbox: `unshare --user --net --pid` does not work here, so the python tool "
                    "runs without namespaces: only the Python-level guard keeps its code off the network "
                    "(see docs/sandbox.md)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _isolation


def namespaces_available() -> bool:
    """Whether runs get their own user, network, IPC and pid namespaces (:func:`isolation_level` is not none)."""
    return isolation_level() != "none"


def _succeeds(command: list[str]) -> bool:
    try:
        done = subprocess.run(command, capture_output=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def run_weak(
    code: str,
    *,
    cpu_seconds: float,
    wall_seconds: float,
    memory_mb: int,
    file_size_mb: int,
    disk_mb: int,
    max_processes: int,
    max_open_files: int,
    max_output_chars: int,
    namespaces: bool | None,
    audit_guard: bool,
) -> SandboxResult:
    """One run of the weak sandbox (see the module's docstring); ``namespaces`` None uses them when
    available, True requires them (RuntimeError otherwise), False never."""
    level = isolation_level() if namespaces is not False else "none"
    if namespaces and level == "none":
        raise RuntimeError("namespaces=True, but `unshare --user --net --pid` does not work on this machine")
    use_ns = level != "none"

    start = time.monotonic()
    cpu = max(1, round(cpu_seconds))  # RLIMIT_CPU counts whole seconds
    base = os.path.realpath(tempfile.mkdtemp(prefix="mmgrpo-sandbox-"))
    workdir, source = os.path.join(base, "work"), os.path.join(base, "main.py")
    # in a pid namespace the bootstrap stays as the namespace's init and reports the code's wait status here
    status_r, status_w = os.pipe() if use_ns else (-1, -1)
    try:
        os.mkdir(workdir, 0o700)
        with open(source, "w", encoding="utf-8") as f:
            f.write(code)
        argv = [
            sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP, workdir, source,
            str(cpu), str(int(memory_mb) << 20), str(int(file_size_mb) << 20),
            str(int(max_processes) if use_ns else -1), str(int(max_open_files)), str(int(audit_guard)),
            str(status_w), "",
        ]  # fmt: skip
        if level == "tmpfs":
            argv = [*_UNSHARE, *_TMPFS, str(int(disk_mb)), workdir, *argv]
        elif level == "namespaces":
            argv = [*_UNSHARE, "--", *argv]
        try:
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, killed as a whole
                pass_fds=(status_w,) if use_ns else (),
            )
        except OSError as e:
            seconds = time.monotonic() - start
            return SandboxResult("", f"could not start the sandbox: {e}", None, "not started", seconds)
        finally:
            if use_ns:
                os.close(status_w)
        out, err, returncode, cpu_used, reason = supervise(proc, start + wall_seconds, int(max_output_chars))
        reported = _reported_status(status_r) if use_ns else None
    finally:
        if use_ns:
            os.close(status_r)
        remove_tree(base)

    if reported is not None:  # the code's own status (unshare only reports its init's)
        returncode = reported
    elif use_ns and reason is None and returncode == EXIT_SETUP:
        reason = "sandbox setup failed"
    if reason is None and returncode not in (0, None):
        reason = "memory limit" if returncode == EXIT_MEMORY else signal_reason(returncode, cpu_used, cpu)
    return finished(out, err, returncode, reason, start, cpu_used, level)


def _reported_status(status_r: int) -> int | None:
    """The code's exit status as its pid namespace's init reported it; None when it reported none (init
    itself was killed: the wall-clock or output limit, or the setup failed)."""
    os.set_blocking(status_r, False)
    try:
        reported = os.read(status_r, 64).strip()
    except BlockingIOError:
        return None
    return os.waitstatus_to_exitcode(int(reported)) if reported else None
