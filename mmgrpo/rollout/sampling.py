"""What a step trains on beyond "B tasks, G episodes each": DAPO's dynamic sampling and overlong handling.

Dynamic sampling (``grpo.dynamic_sampling``): a group whose G rewards are all equal has zero advantages and
teaches nothing, yet costs a full forward and backward. Such groups are dropped and more tasks are rolled
out, B at a time from the task stream, until B groups with reward variance are found or
``grpo.max_sampling_rounds`` extra rounds have run; then the step trains on what it has and says so.

Overlong handling (``grpo.overlong``), for episodes cut for length (LENGTH_CUTS: a turn that reached
``grpo.max_new_tokens``, an episode that reached ``env.max_episode_tokens``; not one ended by
``env.max_turns`` or by the env, which is no sign of rambling):
  mask          their tokens are left out of the loss (DAPO's overlong filtering); they still count in
                their group's statistics; the share is logged as ``overlong/masked_frac``
  soft_penalty  DAPO's soft overlong punishment, added to the reward before advantages: 0 up to
                L - C tokens, falling linearly to -factor at L, -factor for an episode cut for length.
                L = grpo.max_new_tokens is a per-turn limit, so the length compared with it is the
                episode's longest policy turn (a single-turn episode: its response), never the tokens
                summed over turns; C = grpo.overlong_buffer
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mmgrpo.rollout.episodes import RolloutBatch
from mmgrpo.verifier import RewardBreakdown

LENGTH_CUTS = ("max_new_tokens", "token_budget")
"""The truncation reasons (mmgrpo.rollout.episodes.TRUNCATION_REASONS) that mean "too long"."""


def longest_turn(loss_mask: Sequence[int]) -> int:
    """The most policy tokens in one turn of an episode: the longest run of 1s in its response loss mask
    (environment tokens, 0, separate the turns). e.g. [1, 1, 1, 0, 0, 1, 1] -> 3."""
    best = run = 0
    for m in loss_mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


def zero_variance_groups(rewards: Tensor, group_ids: Sequence[int]) -> set[int]:
    """The ids of the groups whose rewards are all equal (max - min < 1e-8). rewards (N,)."""
    by_group: dict[int, list[float]] = {}
    for gid, r in zip(group_ids, rewards.tolist(), strict=True):
        by_group.setdefault(gid, []).append(r)
    return {gid for gid, rs in by_group.items() if max(rs) - min(rs) < 1e-8}


def overlong_penalty(lengths: Tensor, truncated: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment per episode, (N,): 0 for length <= max_len - buffer, then
    ``-factor * (length - (max_len - buffer)) / buffer`` up to max_len, and -factor for a truncated one.

    lengths (N,) policy tokens of each episode; truncated (N,) bool.
    e.g. max_len 8, buffer 4, factor 1: lengths 3, 4, 6, 8 -> 0, 0, -0.5, -1.
    """
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0) / max(buffer, 1)  # (N,)
    penalty = -factor * over.clamp(max=1.0)  # (N,)
    return torch.where(truncated, torch.full_like(penalty, -factor), penalty)  # (N,)


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The episodes ``rows`` of ``batch`` (whole groups, in order)."""
    return RolloutBatch(
        [batch.trajectories[i] for i in rows],
        batch.tokens.select(rows),
        batch.group_size,
        failed_tasks=list(batch.failed_tasks),
    )


def select_scored(scored: RewardBreakdown, rows: list[int]) -> RewardBreakdown:
    idx = torch.as_tensor(rows, dtype=torch.long)
    return RewardBreakdown(
        total=scored.total[idx],
        per_verifier={k: v[idx] for k, v in scored.per_verifier.items()},
        failures=dict(scored.failures),
        errors=list(scored.errors),
        skipped={k: v[idx] for k, v in scored.skipped.items()},
    )


def concat_batches(parts: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The episodes of ``parts`` in order, as one batch; group ids are renumbered so that groups of
    different parts never share an id."""
    from mmgrpo.model.batch import TokenBatch

    if len(parts) == 1:
        return parts[0]
    offset = 0
    for part in parts:
        for t in part.trajectories:
            t.group += offset
        offset = max((t.group for t in part.trajectories), default=offset - 1) + 1
    return RolloutBatch(
        [t for p in parts for t in p.trajectories],
        TokenBatch.concat([p.tokens for p in parts], pad_token_id),
        parts[0].group_size,
        failed_tasks=[f for p in parts for f in p.failed_tasks],
    )


def concat_scored(parts: list[RewardBreakdown]) -> RewardBreakdown:
    """Scores of several batches in order (failures summed per verifier)."""
    if len(parts) == 1:
        return parts[0]
    failures: dict[str, int] = {}
    for p in parts:
        for k, v in p.failures.items():
            failures[k] = failures.get(k, 0) + v
    return RewardBreakdown(
        total=torch.cat([p.total for p in parts]),
        per_verifier={k: torch.cat([p.per_verifier[k] for p in parts]) for k in parts[0].per_verifier},
        failures=failures,
        errors=[e for p in parts for e in p.errors],
        skipped={k: torch.cat([p.skipped[k] for p in parts]) for k in parts[0].skipped},
    )
