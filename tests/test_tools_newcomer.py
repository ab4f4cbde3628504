"""Tools as a newcomer meets them (issue 17, item 6): tool settings in YAML, hung tools' threads, results
that are not JSON, and a tool env given a single turn.

Each test failed on 48bbbf8: a ``{name: python, cpu_seconds: 2}`` entry raised ``TypeError: unhashable type:
'dict'``; every episode of a hanging tool left one more thread; ``object()`` was a successful result reading
``<object object at 0x...>``; ``env.max_turns: 1`` on a tool env loaded and trained without a word.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from PIL import Image

from mmgrpo.config.core import load_config
from mmgrpo.env import Task, system, user
from mmgrpo.envs.tool_env import ToolEnv
from mmgrpo.errors import ConfigError
from mmgrpo.registry import make_env
from mmgrpo.tools.runner import FAILURE_KINDS, Tool, ToolRunner, tool_call_text


def _text(result) -> str:
    return "".join(p["text"] for p in result.content if p["type"] == "text")


def _env_from_yaml(tmp_path, env_yaml: str, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(env_yaml, encoding="utf-8")
    cfg = load_config(path, overrides)
    return make_env(cfg.env.name, **cfg.env.kwargs)


# --------------------------------------------------------------------------------------------- settings in YAML
TOOL_MATH_WITH_PYTHON = """\
env:
  name: tool_math
  max_turns: 3
  kwargs:
    tools: [calculator, {name: python, cpu_seconds: 1}]
