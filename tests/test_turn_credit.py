"""Turn-level credit (mmgrpo/grpo/turn_credit.py) against plain Python loops and hand-derived numbers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mmgrpo.errors import DataError
from mmgrpo.grpo.advantages import group_advantages
from mmgrpo.grpo.turn_credit import (
    discounted_returns,
    discounted_turn_advantages,
    episode_token_advantages,
    gigpo_turn_advantages,
    normalize_in_groups,
    pad_turns,
    spread_turn_advantages,
    turn_index,
)

# -- plain-loop references ---------------------------------------------------------------------------------


def ref_normalize(values: list[float], eps: float = 1e-6) -> list[float]:
    """(v - mean) / (std_{N-1} + eps); one value or all equal: zeros."""
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(values)
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return [(v - m) / (sd + eps) for v in values]


def ref_returns(rewards: list[float], gamma: float) -> list[float]:
    return [sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards))) for k in range(len(rewards))]


def ref_turn_index(mask: list[int]) -> list[int]:
    out, turn, prev = [], -1, 0
    for m in mask:
        if m and not prev:
            turn += 1
        out.append(turn)
        prev = m
    return out


def ref_discounted(episodes, group_size, gamma, by_position):
    """episodes: list of per-turn reward lists, consecutive groups of group_size."""
    out = [[0.0] * len(e) for e in episodes]
    for g0 in range(0, len(episodes), group_size):
        rows = range(g0, g0 + group_size)
        rets = {i: ref_returns(episodes[i], gamma) for i in rows}
        sets: dict = {}
        for i in rows:
            for k in range(len(episodes[i])):
                sets.setdefault(k if by_position else 0, []).append((i, k))
        for members in sets.values():
            normed = ref_normalize([rets[i][k] for i, k in members])
            for (i, k), a in zip(members, normed, strict=True):
                out[i][k] = a
    return out


def ref_gigpo(episode_adv, episodes, keys, group_size, gamma, omega):
    out = [[0.0] * len(e) for e in episodes]
    for g0 in range(0, len(episodes), group_size):
        rows = range(g0, g0 + group_size)
        rets = {i: ref_returns(episodes[i], gamma) for i in rows}
        sets: dict = {}
        for i in rows:
            for k in range(len(episodes[i])):
                sets.setdefault(keys[i][k], []).append((i, k))
        for members in sets.values():
            normed = ref_normalize([rets[i][k] for i, k in members])
            for (i, k), a in zip(members, normed, strict=True):
                out[i][k] = episode_adv[i] + omega * a
    return out


def random_episodes(rng: random.Random, n: int, max_turns: int = 5):
    return [
        [rng.choice([0.0, 0.0, 0.5, 1.0, -0.2]) for _ in range(rng.randint(1, max_turns))] for _ in range(n)
    ]


def as_lists(t: torch.Tensor, episodes) -> list[float]:
    """The real turns of t (N, K), flattened row by row (pytest.approx takes flat lists)."""
    return [x for i, e in enumerate(episodes) for x in t[i, : len(e)].tolist()]


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


# -- layout --------------------------------------------------------------------------------------------------


def test_pad_turns_pads_ragged_episodes_and_marks_the_real_turns():
    values, valid = pad_turns([[1.0], [0.0, 2.0, 3.0], []])
    assert values.tolist() == [[1.0, 0.0, 0.0], [0.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    assert valid.tolist() == [[True, False, False], [True, True, True], [False, False, False]]


def test_turn_index_matches_a_loop_on_random_masks():
    rng = random.Random(0)
    masks = [[rng.choice([0, 1, 1]) for _ in range(17)] for _ in range(20)]
    got = turn_index(torch.tensor(masks))
    assert got.tolist() == [ref_turn_index(m) for m in masks]


def test_turn_index_env_tokens_take_the_turn_before_them_and_starts_split_adjacent_turns():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0]])  # prompt-side env tokens, turn 0, env, turn 1, env
    assert turn_index(mask).tolist() == [[-1, -1, 0, 0, 0, 0, 1, 1]]
    # two turns with no env token between them are one run of 1s; their starts tell them apart
    adjacent = torch.tensor([[1, 1, 1, 1, 0]])
    assert turn_index(adjacent).tolist() == [[0, 0, 0, 0, 0]]
    assert turn_index(adjacent, [[0, 2]]).tolist() == [[0, 0, 1, 1, 1]]
    with pytest.raises(DataError):
        turn_index(adjacent, [[2, 0]])


def test_spread_puts_each_turns_advantage_on_its_policy_tokens_only():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 0, 0, 0]])
    turn_adv = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    got = spread_turn_advantages(turn_adv, mask)
    assert got.tolist() == [[0.5, 0.5, 0.0, -1.0, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0]]
    with pytest.raises(DataError, match="more policy turns"):
        spread_turn_advantages(turn_adv[:, :1], mask)


def test_equal_turn_advantages_spread_to_exactly_the_episode_broadcast():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    adv = group_advantages(rewards, 4)  # (N,) GRPO.md row 3: 0.7833 -1.3056 0.7833 -0.2611
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0], [0, 1, 1, 1, 1, 1]])
    per_turn = adv[:, None].expand(4, 3).clone()  # every turn the episode's advantage
    assert torch.equal(spread_turn_advantages(per_turn, mask), episode_token_advantages(adv, mask))
    assert episode_token_advantages(adv, mask)[0].tolist() == pytest.approx(
        [0.7833, 0.7833, 0, 0.7833, 0.7833, 0], abs=1e-4
    )


# -- statistics ----------------------------------------------------------------------------------------------


def test_normalize_in_groups_matches_a_loop_with_variable_set_sizes():
    rng = random.Random(1)
    values = [rng.choice([0.0, 1.0, 0.3, 2.0]) for _ in range(40)]
    ids = [rng.randint(0, 9) for _ in range(40)]
    got = normalize_in_groups(torch.tensor(values), torch.tensor(ids))
    want = [0.0] * 40
    for s in set(ids):
        members = [i for i in range(40) if ids[i] == s]
        for i, a in zip(members, ref_normalize([values[i] for i in members]), strict=True):
            want[i] = a
    assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_normalize_in_groups_gives_exact_zeros_for_singletons_and_equal_sets():
    got = normalize_in_groups(torch.tensor([3.0, 0.1, 0.1, 0.1, 5.0]), torch.tensor([0, 1, 1, 1, 2]))
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert normalize_in_groups(torch.tensor([1.0, 0.0]), torch.tensor([4, 4]), scale="none").tolist() == [
        0.5,
        -0.5,
    ]


def test_discounted_returns_by_hand_and_against_a_loop():
    values, valid = pad_turns([[0.0, 0.0, 1.0], [1.0, 1.0]])
    got = discounted_returns(values, valid, gamma=0.5)
    assert got.tolist() == [[0.25, 0.5, 1.0], [1.5, 1.0, 0.0]]  # 1*0.5^2, 1*0.5, 1; 1 + 0.5*1, 1; padding 0
    episodes = random_episodes(random.Random(2), 12)
    values, valid = pad_turns(episodes)
    got = discounted_returns(values, valid, gamma=0.9)
    assert as_lists(got, episodes) == pytest.approx(flat([ref_returns(e, 0.9) for e in episodes]), abs=1e-6)


# -- discounted per-turn advantages -------------------------------------------------------------------------


def test_discounted_docstring_example():
    rewards, valid = pad_turns([[0.0, 0.0], [0.0, 1.0]])
    got = discounted_turn_advantages(rewards, valid, 2, gamma=0.5)
    # position 0: returns [0, 0.5]; position 1: [0, 1]; each a pair -> -+1/sqrt(2) with std N-1
    assert flat(got.tolist()) == pytest.approx([-0.7071, -0.7071, 0.7071, 0.7071], abs=1e-4)


@pytest.mark.parametrize("by_position", [True, False])
def test_discounted_turn_advantages_match_a_loop_on_ragged_groups(by_position):
    episodes = random_episodes(random.Random(3), 24)
    rewards, valid = pad_turns(episodes)
    got = discounted_turn_advantages(
        rewards, valid, 6, gamma=0.8, normalize="position" if by_position else "group"
    )
    want = ref_discounted(episodes, 6, 0.8, by_position)
    assert as_lists(got, episodes) == pytest.approx(flat(want), abs=1e-5)
    assert got[~valid].abs().sum() == 0  # padding turns get nothing


def test_discounted_single_turn_episodes_are_grpo():
    rewards = torch.tensor([1.0, 0.8, 0.8, 0.5, 0.5, 0.5, 0.2, 0.0])  # GRPO.md's first row
    values, valid = pad_turns([[r] for r in rewards.tolist()])
    for normalize in ("position", "group"):
        got = discounted_turn_advantages(values, valid, 8, normalize=normalize)[:, 0]
        assert torch.allclose(got, group_advantages(rewards, 8), atol=1e-5)
    assert got[0].item() == pytest.approx(1.4048, abs=1e-4)


def test_discounted_group_ids_order_and_left_out_rows():
    episodes = random_episodes(random.Random(4), 8)
    rewards, valid = pad_turns(episodes)
    perm = [3, 0, 6, 1, 7, 2, 4, 5]
    ids = [0 if i < 4 else 1 for i in perm]  # rows shuffled, told by group id
    shuffled = discounted_turn_advantages(rewards[perm], valid[perm], 4, group_ids=ids, gamma=0.9)
    plain = discounted_turn_advantages(rewards, valid, 4, gamma=0.9)
    assert torch.allclose(shuffled, plain[perm], atol=1e-6)
    keep = torch.tensor([True, False, True, True, True, True, True, True])
    left = discounted_turn_advantages(rewards, valid, 4, gamma=0.9, valid=keep)
    assert left[1].abs().sum() == 0
    want = ref_discounted([episodes[0], episodes[2], episodes[3]], 3, 0.9, True)
    assert as_lists(left[[0, 2, 3]], [episodes[0], episodes[2], episodes[3]]) == pytest.approx(
        flat(want), abs=1e-5
    )


def test_episode_rewards_not_earned_by_a_turn_count_at_the_last_turn():
    rewards, valid = pad_turns([[0.0, 0.0], [0.0]])
    # a verifier gives episode 0 reward 1 (no turn earned it): its last turn gets it, discounted backwards
    got = discounted_turn_advantages(rewards, valid, 2, gamma=0.5, episode_rewards=torch.tensor([1.0, 0.0]))
    # position 0: returns [0.5, 0.0] -> [+0.7071, -0.7071]; position 1: episode 0 alone -> 0
    assert flat(got.tolist()) == pytest.approx([0.7071, 0.0, -0.7071, 0.0], abs=1e-4)


def test_a_group_of_identical_episodes_gets_zeros():
    episodes = random_episodes(random.Random(5), 8)
    rewards, valid = pad_turns([[1.0, 0.0, 1.0]] * 4 + episodes[:4])
    got = discounted_turn_advantages(rewards, valid, 4)
    assert got[:4].abs().sum() == 0  # four identical episodes: nothing to prefer


# -- GiGPO ---------------------------------------------------------------------------------------------------


def test_gigpo_by_hand_on_a_shared_state():
    # two episodes from the same start "A"; episode 0 goes A -> B (reward at turn 1), episode 1 goes A -> C
    # -> B (reward at turn 2). Step group "A": returns [0.9, 0.81]; group "B": [1, 1]; "C" alone.
    rewards, valid = pad_turns([[0.0, 1.0], [0.0, 0.0, 1.0]])
    keys = [["A", "B"], ["A", "C", "B"]]
    ep = torch.tensor([0.3, -0.3])
    got = gigpo_turn_advantages(ep, rewards, valid, keys, 2, gamma=0.9, omega=1.0)
    step_a = 0.7071  # the pair [0.9, 0.81] normalised with std N-1: +-1/sqrt(2)
    # ep 0: A +step_a, B 0, padding 0; ep 1: A -step_a, C 0 (singleton), B 0 (equal returns)
    want = [[0.3 + step_a, 0.3, 0.0], [-0.3 - step_a, -0.3, -0.3]]
    assert flat(got.tolist()) == pytest.approx(flat(want), abs=1e-4)


def test_gigpo_matches_a_loop_with_random_states_and_groups():
    rng = random.Random(6)
    episodes = random_episodes(rng, 16, max_turns=6)
    keys = [[rng.choice("abcd") for _ in e] for e in episodes]  # few states: many shared, some singletons
    rewards, valid = pad_turns(episodes)
    ep = torch.tensor([rng.uniform(-1, 1) for _ in episodes])
    got = gigpo_turn_advantages(ep, rewards, valid, keys, 8, gamma=0.95, omega=0.7)
    want = ref_gigpo(ep.tolist(), episodes, keys, 8, 0.95, 0.7)
    assert as_lists(got, episodes) == pytest.approx(flat(want), abs=1e-5)


def test_gigpo_states_are_grouped_within_a_task_only_and_omega_zero_is_grpo():
    rewards, valid = pad_turns([[1.0], [0.0], [1.0], [0.0]])
    keys = [["s"], ["t"], ["t"], ["s"]]  # "s" in task 0 is not "s" in task 1
    ep = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)
    got = gigpo_turn_advantages(ep, rewards, valid, keys, 2)
    assert torch.equal(got[:, 0], ep)  # every state is a singleton within its task: step-level 0
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 0], [1, 0, 0]])
    rewards, valid = pad_turns([[0.0, 1.0], [0.0], [0.0], [1.0]])
    keys = [["x", "y"], ["x"], ["x"], ["x"]]
    ep = torch.tensor([1.0, -1.0, 0.5, -0.5])
    zero = gigpo_turn_advantages(ep, rewards, valid, keys, 2, omega=0.0)
    assert torch.equal(spread_turn_advantages(zero, mask), episode_token_advantages(ep, mask))


def test_gigpo_rejects_missing_keys():
    rewards, valid = pad_turns([[0.0, 1.0], [0.0]])
    with pytest.raises(DataError, match="one key per turn"):
        gigpo_turn_advantages(torch.zeros(2), rewards, valid, [["a"], ["a"]], 2)
