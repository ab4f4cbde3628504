"""A control group per sandbox run: memory and process-count limits that hold for the whole process tree.

``create(memory_bytes, max_pids)`` makes ``mmgrpo-sandbox-<pid>-<n>`` under this process's own cgroup, in
the unified hierarchy (cgroup v2: ``memory.max``, ``memory.swap.max`` 0, ``pids.max``) or in the v1
``memory`` and ``pids`` hierarchies (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap
is accounted, ``pids.max``), or returns None where this process may not create cgroups (not root and no
delegated subtree; read-only ``/sys/fs/cgroup``). The run's first process joins it with
``join_script()`` before it starts bubblewrap, so every process of the run is inside, and so is the tmpfs
its files use (shared memory is charged to the cgroup that touched it). After the run, ``oom_killed()``
says whether the kernel killed a process for memory, ``close()`` kills whatever is left and removes the
group; it never raises. Groups left by a process that was killed are removed by the next ``create``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "mmgrpo-sandbox-"
_counter = itertools.count()


@dataclass
class RunCgroup:
    paths: list[Path]  # v2: one folder; v1: the memory one and the pids one
    version: int

    def join_script(self) -> str:
        """Shell lines that move the shell itself (``$$``) into the group; its children stay there."""
        return "".join(f'echo $$ > "{p}/cgroup.procs" || exit 96; ' for p in self.paths)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for going past its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.paths[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def cpu_seconds(self) -> float | None:
        """CPU time used by every process of the group (v2 ``cpu.stat``, v1 ``cpuacct.usage``), or None."""
        try:
            if self.version == 2:
                for line in (self.paths[0] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
            for path in self.paths:
                if (path / "cpuacct.usage").is_file():
                    return int((path / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
        return None

    def close(self) -> None:
        """Kill every process left in the group, then remove it. Never raises."""
        for path in self.paths:
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")  # v2, kernel 5.14+
        deadline = time.monotonic() + 2.0
        for path in self.paths:
            while (pids := _pids(path)) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
            _remove(path, deadline)


def create(memory_bytes: int, max_pids: int) -> RunCgroup | None:
    """A new group with these limits, or None where cgroups cannot be made here."""
    name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
    for version, parents in ((2, _v2_parent()), (1, _v1_parents())):
        if not parents:
            continue
        made: list[Path] = []
        try:
            for parent in parents:
                _remove_stale(parent)
                path = parent / name
                path.mkdir()
                made.append(path)
            if version == 2:
                path = made[0]
                (path / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0")
                (path / "pids.max").write_text(str(max_pids))
            else:
                memory, pids = made[:2]
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):  # only where swap is accounted
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (pids / "pids.max").write_text(str(max_pids))
            return RunCgroup(made, version)
        except OSError:
            for path in made:
                _remove(path, time.monotonic() + 0.5)
    return None


def _own(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of ``controller`` ("" = the unified one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path
    return None


def _v2_parent() -> list[Path]:
    own = _own("")
    if own is None or not (ROOT / "cgroup.controllers").is_file():
        return []
    parent = ROOT / own.lstrip("/")
    try:
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return []
    return [parent] if os.access(parent, os.W_OK) else []


def _v1_parents() -> list[Path]:
    """The memory and pids hierarchies' folders of this process (and cpuacct's, for the CPU time, if any)."""
    parents = []
    for controller in ("memory", "pids", "cpuacct"):
        own = _own(controller)
        base = ROOT / controller
        usable = own is not None and (base / "cgroup.procs").is_file()
        parent = base / (own or "").lstrip("/")
        if usable and os.access(parent, os.W_OK):
            parents.append(parent)
        elif controller != "cpuacct":
            return []
    return parents


def _pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _remove(path: Path, deadline: float) -> None:
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


def _remove_stale(parent: Path) -> None:
    """Remove the groups of sandbox runs whose trainer is gone (killed before it could remove them)."""
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return
    for path in entries:
        owner = path.name[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            for pid in _pids(path):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _remove(path, time.monotonic() + 0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
