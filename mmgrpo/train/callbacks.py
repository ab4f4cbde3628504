"""Callbacks: user code the training loop calls at its events, as transformers' ``TrainerCallback``.

    class Printer(mmgrpo.TrainerCallback):
        def on_step_end(self, trainer, metrics):
            print(metrics["step"], metrics["reward"])

    mmgrpo.run("examples/counting_tiny.yaml", callbacks=[Printer()])

Events, in order: ``on_train_begin(trainer)`` as GRPO starts (after any warm start), then every step
``on_step_end(trainer, metrics)`` (the step's record, as written to metrics.jsonl, with ``eval_accuracy``
on an evaluation step), ``on_evaluate(trainer, metrics)`` after a held-out evaluation during training
(``{"step", "eval_accuracy"}``), ``on_save(trainer, path)`` after each checkpoint and model folder is
written (checkpoint-N, final, a model saved with ``trainer.save``), and ``on_train_end(trainer, metrics)``
after the final model (the last step's metrics). Unlike transformers there is no ``control`` object: a
callback stops the run with ``trainer.stop_requested = True`` (the step finishes, a checkpoint is written
and ``TrainingStopped`` raised, as on Ctrl-C), and reads anything else from ``trainer``.

A callback is any object with some of these methods (a :class:`TrainerCallback` subclass or not); they
run on the main process only (under ``accelerate launch``: rank 0), where the metrics are written. An
exception in a callback ends the run, as it would in transformers: a callback is the user's own code.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mmgrpo.errors import ConfigError

EVENTS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


class TrainingStopped(Exception):
    """Raised by ``Trainer.train`` after a stop was requested (SIGINT/SIGTERM, or a callback setting
    ``trainer.stop_requested``) and the checkpoint ``path`` of ``step`` was written."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"stopped after step {step}; checkpoint {path}")
        self.step, self.path = step, path
        self.signum = 0  # the signal that stopped it (set by mmgrpo.run), 0 for a callback's request
        self.steps: int | None = None  # the run's grpo.steps (set by mmgrpo.run)


class WarmStartInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during the warm start of ``mmgrpo.run``, after the model so far was saved to
    ``path`` (output_dir/interrupted) and a line said so."""

    def __init__(self, path: Path):
        super().__init__(f"interrupted during the warm start; the model so far is in {path}")
        self.path = path


class TrainerCallback:
    """Base class with every event as a no-op: override the ones you need."""

    def on_train_begin(self, trainer: Any) -> None:
        """GRPO begins (after any warm start; on a resume, at the checkpoint's step)."""

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        """A GRPO step ended; ``metrics`` is its record (``step``, ``reward``, ``kl``, ...)."""

    def on_evaluate(self, trainer: Any, metrics: dict[str, Any]) -> None:
        """A held-out evaluation during training (grpo.eval_every) gave ``metrics["eval_accuracy"]``."""

    def on_save(self, trainer: Any, path: Path) -> None:
        """A checkpoint or a model folder was written to ``path``."""

    def on_train_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        """The final model is saved; ``metrics`` is the last step's record."""


class Callbacks:
    """The callbacks of one trainer, called in order at each event (main process only)."""

    def __init__(self, callbacks: Iterable[Any] = (), *, active: bool = True) -> None:
        self.items: list[Any] = []
        self.active = active
        for cb in callbacks or ():
            self.add(cb)

    def add(self, callback: Any) -> None:
        """Add a callback instance (a class is instantiated, as transformers' ``add_callback`` does)."""
        if isinstance(callback, type):
            callback = callback()
        if not any(callable(getattr(callback, e, None)) for e in EVENTS):
            raise ConfigError(
                f"callback {callback!r} has none of the methods {', '.join(EVENTS)}: subclass "
                "mmgrpo.TrainerCallback and override the events you need"
            )
        self.items.append(callback)

    def __call__(self, event: str, trainer: Any, *args: Any) -> None:
        if not self.active:
            return
        for cb in self.items:
            method = getattr(cb, event, None)
            if callable(method):
                method(trainer, *args)
