"""Run by tests/test_distributed.py under ``accelerate launch`` (2 processes on the CPU): the learning rate
of every optimizer step of the trainer's own optimizer and scheduler, for each schedule with warm-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mmgrpo.config.core import load_config
from mmgrpo.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("constant", "linear", "cosine")


def schedule_lrs(model: str, out: Path, schedule: str, steps: int = 6, warmup: int = 2) -> list[float]:
    """The lr each of ``steps`` optimizer steps ran at, stepping as Trainer.update does."""
    sets = [
        f"model.path={model}",
        f"output_dir={out}",
        f"grpo.lr_schedule={schedule}",
        f"grpo.warmup_steps={warmup}",
        f"grpo.steps={steps}",
        "grpo.lr=1e-3",
        "grpo.tasks_per_step=2",
        "warm_start.steps=0",
    ]
    trainer = Trainer(load_config(ROOT / "examples" / "counting_tiny.yaml", sets), progress=False)
    lrs = []
    for _ in range(steps):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.scheduler.step()
    return lrs


if __name__ == "__main__":
    model, out = sys.argv[1], Path(sys.argv[2])
    got = {s: schedule_lrs(model, out / s, s) for s in SCHEDULES}
    from accelerate import PartialState

    (out / f"lrs{PartialState().process_index}.json").write_text(json.dumps(got))
