"""The ``python`` tool: run model-written Python in a separate, limited process and report what it printed.

This module is the parent side: ``run_python(code)`` is the engine (it starts the child, supervises it,
collects what it printed and cleans up) and ``make_python_tool(**limits)`` wraps it as a tool. What runs
inside the child (its limits, the guard, running the code) is :mod:`mmgrpo.toolbox.sandbox_child`. What is
and is not guaranteed is written down in ``docs/sandbox.md``; in short, the code runs

- in its own process (``python -I -S -B -u``: isolated mode, no site-packages, no bytecode written), with an
  almost empty environment, in a fresh temporary working directory that is deleted afterwards;
- where the system allows it, in new user, network, IPC and pid namespaces (``unshare --user
  --map-root-user --net --ipc --pid --fork``): the only network interface is a loopback that is down, so no
  connection can be made, and when the run ends every process it started ends with it; and, where a mount
  namespace works too, with a size-limited tmpfs as its working directory (``isolation_level()``);
- under resource limits the child sets on itself before the code runs (``RLIMIT_CPU``, ``RLIMIT_AS``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0 and, in a user namespace, ``RLIMIT_NPROC``);
- under a wall-clock deadline: at the deadline, and after every run, its whole process group is killed;
- behind a Python audit hook (``sys.addaudithook``) installed before the code runs, which refuses sockets,
  new processes, ``ctypes`` and file access outside the working directory with a ``PermissionError``: a
  guard against ordinary code, not a security boundary against code written to get around it.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox import bwrap, cgroups, seccomp
from mmgrpo.toolbox.sandbox_child import BOOTSTRAP, EXIT_MEMORY, EXIT_SETUP

__all__ = [
    "LIMIT_NAMES",
    "SandboxResult",
    "format_result",
    "isolation_level",
    "make_python_tool",
    "namespaces_available",
    "run_python",
]

MAX_CODE_CHARS = 50_000
"""Longest program accepted (longer code raises ValueError)."""
KILL_OUTPUT_BYTES = 1_000_000
"""A program that prints more than this (stdout and stderr together) is stopped: ``killed_reason='output limit'``."""

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
STARTUP_S = 0.5
"""Added to a bubblewrap run's deadline for the sandbox's own start-up (about 0.15-0.3 s measured here)."""
_isolation: str | None = None
_isolation_lock = threading.Lock()


@dataclass
class SandboxResult:
    """What one run produced. ``stdout`` keeps the first ``max_output_chars`` characters, ``stderr`` the last
    ones (where the traceback is); ``*_cut`` count the characters left out."""

    stdout: str
    stderr: str
    returncode: int | None
    """The exit status; negative for a signal (``-9``: SIGKILL); None if it could not be started."""
    killed_reason: str | None
    """Why the run was stopped: ``"CPU time limit"``, ``"wall time limit"``, ``"memory limit"``,
    ``"output limit"`` or ``"signal SIGSEGV"`` and the like; None when the code ended by itself."""
    seconds: float
    """Wall-clock seconds from start to the end of the cleanup."""
    cpu_seconds: float = 0.0
    isolation: str = "none"
    """``"tmpfs"``: namespaces and a size-limited tmpfs working directory; ``"namespaces"``: user, network,
    IPC and pid namespaces; ``"none"``: neither (see :func:`isolation_level`)."""
    stdout_cut: int = 0
    stderr_cut: int = 0


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


def run_python(
    code: str,
    *,
    cpu_seconds: float = 2,
    wall_seconds: float = 5,
    memory_mb: int = 256,
    file_size_mb: int = 1,
    disk_mb: int = 64,
    max_processes: int = 32,
    max_open_files: int = 64,
    max_output_chars: int = 2000,
    weak_sandbox: bool = False,
    namespaces: bool | None = None,
    audit_guard: bool = True,
) -> SandboxResult:
    """Run ``code`` with ``python3 -I -S`` inside bubblewrap (:mod:`mmgrpo.toolbox.bwrap`), within the limits;
    never raises for anything the code does (only for bad arguments). Where the boundary cannot be set up the
    run does not start (``killed_reason="not started"``, stderr says why).

    ``weak_sandbox=True`` runs without bubblewrap instead: ``unshare`` namespaces where they work
    (``namespaces`` None: when available, True: required, False: never) and the Python guard; not a
    boundary against code written to get out (docs/sandbox.md). ``audit_guard=False`` leaves out the
    Python-level guard: what code that switched it off would have (the red-team tests run that way).
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"the program is too long ({len(code)} characters, at most {MAX_CODE_CHARS})")
    _check_limits(
        cpu_seconds=cpu_seconds,
        wall_seconds=wall_seconds,
        memory_mb=memory_mb,
        file_size_mb=file_size_mb,
        disk_mb=disk_mb,
        max_processes=max_processes,
        max_open_files=max_open_files,
        max_output_chars=max_output_chars,
    )
    if not weak_sandbox:
        return _run_bwrap(
            code,
            cpu_seconds=cpu_seconds,
            wall_seconds=wall_seconds,
            memory_mb=memory_mb,
            file_size_mb=file_size_mb,
            disk_mb=disk_mb,
            max_processes=max_processes,
            max_open_files=max_open_files,
            max_output_chars=max_output_chars,
            audit_guard=audit_guard,
        )
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
            str(status_w), "0",
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
        out, err, returncode, cpu_used, reason = _supervise(proc, start + wall_seconds, int(max_output_chars))
        reported = _reported_status(status_r) if use_ns else None
    finally:
        if use_ns:
            os.close(status_r)
        _remove_tree(base)

    if reported is not None:  # the code's own status (unshare only reports its init's)
        returncode = reported
    elif use_ns and reason is None and returncode == EXIT_SETUP:
        reason = "sandbox setup failed"
    if reason is None and returncode not in (0, None):
        if returncode == EXIT_MEMORY:
            reason = "memory limit"
        elif returncode < 0:
            sig = -returncode
            if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_used >= cpu - 0.1:
                reason = "CPU time limit"
            else:
                reason = f"signal {_signal_name(sig)}"
    (stdout, stdout_cut), (stderr, stderr_cut) = out, err
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=returncode,
        killed_reason=reason,
        seconds=time.monotonic() - start,
        cpu_seconds=cpu_used,
        isolation=level,
        stdout_cut=stdout_cut,
        stderr_cut=stderr_cut,
    )


