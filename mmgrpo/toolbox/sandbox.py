"""The ``python`` tool: run model-written Python inside the operating system's sandbox and report what it
printed (the threat model and what holds where: ``docs/sandbox.md``).

``run_python(code)`` runs it inside bubblewrap (:mod:`mmgrpo.toolbox.bwrap`: an unprivileged uid, no
network, a read-only file system with only the interpreter and its standard library, a tmpfs working
directory, die-with-parent), with seccomp filters (:mod:`mmgrpo.toolbox.seccomp`), a cgroup for memory and
processes where the machine allows one (:mod:`mmgrpo.toolbox.cgroups`), resource limits and the Python
guard as a second line (:mod:`mmgrpo.toolbox.sandbox_child`, the bootstrap inside); it supervises the run
from outside (:mod:`mmgrpo.toolbox.supervise`). ``make_python_tool(**settings)`` wraps it as a tool and
refuses, with one line, where the boundary cannot be set up, unless ``weak_sandbox`` is accepted
(:mod:`mmgrpo.toolbox.sandbox_weak`, the older engine, said loudly).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox import bwrap, cgroups, seccomp
from mmgrpo.toolbox.sandbox_child import BOOTSTRAP, EXIT_MEMORY, EXIT_SETUP
from mmgrpo.toolbox.sandbox_weak import isolation_level, namespaces_available, run_weak
from mmgrpo.toolbox.supervise import KILL_OUTPUT_BYTES, SandboxResult, finished, signal_reason, supervise
from mmgrpo.tools.visible import visible

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

STARTUP_S = 0.5
"""Added to a bubblewrap run's deadline for the sandbox's own start-up (about 0.15-0.3 s measured here)."""


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
    limits = dict(
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
    _check_limits(**{k: v for k, v in limits.items() if k != "audit_guard"})
    if not weak_sandbox:
        return _run_bwrap(code, **limits)
    return run_weak(code, namespaces=namespaces, **limits)


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
        str(int(audit_guard)), "-2", ",".join(modules_to_preload(code)), inner.hex(),
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
        out, err, returncode, cpu_used, reason = supervise(proc, deadline, int(max_output_chars))
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
    if reason is None:
        reason = signal_reason(returncode, cpu_used, cpu)
    return finished(
        out, err, returncode, reason, start, cpu_used, "bwrap" + ("+cgroup" if group is not None else "")
    )


LAZY_EXTENSIONS = ("unicodedata",)
"""C extensions the standard library imports inside functions on common paths, preloaded for every run:
``unicodedata`` for the idna codec of every host name (``socket.create_connection``, ``urllib``). Where they
are built in (Debian's python3) this costs nothing; as shared objects (pyenv's, a non-root trainer's
interpreter) about 0.2 ms."""


def modules_to_preload(code: str) -> list[str]:
    """The modules a bubblewrap run imports before its inner filter (which allows no new native code): every
    module the code names in an ``import`` statement, so their C extensions are loaded by then (the code
    would import them anyway: this costs nothing extra), and :data:`LAZY_EXTENSIONS`. A C extension reached
    only by a computed name (``importlib.import_module(name)``) or lazily inside another standard-library
    function fails to load."""
    import ast

    names: set[str] = set(LAZY_EXTENSIONS)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return sorted(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    return sorted(n for n in names if n.replace(".", "").replace("_", "").isalnum())[:200]


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
    stopped, or its exit status when it failed; about ``max_chars`` characters at most. Control characters
    the program printed are shown as escapes (:func:`mmgrpo.tools.visible.visible`)."""
    notes = []
    if result.killed_reason is not None:
        notes.append(f"error: the program was stopped: {_explain(result)}")
    elif result.returncode not in (0, None):
        notes.append(f"(exit status {result.returncode})")
    # the end of stderr (where the error is) gets half the room when there is output too, all of it otherwise
    room = max(100, max_chars - sum(len(n) + 1 for n in notes) - 80)
    stdout, stdout_cut = visible(result.stdout), result.stdout_cut  # escapes shown, not run by a terminal
    stderr, stderr_cut = visible(result.stderr), result.stderr_cut
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
