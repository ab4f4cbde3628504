"""Progress where stderr is not a terminal: no ``\\r`` frames, a whole line now and then.

A tqdm bar redraws itself with carriage returns; in a log file (``mmgrpo train ... 2> log``, a batch job's
output) every frame stays, and a line written between two frames (``mmgrpo: error: ...``) is glued onto the
end of a bar's frame instead of starting its own line. tqdm's own answer is ``disable=None`` ("disable on
non-TTY"), and transformers' Trainer users turn the bars off with ``disable_tqdm``; the command line does the
first by itself (:func:`bars_wanted`) and, for GRPO, prints :class:`ProgressLines` instead: one whole line
every tenth of the run, so that a log still says how far it got. ``--no-progress`` turns both off.

The Python API is left alone: a notebook's stderr is not a terminal either, and its bars are widgets.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from mmgrpo.train.callbacks import TrainerCallback


def bars_wanted(progress: bool, stream: TextIO | None = None) -> bool:
    """Whether the command line draws progress bars: asked for (no ``--no-progress``) and ``stream``
    (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(progress) and stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class ProgressLines(TrainerCallback):
    """One line per ``every`` GRPO steps (default: a tenth of grpo.steps) and at the last step, to stderr:
    ``grpo step 30/300: reward 0.412, kl 0.0031`` (as the bar's name; not an ``mmgrpo:`` line, which
    says something happened)."""

    def __init__(self, every: int | None = None, stream: TextIO | None = None) -> None:
        self.every, self.stream = every, stream

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        steps = trainer.cfg.grpo.steps
        step = int(metrics.get("step", trainer.step))
        every = self.every or max(1, steps // 10)
        if step % every and step != steps:
            return
        shown = [f"{k} {metrics[k]:.4g}" for k in ("reward", "kl", "eval_accuracy") if k in metrics]
        print(
            f"grpo step {step}/{steps}: {', '.join(shown)}",
            file=self.stream or sys.stderr,
            flush=True,
        )
