"""FrozenLake without the safe-move hint (issue 55): the bare grid, solvable random maps, held-out maps, and
the per-turn state key that turn-level credit (GiGPO) groups by."""

from __future__ import annotations

import random
from collections import deque

import pytest

from mmgrpo.envs.gym_adapter import GymChatEnv
from mmgrpo.envs.gym_frozenlake import ACTION_NAMES
from mmgrpo.errors import ConfigError

BARE = {
    "env": "FrozenLake-v1",
    "env_kwargs": {"is_slippery": False},
    "wrappers": [
        "mmgrpo.envs.gym_frozenlake:RandomMaps",
        {"name": "mmgrpo.envs.gym_frozenlake:GridText", "kwargs": {"hint": False}},
    ],
    "action_names": list(ACTION_NAMES),
    "max_steps": 10,
    "demo_policy": "mmgrpo.envs.gym_frozenlake:shortest_path",
}


def text_of(messages) -> str:
    return messages[-1]["content"][0]["text"]


def solvable(grid: str) -> bool:
    """Breadth-first from P over non-hole cells: does it reach G?"""
    lines = grid.splitlines()
    start = next((r, c) for r, line in enumerate(lines) for c, ch in enumerate(line) if ch == "P")
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if lines[r][c] == "G":
            return True
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            nr, nc = r + dr, c + dc
            if (
                0 <= nr < len(lines)
                and 0 <= nc < len(lines[0])
                and (nr, nc) not in seen
                and lines[nr][nc] != "H"
            ):
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def test_bare_grid_has_no_hint_and_is_a_solvable_4x4_map():
    env = GymChatEnv(**BARE)
    for seed in range(60):
        for split in ("train", "eval"):
            messages, info = env.reset(seed=seed, options={"split": split})
            text = text_of(messages)
            lines = text.splitlines()
            assert "safe" not in text and len(lines) == 4 and all(len(line) == 4 for line in lines)
            assert lines[0][0] == "P" and lines[3][3] == "G" and set(text) <= set("SFHGP\n")
            assert solvable(text)
            assert info["state"] == text  # the key is the bare grid


def test_bare_held_out_maps_never_appear_in_training():
    env = GymChatEnv(**BARE)

    def board(seed: int, split: str) -> str:
        return text_of(env.reset(seed=seed, options={"split": split})[0])

    train = {board(s, "train") for s in range(300)}
    held_out = {board(s, "eval") for s in range(300)}
    assert len(train) > 150 and len(held_out) > 150  # many different maps, not a handful repeated
    assert not train & held_out


def test_hinted_default_is_unchanged_and_has_the_same_state_key():
    hinted = GymChatEnv(
        **{**BARE, "wrappers": BARE["wrappers"][:1] + ["mmgrpo.envs.gym_frozenlake:GridText"]}
    )
    bare = GymChatEnv(**BARE)
    messages, info = hinted.reset(seed=5)
    assert text_of(messages).splitlines()[-1].startswith("safe: ")
    assert info["state"] == text_of(bare.reset(seed=5)[0])  # the hint is not part of the state
    with pytest.raises(ConfigError, match="hint"):
        GymChatEnv(
            **{
                **BARE,
                "wrappers": [{"name": "mmgrpo.envs.gym_frozenlake:GridText", "kwargs": {"hint": "no"}}],
            }
        )


def test_state_key_per_turn_follows_the_player_and_stays_on_an_invalid_reply():
    env = GymChatEnv(**BARE)
    _, info = env.reset(seed=7)
    first = info["state"]
    _, _, _, _, info = env.step("jump")  # not a move: the wrapped env is not stepped
    assert info["invalid_action"] and info["state"] == first
    turns = env.demonstration(env.reset(seed=7)[1], random.Random(0))  # a shortest path on this map
    env.reset(seed=7)
    states = [first]
    for turn in turns[:-1]:
        messages, _, _, _, info = env.step(turn)
        assert info["state"] == text_of(messages)  # the key is what the next turn sees
        states.append(info["state"])
    assert len(set(states)) == len(states)  # a shortest path never revisits a cell
    # another episode on the same map that reaches the same cell gets the same key
    env.reset(seed=7)
    _, _, _, _, again = env.step(turns[0])
    assert again["state"] == states[1]


def test_demonstrations_reach_the_goal_on_bare_held_out_maps():
    env = GymChatEnv(**BARE)
    for seed in range(30):
        _, info = env.reset(seed=seed, options={"split": "eval"})
        turns = env.demonstration(info, random.Random(seed))
        env.reset(seed=seed, options={"split": "eval"})
        total = 0.0
        for turn in turns:
            _, reward, terminated, truncated, _ = env.step(turn)
            total += reward
            if terminated or truncated:
                break
        assert total == 1.0
