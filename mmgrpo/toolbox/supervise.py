"""Supervising one sandboxed run from outside: read its output within bounds, stop it at its deadline,
kill its process group, reap it; and the result type (:class:`SandboxResult`). Shared by the bubblewrap
sandbox and the weak one (:mod:`mmgrpo.toolbox.sandbox`, :mod:`mmgrpo.toolbox.sandbox_weak`)."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

KILL_OUTPUT_BYTES = 1_000_000
"""A program that prints more than this (stdout and stderr together) is stopped: ``killed_reason='output limit'``."""


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


def supervise(
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
            if exited_at is None and has_exited(proc.pid):
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
        while reason is None and not has_exited(proc.pid):
            if time.monotonic() >= deadline:
                reason = "wall time limit"
                break
            time.sleep(0.01)
    kill_group(proc.pid)  # the child is not reaped yet, so its process group id is still ours
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


def has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, and so its group id, stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_tree(path: str) -> None:
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


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def signal_reason(returncode: int | None, cpu_used: float, cpu_limit: int) -> str | None:
    """Why a run that died of a signal stopped: ``CPU time limit`` (SIGXCPU/SIGKILL after using its CPU
    seconds), else ``signal SIGSEGV`` and the like; None for an exit status."""
    if returncode is None or returncode >= 0:
        return None
    sig = -returncode
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_used >= cpu_limit - 0.1:
        return "CPU time limit"
    return f"signal {signal_name(sig)}"


def finished(
    out, err, returncode: int | None, reason: str | None, start: float, cpu_used: float, isolation: str
):
    """The SandboxResult of a supervised run: ``out``/``err`` as ``supervise`` returns them ((text, cut))."""
    (stdout, stdout_cut), (stderr, stderr_cut) = out, err
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=returncode,
        killed_reason=reason,
        seconds=time.monotonic() - start,
        cpu_seconds=cpu_used,
        isolation=isolation,
        stdout_cut=stdout_cut,
        stderr_cut=stderr_cut,
    )
