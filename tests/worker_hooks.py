"""What the multi-process workers (tests/dist_worker.py, tests/fsdp_worker.py) record of a run's first
step, by wrapping the trainer's update and its optimizer's step."""

from __future__ import annotations

import types
from collections.abc import Callable

from mmgrpo.model.adapters import unwrap


def record_first_step(
    trainer,
    seen: dict,
    *,
    grad: Callable = lambda g: g.detach().clone(),
    after_step: Callable[[], None] | None = None,
) -> None:
    """Into ``seen``: step 1's rows and advantages (``tokens``, ``adv``) and its synchronised gradient
    (``grads``: ``grad(p.grad)`` per parameter, taken just before the optimizer steps); ``after_step`` runs
    once after that first optimizer step."""
    model = unwrap(trainer.policy.model)
    real_update, real_step = trainer.update, trainer.optimizer.step

    def update(tokens, adv, G):
        if trainer.step == 0:
            seen["tokens"], seen["adv"] = tokens, adv.clone()
        return real_update(tokens, adv, G)

    def step(_optimizer, *a, **kw):
        first = "grads" not in seen and trainer.step == 0
        if first:
            seen["grads"] = {n: grad(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        result = real_step(*a, **kw)
        if first and after_step is not None:
            after_step()
        return result

    trainer.update = update
    # a bound method: the learning-rate schedule rebuilt on resume wraps the optimizer's step
    trainer.optimizer.step = types.MethodType(step, trainer.optimizer)
