"""The textarena env: single-player TextArena games played in chat, only the new part of TextArena's growing
observation shown each turn, a ``success`` apart from the shaped reward; trained from a YAML alone."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textarena")

from mmgrpo.cli.app import main  # noqa: E402
from mmgrpo.env import check_env, message_text  # noqa: E402
from mmgrpo.envs.textarena_env import TextArenaEnv, new_part  # noqa: E402
from mmgrpo.errors import ConfigError  # noqa: E402
from mmgrpo.registry import ENVS, make_env, register_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _text(messages: list[dict]) -> str:
    return "".join(message_text(m) for m in messages)


def test_follows_the_protocol_and_leaves_the_callers_random_alone():
    env = make_env("textarena", env_id="GuessTheNumber-v0")
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    check_env(env, action="[7]")
    assert [random.random() for _ in range(3)] == expected  # TextArena seeds the global random; not ours
    train = [_text(env.reset(seed=s, options={"split": "train"})[0]) for s in range(2)]
    assert train[0].startswith("[GAME] You are Player 0. You are playing Guess The Number.")


def test_each_turn_shows_only_the_new_part_and_a_won_game_is_a_success():
    env = TextArenaEnv(env_id="GuessTheNumber-v0")
    env.reset(seed=0, options={"split": "eval"})  # the number is 5 (TextArena's draw for game seed 1)
    low, high, turns = 1, 20, []
    for _ in range(10):
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(f"I guess [{guess}]")
        if terminated:
            break
        turns.append(_text(obs))
        low, high = (guess + 1, high) if "higher" in turns[-1] else (low, guess - 1)
    assert turns == ["[GAME] The target number is lower."] + turns[1:] and len(turns) >= 1
    assert all(t.startswith("[GAME] ") and "Player] " not in t and "You are Player" not in t for t in turns)
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["success"] is True and info["metrics"]["success"] == 1.0


def test_a_game_lost_by_invalid_moves_keeps_its_shaped_reward_but_is_no_success():
    env = TextArenaEnv(env_id="GuessTheNumber-v0")
    env.reset(seed=1, options={"split": "eval"})  # the number is 8
    obs, reward, terminated, _, info = env.step("[10]")
    assert (_text(obs), reward, terminated, info["metrics"]["success"]) == (
        "[GAME] The target number is lower.",
        0.0,
        False,
        0.0,
    )
    obs, *_ = env.step("[10]")  # a repeated guess: a warning first ...
    assert "invalid move" in _text(obs)
    obs, reward, terminated, _, info = env.step("[10]")  # ... then the game is lost
    assert obs == [] and terminated and reward == pytest.approx(1 - 2 / 19)  # TextArena's shaped 0.89
    assert info["metrics"] == {"success": 0.0, "invalid_move": 1.0, "game_reward": reward}
    assert info["success"] is False


def test_new_part_drops_the_history_and_the_echo_of_the_move():
    first = "\n[GAME] Guess a number."
    second = first + "\n[Player] [3]\n[GAME] The target number is higher."
    assert new_part("", first) == "[GAME] Guess a number."
    assert new_part(first, second) == "[GAME] The target number is higher."
    assert new_part(first, "\n[GAME] another game") == "[GAME] another game"  # not an extension: all of it


def test_mistakes_are_named():
    with pytest.raises(ConfigError, match="GuessTheNumber-v0"):
        make_env("textarena", env_id="GuessTheNumbr-v0")
    with pytest.raises(ConfigError, match="env_kwargs"):
        make_env("textarena", env_id="GuessTheNumber-v0", env_kwargs={"colour": "red"})


# the warm start teaches the move's form ("[7]" then the end of the turn): an untrained model's reply runs to
# max_new_tokens, which ends the episode before the game is stepped at all
YAML = """\
seed: 0
output_dir: {out}
model: {{path: {model}, dtype: float32, device: cpu, freeze_vision: false}}
env: {{name: {env}, max_turns: 3, max_episode_tokens: 200, kwargs: {{env_id: GuessTheNumber-v0}}}}
verifiers: [{{name: env_reward}}]
warm_start: {{steps: 30, lr: 1.0e-3, batch_size: 8, target: "[{{random}}]", random_low: 1, random_high: 20,
             check_tasks: 8, min_skill: 0}}
grpo: {{steps: 2, tasks_per_step: 2, group_size: 4, max_new_tokens: 8, micro_batch_size: 8}}
eval: {{episodes: 4, batch_size: 4, max_new_tokens: 8}}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``mmgrpo train`` on the YAML alone, in a fresh process; returns the run directory."""
    from mmgrpo.tiny.text import build_tiny_text_model

    tmp = tmp_path_factory.mktemp("textarena")
    model = build_tiny_text_model(tmp / "model")
    config = tmp / "ta.yaml"
    config.write_text(YAML.format(out=tmp / "run", model=model, env="textarena"))
    done = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "train", str(config), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


def test_trains_from_a_yaml_alone_and_logs_success_apart_from_the_reward(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "stage" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["env_errors"] == 0 and 0.0 <= r["env/success"] <= 1.0 for r in steps)  # the game was played
    assert all(r["turns"] >= 1.0 for r in steps)


class ScriptedGuesses(TextArenaEnv):
    """Whatever the model writes, plays ``[10]`` three times in one turn: one valid guess, then a repeat (a
    warning), then the repeat that loses the game by invalid moves with TextArena's shaped reward."""

    def step(self, action):
        for _ in range(3):
            out = super().step("[10]")
            if out[2]:
                return out
        raise AssertionError("the game should have ended on the third [10]")


def test_eval_reports_a_lost_game_as_no_success_however_high_its_reward(trained, tmp_path, capsys):
    register_env("scripted_guesses", ScriptedGuesses, overwrite=True)
    try:
        config = tmp_path / "ta.yaml"
        config.write_text(YAML.format(out=tmp_path / "run", model=trained / "final", env="scripted_guesses"))
        model = tmp_path / "model"
        shutil.copytree(trained / "final", model)  # eval.json is written next to the model
        capsys.readouterr()
        assert main(["eval", str(config), "--model", str(model), "--no-progress"]) == 0
    finally:
        ENVS._entries.pop("scripted_guesses", None)
    printed = capsys.readouterr().out.splitlines()
    # the eval games' numbers are 5, 8, 20 and 11: a first guess of 10 earns 0.74, 0.89, 0.47 and 0.95
    mean = (1 - 5 / 19 + 1 - 2 / 19 + 1 - 10 / 19 + 1 - 1 / 19) / 4
    assert f"score: {mean:.3f} (mean of env_reward)" in printed
    assert "success: 0.000 (env: game won)" in printed
    assert printed[-1] == "accuracy: 0.000 (n=4)"  # was 1.000 when accuracy meant a score >= 0.5
    result = json.loads((model / "eval.json").read_text())
    assert result["success_rule"] == "env: game won" and result["success_source"] == "env"
    assert result["success"] == 0.0 and result["score"] == pytest.approx(mean)