"""


def test_a_tool_entry_with_settings_reaches_the_tools_factory(tmp_path):
    env = _env_from_yaml(tmp_path, TOOL_MATH_WITH_PYTHON)
    _, info = env.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator", "python"]
    (answer,), *_ = env.step(tool_call_text("python", {"code": "print(6 * 7)"}))
    assert answer["content"] == [{"type": "text", "text": "42"}] and answer["error"] is None
    t0 = time.perf_counter()
    (spin,), *_ = env.step(tool_call_text("python", {"code": "while True: pass"}))
    assert "CPU" in spin["content"][0]["text"], spin  # stopped by the sandbox's cpu_seconds: 1, not at 5 s
    assert time.perf_counter() - t0 < 4.5


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        (
            "[{name: python, cpu_second: 2}]",
            r"tools\[0\]: tool 'python': unknown setting 'cpu_second'\. Did you mean 'cpu_seconds'\? "
            r"Known settings: .*cpu_seconds, wall_seconds, memory_mb",
        ),
        (
            "[calculator, {name: calculator, digits: 3}]",
            r"tools\[1\]: tool 'calculator': unknown setting 'digits'\. It takes no settings",
        ),
        (
            "[{python: {cpu_seconds: 2}}]",
            r"tools\[0\]: a tool given as a mapping needs a 'name' key.*\{name: python, <setting>: value\}",
        ),
        ("[{name: pyton}]", r"unknown tool 'pyton'\. Did you mean 'python'\?"),
        ("[[calculator]]", r"tools\[0\]: expected a tool name or a mapping"),
    ],
)
def test_a_bad_tool_entry_is_one_error_naming_the_tool_and_the_key(tmp_path, tools, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        _env_from_yaml(tmp_path, TOOL_MATH_WITH_PYTHON, f"env.kwargs.tools={tools}")
    assert "\n" not in str(e.value)


def test_image_tools_may_be_written_as_mappings_and_take_no_settings(tmp_path):
    zoom_yaml = "env:\n  name: zoom_count\n  max_turns: 3\n  kwargs:\n    tools: [{name: zoom}, crop]\n"
    env = _env_from_yaml(tmp_path, zoom_yaml)
    _, info = env.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["zoom", "crop"]
    with pytest.raises(ConfigError, match=r"tools\[0\]: tool 'zoom': unknown setting 'grid'.*zoom_size"):
        _env_from_yaml(tmp_path, zoom_yaml, "env.kwargs.tools=[{name: zoom, grid: 4}]")


def test_a_tools_own_time_limit_extends_the_runners_deadline():
    def slow(x: int) -> int:
        """Answer slowly.

        Args:
            x: a number.
        """
        time.sleep(0.4)
        return x

    slow.timeout_s = 1.5  # as the toolbox's python and http tools carry theirs
    runner = ToolRunner([slow], timeout_s=0.1)
    (r,) = runner.run(tool_call_text("slow", {"x": 3}))
    assert (r.failure, _text(r)) == (None, "3")
    (r,) = ToolRunner([Tool(slow, timeout_s=0.1)]).run(tool_call_text("slow", {"x": 3}))
    assert r.failure == "timeout"  # the Tool's own timeout_s still wins


# --------------------------------------------------------------------------------------------- hung tools
_release = threading.Event()


def hang_newcomer(x: int) -> str:
    """Never answer (until the test releases it).

    Args:
        x: anything.
    """
    _release.wait()
    return "awake"


class HangEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([hang_newcomer], timeout_s=0.05)

    def make_task(self, seed: int, split: str) -> Task:
        return Task(messages=[system("Use the tool."), user("Go.")], info={"answer": "1"})


def _alive(name: str) -> int:
    return sum(t.name == f"mmgrpo-tool-{name}" for t in threading.enumerate())


def test_a_hanging_tool_leaves_at_most_the_cap_of_threads_however_many_episodes_call_it():
    from mmgrpo.tools import runner as tools

    MAX_ABANDONED = getattr(tools, "MAX_ABANDONED", 8)  # noqa: N806  (48bbbf8 had no cap: 40 threads)
    before = threading.active_count()
    failures = []
    try:
        for episode in range(40):  # a new env runner per episode, as in training
            env = HangEnv()
            env.reset(seed=episode)
            (message,), _, terminated, _, info = env.step(tool_call_text("hang_newcomer", {"x": episode}))
            assert not terminated and message["content"][0]["text"].startswith("error: hang_newcomer ")
            failures.append(message["error"])
        assert threading.active_count() - before <= MAX_ABANDONED
        assert _alive("hang_newcomer") == MAX_ABANDONED == tools.abandoned_threads()["hang_newcomer"]
        assert failures == ["timeout"] * MAX_ABANDONED + ["overloaded"] * (40 - MAX_ABANDONED)
        assert "overloaded" in FAILURE_KINDS and info["tool_failures"] == {"overloaded": 1}
        assert "still running past their deadline" in message["content"][0]["text"]
    finally:
        _release.set()
    deadline = time.monotonic() + 5
    while _alive("hang_newcomer") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _alive("hang_newcomer") == 0 and "hang_newcomer" not in tools.abandoned_threads()
    env = HangEnv()
    env.reset(seed=0)
    (message,), *_ = env.step(tool_call_text("hang_newcomer", {"x": 0}))
    assert (message["error"], message["content"][0]["text"]) == (None, "awake")  # the tool is usable again


# --------------------------------------------------------------------------------------------- results
_loop: list = []
_loop.append(_loop)
_deep: list = []
for _ in range(5000):
    _deep = [_deep]
RESULTS = {
    "object": (object(), "a value of type object,"),
    "set": ({1, 2}, "a value of type set,"),
    "numpy_int": (np.int64(3), "a value of type numpy.int64,"),
    "bytes": (b"x", "a value of type bytes,"),
    "dict_with_a_set": ({"a": {1}}, "a value of type dict (Object of type set is not JSON serializable)"),
    "circular": (_loop, "a value of type list (Circular reference detected)"),
    "nested": (_deep, "a value of type list (nested too deeply)"),
    "image_and_object": ((Image.new("RGB", (2, 2)), object()), "a value of type object,"),
}


def give(kind: str):
    """Return a value of the given kind.

    Args:
        kind: which value.
    """
    return {**{k: v for k, (v, _) in RESULTS.items()}, "dict": {"a": [1, None]}, "none": None}[kind]


@pytest.mark.parametrize("kind", RESULTS)
def test_a_result_that_is_not_json_is_a_bad_result_naming_the_tool_and_the_type(kind):
    (r,) = ToolRunner([give]).run(tool_call_text("give", {"kind": kind}))
    assert r.failure == "bad_result" and "bad_result" in FAILURE_KINDS
    assert _text(r).startswith(f"error: give returned {RESULTS[kind][1]}")
    assert "which is not JSON; a tool must return a str, a number" in _text(r) and " at 0x" not in _text(r)


@pytest.mark.parametrize(("kind", "text"), [("dict", '{"a": [1, null]}'), ("none", "None")])
def test_json_results_are_still_shown(kind, text):
    (r,) = ToolRunner([give]).run(tool_call_text("give", {"kind": kind}))
    assert (r.failure, _text(r)) == (None, text)


# --------------------------------------------------------------------------------------------- max_turns
@pytest.mark.parametrize("env", ["tool_math", "zoom_count"])
def test_a_tool_env_with_one_turn_is_refused_when_the_config_loads(env):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"env.name={env}", "env.max_turns=1"])
    message = str(e.value)
    assert "'env.max_turns' is 1, but the tool env" in message and f"'{env}'" in message
    assert "set env.max_turns >= 2" in message and "\n" not in message
    assert load_config(None, [f"env.name={env}", "env.max_turns=2"]).env.max_turns == 2
    assert load_config(None, ["env.name=counting", "env.max_turns=1"]).env.max_turns == 1


def test_train_with_a_one_turn_tool_env_stops_before_anything_runs(tmp_path, capsys):
    from mmgrpo.cli.app import main

    path = tmp_path / "tools.yaml"
    path.write_text("env:\n  name: tool_math\n  kwargs: {tools: [calculator]}\n", encoding="utf-8")
    assert main(["train", str(path), "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'env.max_turns' is 1, but the tool env 'tool_math'" in err
    assert not (tmp_path / "run").exists()


def test_a_built_tool_env_is_checked_against_max_turns():
    from mmgrpo.envs.tool_env import check_max_turns

    with pytest.raises(ConfigError, match=r"env.max_turns is 1, but the tool env HangEnv .* >= 2"):
        check_max_turns(HangEnv(), 1)
    check_max_turns(HangEnv(), 2)
    check_max_turns(object(), 1)  # not a tool env: nothing to say
