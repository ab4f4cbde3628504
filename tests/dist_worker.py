"""Run by tests/test_distributed.py under ``accelerate launch`` (2 processes on the CPU): trains a few
steps and saves, per process, what it rolled out, its advantages and the synchronised gradient of step 1."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from worker_hooks import record_first_step

from mmgrpo.config.core import load_config
from mmgrpo.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def main(out: Path, sets: list[str]) -> None:
    cfg = load_config(ROOT / "examples" / "counting_tiny.yaml", sets)
    trainer = Trainer(cfg, progress=False)
    seen: dict = {}
    real_collect, real_score = trainer.collect, trainer.rewards.score

    def score(episodes, **kwargs):
        scored = real_score(episodes, **kwargs)
        if trainer.step == 0:
            seen["rewards"] = scored.total.clone()
        return scored

    def collect(G):
        batch, scored, stats = real_collect(G)
        if trainer.step == 0:
            seen["seeds"] = [t.seed for t in batch.trajectories]
        return batch, scored, stats

    trainer.collect, trainer.rewards.score = collect, score
    # step 1's gradient after DDP's all-reduce (clipping is off: huge max norm)
    record_first_step(trainer, seen)
    trainer.train()
    seen["world"] = trainer.world
    torch.save(seen, out / f"rank{trainer.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
