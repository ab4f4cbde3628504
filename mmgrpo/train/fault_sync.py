"""Fault accounting over every process: each step's failed resets, env steps and verifier calls are
gathered from all processes and counted once (``FaultTracker`` of ``mmgrpo.train.faults`` decides whether
the run stops), and a non-finite reward or advantage found on any process makes every process skip or
stop at the same step.
"""

from __future__ import annotations

from typing import Any

from mmgrpo.errors import NonFiniteError
from mmgrpo.train.distributed import gather_objects
from mmgrpo.train.faults import FaultTracker


def account_faults(faults: FaultTracker, accelerator, batch: Any, scored: Any, step: int) -> None:
    """Count failed resets, failed env steps and verifier failures of step ``step`` (a ``RolloutBatch`` and
    its ``RewardBreakdown``) over all processes; ``faults`` stops the run past faults.max_failure_frac."""
    local = {
        "reset": batch.failed_tasks,
        "tasks": len(batch.failed_tasks) + len(set(batch.group_ids)),
        "step": [(t.seed, t.env_error) for t in batch.trajectories if t.env_error is not None],
        "episodes": len(batch.trajectories),
        "vfail": scored.failures,
        "verrors": scored.errors,
    }
    parts = gather_objects(accelerator, local)
    episodes = sum(p["episodes"] for p in parts)
    faults.env_reset_failures(step, [x for p in parts for x in p["reset"]], sum(p["tasks"] for p in parts))
    faults.env_step_failures(step, [x for p in parts for x in p["step"]], episodes)
    vfail: dict[str, int] = {}
    for p in parts:
        for name, n in p["vfail"].items():
            vfail[name] = vfail.get(name, 0) + n
    faults.verifier_failures(step, vfail, [e for p in parts for e in p["verrors"]], episodes)


def agree_finite(accelerator, problem: str | None, nonfinite: str) -> str | None:
    """The first process's non-finite finding, on every process (they must all skip or all stop);
    NonFiniteError when ``nonfinite`` (faults.nonfinite) is "stop"."""
    found = [p for p in gather_objects(accelerator, problem) if p is not None]
    if found and nonfinite == "stop":
        raise NonFiniteError(
            f"{found[0]}. Fix the verifier, or set faults.nonfinite=skip to skip such batches"
        )
    return found[0] if found else None


SKIPPED = {
    "loss": float("nan"),
    "kl": float("nan"),
    "clip_frac": float("nan"),
    "ratio_mean": float("nan"),
    "grad_norm": float("nan"),
    "skipped": 1,
}
"""The loss statistics of a batch skipped for a non-finite value (faults.nonfinite=skip)."""
