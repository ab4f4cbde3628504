"""GymChatEnv: a plain gymnasium game played in chat, checked with check_env, its rewards trained through the
env_reward verifier with no verifier written."""

from __future__ import annotations

import string

import gymnasium
import pytest
import torch
from gymnasium.spaces import Box, Discrete, Text

from mmgrpo import registry
from mmgrpo.env import check_env, message_text
from mmgrpo.envs.gym_adapter import GymChatEnv, default_obs_to_text
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.verifier import Episode, Rewards
from mmgrpo.verifiers.agent import env_reward

GAME_ID = "mmgrpo_test/GuessNumber-v0"
WRONG, RIGHT = -0.1, 1.0


class GuessNumber(gymnasium.Env):
    """Guess a secret number in [0, n): "higher"/"lower" after a wrong guess (-0.1), 1.0 when right."""

    def __init__(self, n: int = 8, discrete: bool = False) -> None:
        self.n = n
        self.observation_space = Text(200, charset=string.printable)
        self.action_space = Discrete(n) if discrete else Text(2, min_length=1, charset=string.digits)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.n))
        info = {"answer": self.secret, "inner_seed": seed, "inner_options": options}
        return f"I picked a number from 0 to {self.n - 1}. Guess it.", info

    def step(self, action):
        guess = int(action)
        if guess == self.secret:
            return "Correct!", RIGHT, True, False, {"guess": guess}
        return ("Higher." if guess < self.secret else "Lower."), WRONG, False, False, {"guess": guess}


if GAME_ID not in gymnasium.registry:
    gymnasium.register(GAME_ID, entry_point=GuessNumber, max_episode_steps=6)


def play(env: GymChatEnv, seed: int, replies) -> tuple[Episode, list[list[dict]]]:
    """Reset on ``seed`` and send ``replies`` (a list, or a function of the secret); the finished Episode."""
    messages, info = env.reset(seed=seed)
    if callable(replies):
        replies = replies(int(info["answer"]))
    total, new_turns = 0.0, []
    for reply in replies:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
        new, reward, terminated, truncated, _ = env.step(reply)
        messages += new
        new_turns.append(new)
        total += reward
        if terminated or truncated:
            break
    return Episode(completion=replies[-1], messages=messages, task=info, env_reward=total), new_turns


# -- protocol ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("discrete", [False, True])
@pytest.mark.parametrize("action", ["", "3", "<answer>3</answer>"])
def test_check_env(discrete, action):
    check_env(GymChatEnv(GuessNumber(discrete=discrete), system="Reply with a number."), action=action)
    check_env(GymChatEnv(GAME_ID, env_kwargs={"discrete": discrete}, max_steps=4), action=action)


def test_reset_messages_info_and_split_seeds():
    env = GymChatEnv(GuessNumber(), system="Guess the number.")
    messages, info = env.reset(seed=3)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert message_text(messages[1]) == "I picked a number from 0 to 7. Guess it."
    assert isinstance(info["answer"], str) and info["split"] == "train" and info["seed"] == 3
    # the wrapped env's seed is 2 * seed + (split == "eval"): train and eval never share one
    assert info["inner_seed"] == 6
    assert env.reset(seed=3, options={"split": "eval"})[1]["inner_seed"] == 7
    # other options reach the wrapped env without "split"
    assert env.reset(seed=0, options={"split": "eval", "level": 2})[1]["inner_options"] == {"level": 2}
    assert env.reset(seed=0)[1]["inner_options"] is None
    assert GymChatEnv(GuessNumber()).reset(seed=0)[0][0]["role"] == "user"  # no system message
    with pytest.raises(EnvError, match="unknown split"):
        env.reset(seed=0, options={"split": "test"})


def test_play_to_the_end():
    env = GymChatEnv(GuessNumber())
    # guess secret+1 ("Lower."), then the secret
    episode, turns = play(env, 5, lambda s: [str((s + 1) % 8), str(s)])
    assert [message_text(m) for m in turns[0]] in (["Lower."], ["Higher."])
    assert turns[1] == []  # the episode ended: no new messages
    assert episode.env_reward == pytest.approx(WRONG + RIGHT)
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("1")
    with pytest.raises(EnvError, match="before reset"):
        GymChatEnv(GuessNumber()).step("1")


def test_final_observation_and_step_info():
    env = GymChatEnv(GuessNumber())
    _, info = env.reset(seed=1)
    *_, step_info = env.step(info["answer"])
    assert step_info["guess"] == int(info["answer"]) and step_info["steps"] == 1
    assert step_info["invalid_action"] is None
    assert message_text(step_info["final_message"]) == "Correct!"


# -- bad replies are observations --------------------------------------------------------------------------
def test_bad_text_action_is_an_observation():
    env = GymChatEnv(GuessNumber())
    env.reset(seed=0)
    new, reward, terminated, truncated, info = env.step("seven")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["invalid_action"] == "'seven' is not a valid action"
    assert env.step("  <answer>9</answer> ")[4]["invalid_action"] is None  # the tag's content, stripped
    assert message_text(new[0]) == (
        "Invalid action: 'seven' is not a valid action. Reply with 1 to 2 characters using only the "
        "characters '0123456789'."
    )


