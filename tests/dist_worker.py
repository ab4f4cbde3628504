"""Run by tests/test_distributed.py under ``accelerate launch`` (2 processes on the CPU): trains a few
steps and saves, per process, what it rolled out, its advantages and the synchronised gradient of step 1."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mmgrpo.config.core import load_config
from mmgrpo.model.adapters import unwrap
from mmgrpo.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def main(out: Path, sets: list[str]) -> None:
    cfg = load_config(ROOT / "examples" / "counting_tiny.yaml", sets)
    trainer = Trainer(cfg, progress=False)
    seen: dict = {}
    real_collect, real_update, real_step = trainer.collect, trainer.update, trainer.optimizer.step
    real_score = trainer.rewards.score

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

    def update(tokens, adv, G):
        if trainer.step == 0:
            seen["tokens"], seen["adv"] = tokens, adv.clone()
        return real_update(tokens, adv, G)

    def step(*args, **kwargs):
        if "grads" not in seen:  # step 1's gradient, after DDP's all-reduce (clipping is off: huge max norm)
            model = unwrap(trainer.policy.model)
            seen["grads"] = {
                n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
            }
        return real_step(*args, **kwargs)

    trainer.collect, trainer.update, trainer.optimizer.step = collect, update, step
    trainer.rewards.score = score
    trainer.train()
    seen["world"] = trainer.world
    torch.save(seen, out / f"rank{trainer.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
