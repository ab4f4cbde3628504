"""gym envs as a newcomer meets them (issue 17, item 9): a misspelt env_kwarg, a stock game that an untrained
model never plays past turn 1 (a warm start from demonstrations), and transcripts of whitespace replies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import gymnasium
import pytest
import yaml
from gymnasium.spaces import Discrete, Text

from mmgrpo.cli.app import main
from mmgrpo.envs.gym_adapter import GymChatEnv
from mmgrpo.envs.gym_frozenlake import ACTION_NAMES, RandomMaps, shortest_path
from mmgrpo.errors import ConfigError
from mmgrpo.rollout.evaluation import EvalResult, write_transcripts

ROOT = Path(__file__).resolve().parent.parent
FROZENLAKE = {
    "env": "FrozenLake-v1",
    "env_kwargs": {"is_slippery": False},
    "wrappers": ["mmgrpo.envs.gym_frozenlake:RandomMaps", "mmgrpo.envs.gym_frozenlake:GridText"],
    "action_names": list(ACTION_NAMES),
    "max_steps": 10,
}


class Countdown(gymnasium.Env):
    """Reach 0 from a random start in [3, 6) by subtracting 1, 2 or 3 (action 0, 1, 2); 1.0 on exactly 0."""

    def __init__(self, text: bool = False) -> None:
        self.observation_space = Text(20)
        self.action_space = Text(1, min_length=1, charset="123") if text else Discrete(3)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.left = int(self.np_random.integers(3, 6))
        return str(self.left), {}

    def step(self, action):
        self.left -= int(action) if isinstance(action, str) else int(action) + 1
        done = self.left <= 0
        return str(self.left), float(self.left == 0), done, False, {}


def replay(env: GymChatEnv, seed: int, turns: list[str], split: str = "train") -> tuple[float, int, bool]:
    """Reset on ``seed`` and play ``turns`` through ``step`` (as the warm start does): total reward, turns
    played, whether every reply was a valid action."""
    env.reset(seed=seed, options={"split": split})
    total, valid = 0.0, True
    for k, text in enumerate(turns, 1):
        _, reward, terminated, truncated, info = env.step(text)
        total, valid = total + reward, valid and info["invalid_action"] is None
        if terminated or truncated:
            return total, k, valid
    return total, len(turns), valid


# -- a wrong env_kwargs: one line naming the id, the key and the accepted keys ------------------------------
def test_a_misspelt_env_kwarg_is_one_config_line_through_the_cli(tmp_path, capsys):
    """48bbbf8: gymnasium's raw traceback ("FrozenLakeEnv.__init__() got an unexpected keyword argument")."""
    config = tmp_path / "fl.yaml"
    kwargs = {"env": "FrozenLake-v1", "env_kwargs": {"is_slipery": False}}
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tmp_path / "no-model")},
                "output_dir": str(tmp_path / "run"),
                "env": {"name": "gym", "kwargs": kwargs},
                "verifiers": [{"name": "env_reward"}],
            }
        )
    )
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mmgrpo: error: GymChatEnv(env='FrozenLake-v1'): env_kwargs has an unknown key")
    assert "'is_slipery' (did you mean 'is_slippery'?)" in err
    assert "FrozenLake-v1 accepts: render_mode, desc, map_name, is_slippery" in err


def test_bad_env_kwargs_of_other_games_and_bad_values():
    with pytest.raises(ConfigError, match=r"'nat' \(did you mean 'natural'\?\); Blackjack-v1 accepts: .*sab"):
        GymChatEnv("Blackjack-v1", env_kwargs={"nat": True})
    # a bad value fails inside the env: still a ConfigError (one line), naming the id and the kwargs
    with pytest.raises(ConfigError, match=r"FrozenLake-v1.*\{'map_name': '5x5'\}.*KeyError"):
        GymChatEnv("FrozenLake-v1", env_kwargs={"map_name": "5x5"})
    with pytest.raises(ConfigError, match="env_kwargs must be a mapping"):
        GymChatEnv("FrozenLake-v1", env_kwargs=["is_slippery"])  # type: ignore[arg-type]
    # gymnasium.make's own keywords are accepted
    GymChatEnv("FrozenLake-v1", env_kwargs={"max_episode_steps": 5, "is_slippery": False})


