"""Turn-level credit: advantages per policy turn of a multi-turn episode, spread to its tokens.

GRPO gives every token of an episode the same advantage (its reward normalised in its group). On long
episodes that cannot tell a good move from the bad one two turns later; the functions here give each policy
turn its own advantage and return token advantages (N, T) that :func:`mmgrpo.grpo.losses.grpo_loss` takes
as they are (it accepts (N,) or (N, T)).

Three schemes (``credit``):

- ``"episode"`` (GRPO, the default elsewhere): :func:`episode_token_advantages`, the per-row advantage
  (N,) broadcast over the row's policy tokens. Kept here so the other two can be tested against it.
- ``"discounted"``: :func:`discounted_turn_advantages`. Per-turn returns
  ``R_k = sum_{j>=k} gamma^(j-k) r_j`` from per-turn rewards, normalised inside the task's group. By
  default per turn position (turn k of an episode is compared with turn k of the group's other episodes),
  as MT-GRPO normalises turn-level rewards per turn across the group (Zeng et al., "Reinforcing Multi-Turn
  Reasoning in LLM Agents via Turn-Level Credit Assignment", 2025): the baseline then depends on the time
  step only, which stays unbiased, and a late turn of a successful episode is not favoured over its first
  turn merely because fewer discount factors separate it from the reward (which pooling all turns of the
  group does: with a terminal reward 1, ``R_k = gamma^(L-1-k)`` grows with k). ``normalize="group"``
  pools every turn of the group instead (one mean and std per group, more samples per statistic). A
  position only one episode of the group reaches gets 0, as a group of size 1 does.
- ``"gigpo"``: :func:`gigpo_turn_advantages` (GiGPO, Feng et al., arXiv 2505.10978, verl-agent). The
  episode-level advantage (the GRPO one, computed by the caller) plus ``omega`` times a step-level one:
  the turns of a group's episodes whose state keys are equal (the same observation, e.g. the same grid,
  reached by different episodes or twice by one) form a step group, and each turn's discounted return is
  normalised inside its step group. A turn whose state no other turn of the group shares gets step-level 0
  (nothing to compare it with). The paper uses gamma 0.95 and omega 1; so do the defaults.

Normalisation: ``scale`` as in :func:`mmgrpo.grpo.advantages.group_advantages` ("std_unbiased" N-1, the
default; "std_biased" N; "none" for mean-only, Dr. GRPO style); ``eps`` added to the std; a set of equal
values gets exact zeros, never NaN.

Layout of the inputs. Per-turn lists are padded to (N, K), K the longest episode's number of turns, by
:func:`pad_turns`, with a ``turn_valid`` (N, K) mask. Token positions are the response's (N, T) with the
``loss_mask`` (1 = a token the policy generated). :func:`turn_index` maps each token to its turn: the
policy tokens of turn k get k; environment tokens (mask 0) take the index of the policy turn *before* them
(they are its consequence) and tokens before the first policy turn get -1. Only the policy tokens carry an
advantage: every spread returns 0 where the loss mask is 0.

Example (one group of two 2-turn episodes, the second reaching the goal)::

    rewards, valid = pad_turns([[0.0, 0.0], [0.0, 1.0]])          # (2, 2), (2, 2)
    discounted_returns(rewards, valid, gamma=0.5)                  # [[0, 0], [0.5, 1]]
    discounted_turn_advantages(rewards, valid, group_size=2, gamma=0.5)
    # per position, std N-1: [[-0.707, -0.707], [0.707, 0.707]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.errors import DataError
from mmgrpo.grpo.advantages import Scale, group_order

Credit = Literal["episode", "discounted", "gigpo"]
TurnNorm = Literal["position", "group"]

__all__ = [
    "Credit",
    "discounted_returns",
    "discounted_turn_advantages",
    "episode_token_advantages",
    "gigpo_turn_advantages",
    "normalize_in_groups",
    "pad_turns",
    "spread_turn_advantages",
    "turn_index",
]


# -- layout ------------------------------------------------------------------------------------------------
def pad_turns(turn_values: Sequence[Sequence[float]]) -> tuple[Tensor, Tensor]:
    """Per-episode lists of per-turn values (ragged) as ``values`` (N, K) float, padded with 0, and
    ``valid`` (N, K) bool; K = the longest list (at least 1, so an empty batch of turns still has a column)."""
    n = len(turn_values)
    k = max([len(v) for v in turn_values] + [1])
    values = torch.zeros(n, k)  # (N, K)
    valid = torch.zeros(n, k, dtype=torch.bool)  # (N, K)
    for i, row in enumerate(turn_values):
        if len(row):
            values[i, : len(row)] = torch.tensor([float(x) for x in row])
            valid[i, : len(row)] = True
    return values, valid


def turn_index(loss_mask: Tensor, turn_starts: Sequence[Sequence[int]] | None = None) -> Tensor:
    """The policy turn of every response token: (N, T) long.

    loss_mask (N, T): 1 where the policy generated the token. Without ``turn_starts`` each maximal run of
    1s is one turn. With ``turn_starts`` (per row, the token position where each policy turn begins, in
    increasing order) a turn runs from its start to the next one, so a turn may contain masked tokens.
    Environment tokens (mask 0) get the index of the turn before them; tokens before the first turn, -1.
    """
    if loss_mask.dim() != 2:
        raise DataError(f"loss_mask must be (N, T), got shape {tuple(loss_mask.shape)}.")
    policy = loss_mask != 0  # (N, T)
    n, t = policy.shape
    if turn_starts is None:
        prev = torch.cat([torch.zeros(n, 1, dtype=torch.bool, device=policy.device), policy[:, :-1]], dim=1)
        starts = policy & ~prev  # (N, T) first token of each run of 1s
    else:
        if len(turn_starts) != n:
            raise DataError(f"turn_starts has {len(turn_starts)} rows for a loss mask of {n} rows.")
        starts = torch.zeros(n, t, dtype=torch.bool, device=policy.device)  # (N, T)
        for i, row in enumerate(turn_starts):
            row = [int(s) for s in row]
            if any(b <= a for a, b in zip(row, row[1:], strict=False)) or any(not 0 <= s < t for s in row):
                raise DataError(f"turn_starts[{i}] = {row}: expected increasing positions in [0, {t}).")
            starts[i, row] = True
    return starts.long().cumsum(dim=1) - 1  # (N, T) -1 before the first turn


def spread_turn_advantages(
    turn_adv: Tensor, loss_mask: Tensor, turn_starts: Sequence[Sequence[int]] | None = None
) -> Tensor:
    """Token advantages (N, T): each policy token gets its turn's entry of ``turn_adv`` (N, K); tokens with
    loss mask 0 get 0. DataError when a row's loss mask holds more turns than ``turn_adv`` has columns."""
    idx = turn_index(loss_mask, turn_starts)  # (N, T)
    policy = loss_mask != 0  # (N, T)
    k = turn_adv.shape[1]
    used = torch.where(policy, idx, torch.full_like(idx, -1))  # (N, T) turn of each policy token
    if bool((used >= k).any()):
        rows = sorted({int(r) for r in (used >= k).nonzero()[:, 0].tolist()})
        raise DataError(
            f"rows {rows[:5]} have more policy turns in their loss mask than the {k} per-turn values given: "
            "pass one reward (and state key) per policy turn, or turn_starts when a turn's tokens are split."
        )
    gathered = turn_adv.gather(1, idx.clamp(0, k - 1))  # (N, T)
    return torch.where(policy & (idx >= 0), gathered, torch.zeros_like(gathered))  # (N, T)


