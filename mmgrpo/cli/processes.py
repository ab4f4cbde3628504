"""GRPO on several processes of one machine, launched from Python: how ``mmgrpo demo`` uses every CPU core.

On a CPU, one process with T threads gains little from the second thread on this tiny model (measured:
13% on 2 cores; most operators are too small to split), while T processes with one thread each split the
step's groups between them (data parallel, gradients all-reduced over gloo: ``mmgrpo.train.distributed``). The
result is the same algorithm on the same global batch; only the sampling random streams differ (each
process seeds its own, ``seed + rank``).

``launch`` starts ``accelerate launch --multi_gpu --num_processes N`` (torchrun's launcher; with
``model.device=cpu`` each process joins a gloo group) on :func:`worker`, which trains one config and
nothing else: the caller does the warm start and the evaluations before and after.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mmgrpo.errors import ConfigError


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_processes(requested: str, device: str) -> int:
    """``--processes``: ``auto`` = one per core (at most 2: beyond that the tiny demo's step is too small
    to split further) on the CPU, 1 on a GPU; or a number."""
    if requested == "auto":
        return min(2, available_cores()) if device == "cpu" else 1
    try:
        n = int(requested)
    except ValueError:
        raise ConfigError(f"--processes takes 'auto' or a whole number >= 1, got {requested!r}") from None
    if n < 1:
        raise ConfigError(f"--processes takes 'auto' or a whole number >= 1, got {n}")
    return n


def launch(config: Path, overrides: list[str], processes: int, *, progress: bool = True) -> None:
    """Train ``config`` with ``overrides`` on ``processes`` local processes (one thread each when there are
    as many cores); returns when they finish, raises RuntimeError with their output's tail if one fails."""
    threads = max(1, available_cores() // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    root = str(Path(__file__).resolve().parents[2])  # the checkout (mmgrpo/cli/processes.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
    ]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_port", "0", "-m", "mmgrpo.cli.processes", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    if not progress:
        cmd.append("--no-progress")
    # the workers' progress bar (rank 0's) goes straight to this terminal; everything else is kept for
    # the error message
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        tail = (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:]
        raise RuntimeError(
            f"training on {processes} processes failed (exit {proc.returncode}). Their output ends with:\n"
            f"{tail}\nRun with --processes 1 to train in this process instead."
        )


def worker(argv: list[str] | None = None) -> int:
    """One process of :func:`launch`: ``python -m mmgrpo.cli.processes CONFIG [--set K=V ...]``."""
    import argparse

    import torch

    from mmgrpo.config.core import load_config
    from mmgrpo.train.distributed import leave_process_group
    from mmgrpo.train.trainer import Trainer

    ap = argparse.ArgumentParser(prog="mmgrpo.cli.processes")
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.no_progress:
        from mmgrpo.cli.commands import library_bars_off

        library_bars_off()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainer = Trainer(load_config(args.config, args.set), progress=not args.no_progress)
    trainer.train()
    leave_process_group(0)  # exits here
    return 0


if __name__ == "__main__":
    sys.exit(worker())
