"""What changes when ``accelerate launch`` runs the trainer on W processes.

Process r of W takes tasks r, r+W, r+2W, ... of each step's B tasks, whole groups, so every group's
advantages are computed where all of its G rewards are (exact, no gather needed). The loss of each process
is normalised by the global token and sequence counts and multiplied by W, because DDP averages gradients
over processes: the averaged gradient is then the gradient of the single-process loss over the global
batch. Metrics are reduced here; only the main process writes files.

With one process every function here returns its input unchanged and no collective runs, so a
single-process run computes exactly what it computed before multi-process support.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from mmgrpo.model.adapters import unwrap

SUM_KEYS = frozenset(
    {
        "loss",  # each process's share is normalised by the global counts: the sum is the global loss
        "kl",  # token-share weighted on each process
        "entropy",  # token-share weighted on each process, like kl
        "clip_frac",
        "ratio_mean",
        "verifier_failures",
        "reward_none",
        "reward_unscored",
        "env_errors",
        "env_reset_failures",
        "num_episodes",
        "dynamic/dropped_groups",
        "dynamic/kept_groups",
    }
)
FIRST_KEYS = frozenset(
    {"step", "grad_norm", "lr", "skipped", "group_size", "dynamic/rounds"}
)  # the same on every process
MAX_KEYS = frozenset(
    {"rollout_time", "train_time", "step_time", "dynamic/gave_up", "mismatch/max_abs"}
)  # the step waits for the slowest; the largest sampler gap of any process


def shard(items: list, rank: int, world: int) -> list:
    """Process ``rank``'s share of ``items``: every ``world``-th one, starting at ``rank``."""
    return items[rank::world]


def gather_objects(accelerator, obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order (no collective with one process)."""
    if accelerator.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def global_counts(accelerator, *values: int) -> torch.Tensor:
    """Each process's integers, gathered: (W, len(values)) (no collective with one process)."""
    local = torch.tensor([list(values)], dtype=torch.long, device=accelerator.device)  # (1, k)
    if accelerator.num_processes == 1:
        return local.cpu()
    return accelerator.gather(local).cpu()  # (W, k)


def global_sum(accelerator, value: float) -> float:
    """The sum of ``value`` over processes (no collective with one process)."""
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum"))


def reduce_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One metrics record from each process's record of the same step.

    Sums for the keys in SUM_KEYS, the first process's value for FIRST_KEYS, the maximum for times and
    the mean weighted by each process's ``num_episodes`` for the rest (rewards, lengths, shares); a key
    some processes lack is averaged over those that have it. Per-episode counters whose keys depend on
    what a process saw (tool failure kinds, env metrics) are not reduced here: the trainer computes them
    over every process's episodes at once.
    """
    if len(records) == 1:
        return records[0]
    out: dict[str, Any] = {}
    keys = [k for r in records for k in r]
    for key in dict.fromkeys(keys):  # first-seen order
        have = [r for r in records if key in r]
        values = [r[key] for r in have]
        if key in FIRST_KEYS or not all(isinstance(v, (int, float)) for v in values):
            out[key] = values[0]
        elif key in SUM_KEYS:
            out[key] = sum(values)
        elif key in MAX_KEYS:
            out[key] = max(values)
        else:
            weights = [r.get("num_episodes", 1) for r in have]
            total = sum(weights)
            out[key] = sum(w * v for w, v in zip(weights, values, strict=True)) / total if total else 0.0
    return out


def leave_process_group(code: int = 0) -> None:
    """After a command succeeded in a process of ``accelerate launch`` (torchrun sets LOCAL_RANK): destroy
    the default process group, flush the output and exit with ``code`` at once, without the interpreter's
    teardown. Left to that teardown, gloo's threads may still hold work while Python shuts down, and the
    process aborted after its run was complete and saved (``terminate called without an active
    exception``, SIGABRT, rank 1: 2-process tests in 3 of 5 fresh-clone CI runs, with destroy_process_group
    alone in one of them; 0 of 28 reruns outside CI). Outside a launched process only the group is
    destroyed. Call it only after success: after a failure a peer may be inside a collective."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "LOCAL_RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def outside_ddp(policy):
    """The policy's forwards run on the bare module inside the block (no DDP collectives)."""
    wrapped = policy.model
    policy.model = unwrap(wrapped)
    try:
        yield
    finally:
        policy.model = wrapped


@contextlib.contextmanager
def warm_start_outside_ddp(trainer):
    """The warm start on every process alike, on the bare module (no DDP collectives), then the main
    process's weights made everyone's. Every process warm-starts on the same demonstrations, so DDP's
    averaging changed nothing there; inside DDP, a text env on a VLM whose vision tower trains
    (model.freeze_vision: false) stopped at the second step with DDP's "parameters that were not used in
    producing loss" (the vision tower sees no image). The skill checks inside are decided by the main
    process (mmgrpo.train.warm_check.main_process_says), so every process stops at the same step. After an
    error nothing is broadcast (a peer may not be in the collective)."""
    if trainer.world <= 1:
        yield
        return
    with outside_ddp(trainer.policy):
        yield
    import torch.distributed as dist

    module = unwrap(trainer.policy.model)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def said_by_main_only(exc: BaseException) -> bool:
    """Whether this process of ``accelerate launch`` leaves an error's line to the main process: an error
    every process meets alike (a config's, or the warm start's check, which the main process decides), once
    printed by every process. Errors a process may meet alone (a step's env or data) are still said by it."""
    import os

    from mmgrpo.errors import ConfigError, WarmStartError
    from mmgrpo.train.run_lock import is_launch_main_process

    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or is_launch_main_process():
        return False
    return isinstance(exc, (ConfigError, WarmStartError))


def tell_launcher(line: str) -> None:
    """Leave an error's one line where torchrun's agent (under ``accelerate launch``) reads a failed
    process's error (TORCHELASTIC_ERROR_FILE): its ChildFailedError summary then shows the line as the root
    cause instead of "To enable traceback see: ...". Outside a launched process, or on a failed write,
    nothing happens."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass
