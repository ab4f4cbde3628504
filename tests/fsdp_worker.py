"""Run by tests/test_fsdp.py under ``accelerate launch`` (2 CPU processes, gloo) with model.fsdp=true.

    fsdp_worker.py OUT CONFIG [--resume CHECKPOINT] [--kill-after STEP] [--model-forward] [KEY=VALUE ...]

Trains CONFIG with the --set overrides and saves, per process, to OUT/rank{r}.pt: the shard shapes of
every parameter, step 1's rows, advantages and synchronised gradient (gathered whole), and the bytes the
process holds of parameters, gradients and AdamW state after step 1. ``--kill-after STEP``: every process
SIGKILLs itself right after the checkpoint of STEP is written (a crash, not a clean stop).
``--model-forward``: rollouts decode through the model's own forward, never the lean step
(``mmgrpo.model.engine.LEAN_DECODE = False``), as rollouts on the shards always do.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from worker_hooks import record_first_step

from mmgrpo.config.core import load_config
from mmgrpo.model import engine
from mmgrpo.train import fsdp
from mmgrpo.train.trainer import Trainer


def main(out: Path, config: str, args: list[str]) -> None:
    resume = kill_after = None
    sets = []
    it = iter(args)
    for a in it:
        if a == "--resume":
            resume = Path(next(it))
        elif a == "--kill-after":
            kill_after = int(next(it))
        elif a == "--model-forward":
            engine.LEAN_DECODE = False
        else:
            sets.append(a)
    trainer = Trainer(load_config(config, sets), progress=False)
    model = trainer.policy.model
    seen: dict = {
        "world": trainer.world,
        "shards": {
            n: (tuple(fsdp.local_tensor(p).shape), tuple(p.shape)) for n, p in model.named_parameters()
        },
        "reference_shards": {
            n: (tuple(fsdp.local_tensor(p).shape), tuple(p.shape))
            for n, p in (trainer.policy.reference.named_parameters() if trainer.policy.reference else [])
        },
    }
    real_save = trainer.save_checkpoint

    def save_checkpoint():
        path = real_save()
        if kill_after is not None and trainer.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    trainer.save_checkpoint = save_checkpoint
    # step 1's gradient after FSDP's reduce-scatter, gathered whole (a collective)
    record_first_step(
        trainer,
        seen,
        grad=lambda g: g.full_tensor().clone(),
        after_step=lambda: seen.update(held=fsdp.held_bytes(model, trainer.optimizer)),
    )
    if resume is not None:
        trainer.resume(resume)
    trainer.train()
    if trainer.lockstep is not None:  # this process's forwards in rollouts: its own, and padding ones
        seen["forwards"] = (trainer.lockstep.real, trainer.lockstep.padding)
    if torch.cuda.is_available():  # the process's peak GPU memory over the whole run
        seen["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    seen["final"] = fsdp.full_state_dict(model)  # the gathered weights the final folder should hold
    torch.save(seen, out / f"rank{trainer.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
