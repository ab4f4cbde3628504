"""Continuing a run from a checkpoint, beyond restoring its state (``mmgrpo.train.checkpoint``): the
learning rates and schedule set again from the config the run resumes with (``rebuild_lr``; a changed
grpo.num_iterations re-fits the schedule's position to the new count of optimizer steps per step), and the
metrics file cut back to the steps the checkpoint had done (``truncate_metrics``). See docs/resume.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmgrpo.config.core import Config
from mmgrpo.train.lr_schedule import make_scheduler


def rebuild_lr(cfg: Config, optimizer, scheduler, saved: dict[str, Any] | None = None) -> str | None:
    """Set each parameter group's learning rate (the vision group's from model.vision_lr), AdamW's
    betas and weight decay, and the learning-rate schedule from ``cfg``, at the position the restored
    ``scheduler`` (accelerate's wrapper) had reached. AdamW's moments stay as restored. With an unchanged
    config this reproduces the restored values exactly (lr = initial_lr * factor(n), the schedule's own
    formula).

    The schedule counts optimizer steps, grpo.num_iterations per GRPO step. When the checkpoint's run
    (``saved``, its flat config) took another number per step, its optimizer steps are converted to the
    new count (10 steps at 1 iteration: position 20 at 2), so that the resumed step trains at the new
    schedule's lr for that step and the schedule ends at its last step; counting the old optimizer steps
    as new ones put a linear decay over 20 steps, resumed at step 10 with 2 iterations, at 0.75 of the
    lr instead of 0.5, ending at 0.25 instead of 0. Returns one line saying so then, else None."""
    from torch.optim.lr_scheduler import LambdaLR

    g, vision_lr = cfg.grpo, cfg.model.vision_lr
    optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper
    done = scheduler.scheduler.last_epoch  # optimizer steps taken (a skipped batch takes none)
    saved = saved or {}
    old_iters, iters = int(saved.get("grpo.num_iterations", g.num_iterations)), g.num_iterations
    position = done if old_iters == iters else round(done * iters / old_iters)
    for group in optimizer.param_groups:
        lr = vision_lr if group.get("name") == "vision" and vision_lr is not None else g.lr
        group.update(lr=lr, initial_lr=lr, betas=tuple(g.betas), weight_decay=g.weight_decay)
    total = g.steps * iters
    factors = make_scheduler(  # the new schedule's factor per optimizer step
        g.lr_schedule, optimizer, warmup_steps=g.warmup_steps, steps=total
    ).lr_lambdas
    scheduler.scheduler = LambdaLR(optimizer, factors, last_epoch=position - 1)  # constructing steps it
    if old_iters == iters:
        return None
    old_total = int(saved.get("grpo.steps", g.steps)) * old_iters
    return (
        f"mmgrpo: grpo.num_iterations {old_iters} -> {iters}: the learning-rate schedule was re-fitted from "
        f"{old_total} to {total} optimizer steps (grpo.steps x grpo.num_iterations); the checkpoint's {done} "
        f"optimizer steps count as {position} of the new {total}, so training goes on at lr "
        f"{optimizer.param_groups[0]['lr']:.4g} and the schedule ends at step {g.steps}"
    )


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the GRPO lines of steps after ``step`` (done again after a resume), atomically; warm-start
    lines stay."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if "stage" in rec or int(rec.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def finished_run(trainer) -> dict[str, Any] | None:
    """A resume of a run that has done all of grpo.steps, its final model saved: nothing to do. Says so in
    one line (how to go on) and returns the last step's metrics record, so that nothing is written: before,
    the run trained no step, printed "last reward nan", exited 0 and wrote final/ again with an empty model
    card. None when there are steps to do (or final/ is missing: the run then writes it)."""
    import sys

    steps, final = trainer.cfg.grpo.steps, trainer.out / "final"
    if trainer.step < steps or not (final / "config.json").is_file():
        return None
    records = []
    if trainer.metrics_path.is_file():
        for line in trainer.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "stage" not in record and "reward" in record:
                records.append(record)
    if trainer.is_main:
        print(
            f"mmgrpo: nothing to do: the run in {trainer.out} already has {trainer.step} steps (grpo.steps="
            f"{steps}) and its model in {final}; nothing was changed. To train on, raise grpo.steps: "
            f"--set grpo.steps={steps + max(steps // 2, 1)} --resume",
            file=sys.stderr,
            flush=True,
        )
    return records[-1] if records else {}