def test_discrete_default_parser_and_action_names():
    env = GymChatEnv(GuessNumber(discrete=True))
    _, info = env.reset(seed=0)
    new, reward, *_ = env.step("I guess 9")
    assert reward == 0.0 and "Reply with one integer from 0 to 7." in message_text(new[0])
    assert "9" in env.step("<answer>9</answer>")[4]["invalid_action"]  # out of range
    assert env.step(f"I think... <answer> {info['answer']} </answer>")[1:3] == (RIGHT, True)

    named = GymChatEnv(GuessNumber(n=3, discrete=True), action_names=["zero", "one", "two"])
    _, info = named.reset(seed=0)
    new, *_ = named.step("four")
    assert "Reply with one of: zero, one, two." in message_text(new[0])
    word = ["zero", "one", "two"][int(info["answer"])]
    assert named.step(f"<answer>{word.upper()}</answer>")[1:3] == (RIGHT, True)


def test_custom_parser_and_help():
    def parse(text: str) -> int:
        return int(text.split("guess:")[-1])  # ValueError when the reply has no number

    env = GymChatEnv(
        GuessNumber(discrete=True),
        text_to_action=parse,
        action_help="Write 'guess: <number>'.",
    )
    _, info = env.reset(seed=0)
    new, reward, *_, step_info = env.step("no idea")
    assert reward == 0.0 and "invalid literal" in step_info["invalid_action"]
    assert message_text(new[0]).endswith("Write 'guess: <number>'.")
    assert env.step(f"guess: {info['answer']}")[1:3] == (RIGHT, True)
    by_path = GymChatEnv(GuessNumber(discrete=True), text_to_action="builtins:int")  # from a YAML config
    _, info = by_path.reset(seed=0)
    assert by_path.step("x")[4]["invalid_action"].startswith("invalid literal")
    assert by_path.step(info["answer"])[1] == RIGHT


def test_max_steps_counts_invalid_replies():
    env = GymChatEnv(GuessNumber(), max_steps=2)
    env.reset(seed=0)
    assert env.step("nope")[2:4] == (False, False)
    new, reward, terminated, truncated, _ = env.step("nope")
    assert (new, reward, terminated, truncated) == ([], 0.0, False, True)


def test_gym_time_limit_truncates():
    env = GymChatEnv(GAME_ID)  # registered with max_episode_steps=6
    messages, info = env.reset(seed=0)
    wrong = str((int(info["answer"]) + 1) % 8)
    outcomes = [env.step(wrong)[1:4] for _ in range(6)]
    assert outcomes[-1] == (WRONG, False, True)
    assert all(o == (WRONG, False, False) for o in outcomes[:-1])


def test_constructor_errors_teach():
    with pytest.raises(ConfigError, match="gymnasium cannot make it.*'that_module:Name-v0'"):
        GymChatEnv("mmgrpo_test/Nope-v0")
    with pytest.raises(ConfigError, match="gymnasium.Env or a gymnasium id"):
        GymChatEnv(42)  # type: ignore[arg-type]
    box_game = GuessNumber()
    box_game.action_space = Box(0, 1, shape=(2,))
    with pytest.raises(ConfigError, match="Pass text_to_action="):
        GymChatEnv(box_game)
    with pytest.raises(ConfigError, match="expected 8 non-empty names"):
        GymChatEnv(GuessNumber(discrete=True), action_names=["a", "b"])
    with pytest.raises(ConfigError, match="max_steps"):
        GymChatEnv(GuessNumber(), max_steps=0)
    with pytest.raises(ConfigError, match="cannot import"):
        GymChatEnv(GuessNumber(), obs_to_text="no_such_module:f")


def test_obs_to_text():
    import numpy as np

    assert default_obs_to_text("hi") == "hi"
    assert default_obs_to_text(np.int64(3)) == "3"
    assert default_obs_to_text(np.array([[1, 2], [3, 4]])) == "[[1, 2], [3, 4]]"
    assert default_obs_to_text({"pos": np.array([1.5]), "hp": 3}) == '{"pos": [1.5], "hp": 3}'
    env = GymChatEnv(GuessNumber(), obs_to_text=lambda obs: ["Game says:", obs])
    messages, _ = env.reset(seed=0)
    assert [p["text"] for p in messages[0]["content"]][0] == "Game says:"
    with pytest.raises(EnvError, match="obs_to_text could not turn"):
        GymChatEnv(GuessNumber(), obs_to_text=lambda obs: 3).reset(seed=0)


# -- rewards: the env's own reward trains with no verifier written -----------------------------------------
def test_env_rewards_flow_through_the_env_reward_verifier():
    registry._reset_for_tests()
    try:
        if "env_reward" not in registry.list_verifiers():
            registry.register_verifier("env_reward", env_reward)
        if "gym" not in registry.list_envs():
            registry.register_env("gym", GymChatEnv)
        env = registry.make_env("gym", env=GAME_ID, system="Guess the number.")
        assert isinstance(env, GymChatEnv)
        first_try, _ = play(env, 0, lambda s: [str(s)])
        second_try, _ = play(env, 1, lambda s: [str((s + 1) % 8), str(s)])
        never, _ = play(env, 2, lambda s: [str((s + 1) % 8)] * 6)  # six wrong guesses: the time limit
        rewards = Rewards([registry.make_verifier("env_reward", weight=2.0)])
        out = rewards.score([first_try, second_try, never])
        # env rewards: 1.0; -0.1 + 1.0; 6 * -0.1. Weighted by 2 and counted once (not also added unweighted)
        expected = torch.tensor([RIGHT, WRONG + RIGHT, 6 * WRONG])
        torch.testing.assert_close(out.per_verifier["env_reward"], expected)
        torch.testing.assert_close(out.total, 2 * expected)
        assert out.failures == {"env_reward": 0}
    finally:
        registry._reset_for_tests()
