"""The ``mmgrpo`` command: ``app`` (the parser and ``main``), ``commands`` (train, sft, eval, plot, probe,
tiny-model, list), ``demo`` and ``processes`` (local multi-process launches). The run lock and the CPU
threads live in ``mmgrpo.train`` (``run_lock``, ``threads``): ``mmgrpo.run`` uses them too.
"""

from mmgrpo.cli.app import main

__all__ = ["main"]