def _run_bwrap(
    code: str,
    *,
    cpu_seconds,
    wall_seconds,
    memory_mb,
    file_size_mb,
    disk_mb,
    max_processes,
    max_open_files,
    max_output_chars,
    audit_guard,
) -> SandboxResult:
    """One run inside bubblewrap, in a cgroup of its own where the machine allows one."""
    start = time.monotonic()
    try:
        boundary = bwrap.boundary()
        outer, inner = seccomp.outer_filter(), seccomp.inner_filter()
    except (bwrap.Unavailable, seccomp.SeccompUnavailable) as e:
        return SandboxResult("", f"the sandbox could not be set up: {e}", None, "not started", 0.0)
    cpu = max(1, round(cpu_seconds))  # RLIMIT_CPU counts whole seconds
    memory, disk = int(memory_mb) << 20, int(disk_mb) << 20
    # the tmpfs's pages are charged to the group that writes them: room for both; +3 for bwrap's processes
    group = cgroups.create(memory + disk, int(max_processes) + 3)
    nproc = -1 if group is not None else int(max_processes)
    args = [
        "-I", "-S", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP, bwrap.WORKDIR, f"{bwrap.WORKDIR}/main.py",
        str(cpu), str(memory), str(int(file_size_mb) << 20), str(nproc), str(int(max_open_files)),
        str(int(audit_guard)), "-1", "1", inner.hex(),
    ]  # fmt: skip
    code_fd, filter_fd = bwrap.memfd(code.encode("utf-8", errors="surrogatepass")), bwrap.memfd(outer)
    argv = boundary.command(code_fd=code_fd, seccomp_fd=filter_fd, disk_bytes=disk, args=args)
    if group is not None:  # the first process joins the group, then becomes setpriv / bwrap
        argv = ["/bin/sh", "-c", group.join_script() + 'exec "$@"', "sh", *argv]
    oom = False
    try:
        try:
            proc = subprocess.Popen(
                argv,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(code_fd, filter_fd),
            )
        except OSError as e:
            return SandboxResult(
                "", f"could not start the sandbox: {e}", None, "not started", time.monotonic() - start
            )
        finally:
            os.close(code_fd)
            os.close(filter_fd)
        deadline = (
            start + STARTUP_S + wall_seconds
        )  # wall_seconds is the program's, not the sandbox's start-up
        out, err, returncode, cpu_used, reason = _supervise(proc, deadline, int(max_output_chars))
    finally:
        if group is not None:
            oom = group.oom_killed()
            cpu_used = group.cpu_seconds() or cpu_used  # every process of the run (rusage sees bwrap's only)
            group.close()
    if returncode is not None and 128 < returncode < 128 + 65:  # bwrap reports a signal as 128 + its number
        returncode = -(returncode - 128)
    if reason is None and (
        returncode in (EXIT_SETUP, 96) or (returncode == 1 and err[0].startswith("bwrap:"))
    ):
        reason = "sandbox setup failed"
    if reason is None and (oom or returncode == EXIT_MEMORY):
        reason = "memory limit"
    if reason is None and returncode is not None and returncode < 0:
        sig = -returncode
        if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_used >= cpu - 0.1:
            reason = "CPU time limit"
        else:
            reason = f"signal {_signal_name(sig)}"
    (stdout, stdout_cut), (stderr, stderr_cut) = out, err
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=returncode,
        killed_reason=reason,
        seconds=time.monotonic() - start,
        cpu_seconds=cpu_used,
        isolation="bwrap" + ("+cgroup" if group is not None else ""),
        stdout_cut=stdout_cut,
        stderr_cut=stderr_cut,
    )