def episode_token_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """The GRPO broadcast as (N, T): the row's advantage (N,) on each of its policy tokens, 0 elsewhere."""
    return advantages[:, None] * (loss_mask != 0).to(advantages.dtype)  # (N, T)


# -- statistics --------------------------------------------------------------------------------------------
def normalize_in_groups(
    values: Tensor, ids: Tensor, *, scale: Scale = "std_unbiased", eps: float = 1e-6
) -> Tensor:
    """``(v - mean) / (std + eps)`` of values (M,) inside each set of entries sharing an id (ids (M,) long,
    any non-negative ints); sets of one entry, and sets whose values are all equal, get exact 0."""
    if scale not in ("std_unbiased", "std_biased", "none"):
        raise ValueError(f"scale must be 'std_unbiased', 'std_biased' or 'none', got {scale!r}.")
    if values.numel() == 0:
        return values.clone()
    v = values.double()  # (M,) float64: sums over sets stay exact enough
    _, inv = torch.unique(ids, return_inverse=True)  # (M,) set of each entry, 0..S-1
    s = int(inv.max()) + 1
    count = torch.zeros(s, dtype=v.dtype).index_add_(0, inv, torch.ones_like(v))  # (S,)
    mean = torch.zeros(s, dtype=v.dtype).index_add_(0, inv, v) / count  # (S,)
    centred = v - mean[inv]  # (M,)
    out = centred
    if scale != "none":
        sq = torch.zeros(s, dtype=v.dtype).index_add_(0, inv, centred**2)  # (S,)
        denom = (count - 1).clamp(min=1) if scale == "std_unbiased" else count  # (S,)
        std = (sq / denom).sqrt()  # (S,)
        out = centred / (std[inv] + eps)  # (M,)
    vmax = torch.full((s,), float("-inf"), dtype=v.dtype).scatter_reduce(0, inv, v, "amax")  # (S,)
    vmin = torch.full((s,), float("inf"), dtype=v.dtype).scatter_reduce(0, inv, v, "amin")  # (S,)
    flat = (vmax == vmin)[inv]  # (M,) a single entry, or all equal
    return torch.where(flat, torch.zeros_like(out), out).to(values.dtype)  # (M,)