# -- demonstrations: a warm start for any gym env ------------------------------------------------------------
@pytest.mark.parametrize("text_space", [False, True])
def test_default_demonstrations_are_random_valid_actions_that_replay(text_space):
    """48bbbf8: GymChatEnv had no demonstration, so warm_start.source: env refused every gym env."""
    env = GymChatEnv(Countdown(text=text_space))
    _, info = env.reset(seed=4)
    turns = env.demonstration(info, random.Random(0))
    assert turns and all(isinstance(t, str) for t in turns)
    assert all(t in ("1", "2", "3") if text_space else t in ("0", "1", "2") for t in turns)
    total, played, valid = replay(env, 4, turns)
    assert valid and played == len(turns)  # the episode the replies were made for: it ends on the last one
    # the same rng seed gives the same demonstrations; another seed (usually) others
    assert env.demonstration(env.reset(seed=4)[1], random.Random(0)) == turns


def test_demonstrations_leave_the_episode_as_reset_left_it():
    env = GymChatEnv(Countdown())
    messages, info = env.reset(seed=7)
    env.demonstration(info, random.Random(1))
    assert env.step("0")[4]["steps"] == 1  # the episode starts over from the reset, not after the demo
    assert env.reset(seed=7)[0] == messages


def test_demo_policy_names_format_and_random_share():
    env = GymChatEnv(
        Countdown(),
        action_names=["one", "two", "three"],
        demo_policy=lambda obs: min(int(obs), 3) - 1,  # a solver: take what is left, at most 3
        demo_reply="<answer>{action}</answer>",
        max_steps=8,
    )
    for seed in range(5):
        _, info = env.reset(seed=seed)
        turns = env.demonstration(info, random.Random(seed))
        assert all(
            t in ("<answer>one</answer>", "<answer>two</answer>", "<answer>three</answer>") for t in turns
        )
        assert replay(env, seed, turns)[0] == 1.0  # the solver always lands on 0
    # a policy taking (obs, rng) draws from the warm start's rng: reproducible
    seen = []
    rng_env = GymChatEnv(Countdown(), demo_policy=lambda obs, rng: seen.append(obs) or rng.randrange(3))
    _, info = rng_env.reset(seed=1)
    assert rng_env.demonstration(info, random.Random(5)) == rng_env.demonstration(info, random.Random(5))
    assert seen  # the policy was asked
    # demo_random_share=1: every step a random action, the policy never asked
    asked = []
    never = GymChatEnv(Countdown(), demo_policy=lambda obs: asked.append(obs) or 0, demo_random_share=1.0)
    _, info = never.reset(seed=2)
    assert never.demonstration(info, random.Random(0)) and asked == []


def take(text: str) -> int | None:
    """A custom parser: "take N" is action N; anything else names no action."""
    return int(text[5:]) if text.startswith("take ") else None


def test_demo_errors_teach():
    env = GymChatEnv(Countdown(), demo_policy=lambda obs: 7)
    _, info = env.reset(seed=0)
    with pytest.raises(
        ConfigError, match=r"demo_policy=...\): it returned 7, which is not in the action space"
    ):
        env.demonstration(info, random.Random(0))
    custom = GymChatEnv(Countdown(), text_to_action=take)
    _, info = custom.reset(seed=0)
    with pytest.raises(ConfigError, match="does not parse back to it.*Pass action_to_text="):
        custom.demonstration(info, random.Random(0))
    fixed = GymChatEnv(
        Countdown(),
        text_to_action=take,
        action_to_text=lambda action: f"take {action}",
    )
    _, info = fixed.reset(seed=0)
    assert all(t.startswith("take ") for t in fixed.demonstration(info, random.Random(0)))
    with pytest.raises(ConfigError, match="demo_reply"):
        GymChatEnv(Countdown(), demo_reply="<answer></answer>")
    with pytest.raises(ConfigError, match="demo_random_share"):
        GymChatEnv(Countdown(), demo_random_share=1.5)
    with pytest.raises(ConfigError, match="apply to an env id only"):
        GymChatEnv(Countdown(), wrappers=["mmgrpo.envs.gym_frozenlake:GridText"])


