"""Continuing a run from a checkpoint, beyond restoring its state (``mmgrpo.train.checkpoint``): the
learning rates and schedule set again from the config the run resumes with (``rebuild_lr``), and the
metrics file cut back to the steps the checkpoint had done (``truncate_metrics``). See docs/resume.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmgrpo.config.core import Config
from mmgrpo.train.lr_schedule import make_scheduler


def rebuild_lr(cfg: Config, optimizer, scheduler) -> None:
    """Set each parameter group's learning rate (the vision group's from model.vision_lr), AdamW's
    betas and weight decay, and the learning-rate schedule from ``cfg``, at the position the restored
    ``scheduler`` (accelerate's wrapper) had reached (the optimizer steps taken). AdamW's moments stay as
    restored. With an unchanged config this reproduces the restored values exactly (lr = initial_lr *
    factor(n), the schedule's own formula)."""
    from torch.optim.lr_scheduler import LambdaLR

    g, vision_lr = cfg.grpo, cfg.model.vision_lr
    optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper
    done = scheduler.scheduler.last_epoch  # optimizer steps taken (a skipped batch takes none)
    for group in optimizer.param_groups:
        lr = vision_lr if group.get("name") == "vision" and vision_lr is not None else g.lr
        group.update(lr=lr, initial_lr=lr, betas=tuple(g.betas), weight_decay=g.weight_decay)
    factors = make_scheduler(  # the new schedule's factor per optimizer step
        g.lr_schedule, optimizer, warmup_steps=g.warmup_steps, steps=g.steps * g.num_iterations
    ).lr_lambdas
    scheduler.scheduler = LambdaLR(optimizer, factors, last_epoch=done - 1)  # constructing steps it to done


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
