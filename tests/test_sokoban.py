"""The tiny Sokoban (mmgrpo/envs/sokoban.py): rules, puzzles, splits, the solver, state keys, registration."""

from __future__ import annotations

import random

import pytest

from mmgrpo.env import check_env
from mmgrpo.envs.sokoban import ACTIONS, SokobanEnv, draw_puzzle, greedy_push, parse, render, solve
from mmgrpo.errors import ConfigError


def text_of(messages) -> str:
    return messages[-1]["content"][0]["text"]


def play(env: SokobanEnv, policy, seed: int, split: str = "eval") -> tuple[float, int]:
    """Total reward and replies of one episode where ``policy(state text) -> action``."""
    _, info = env.reset(seed=seed, options={"split": split})
    total, turns = 0.0, 0
    while True:
        _, reward, terminated, truncated, info = env.step(ACTIONS[policy(info["state"])])
        total, turns = total + reward, turns + 1
        if terminated or truncated:
            return total, turns


def test_rules_step_push_and_blocked_moves_by_hand():
    p = parse("_PB_T\n_____")
    assert p.move(p.player, p.box, 2) == ((0, 2), (0, 3))  # right: pushes the box
    assert p.move(p.player, p.box, 0) == ((0, 0), (0, 2))  # left: a step
    assert p.move(p.player, p.box, 3) == ((0, 1), (0, 2))  # up: the edge is a wall
    q = parse("_PB#T\n_____")
    assert q.move(q.player, q.box, 2) == ((0, 1), (0, 2))  # a box against a wall does not move
    assert p.plan(p.player, p.box) == [2, 2]
    assert parse("PB__\n___T").plan((0, 0), (0, 1)) is None  # the box on the top edge, target below: lost
    assert render(parse("_p_\n_B_")) == "_p_\n_B_"  # the player on the target shows as p


def test_puzzles_are_solvable_in_range_and_need_pushes_from_two_sides():
    for seed in range(80):
        p = draw_puzzle(seed)
        plan = p.plan(p.player, p.box)
        assert plan is not None and 4 <= len(plan) <= 8
        pushes = set()
        player, box = p.player, p.box
        for action in plan:
            player, nxt = p.move(player, box, action)
            if nxt != box:
                pushes.add(action)
            box = nxt
        assert box == p.target and len(pushes) >= 2


def test_held_out_puzzles_never_appear_in_training():
    env = SokobanEnv()
    train = {text_of(env.reset(seed=s, options={"split": "train"})[0]) for s in range(300)}
    held_out = {text_of(env.reset(seed=s, options={"split": "eval"})[0]) for s in range(300)}
    assert len(train) > 250 and len(held_out) > 250
    assert not train & held_out


def test_the_solver_wins_every_held_out_puzzle_and_a_non_planner_does_not():
    env = SokobanEnv()
    solved = [play(env, solve, s)[0] for s in range(100)]
    greedy = [play(env, greedy_push, s)[0] for s in range(100)]
    rng = random.Random(0)
    rand = [play(env, lambda _: rng.randrange(4), s)[0] for s in range(100)]
    assert sum(solved) == 100
    assert 0.4 < sum(greedy) / 100 < 0.9  # pushing towards the target without looking ahead: often lost
    assert sum(rand) / 100 < 0.1
    hard = SokobanEnv(greedy_fails=True)
    assert sum(play(hard, solve, s)[0] for s in range(20)) == 20
    assert sum(play(hard, greedy_push, s)[0] for s in range(20)) == 0  # only planning wins these


def test_a_deadlock_ends_the_episode_at_once_with_reward_zero():
    env = SokobanEnv()
    for seed in range(50):
        _, info = env.reset(seed=seed)
        p = parse(info["state"])
        for action in range(4):  # find a first move that loses the game
            env.reset(seed=seed)
            player, box = p.move(p.player, p.box, action)
            if p.plan(player, box) is None:
                _, reward, terminated, truncated, info = env.step(ACTIONS[action])
                assert (reward, terminated, truncated, info["deadlock"]) == (0.0, True, False, True)
                return
    pytest.fail("no puzzle of the first 50 can be lost in one move")


def test_state_keys_follow_the_game_and_match_the_observation():
    env = SokobanEnv()
    messages, info = env.reset(seed=11)
    assert info["state"] == text_of(messages) and "P" in info["state"] and "B" in info["state"]
    first = info["state"]
    _, _, _, _, info = env.step("jump")  # rejected: the game did not move, nor does its key
    assert info["invalid_action"] and info["state"] == first
    env.reset(seed=11)
    action = solve(first)
    messages, _, _, _, info = env.step(ACTIONS[action])
    assert info["state"] == text_of(messages) != first
    env.reset(seed=11)
    assert env.step(ACTIONS[action])[4]["state"] == info["state"]  # same puzzle, same move: same key


def test_demonstrations_solve_and_check_env_passes():
    env = SokobanEnv()
    for seed in range(20):
        _, info = env.reset(seed=seed, options={"split": "eval"})
        turns = env.demonstration(info, random.Random(seed))
        env.reset(seed=seed, options={"split": "eval"})
        rewards = [env.step(t)[1] for t in turns]
        assert rewards[-1] == 1.0 and len(turns) <= 8
    check_env(SokobanEnv())


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="max_moves"):
        SokobanEnv(min_moves=6, max_moves=4)
    with pytest.raises(ConfigError, match="fit"):
        SokobanEnv(rows=2, cols=2, walls=2)
    with pytest.raises(ConfigError, match="greedy_fails"):
        SokobanEnv(greedy_fails="yes")


def test_registered_as_sokoban():
    from mmgrpo.registry import list_envs, make_env

    assert "sokoban" in list_envs()
    env = make_env("sokoban", max_steps=5)
    assert isinstance(env, SokobanEnv) and env.max_steps == 5