def _reported_status(status_r: int) -> int | None:
    """The code's exit status as its pid namespace's init reported it; None when it reported none (init
    itself was killed: the wall-clock or output limit, or the setup failed)."""
    os.set_blocking(status_r, False)
    try:
        reported = os.read(status_r, 64).strip()
    except BlockingIOError:
        return None
    return os.waitstatus_to_exitcode(int(reported)) if reported else None


LIMIT_NAMES = (
    "cpu_seconds",
    "wall_seconds",
    "memory_mb",
    "file_size_mb",
    "disk_mb",
    "max_processes",
    "max_open_files",
    "max_output_chars",
    "weak_sandbox",
    "namespaces",
    "audit_guard",
)
"""The keyword arguments of :func:`run_python` that ``make_python_tool`` accepts."""


def _check_limits(**numbers: object) -> None:
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key} must be a positive number, got {value!r}")


def make_python_tool(*, name: str = "python", **limits) -> Callable[[str], str]:
    """The ``python(code)`` tool: runs ``code`` with :func:`run_python` under ``limits`` (its keyword
    arguments) and returns what it printed, plus a line saying why it was stopped when it was.

    The function carries ``timeout_s`` (``wall_seconds`` + 5): give the tool runner at least that much, so
    the sandbox's own, clearer message arrives before the runner's timeout.
    """
    bad = sorted(set(limits) - set(LIMIT_NAMES))
    if bad:
        raise ConfigError(
            f"python tool: unknown setting {bad[0]!r}.{did_you_mean(bad[0], LIMIT_NAMES)} "
            f"Known settings: {', '.join(LIMIT_NAMES)}"
        )
    try:
        _check_limits(
            **{k: v for k, v in limits.items() if k not in ("weak_sandbox", "namespaces", "audit_guard")}
        )
    except ValueError as e:
        raise ConfigError(f"python tool: {e}") from None
    if not limits.get("weak_sandbox", False):
        problem = bwrap.problem()
        if problem is not None:
            raise ConfigError(
                f"python tool: its sandbox cannot be set up here: {problem}. Or accept running model-written "
                "code without it (not a security boundary) with the tool setting weak_sandbox: true"
            )
    else:
        _say_weak(name)
    max_chars = limits.get("max_output_chars", 2000)
    wall = limits.get("wall_seconds", 5)

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Only the standard library is available; there is no network and no access to files outside the
        program's own (empty) working directory. Use print() to show results.

        Args:
            code: The complete Python program to run, e.g. "print(sum(range(10)))".
        """
        return format_result(run_python(code, **limits), max_chars)

    python.__name__ = python.__qualname__ = name
    python.timeout_s = wall + 5  # type: ignore[attr-defined]
    return python


_weak_said: set[str] = set()


def _say_weak(name: str) -> None:
    """The loud line of a run that accepted the weak sandbox (once per tool name and process)."""
    if name in _weak_said:
        return
    _weak_said.add(name)
    problem = bwrap.problem()
    line = (
        f"mmgrpo: WARNING: the {name!r} tool runs model-written code WITHOUT its OS sandbox (weak_sandbox: true"
        + (f"; {problem}" if problem else "")
        + "): only namespaces where unshare works and a Python guard that code can switch off stand between it "
        "and this machine. Install bubblewrap and drop weak_sandbox for training (docs/sandbox.md)."
    )
    print(line, file=sys.stderr, flush=True)
    warnings.warn(line, RuntimeWarning, stacklevel=3)


def format_result(result: SandboxResult, max_chars: int = 2000) -> str:
    """The text the model sees: stdout, then ``stderr:`` and stderr, then one line saying why the program was
    stopped, or its exit status when it failed; about ``max_chars`` characters at most."""
    notes = []
    if result.killed_reason is not None:
        notes.append(f"error: the program was stopped: {_explain(result)}")
    elif result.returncode not in (0, None):
        notes.append(f"(exit status {result.returncode})")
    # the end of stderr (where the error is) gets half the room when there is output too, all of it otherwise
    room = max(100, max_chars - sum(len(n) + 1 for n in notes) - 80)
    stdout, stdout_cut = result.stdout, result.stdout_cut
    stderr, stderr_cut = result.stderr, result.stderr_cut
    stderr_room = max(room // 2, room - len(stdout))
    if len(stderr) > stderr_room:
        stderr_cut += len(stderr) - stderr_room
        stderr = stderr[len(stderr) - stderr_room :]
    stdout_room = room - len(stderr)
    if len(stdout) > stdout_room:
        stdout_cut += len(stdout) - stdout_room
        stdout = stdout[:stdout_room]
    parts = []
    if stdout:
        parts.append(stdout.rstrip("\n"))
    if stdout_cut:
        parts.append(f"[... {stdout_cut} more characters of output not shown]")
    if stderr:
        head = f"[... {stderr_cut} characters cut]\n" if stderr_cut else ""
        parts.append("stderr:\n" + head + stderr.rstrip("\n"))
    if not parts and not notes:
        parts.append("(no output: use print() to show results)")
    return "\n".join(parts + notes)


def _explain(result: SandboxResult) -> str:
    reason = result.killed_reason
    if reason == "CPU time limit":
        return f"CPU time limit reached ({result.cpu_seconds:.1f} s of computing); make the program faster"
    if reason == "wall time limit":
        return f"time limit reached after {result.seconds:.1f} s (waiting or looping too long)"
    if reason == "memory limit":
        return "memory limit reached (MemoryError); use less memory"
    if reason == "output limit":
        return f"it printed more than {KILL_OUTPUT_BYTES} bytes; print less"
    if reason == "sandbox setup failed":
        return "the sandbox could not be set up (not the program's fault)"
    return f"{reason}"


# --------------------------------------------------------------------------------------------- supervision
def _supervise(
    proc: subprocess.Popen, deadline: float, max_chars: int
) -> tuple[tuple[str, int], tuple[str, int], int | None, float, str | None]:
    """Read both pipes until they close, the child exits or the deadline passes; kill the process group;
    reap the child. Returns ((stdout, cut), (stderr, cut), returncode, cpu seconds, reason or None)."""
    keep = max_chars * 4 + 16  # bytes: enough for max_chars characters of UTF-8
    heads = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    tails = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = {proc.stdout: 0, proc.stderr: 0}
    reason = None
    with selectors.DefaultSelector() as sel:
        for pipe in heads:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ)
        exited_at = None
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                reason = "wall time limit"
                break
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now  # stragglers may hold the pipes: read what is there, then stop
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                pipe = key.fileobj
                total[pipe] += len(chunk)
                if len(heads[pipe]) < keep:
                    heads[pipe] += chunk[: keep - len(heads[pipe])]
                tails[pipe] = (tails[pipe] + chunk)[-keep:]
            if sum(total.values()) > KILL_OUTPUT_BYTES:
                reason = "output limit"
                break
        # wait (until the deadline) for the child to exit, with the pipes closed or ignored
        while reason is None and not _has_exited(proc.pid):
            if time.monotonic() >= deadline:
                reason = "wall time limit"
                break
            time.sleep(0.01)
    _kill_group(proc.pid)  # the child is not reaped yet, so its process group id is still ours
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    cpu_used = usage.ru_utime + usage.ru_stime

    def text(pipe, from_end: bool) -> tuple[str, int]:
        data = tails[pipe] if from_end and total[pipe] > keep else heads[pipe]
        decoded = data.decode("utf-8", errors="replace")
        if total[pipe] <= keep and len(decoded) <= max_chars:
            return decoded, 0
        shown = decoded[-max_chars:] if from_end else decoded[:max_chars]
        # characters left out: exact when everything was kept, estimated from bytes otherwise
        cut = len(decoded) - len(shown) if total[pipe] <= keep else total[pipe] - len(shown.encode())
        return shown, max(cut, 0)

    return text(proc.stdout, False), text(proc.stderr, True), returncode, cpu_used, reason


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, and so its group id, stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    """Delete the working directory even where the code removed permissions from its folders."""
    try:
        os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                sub = os.path.join(root, d)
                if not os.path.islink(sub):
                    os.chmod(sub, 0o700)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
