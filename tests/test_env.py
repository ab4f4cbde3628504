"""The episode protocol: message builders, MessagesSpace, SingleTurnEnv and check_env."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from mmgrpo.env import (
    AssistantText,
    ChatEnv,
    MessagesSpace,
    SingleTurnEnv,
    Task,
    assistant,
    check_env,
    image_part,
    message_images,
    message_text,
    system,
    text_part,
    user,
)
from mmgrpo.errors import EnvError


class EchoEnv(SingleTurnEnv):
    """Minimal single-turn env: a seeded image and question whose answer is seed + 1."""

    def make_task(self, seed: int, split: str) -> Task:
        value = 2 * seed + (split == "eval")
        image = Image.new("RGB", (8, 8), (value % 256, 0, 0))
        return Task([system("Answer."), user(image, f"What is {seed} + 1?")], {"answer": str(seed + 1)})


def test_builders_and_accessors():
    img = Image.new("RGB", (4, 4))
    msg = user(img, "a", text_part("b"))
    assert msg == {"role": "user", "content": [image_part(img), text_part("a"), text_part("b")]}
    assert message_text(msg) == "ab"
    assert message_text({"role": "assistant", "content": "plain"}) == "plain"
    assert message_images([system("s"), msg, assistant("x")]) == [img]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [system("s"), user(Image.new("RGB", (2, 2)), "q"), assistant("a")],
        [{"role": "tool", "content": []}],
    ],
)
def test_messages_space_accepts(messages):
    assert MessagesSpace().contains(messages)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [{"role": "robot", "content": [text_part("x")]}],
        [{"role": "user", "content": "plain string"}],
        [{"role": "user", "content": [{"type": "audio", "audio": b""}]}],
        [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        [("user", "hi")],
    ],
)
def test_messages_space_rejects(messages):
    assert not MessagesSpace().contains(messages)


def test_spaces_sample_and_action_text():
    space = MessagesSpace()
    assert space.contains(space.sample())
    action = AssistantText()
    assert action.contains("") and action.contains("日本語 <answer>3</answer>") and not action.contains(3)
    assert action.contains(action.sample())
    assert isinstance(ChatEnv.action_space, AssistantText) and isinstance(
        ChatEnv.observation_space, MessagesSpace
    )


def test_single_turn_env_passes_check_env_and_ends_after_one_step():
    env = EchoEnv()
    check_env(env, seeds=(0, 1, 7))
    messages, info = env.reset(seed=3, options={"split": "eval"})
    assert info == {"answer": "4", "seed": 3, "split": "eval"}
    assert message_text(messages[1]) == "What is 3 + 1?"
    new, reward, terminated, truncated, _ = env.step("<answer>4</answer>")
    assert (new, reward, terminated, truncated) == ([], 0.0, True, False)
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("again")


def test_reset_without_seed_draws_from_np_random():
    env = EchoEnv()
    env.reset(seed=5)
    seeds_a = [env.reset()[1]["seed"] for _ in range(3)]
    env.reset(seed=5)
    assert [env.reset()[1]["seed"] for _ in range(3)] == seeds_a


def test_step_before_reset_raises():
    with pytest.raises(EnvError, match="before reset"):
        EchoEnv().step("hi")


def test_bad_split_and_seed_raise_naming_the_value():
    with pytest.raises(EnvError, match="'test'"):
        EchoEnv().reset(seed=0, options={"split": "test"})
    with pytest.raises(EnvError, match="-1"):
        EchoEnv().reset(seed=-1)


class RandomEnv(EchoEnv):
    def make_task(self, seed: int, split: str) -> Task:
        return Task([user(f"{random.random()}")], {"answer": "1"})


class WrongStepEnv(EchoEnv):
    def step(self, action):
        return [], 0.0, True, {}


class IntAnswerEnv(EchoEnv):
    def make_task(self, seed: int, split: str) -> Task:
        return Task([user("q")], {"answer": 1})


class BadMessagesEnv(EchoEnv):
    def make_task(self, seed: int, split: str) -> Task:
        return Task([{"role": "user", "content": "q"}], {})


class NotATaskEnv(EchoEnv):
    def make_task(self, seed: int, split: str):
        return [user("q")], {}


@pytest.mark.parametrize(
    "env_cls, match",
    [
        (RandomEnv, "not deterministic"),
        (WrongStepEnv, r"must return \(messages, reward, terminated, truncated, info\)"),
        (IntAnswerEnv, r"info\['answer'\] must be a str"),
        (BadMessagesEnv, "content must be a list"),
        (NotATaskEnv, "return Task"),
    ],
)
def test_check_env_catches_broken_envs(env_cls, match):
    with pytest.raises(EnvError, match=match):
        check_env(env_cls())
