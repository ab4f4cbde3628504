"""grpo.credit: the step's advantages per episode (GRPO) or per policy turn (mmgrpo.grpo.turn_credit), from
the rollout's trajectories: each turn's env reward (``Trajectory.turn_rewards``, 0 for a turn the env never
answered, e.g. one cut at max_new_tokens) and the state it answered (``Trajectory.turn_states``, the env's
``info["state"]``; a turn without one is a step group of its own, step-level advantage 0)."""

from __future__ import annotations

from collections.abc import Hashable

from torch import Tensor

from mmgrpo.grpo import turn_credit
from mmgrpo.rollout.episodes import RolloutBatch


def assign(g, batch: RolloutBatch, episode_adv: Tensor, rewards: Tensor, valid: Tensor) -> Tensor:
    """``episode_adv`` (N,) as it is for grpo.credit=episode; else token advantages (N, T) over the
    batch's response columns. ``rewards`` (N,) the episodes' (shaped) rewards, ``valid`` (N,) bool the rows in
    their groups' statistics."""
    if g.credit == "episode":
        return episode_adv
    trajs = batch.trajectories
    per_turn = [
        list(t.turn_rewards[: t.turns]) + [0.0] * max(t.turns - len(t.turn_rewards), 0) for t in trajs
    ]
    turn_rewards, turn_valid = turn_credit.pad_turns(per_turn)  # (N, K), (N, K)
    G, ids = batch.group_size, batch.group_ids
    kw = dict(
        group_ids=ids, gamma=g.credit_gamma, episode_rewards=rewards.float(), valid=valid, scale=g.scale
    )
    if g.credit == "discounted":
        turn_adv = turn_credit.discounted_turn_advantages(
            turn_rewards, turn_valid, G, normalize=g.credit_norm, **kw
        )
    else:
        keys = [state_keys(i, t.turn_states, t.turns) for i, t in enumerate(trajs)]
        turn_adv = turn_credit.gigpo_turn_advantages(
            episode_adv.float(), turn_rewards, turn_valid, keys, G, omega=g.credit_omega, **kw
        )  # (N, K)
    return turn_credit.spread_turn_advantages(turn_adv, batch.tokens.loss_mask)  # (N, T)


def state_keys(row: int, states: list, turns: int) -> list[Hashable]:
    """One hashable key per policy turn: the env's state, or a key no other turn has when it gave none."""
    keys: list[Hashable] = []
    for k in range(turns):
        if k < len(states) and states[k] is not None:
            s = states[k]
            keys.append(s if isinstance(s, Hashable) else repr(s))
        else:
            keys.append(("no state", row, k))
    return keys


__all__ = ["assign", "state_keys"]
