"""ToolEnv: reset/step protocol of tool-using episodes, per-episode tools, and fuzzed turns through step()."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_tools import add, call, echo, fail, random_turn

from mmgrpo.env import SPLITS, Task, check_env, message_images, message_problem, system, user
from mmgrpo.envs.tool_env import ToolEnv
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.tools.runner import FAILURE_KINDS, Tool


class SumEnv(ToolEnv):
    """Add up a list of numbers, with an ``add`` tool at hand (the example subclass of the docs)."""

    def __init__(self, **runner_settings) -> None:
        super().__init__([add, echo, fail], **runner_settings)

    def make_task(self, seed: int, split: str) -> Task:
        rng = random.Random(2 * seed + (split == "eval"))
        numbers = [rng.randint(1, 99) for _ in range(3)]
        return Task(
            [
                system("Use the tools, then answer with the number only."),
                user(f"What is {' + '.join(map(str, numbers))}?"),
            ],
            {"answer": str(sum(numbers))},
        )


class ImageEnv(ToolEnv):
    """Each episode gets a ``size`` tool bound to its own image (as crop and zoom are)."""

    def make_task(self, seed: int, split: str) -> Task:
        image = Image.new("RGB", (10 + seed % 50, 20), "white")
        return Task([user("How wide is the image?", image)], {"answer": str(image.width)})

    def episode_tools(self, task: Task) -> list[Tool]:
        (image,) = message_images(task.messages)

        def size() -> list[int]:
            """The image's width and height in pixels."""
            return list(image.size)

        return [size]


def test_check_env_passes():
    check_env(SumEnv())
    check_env(ImageEnv())


def test_reset_returns_prompt_and_tool_schemas():
    messages, info = SumEnv().reset(seed=3, options={"split": "eval"})
    assert message_problem(messages) is None and messages[1]["role"] == "user"
    assert (info["seed"], info["split"]) == (3, "eval") and info["answer"].isdigit()
    assert [s["function"]["name"] for s in info["tools"]] == ["add", "echo", "fail"]
    assert info["tools"][0]["function"]["parameters"]["required"] == ["a"]


def test_same_seed_and_split_give_the_same_task_and_splits_differ():
    env = SumEnv()
    tasks = {split: env.reset(seed=7, options={"split": split})[0][1] for split in SPLITS}
    assert env.reset(seed=7, options={"split": "train"})[0][1] == tasks["train"] != tasks["eval"]


def test_tool_turns_then_final_answer():
    env = SumEnv()
    env.reset(seed=0)
    messages, reward, terminated, truncated, info = env.step(
        "Let me add.\n" + call("add", a=2, b=3) + call("nope")
    )
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert [(m["role"], m["name"], m["error"]) for m in messages] == [
        ("tool", "add", None),
        ("tool", "nope", "unknown_tool"),
    ]
    assert messages[0]["content"] == [{"type": "text", "text": "5"}]
    assert info["tool_calls"] == 2 and info["tool_failures"] == {"unknown_tool": 1}
    assert info["tool_names"] == ["add", "nope"] and "answer" in info and "tools" in info

    messages, reward, terminated, truncated, info = env.step(
        call("add", a="x")
    )  # a bad call is an observation
    assert (
        not terminated
        and messages[0]["error"] == "bad_arguments"
        and info["tool_failures"] == {"bad_arguments": 1}
    )

    messages, reward, terminated, truncated, info = env.step("The answer is 5.")
    assert (messages, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["tool_calls"] == 0 and info["tool_failures"] == {} and info["tool_names"] == []
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("again")


def test_episode_tools_are_bound_to_the_episode():
    env = ImageEnv()
    _, info = env.reset(seed=5)
    assert [s["function"]["name"] for s in info["tools"]] == ["size"]
    messages, *_ = env.step(call("size"))
    assert messages[0]["content"][0]["text"] == "[15, 20]"
    env.reset(seed=1)
    assert env.step(call("size"))[0][0]["content"][0]["text"] == "[11, 20]"


def test_runner_settings_reach_the_runner():
    env = SumEnv(max_calls_per_turn=1, max_result_chars=3)
    env.reset(seed=0)
    messages, *_ = env.step(call("echo", text="abcdef") + call("add", a=1))
    assert [m["error"] for m in messages] == ["oversized", "too_many_calls"]
    assert messages[0]["content"][0]["text"].startswith("abc...[truncated: result was 6 characters, limit 3]")


def test_step_before_reset_and_non_text_actions_raise():
    with pytest.raises(EnvError, match="before reset"):
        SumEnv().step("hi")
    env = SumEnv()
    env.reset(seed=0)
    with pytest.raises(EnvError, match=r"takes the assistant's text \(str\), got int"):
        env.step(3)


def test_bad_reset_arguments_and_settings_raise():
    with pytest.raises(EnvError, match="'test'"):
        SumEnv().reset(seed=0, options={"split": "test"})
    with pytest.raises(EnvError, match="-1"):
        SumEnv().reset(seed=-1)
    with pytest.raises(ConfigError, match="timeout_s"):
        SumEnv(timeout_s=-1)
    with pytest.raises(NotImplementedError, match="make_task"):
        ToolEnv([add]).reset(seed=0)


FUZZ_ENV = SumEnv()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_fuzzed_turns_through_step(seed):
    env = FUZZ_ENV
    env.reset(seed=seed % 1000)
    text = random_turn(seed)
    messages, reward, terminated, truncated, info = env.step(text)
    assert message_problem(messages) is None and reward == 0.0 and not truncated
    assert terminated == (messages == []) == (info["tool_calls"] == 0)
    assert len(messages) == info["tool_calls"] == len(info["tool_names"])
    assert set(info["tool_failures"]) <= set(FAILURE_KINDS)
    assert sum(info["tool_failures"].values()) == sum(m["error"] is not None for m in messages)
    for m in messages:
        assert m["role"] == "tool" and (m["error"] is None or m["error"] in FAILURE_KINDS)
