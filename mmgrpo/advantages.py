"""Group-relative advantages: the one place where rewards become the learning signal of GRPO.

Rewards arrive as one flat tensor of N = num_groups * group_size scalars. Which rows form a group is given
explicitly by ``group_ids`` (one task id per row, as verl's ``uid``), so rows may come in any order (multi-turn
batches, dynamic sampling and sharding move them); without ids, consecutive rows belong to the same task (rows
``[g*G : (g+1)*G]`` are group g). Every statistic is taken inside a group, never across the batch, and before
the batch is split into micro-batches.

    A_i = (r_i - baseline_i) / (scale_group + eps)

Where this departs from (or pins down) the papers:

- DeepSeekMath says "normalised by the group mean and standard deviation" without saying which standard
  deviation. The default here is the unbiased one (N-1, what ``torch.std`` and TRL use); ``std_biased``
  (N) is available, and ``scale="none"`` is Dr. GRPO (no division at all).
- ``eps`` is added to the standard deviation (not under a square root), as in TRL.
- A group whose rewards are all exactly equal gets exact zeros, never NaN and never the rounding noise of
  ``r - mean(r)``. A group of size 1 has no baseline and also gets zeros.
- ``baseline="rloo"`` (leave-one-out, arXiv 2402.14740) subtracts the mean of the *other* G-1 rewards.
  ``scale`` still applies after the baseline, so the paper's RLOO is ``baseline="rloo", scale="none"``;
  ``scale="std_unbiased"`` with RLOO is a hybrid that some codebases use.

Example::

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])                     # (N,) one group of G=4
    group_advantages(rewards, group_size=4)                          # (N,) [0.866, -0.866, 0.866, -0.866]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.errors import DataError

Baseline = Literal["mean", "rloo"]
Scale = Literal["std_unbiased", "std_biased", "none"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Check the shape and view rewards (N,) as (num_groups, group_size), in floating point."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    if rewards.dim() != 1:
        raise DataError(
            f"rewards must be a 1-D tensor (N,) with N = num_groups * group_size, got shape {tuple(rewards.shape)}."
        )
    n = rewards.shape[0]
    if n % group_size != 0:
        raise DataError(
            f"rewards has {n} rows, which is not a multiple of group_size={group_size}. Pass all G={group_size} "
            f"episodes of every task, consecutive rows per task (N = num_groups * group_size)."
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()  # (N,)
    if not bool(torch.isfinite(rewards).all()):
        raise DataError(
            "rewards contain NaN or inf; the reward function must map a bad episode to a finite number."
        )
    return rewards.view(n // group_size, group_size)  # (B, G)


def group_order(group_ids: Sequence[int], group_size: int) -> Tensor:
    """A permutation (N,) that puts the rows of each group next to each other (groups in order of first
    appearance, rows in their order); DataError unless every id has exactly ``group_size`` rows."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(int(g), []).append(i)
    bad = {g: len(r) for g, r in rows.items() if len(r) != group_size}
    if bad:
        raise DataError(
            f"every group needs exactly group_size={group_size} rows; group id -> rows: {dict(list(bad.items())[:5])}. "
            "Keep all G episodes of a task in the batch."
        )
    return torch.tensor([i for r in rows.values() for i in r], dtype=torch.long)  # (N,)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    group_ids: Sequence[int] | None = None,
    baseline: Baseline = "mean",
    scale: Scale = "std_unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages (N,) of rewards (N,), normalised inside each group: the rows sharing a ``group_ids`` entry,
    or, without ids, each run of ``group_size`` consecutive rows.

    baseline: "mean" (GRPO) subtracts the group mean; "rloo" subtracts the mean of the other G-1 rewards.
    scale: divide by the group's "std_unbiased" (N-1) or "std_biased" (N) standard deviation plus ``eps``,
        or "none" (Dr. GRPO, and the paper's RLOO).
    Groups whose rewards are all equal, and every group when group_size == 1, get exact zeros.
    """
    if baseline not in ("mean", "rloo"):
        raise ValueError(f"baseline must be 'mean' or 'rloo', got {baseline!r}.")
    if scale not in ("std_unbiased", "std_biased", "none"):
        raise ValueError(f"scale must be 'std_unbiased', 'std_biased' or 'none', got {scale!r}.")
    if group_ids is not None:
        if len(group_ids) != rewards.shape[0]:
            raise DataError(
                f"group_ids has {len(group_ids)} entries for {rewards.shape[0]} rewards; one per row."
            )
        order = group_order(group_ids, group_size)  # (N,) grouped rows
        grouped = group_advantages(
            rewards[order], group_size, baseline=baseline, scale=scale, eps=eps
        )  # (N,)
        return torch.empty_like(grouped).index_copy_(0, order, grouped)  # (N,) back in row order
    r = _grouped(rewards, group_size)  # (B, G)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)  # (N,) no baseline without a second sample

    if baseline == "mean":
        b = r.mean(dim=1, keepdim=True)  # (B, 1)
    else:
        b = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)  # (B, G) mean of the other G-1 rewards
    a = r - b  # (B, G)

    if scale != "none":
        std = r.std(dim=1, keepdim=True, correction=1 if scale == "std_unbiased" else 0)  # (B, 1)
        a = a / (std + eps)  # (B, G)

    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # (B, 1) all rewards equal
    a = torch.where(constant, torch.zeros_like(a), a)  # (B, G) exact zeros, not rounding noise
    return a.reshape(-1)  # (N,)


def group_stats(rewards: Tensor, group_size: int) -> dict[str, float]:
    """Diagnostics of the learning signal (when the reward is flat, look at these two numbers first).

    reward_std_within_group: mean over groups of the unbiased (N-1) standard deviation inside each group
        (0 when group_size == 1).
    frac_zero_std_groups: fraction of groups whose rewards are all equal (max - min < 1e-8); such groups
        give zero advantages and teach nothing.
    """
    r = _grouped(rewards, group_size)  # (B, G)
    if group_size == 1:
        std = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)  # (B,)
    else:
        std = r.std(dim=1, correction=1)  # (B,)
    spread = r.amax(dim=1) - r.amin(dim=1)  # (B,)
    return {
        "reward_std_within_group": float(std.mean()) if r.shape[0] else 0.0,
        "frac_zero_std_groups": float((spread < 1e-8).float().mean()) if r.shape[0] else 0.0,
    }
