"""DAPO's sampling-side pieces, as the trainer applies them to a step's episodes.

- Dynamic sampling (``grpo.dynamic_sampling``): groups whose rewards are all equal carry no gradient; they
  are dropped and more tasks are rolled out, ``tasks_per_step`` at a time, until every process has its
  share of groups with reward variance or ``grpo.max_sampling_rounds`` is reached (``sample_varied_groups``).
  Every process takes part in every round, so none waits on a collective the others skipped.
- Overlong shaping (``grpo.overlong``): ``soft_penalty`` lowers the reward of responses that near the length
  cut (``shape_rewards``); ``mask`` takes episodes cut for length out of the loss (``trained_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from mmgrpo.config.sections import GRPOConfig
from mmgrpo.model.batch import TokenBatch
from mmgrpo.rollout.episodes import RolloutBatch
from mmgrpo.rollout.sampling import (
    LENGTH_CUTS,
    concat_batches,
    concat_scored,
    longest_turn,
    overlong_penalty,
    select_rows,
    select_scored,
    zero_variance_groups,
)
from mmgrpo.train.distributed import gather_objects


@dataclasses.dataclass
class Sampled:
    """What dynamic sampling kept: the rows of at most ``need`` groups, and how it went."""

    batch: RolloutBatch
    scored: Any  # RewardBreakdown of the kept rows
    rounds: int
    dropped: int  # groups dropped for zero reward variance
    have: int  # groups with variance found (may exceed need)
    need: int  # this process's share of groups

    @property
    def gave_up(self) -> bool:
        return self.have < self.need

    def stats(self) -> dict[str, float]:
        return {
            "dynamic/rounds": self.rounds,
            "dynamic/dropped_groups": self.dropped,
            "dynamic/kept_groups": min(self.have, self.need),
            "dynamic/gave_up": int(self.gave_up),
        }


def sample_varied_groups(
    one_round: Callable[[], tuple[RolloutBatch, Any]],
    *,
    need: int,
    max_rounds: int,
    accelerator,
    pad_token_id: int,
) -> Sampled:
    """Call ``one_round`` (roll out and score the next tasks) until this process has ``need`` groups whose
    rewards vary, on every process, or more than ``max_rounds`` rounds ran; keep the first ``need`` such
    groups. When none was found, the last round's batch is returned (with every group flat)."""
    kept: list[tuple[RolloutBatch, Any]] = []
    have = dropped = rounds = 0
    while True:
        batch, scored = one_round()
        rounds += 1
        flat = zero_variance_groups(scored.total, batch.group_ids)
        rows = [i for i, gid in enumerate(batch.group_ids) if gid not in flat]
        dropped += len(flat)
        if rows:
            kept.append((select_rows(batch, rows), select_scored(scored, rows)))
            have += len(set(batch.group_ids[i] for i in rows))
        done = all(gather_objects(accelerator, have >= need))
        if done or rounds > max_rounds:
            break
    if kept:
        batch = concat_batches([b for b, _ in kept], pad_token_id)
        scored = concat_scored([s for _, s in kept])
        first = set(list(dict.fromkeys(batch.group_ids))[:need])  # at most this process's share
        rows = [i for i, gid in enumerate(batch.group_ids) if gid in first]
        batch, scored = select_rows(batch, rows), select_scored(scored, rows)
    return Sampled(batch, scored, rounds, dropped, have, need)


def gave_up_line(step: int, s: Sampled, tasks_per_step: int) -> str:
    """The warning when dynamic sampling stopped short of its groups."""
    return (
        f"mmgrpo: warning: step {step}: dynamic sampling gave up after {s.rounds} rounds of "
        f"{tasks_per_step} tasks: {s.have} of the {s.need} groups needed have reward variance, training "
        "on those. Raise grpo.max_sampling_rounds, make the reward finer, or warm-start the model."
    )


def shape_rewards(g: GRPOConfig, batch: RolloutBatch, rewards: torch.Tensor) -> torch.Tensor:
    """Rewards (N,) after grpo.overlong=soft_penalty (DAPO), before group normalisation."""
    if g.overlong != "soft_penalty":
        return rewards
    # max_new_tokens bounds each turn: the longest turn is what nears it (single-turn: the response)
    lengths = torch.tensor([longest_turn(t.loss_mask) for t in batch.trajectories])  # (N,)
    cut = torch.tensor([t.truncation in LENGTH_CUTS for t in batch.trajectories])  # (N,)
    return rewards + overlong_penalty(lengths, cut, g.max_new_tokens, g.overlong_buffer, g.overlong_factor)


def trained_tokens(g: GRPOConfig, batch: RolloutBatch) -> TokenBatch:
    """The batch's tokens; with grpo.overlong=mask, episodes cut for length leave the loss (DAPO's
    overlong filtering); those ended by max_turns or the env stay."""
    if g.overlong != "mask":
        return batch.tokens
    cut = torch.tensor([t.truncation in LENGTH_CUTS for t in batch.trajectories])  # (N,)
    tokens = batch.tokens
    mask = tokens.loss_mask * (~cut).long()[:, None]  # (N, T)
    return dataclasses.replace(tokens, loss_mask=mask)