def test_warm_start_trains_on_a_gym_envs_demonstrations(tiny_policy):
    """warm_start.source: env on a stock gymnasium game (48bbbf8: a ConfigError, no demonstrations)."""
    from mmgrpo.train.warmstart import demonstration_batch, warm_start

    def make():
        return GymChatEnv(**FROZENLAKE, demo_policy="mmgrpo.envs.gym_frozenlake:shortest_path")

    batch = demonstration_batch(tiny_policy, make(), [10, 11], random.Random(0))
    assert int(batch.loss_mask.sum()) >= 2 * 6 * 2  # two 6-move episodes, each reply 2+ taught tokens
    losses = []
    warm_start(
        tiny_policy,
        make,
        steps=3,
        lr=1e-3,
        batch_size=2,
        template="",
        low=0,
        high=0,
        seed=0,
        source="env",
        progress=False,
        log=lambda r: losses.append(r["nll"]),
    )
    assert len(losses) == 3 and losses[-1] < losses[0]


# -- FrozenLake pieces: maps per seed, the grid as text, the solver ---------------------------------------
def test_frozenlake_maps_differ_per_seed_and_held_out_maps_are_never_training_maps():
    env = GymChatEnv(**FROZENLAKE)

    def board(seed: int, split: str) -> str:
        messages, _ = env.reset(seed=seed, options={"split": split})
        return messages[-1]["content"][0]["text"].split("\nsafe:")[0].replace("P", "S")

    train = {board(s, "train") for s in range(150)}
    held_out = {board(s, "eval") for s in range(150)}
    assert len(train) > 60 and len(held_out) > 60
    assert not train & held_out
    assert board(3, "eval") == board(3, "eval")


def test_frozenlake_text_and_the_shortest_path_solver():
    env = GymChatEnv(**FROZENLAKE, demo_policy="mmgrpo.envs.gym_frozenlake:shortest_path")
    messages, info = env.reset(seed=0)
    text = messages[-1]["content"][0]["text"]
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0][0] == "P" and lines[3][3] == "G" and lines[4].startswith("safe: ")
    for seed in range(40):
        _, info = env.reset(seed=seed, options={"split": "eval"})
        turns = env.demonstration(info, random.Random(seed))
        assert replay(env, seed, turns, "eval")[0] == 1.0 and len(turns) >= 6  # corner to corner on a 4x4 map
    assert shortest_path("PFF\nHHF\nFFG\nsafe: right") == 2
    with pytest.raises(ConfigError, match="FrozenLake only"):
        RandomMaps(Countdown())


# -- transcripts of whitespace ------------------------------------------------------------------------------
def test_transcripts_show_empty_and_whitespace_messages(tmp_path):
    """48bbbf8: an empty or whitespace reply was written as blank lines, as if nothing had been said."""
    convo = [
        {"role": "user", "content": [{"type": "text", "text": "Your move."}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": "\n"},
        {"role": "assistant", "content": [{"type": "text", "text": " \n\n"}]},
        {"role": "assistant", "content": "down"},
    ]
    result = EvalResult(accuracy=0.0, n=1, metric="env_reward", transcripts=[convo])
    text = (write_transcripts(result, tmp_path) / "episode-0.md").read_text()
    blocks = text.split("## ")[1:]
    assert [b.strip() for b in blocks] == [
        "user\nYour move.",
        "assistant\n(empty reply)",
        "user\n(whitespace only: '\\n')",
        "assistant\n(whitespace only: ' \\n\\n')",
        "assistant\ndown",
    ]


# -- the example: FrozenLake-v1 played past turn 1 and improved by GRPO -------------------------------------
@pytest.mark.slow
def test_frozenlake_example_plays_on_after_the_warm_start_and_grpo_raises_success(tmp_path, capsys):
    """examples/frozenlake_tiny.yaml on the tiny text model (about 4-5 minutes on one CPU core)."""
    from mmgrpo.tiny.text import build_tiny_text_model

    model = build_tiny_text_model(tmp_path / "tiny-model")  # the demo keeps a model already there
    out = ["--out", str(tmp_path), "--processes", "1", "--no-progress", "--set", f"model.path={model}"]
    assert main(["demo", "--config", str(ROOT / "examples" / "frozenlake_tiny.yaml"), *out]) == 0
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    with capsys.disabled():
        print({k: summary[k] for k in ("base", "before", "after", "n", "seconds")})
    assert summary["tool_use_before"]["turns"] >= 4.0, summary
    assert summary["after"] >= summary["before"] + 0.15, summary
