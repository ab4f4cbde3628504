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

Several verifiers (:func:`combine_advantages`): ``"sum_then_normalize"`` normalises the weighted sum of the
rewards (what ``group_advantages(RewardBreakdown.total)`` does); ``"normalize_then_sum"`` normalises each
verifier's rewards inside each group first and then takes the weighted sum (GDPO, arXiv 2601.05242), so a
reward of large scale or spread cannot drown the others, and a verifier on which a group agrees
contributes 0 there. GDPO then also rescales the summed advantages by their batch standard deviation;
that last step is not done here.

Rows left out (``valid``, as TRL leaves out a completion every reward function returned None for): such a
row is not part of its group's baseline or standard deviation and gets advantage 0; the group's statistics
are those of its other rows (fewer than two: zeros).

Example::

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])                     # (N,) one group of G=4
    group_advantages(rewards, group_size=4)                          # (N,) [0.866, -0.866, 0.866, -0.866]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.errors import DataError

Baseline = Literal["mean", "rloo"]
Scale = Literal["std_unbiased", "std_biased", "none"]
CombineMode = Literal["sum_then_normalize", "normalize_then_sum"]


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
    valid: Tensor | None = None,
) -> Tensor:
    """Advantages (N,) of rewards (N,), normalised inside each group: the rows sharing a ``group_ids`` entry,
    or, without ids, each run of ``group_size`` consecutive rows. ``valid`` (N,) bool: rows marked False are
    left out of their group's statistics and get 0 (see the module docstring); None keeps every row.

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
            rewards[order],
            group_size,
            baseline=baseline,
            scale=scale,
            eps=eps,
            valid=None if valid is None else valid[order],
        )  # (N,)
        return torch.empty_like(grouped).index_copy_(0, order, grouped)  # (N,) back in row order
    r = _grouped(rewards, group_size)  # (B, G)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)  # (N,) no baseline without a second sample
    if valid is not None and not bool(valid.all()):
        return _masked_advantages(r, valid.view(r.shape), baseline, scale, eps).reshape(-1)  # (N,)

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


def _masked_advantages(r: Tensor, m: Tensor, baseline: Baseline, scale: Scale, eps: float) -> Tensor:
    """``group_advantages`` of r (B, G) over the rows where m (B, G) is True; 0 elsewhere, and in groups
    with fewer than two such rows or whose such rows all have one reward."""
    m = m.to(torch.bool)  # (B, G)
    k = m.sum(dim=1, keepdim=True).to(r.dtype)  # (B, 1) rows kept per group
    r_kept = torch.where(m, r, torch.zeros_like(r))  # (B, G)
    mean = r_kept.sum(dim=1, keepdim=True) / k.clamp(min=1)  # (B, 1)
    if baseline == "mean":
        b = mean  # (B, 1)
    else:
        b = (r_kept.sum(dim=1, keepdim=True) - r_kept) / (k - 1).clamp(min=1)  # (B, G) the other kept rows
    a = r - b  # (B, G)
    if scale != "none":
        sq = torch.where(m, (r - mean) ** 2, torch.zeros_like(r))  # (B, G)
        dof = k - (1 if scale == "std_unbiased" else 0)  # (B, 1)
        std = (sq.sum(dim=1, keepdim=True) / dof.clamp(min=1)).sqrt()  # (B, 1)
        a = a / (std + eps)  # (B, G)
    inf = torch.full_like(r, float("inf"))  # (B, G)
    hi = torch.where(m, r, -inf).amax(dim=1, keepdim=True)  # (B, 1)
    lo = torch.where(m, r, inf).amin(dim=1, keepdim=True)  # (B, 1)
    zero = (hi == lo) | (k < 2) | ~m  # (B, G) constant groups, groups without a baseline, left-out rows
    return torch.where(zero, torch.zeros_like(a), a)  # (B, G)


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


def combine_advantages(
    per_verifier: Mapping[str, Tensor],
    weights: Mapping[str, float],
    group_ids: Sequence[int] | None,
    group_size: int,
    mode: CombineMode = "sum_then_normalize",
    baseline: Baseline = "mean",
    scale: Scale = "std_unbiased",
    eps: float = 1e-6,
    valid: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """Advantages (N,) from several rewards: per_verifier maps a name to its rewards (N,), weights a name to
    its weight (the same names); group_ids, group_size, baseline, scale and eps as in :func:`group_advantages`.
    ``valid`` maps a name to (N,) bool, False where that reward does not count (a None from a TRL reward
    function); a name it lacks counts everywhere. "sum_then_normalize" keeps the rows some reward counts on.

    mode "sum_then_normalize": ``group_advantages(sum_v weight_v * r_v)``. The weighted sum is accumulated
        in float64 in the order of ``per_verifier`` and then rounded to the rewards' dtype, as
        ``Rewards.score`` builds ``RewardBreakdown.total``, so the result equals today's
        ``group_advantages(total, ...)`` bit for bit whenever the verifier values are exact in float32
        (0/1, halves, ...; ``RewardBreakdown.per_verifier`` holds float32-rounded values, the total sums the
        unrounded ones). Add an ``env_reward`` entry of weight 1 when the total includes the env reward.
    mode "normalize_then_sum": ``sum_v weight_v * group_advantages(r_v)`` (GDPO without its final batch
        rescaling): every verifier is normalised inside each group on its own, so a verifier whose rewards
        are all equal in a group contributes exactly 0 to that group.
    """
    if mode not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(f"mode must be 'sum_then_normalize' or 'normalize_then_sum', got {mode!r}.")
    if not per_verifier:
        raise ValueError("per_verifier is empty; pass at least one verifier's rewards (N,).")
    if set(weights) != set(per_verifier):
        missing, extra = sorted(set(per_verifier) - set(weights)), sorted(set(weights) - set(per_verifier))
        raise ValueError(
            f"weights must name exactly the verifiers of per_verifier; no weight for {missing}, "
            f"weights for unknown verifiers {extra}."
        )
    first = next(iter(per_verifier.values()))
    for name, r in per_verifier.items():
        if r.dim() != 1 or r.shape != first.shape:
            raise DataError(
                f"every verifier's rewards must be (N,) of one length; {name!r} has shape {tuple(r.shape)}, "
                f"the first has {tuple(first.shape)}."
            )
    dtype = functools.reduce(torch.promote_types, [r.dtype for r in per_verifier.values()])
    if not dtype.is_floating_point:
        dtype = torch.float32
    kwargs = dict(group_ids=group_ids, baseline=baseline, scale=scale, eps=eps)
    valid = dict(valid or {})
    if mode == "sum_then_normalize":
        total = _weighted_sum(per_verifier, weights).to(dtype)  # (N,)
        some = [valid.get(k) for k in per_verifier]
        kept = None if any(v is None for v in some) else torch.stack(some).any(dim=0)  # (N,)
        return group_advantages(total, group_size, valid=kept, **kwargs)  # (N,)
    per_adv = {
        name: group_advantages(r.to(dtype), group_size, valid=valid.get(name), **kwargs)
        for name, r in per_verifier.items()
    }  # name -> (N,), each normalised inside its groups
    return _weighted_sum(per_adv, weights).to(dtype)  # (N,)


def _weighted_sum(values: Mapping[str, Tensor], weights: Mapping[str, float]) -> Tensor:
    """sum_v weights[v] * values[v] (N,), accumulated in float64 in the order of ``values``."""
    first = next(iter(values.values()))
    total = torch.zeros(first.shape, dtype=torch.float64, device=first.device)  # (N,)
    for name, v in values.items():
        total = total + float(weights[name]) * v.to(torch.float64)  # (N,)
    return total  # (N,)


def group_size_at(step: int, schedule: Sequence[tuple[int, int]], default: int) -> int:
    """The group size G at ``step`` under ``schedule`` [(from_step, G), ...], sorted by from_step.

    Each entry holds from its from_step until the next entry's; before the first entry (or with an empty
    schedule) the group size is ``default``. [(0, 16), (100, 8)] gives G = 16 for steps 0..99, then 8.
    Raises ValueError on a negative step, an unsorted or repeated from_step, or a G (or default) below 2.
    """
    if default < 2:
        raise ValueError(f"default group size must be >= 2 (GRPO needs a second sample), got {default}.")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}.")
    previous = -1
    for k, entry in enumerate(schedule):
        if len(entry) != 2:
            raise ValueError(f"schedule[{k}] must be a pair (from_step, G), got {entry!r}.")
        from_step, g = entry
        if from_step < 0:
            raise ValueError(f"schedule[{k}] = {entry!r}: from_step must be >= 0.")
        if from_step <= previous:
            raise ValueError(
                f"schedule must be sorted by from_step with no step twice; schedule[{k}] = {entry!r} "
                f"comes after from_step {previous}: {list(schedule)!r}."
            )
        if g < 2:
            raise ValueError(
                f"schedule[{k}] = {entry!r}: G must be >= 2 (a group of 1 has no baseline and gets zero "
                "advantages)."
            )
        previous = from_step
    g_now = default
    for from_step, g in schedule:
        if from_step <= step:
            g_now = g
    return int(g_now)
