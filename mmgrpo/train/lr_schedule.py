"""Learning-rate schedules: the factor on the initial rate at each optimizer step (pure math).

The same formulas as transformers' ``get_scheduler`` for "constant", "linear" and "cosine" (half a cosine
wave) with linear warm-up from 0, written here so that a run does not import ``transformers.optimization``,
which imports its Trainer's helpers and peft (about 8 MB of peak memory on the tiny model, measured with
benchmarks/vs_trl.py's setup). ``tests/test_lr_schedule.py`` checks them against transformers' at every step.
"""

from __future__ import annotations

import functools
import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(name: str, step: int, *, warmup_steps: int, steps: int) -> float:
    """The factor on the initial learning rate after ``step`` optimizer steps (0-based), for the schedule
    ``name`` over ``steps`` steps with ``warmup_steps`` of linear warm-up from 0."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if name == "constant":
        return 1.0
    span = max(1, steps - warmup_steps)  # the steps after the warm-up
    if name == "linear":
        return max(0.0, (steps - step) / span)
    progress = (step - warmup_steps) / span  # 0 -> 1 after the warm-up
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown learning-rate schedule {name!r}; expected one of {SCHEDULES}")


def make_scheduler(name: str, optimizer, *, warmup_steps: int, steps: int):
    """A ``LambdaLR`` stepping ``optimizer``'s learning rates along ``lr_factor(name, ...)``."""
    from torch.optim.lr_scheduler import LambdaLR

    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; expected one of {SCHEDULES}")
    factor = functools.partial(lr_factor, name, warmup_steps=warmup_steps, steps=steps)
    return LambdaLR(optimizer, factor)
