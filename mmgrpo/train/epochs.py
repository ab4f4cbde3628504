"""``grpo.epochs``: the number of GRPO steps that makes a given number of passes over a dataset.

The task stream plays seed s as row s mod rows of the env's train split (``ChatEnv.num_tasks``), and each
step takes the next ``grpo.tasks_per_step`` seeds, so ``epochs`` passes take
ceil(epochs x rows / tasks_per_step) steps (the last pass may end partway through a step). The trainer
builds the run's config with that ``grpo.steps`` (:func:`with_epoch_steps`) before anything depends on it
(the learning-rate schedule, the progress bar, a resume's check), and saves it: config.yaml holds both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from mmgrpo.config.core import Config
from mmgrpo.env import ChatEnv
from mmgrpo.errors import ConfigError


def epoch_steps(epochs: float, rows: int, tasks_per_step: int) -> int:
    """Steps for ``epochs`` passes over ``rows`` tasks, ``tasks_per_step`` a step (at least 1)."""
    return max(1, math.ceil(epochs * rows / tasks_per_step - 1e-9))


def with_epoch_steps(cfg: Config, make_env: Callable[[], ChatEnv]) -> Config:
    """``cfg`` with grpo.steps from grpo.epochs and the train split's rows (``cfg`` itself without epochs)."""
    g = cfg.grpo
    if g.epochs is None:
        return cfg
    env = make_env()
    try:
        num_tasks = getattr(env, "num_tasks", None)
        rows = num_tasks("train") if num_tasks is not None else None
    finally:
        env.close()
    if not rows:
        raise ConfigError(
            f"grpo.epochs={g.epochs:g}: env '{cfg.env.name}' has no finite train split (every seed is a new "
            "task), so an epoch has no length; set grpo.steps instead (and grpo.epochs: null)"
        )
    steps = epoch_steps(g.epochs, rows, g.tasks_per_step)
    return dataclasses.replace(cfg, grpo=dataclasses.replace(g, steps=steps))
