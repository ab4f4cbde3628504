"""Agent verifiers on multi-turn tool episodes: valid calls, call cost, tool use, the env reward pass-through
(counted once in Rewards), and answer verifiers that read the final answer only."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

from mmgrpo import registry
from mmgrpo.errors import ConfigError
from mmgrpo.verifier import Episode, Rewards, Verifier, check_verifier, from_trl
from mmgrpo.verifiers import agent
from mmgrpo.verifiers.agent import env_reward, tool_call_cost, tool_messages, tool_use_valid, used_tool
from mmgrpo.verifiers.answers import exact_match, number_match

# the entry-point lines for pyproject.toml's [project.entry-points."mmgrpo.verifiers"]
AGENT_ENTRY_POINTS = {
    "env_reward": "mmgrpo.verifiers.agent:env_reward",
    "tool_call_cost": "mmgrpo.verifiers.agent:tool_call_cost",
    "tool_use_valid": "mmgrpo.verifiers.agent:tool_use_valid",
    "used_tool": "mmgrpo.verifiers.agent:used_tool",
}


@pytest.fixture(autouse=True)
def agent_verifiers_registered():
    """The agent verifiers by name, whether or not pyproject.toml declares them yet."""
    registry._reset_for_tests()
    for name, value in AGENT_ENTRY_POINTS.items():
        if name not in registry.list_verifiers():
            registry.register_verifier(name, metadata.EntryPoint(name, value, "mmgrpo.verifiers").load())
    yield
    registry._reset_for_tests()


def text(t: str) -> list[dict]:
    return [{"type": "text", "text": t}]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def result(name: str, content: str, error: str | None = None) -> dict:
    return {"role": "tool", "name": name, "content": text(content), "error": error}


def episode(
    *turns, final: str = "<answer>42</answer>", answer: str = "42", env_reward: float = 0.0
) -> Episode:
    """A tool episode: prompt, then ``turns`` (assistant text or tool message), then the final answer."""
    messages = [
        {"role": "system", "content": text("Use the calculator.")},
        {"role": "user", "content": text("What is 6 * 7?")},
    ]
    for turn in turns:
        messages.append({"role": "assistant", "content": text(turn)} if isinstance(turn, str) else turn)
    messages.append({"role": "assistant", "content": text(final)})
    return Episode(completion=final, messages=messages, task={"answer": answer}, env_reward=env_reward)


GOOD = (call("calculator", expression="6*7"), result("calculator", "42"))
BAD_ARGS = (
    call("calculator", expr="6*7"),
    result("calculator", "missing argument 'expression'", "bad_arguments"),
)
UNKNOWN = (call("calc"), result("calc", "unknown tool 'calc'; tools: calculator", "unknown_tool"))
NO_TOOLS = episode()
ONE_GOOD = episode(*GOOD)
BAD_THEN_GOOD = episode(*BAD_ARGS, *GOOD)
TWO_IN_ONE_TURN = episode(
    call("calculator", expression="6*7") + call("calc"),
    result("calculator", "42"),
    result("calc", "unknown tool", "unknown_tool"),
)
ONLY_FAILED = episode(*UNKNOWN)


def test_tool_messages_are_the_calls():
    assert len(tool_messages(NO_TOOLS)) == 0
    assert [m["name"] for m in tool_messages(TWO_IN_ONE_TURN)] == ["calculator", "calc"]


def test_tool_use_valid_fraction_of_good_calls():
    fn = tool_use_valid()
    # no call: 0 (a call is required); 1/1; bad then good: 1/2; two calls in a turn, one unknown: 1/2
    assert [fn(e) for e in (NO_TOOLS, ONE_GOOD, BAD_THEN_GOOD, TWO_IN_ONE_TURN, ONLY_FAILED)] == [
        0.0,
        1.0,
        0.5,
        0.5,
        0.0,
    ]
    assert tool_use_valid(require_call=False)(NO_TOOLS) == 1.0  # nothing was called wrongly
    assert tool_use_valid(require_call=False)(BAD_THEN_GOOD) == 0.5
    # every failure kind counts against it, and a tool message without an "error" key is a success
    kinds = ["invalid_json", "bad_call", "timeout", "oversized", "too_many_calls", "tool_error"]
    assert fn(episode(*(result("calculator", "x", kind) for kind in kinds))) == 0.0
    assert fn(episode({"role": "tool", "name": "calculator", "content": text("42")})) == 1.0
    with pytest.raises(ConfigError, match="require_call"):
        tool_use_valid(require_call="yes")


def test_tool_call_cost_by_hand():
    assert tool_call_cost()(NO_TOOLS) == 0.0
    assert tool_call_cost()(ONE_GOOD) == pytest.approx(-0.1)
    assert tool_call_cost(cost=0.25)(BAD_THEN_GOOD) == pytest.approx(-0.5)  # failed calls cost too
    assert tool_call_cost(cost=0.25, free_calls=1)(BAD_THEN_GOOD) == pytest.approx(-0.25)
    assert tool_call_cost(cost=0.25, free_calls=5)(BAD_THEN_GOOD) == 0.0
    many = episode(*(GOOD * 10))  # 10 calls at 0.1 = 1.0, capped at 0.3
    assert tool_call_cost(max_penalty=0.3)(many) == pytest.approx(-0.3)
    assert tool_call_cost()(many) == pytest.approx(-1.0)
    for bad in ({"cost": -1}, {"free_calls": -1}, {"free_calls": 1.5}, {"max_penalty": -0.1}, {"cost": True}):
        with pytest.raises(ConfigError, match="tool_call_cost"):
            tool_call_cost(**bad)


def test_tool_call_cost_only_when_right():
    fn = tool_call_cost(cost=0.1, only_when_right=True)
    assert fn(episode(*GOOD, *GOOD)) == pytest.approx(-0.2)  # right: charged per call
    assert fn(episode(*GOOD, *GOOD, final="<answer>41</answer>")) == 0.0  # wrong: no charge
    assert fn(episode(*GOOD, final="no tag")) == 0.0
    assert tool_call_cost(only_when_right=True, field="total")(
        Episode(completion="<answer>7</answer>", messages=list(ONE_GOOD.messages), task={"total": "7"})
    ) == pytest.approx(-0.1)
    with pytest.raises(ConfigError, match="only_when_right"):
        tool_call_cost(only_when_right="yes")


def test_fewer_calls_win_when_composed_with_correctness():
    rewards = Rewards(
        [Verifier("correct", number_match()), Verifier("cost", tool_call_cost(cost=0.1))],
        include_env_reward=False,
    )
    one_call = episode(*GOOD)
    three_calls = episode(*GOOD, *GOOD, *GOOD)
    wrong_one_call = episode(*GOOD, final="<answer>41</answer>")
    out = rewards.score([one_call, three_calls, wrong_one_call])
    # correct - 0.1 * calls: [1 - 0.1, 1 - 0.3, 0 - 0.1]
    torch.testing.assert_close(out.total, torch.tensor([0.9, 0.7, -0.1]))


def test_used_tool():
    assert used_tool()(NO_TOOLS) == 0.0
    assert used_tool()(ONE_GOOD) == 1.0
    assert used_tool()(ONLY_FAILED) == 0.0  # a failed call is not use
    assert used_tool("calculator")(TWO_IN_ONE_TURN) == 1.0
    assert used_tool("calc")(TWO_IN_ONE_TURN) == 0.0  # called, but it failed
    assert used_tool("python")(ONE_GOOD) == 0.0
    with pytest.raises(ConfigError, match="used_tool"):
        used_tool(tool="")


# -- env_reward --------------------------------------------------------------------------------------------
def test_env_reward_passes_through_and_is_counted_once():
    episodes = [episode(env_reward=1.0), episode(env_reward=-0.5)]
    # default: the env reward is added once, unweighted, and not logged
    plain = Rewards([Verifier("correct", number_match())])
    assert plain.adds_env_reward
    torch.testing.assert_close(plain.score(episodes).total, torch.tensor([2.0, 0.5]))
    # the env_reward verifier: weighted (x2) and logged, and not added a second time
    rewards = Rewards([Verifier("correct", number_match()), registry.make_verifier("env_reward", weight=2.0)])
    assert not rewards.adds_env_reward
    out = rewards.score(episodes)
    torch.testing.assert_close(out.per_verifier["env_reward"], torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(out.total, torch.tensor([1.0 + 2.0, 1.0 - 1.0]))
    assert out.failures == {"correct": 0, "env_reward": 0}
    # include_env_reward=False does not silence an explicit env_reward verifier
    explicit = Rewards(rewards.verifiers, include_env_reward=False).score(episodes)
    torch.testing.assert_close(explicit.total, out.total)


def test_env_reward_alone_trains_a_plain_env_and_a_renamed_copy_is_still_counted_once():
    episodes = [episode(env_reward=0.75)]
    only = Rewards([registry.make_verifier("env_reward")]).score(episodes)
    torch.testing.assert_close(only.total, torch.tensor([0.75]))
    renamed = Verifier("game_score", env_reward(), weight=1.0)  # marked by its function, not its name
    torch.testing.assert_close(Rewards([renamed]).score(episodes).total, torch.tensor([0.75]))
    non_finite = Rewards([registry.make_verifier("env_reward")]).score([episode(env_reward=float("nan"))])
    assert non_finite.failures == {"env_reward": 1} and non_finite.total.tolist() == [0.0]


# -- final answer only -------------------------------------------------------------------------------------
def test_answer_verifiers_score_the_final_answer_not_tool_results():
    # the calculator said 42 (even inside <answer> tags); the final answer is 41: no credit
    said_42 = (call("calculator", expression="6*7"), result("calculator", "<answer>42</answer> 42"))
    wrong = episode(*said_42, final="<answer>41</answer>")
    right = episode(*said_42, final="The calculator says so. <answer>42</answer>")
    untagged = episode(*said_42, final="42")  # the right number, outside the answer tags
    for fn in (number_match(), exact_match()):
        assert [fn(e) for e in (wrong, right, untagged)] == [0.0, 1.0, 0.0]
    assert number_match(tag=None)(untagged) == 1.0
    assert number_match(tag=None)(episode(*said_42, final="I am not sure")) == 0.0

    seen = {}

    def final_reward(completions, prompts, **kwargs):  # a TRL function sees the final answer only
        seen["prompts"] = prompts
        return [float("42" in c[0]["content"]) for c in completions]

    assert check_verifier(from_trl(final_reward), [wrong, right]) == [0.0, 1.0]
    assert seen["prompts"][0] == wrong.messages[:-1]  # the tool turns are the TRL prompt


# -- by name -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(AGENT_ENTRY_POINTS))
def test_entry_point_values_load_and_make(name):
    target = metadata.EntryPoint(name, AGENT_ENTRY_POINTS[name], "mmgrpo.verifiers").load()
    assert target is getattr(agent, name)
    v = registry.make_verifier(name)
    values = check_verifier(v, [NO_TOOLS, ONE_GOOD, BAD_THEN_GOOD, TWO_IN_ONE_TURN])
    assert all(isinstance(x, float) for x in values)


def test_make_by_name_with_settings_and_typos():
    v = registry.make_verifier("tool_call_cost", weight=0.5, cost=0.2, free_calls=1)
    assert check_verifier(v, [BAD_THEN_GOOD, episode(*(GOOD * 3))]) == pytest.approx(
        [-0.2, -0.4]
    )  # 2 and 3 calls, 1 free
    with pytest.raises(ConfigError, match="free_call.*Did you mean 'free_calls'"):
        registry.make_verifier("tool_call_cost", free_call=1)
    assert registry.make_verifier("used_tool", tool="calc").fn(TWO_IN_ONE_TURN) == 0.0