def discounted_returns(turn_rewards: Tensor, turn_valid: Tensor, gamma: float) -> Tensor:
    """R_k = sum_{j>=k, j valid} gamma^(j-k) r_j (N, K) from turn_rewards (N, K); 0 on padding turns."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
    r = torch.where(turn_valid, turn_rewards, torch.zeros_like(turn_rewards))  # (N, K)
    out = torch.zeros_like(r)  # (N, K)
    running = torch.zeros_like(r[:, 0])  # (N,)
    for k in range(r.shape[1] - 1, -1, -1):  # K is the number of turns: a short loop
        running = r[:, k] + gamma * running  # (N,)
        out[:, k] = running
    return torch.where(turn_valid, out, torch.zeros_like(out))  # (N, K)


def _group_of_rows(n: int, group_size: int, group_ids: Sequence[int] | None) -> Tensor:
    """(N,) long: a dense group number per row, from ``group_ids`` or consecutive runs of ``group_size``."""
    if group_ids is None:
        if group_size < 1 or n % group_size:
            raise DataError(f"{n} rows are not whole groups of group_size={group_size}; pass group_ids.")
        return torch.arange(n) // group_size  # (N,)
    if len(group_ids) != n:
        raise DataError(f"group_ids has {len(group_ids)} entries for {n} rows; one per row.")
    group_order(group_ids, group_size)  # checks that every group has group_size rows
    dense: dict[int, int] = {}
    return torch.tensor([dense.setdefault(int(g), len(dense)) for g in group_ids], dtype=torch.long)  # (N,)


def _with_episode_rest(turn_rewards: Tensor, turn_valid: Tensor, episode_rewards: Tensor | None) -> Tensor:
    """turn_rewards (N, K) with ``episode_rewards - sum(turn_rewards)`` (N,) added to each row's last valid
    turn: a verifier's reward that no turn earned (format, answer) counts at the end of the episode."""
    if episode_rewards is None:
        return turn_rewards
    r = torch.where(turn_valid, turn_rewards, torch.zeros_like(turn_rewards))  # (N, K)
    rest = episode_rewards.to(r.dtype) - r.sum(dim=1)  # (N,)
    last = turn_valid.long().cumsum(dim=1).argmax(dim=1)  # (N,) the last valid turn (0 when none)
    has = turn_valid.any(dim=1)  # (N,)
    return r.index_put((torch.arange(r.shape[0])[has], last[has]), rest[has], accumulate=True)  # (N, K)


def _check_turns(turn_rewards: Tensor, turn_valid: Tensor) -> None:
    if turn_rewards.dim() != 2 or turn_valid.shape != turn_rewards.shape:
        raise DataError(
            f"turn_rewards and turn_valid must both be (N, K); got {tuple(turn_rewards.shape)} and "
            f"{tuple(turn_valid.shape)} (pad_turns builds them from per-episode lists)."
        )
    if not bool(torch.isfinite(turn_rewards[turn_valid]).all()):
        raise DataError("turn_rewards contain NaN or inf; an env must map a bad turn to a finite reward.")


