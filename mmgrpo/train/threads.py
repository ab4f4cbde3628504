"""How many torch CPU threads a command uses: ``--threads N``, else OMP_NUM_THREADS, else a default from
the cores this process may use (:func:`cpu_cores`, :func:`default_cpu_threads`), said once on stderr."""

from __future__ import annotations

import sys
from pathlib import Path


def cpu_cores() -> int:
    """Physical cores this process may use: its CPU affinity, less hyperthread siblings, within a cgroup
    CPU quota (a container's --cpus)."""
    import os

    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        logical = os.cpu_count() or 1
    cores = logical
    try:
        import psutil  # a dependency of accelerate

        physical, total = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        if physical and total and physical < total:
            cores = max(1, logical * physical // total)
    except ImportError:
        pass
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def default_cpu_threads(cores: int, processes: int = 1) -> int:
    """Torch threads for a CPU run: half of each process's share of the cores, at least 1, at most 4.

    Not all of them: an OpenMP thread spins while it waits for its siblings, so on a machine where other
    work holds some cores every operator waits for the slowest thread. Measured on a 2-core machine under
    a CI job's load, the counting demo's GRPO step took 1.0-1.5 s with one thread and 3.7-15.5 s with
    torch's default of two; the tiny models gain little from more threads even on an idle machine.
    """
    return max(1, min(4, cores // (2 * max(1, processes))))


_THREADS_SAID = False


def user_set_threads(requested: int | None) -> bool:
    """Whether the user chose the torch threads: ``--threads N`` (``requested``) or OMP_NUM_THREADS."""
    import os

    return requested is not None or bool((os.environ.get("OMP_NUM_THREADS") or "").strip())


def set_cpu_threads(requested: int | None) -> None:
    """``--threads N``, else OMP_NUM_THREADS (torch reads it), else on a machine without a GPU
    :func:`default_cpu_threads`, said once per process on stderr. Called when a command's input is
    checked and its work (a model) starts."""
    import os

    global _THREADS_SAID

    if requested is None and user_set_threads(None):  # OMP_NUM_THREADS: torch has read it
        return
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
        return
    if torch.cuda.is_available():  # the model runs on the GPU: torch's default is fine for the rest
        return
    cores, processes = cpu_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    n = default_cpu_threads(cores, processes)
    torch.set_num_threads(n)
    if n != cores and not _THREADS_SAID:
        _THREADS_SAID = True
        print(
            f"mmgrpo: {n} CPU thread{'s' * (n > 1)} ({cores} cores; --threads N or OMP_NUM_THREADS=N to change)",
            file=sys.stderr,
            flush=True,
        )
