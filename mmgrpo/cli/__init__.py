"""The ``mmgrpo`` command: ``app`` (the parser and ``main``), ``commands`` (train, sft, eval, plot, probe,
tiny-model, list), ``demo``, ``threads`` (CPU threads), ``run_lock`` (one writer per output folder) and
``processes`` (local multi-process launches).
"""

from mmgrpo.cli.app import main

__all__ = ["main"]