# -- the two turn-level schemes ----------------------------------------------------------------------------
def discounted_turn_advantages(
    turn_rewards: Tensor,
    turn_valid: Tensor,
    group_size: int,
    *,
    group_ids: Sequence[int] | None = None,
    gamma: float = 0.95,
    normalize: TurnNorm = "position",
    episode_rewards: Tensor | None = None,
    valid: Tensor | None = None,
    scale: Scale = "std_unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """Per-turn advantages (N, K): discounted returns normalised inside each task's group.

    turn_rewards, turn_valid (N, K): per-turn rewards and which turns exist (:func:`pad_turns`).
    normalize: "position" (turn k against turn k of the group's episodes) or "group" (all the group's turns
        together); see the module docstring. episode_rewards (N,): when given, the part of each episode's
        reward that no turn earned is added to its last turn. valid (N,) bool: rows left out of every
        statistic, with advantage 0 (as in ``group_advantages``).
    """
    _check_turns(turn_rewards, turn_valid)
    if normalize not in ("position", "group"):
        raise ValueError(f"normalize must be 'position' or 'group', got {normalize!r}.")
    n, k = turn_rewards.shape
    group = _group_of_rows(n, group_size, group_ids)  # (N,)
    live = turn_valid if valid is None else turn_valid & valid[:, None].bool()  # (N, K)
    returns = discounted_returns(
        _with_episode_rest(turn_rewards.float(), turn_valid, episode_rewards), live, gamma
    )
    position = torch.arange(k)[None, :].expand(n, k)  # (N, K)
    ids = group[:, None] * k + position if normalize == "position" else group[:, None].expand(n, k)  # (N, K)
    adv = torch.zeros_like(returns)  # (N, K)
    adv[live] = normalize_in_groups(returns[live], ids[live], scale=scale, eps=eps)  # (M,) live turns
    return adv  # (N, K)


def gigpo_turn_advantages(
    episode_advantages: Tensor,
    turn_rewards: Tensor,
    turn_valid: Tensor,
    turn_keys: Sequence[Sequence[Hashable]],
    group_size: int,
    *,
    group_ids: Sequence[int] | None = None,
    gamma: float = 0.95,
    omega: float = 1.0,
    episode_rewards: Tensor | None = None,
    valid: Tensor | None = None,
    scale: Scale = "std_unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """GiGPO per-turn advantages (N, K): ``episode_advantages[i] + omega * step_advantage[i, k]``.

    episode_advantages (N,): the episode-level (GRPO) advantages, e.g. ``group_advantages(rewards, G)``.
    turn_keys: per row, one hashable state key per turn (the observation the turn answered, e.g. the grid
        text); turns of the same task group with equal keys form a step group. Keys of padding turns are not
        read. Other arguments as in :func:`discounted_turn_advantages`. Padding turns and left-out rows
        get 0.
    """
    _check_turns(turn_rewards, turn_valid)
    n, k = turn_rewards.shape
    if episode_advantages.shape != (n,):
        raise DataError(f"episode_advantages must be (N,) = ({n},), got {tuple(episode_advantages.shape)}.")
    if len(turn_keys) != n:
        raise DataError(
            f"turn_keys has {len(turn_keys)} rows for {n} episodes; one list of keys per episode."
        )
    group = _group_of_rows(n, group_size, group_ids)  # (N,)
    live = turn_valid if valid is None else turn_valid & valid[:, None].bool()  # (N, K)
    returns = discounted_returns(
        _with_episode_rest(turn_rewards.float(), turn_valid, episode_rewards), live, gamma
    )
    step_ids = torch.full((n, k), -1, dtype=torch.long)  # (N, K) step group of each live turn
    dense: dict[tuple[int, Hashable], int] = {}
    for i in range(n):
        turns = int(turn_valid[i].sum())
        if len(turn_keys[i]) < turns:
            raise DataError(
                f"turn_keys[{i}] has {len(turn_keys[i])} keys for {turns} turns; one key per turn."
            )
        for j in range(turns):
            if bool(live[i, j]):
                step_ids[i, j] = dense.setdefault((int(group[i]), turn_keys[i][j]), len(dense))
    step = torch.zeros_like(returns)  # (N, K)
    step[live] = normalize_in_groups(returns[live], step_ids[live], scale=scale, eps=eps)  # (M,)
    total = episode_advantages.to(step.dtype)[:, None] + omega * step  # (N, K)
    return torch.where(live, total, torch.zeros_like(total))  # (N, K)
