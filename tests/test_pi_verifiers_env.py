"""The ``verifiers`` env: Prime Intellect's verifiers.v1 environments (tests/fixtures/pi_envs) driven in-process.

Single-turn (two weighted rewards and a metric), multi-turn (the Env's ``run`` is a game engine answering each
guess) and tools (a ``vf.Toolset``): the rubric's weighted sum is the step reward and every function's score
an env metric; episodes end (terminated, or truncated at ``max_turns`` and still scored); no thread is started
per episode. Then ``mmgrpo train`` from a YAML alone on the tiny text model, single- and multi-turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip(
    "verifiers.v1", reason="needs Prime Intellect's verifiers >= 0.4 (pip install '.[pi-verifiers]')"
)

from mmgrpo.env import check_env  # noqa: E402
from mmgrpo.envs.pi_verifiers import VerifiersEnv  # noqa: E402
from mmgrpo.errors import ConfigError, EnvError  # noqa: E402
from mmgrpo.registry import make_env, make_verifier  # noqa: E402
from mmgrpo.verifier import Episode, Rewards  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "pi_envs"


@pytest.fixture(autouse=True)
def pi_envs_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ------------------------------------------------------------------------------------------------ single-turn
def test_single_turn_rubric_is_the_reward_and_each_function_a_metric():
    env = make_env("verifiers", env="mmgrpo_pi_qa", args={"num_tasks": 20})
    assert isinstance(env, VerifiersEnv)
    assert (env.num_tasks("train"), env.num_tasks("eval")) == (18, 2)  # a tenth held out
    obs, info = env.reset(seed=3, options={"split": "train"})
    assert [m["role"] for m in obs] == ["system", "user"]
    assert obs[1]["content"][0]["text"] == "What is 3+1? Reply with the number."
    assert info["answer"] == "4" and info["task"] == 3 and "tools" not in info
    # right and short: correct 1 (weight 1) + short 1 (weight 0.5)
    new, reward, terminated, truncated, info = env.step("4")
    assert (new, reward, terminated, truncated) == ([], 1.5, True, False)
    assert info["metrics"] == {"correct": 1.0, "short": 1.0, "reply_chars": 1.0, "verifiers_reward": 1.5}
    env.reset(seed=3)
    *_, reward, _, _, info = env.step("I think it is 5.")
    assert reward == 0.0 and info["metrics"]["correct"] == 0.0 and info["metrics"]["reply_chars"] == 16.0
    env.reset(seed=0, options={"split": "eval"})  # the held-out tasks are the last ones
    assert env.step("19")[1] == 1.5
    check_env(env)
    env.close()


def test_verifiers_rubric_passes_the_env_reward_once():
    rubric = make_verifier("verifiers_rubric")
    episode = Episode(completion="4", env_reward=1.5)
    assert rubric.score([episode]) == [1.5]
    scored = Rewards([rubric]).score([episode])
    assert scored.total.tolist() == [1.5]  # not 3.0: the env reward is not added a second time


# ------------------------------------------------------------------------------------------------ multi-turn
def test_multi_turn_env_run_answers_each_turn_and_scores_at_the_end():
    env = make_env("verifiers", env="mmgrpo_pi_guess")
    obs, info = env.reset(seed=0)  # secret (3 * 0 + 1) % 10 = 1
    assert info["secret"] == 1 and [m["role"] for m in obs] == ["user"]
    assert env.step("5")[:4] == (
        [{"role": "user", "content": [{"type": "text", "text": "No: lower. Try again."}]}],
        0.0,
        False,
        False,
    )
    assert env.step("0")[0][0]["content"][0]["text"] == "No: higher. Try again."
    new, reward, terminated, truncated, info = env.step("1")
    # won (recorded by the Env's run, weight 1) + 0.1 * few_turns (1 / 3 turns); guesses from Env.finalize
    assert (new, terminated, truncated) == ([], True, False)
    assert reward == pytest.approx(1.0 + 0.1 / 3)
    assert info["metrics"] == pytest.approx(
        {"won": 1.0, "few_turns": 1 / 3, "guesses": 3.0, "verifiers_reward": 1.0 + 0.1 / 3}
    )
    check_env(env, action="1")
    env.close()


def test_max_turns_ends_the_exchange_truncated_and_scored():
    env = make_env("verifiers", env="mmgrpo_pi_guess", max_turns=2)
    env.reset(seed=0)
    assert env.step("5")[2:4] == (False, False)
    new, reward, terminated, truncated, info = env.step("7")
    assert (new, terminated, truncated) == ([], False, True)
    assert reward == pytest.approx(0.05) and info["metrics"]["won"] == 0.0  # 0 + 0.1 * (1 / 2 turns)


def test_a_cut_episode_is_cancelled_by_the_next_reset_and_no_thread_is_started():
    env = make_env("verifiers", env="mmgrpo_pi_guess")
    threads = threading.active_count()
    for seed in range(20):
        env.reset(seed=seed)
        env.step("5")  # the rollout cuts it here (its max_turns): the next reset cancels the waiting episode
    assert threading.active_count() == threads
    env.reset(seed=1)  # secret 4
    assert env.step("4")[1] == pytest.approx(1.1)
    env.close()
    env.close()  # idempotent
    assert env._handoff.loop.is_closed()


# ------------------------------------------------------------------------------------------------ tools
def test_tools_run_in_process_and_failures_are_tool_messages():
    env = make_env("verifiers", env="mmgrpo_pi_tools")
    obs, info = env.reset(seed=0)
    (schema,) = info["tools"]
    assert schema["function"]["name"] == "calc_add"  # PI's <server>_<tool> name
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    new, reward, terminated, _, info = env.step(call("calc_add", {"a": 17, "b": 25}))
    assert new == [
        {"role": "tool", "name": "calc_add", "content": [{"type": "text", "text": "42"}], "error": None}
    ]
    assert (reward, terminated, info["tool_calls"]) == (0.0, False, 1)
    new, *_, info = env.step(call("calc_add", {"a": "x"}) + call("nope", {}))
    assert [m["error"] for m in new] == ["bad_arguments", "unknown_tool"]
    assert info["tool_failures"] == {"bad_arguments": 1, "unknown_tool": 1}
    new, reward, terminated, _, info = env.step("The sum is 42.")
    assert (new, reward, terminated) == ([], 1.0, True)
    assert info["metrics"]["tool_results"] == 3.0 and info["metrics"]["correct"] == 1.0
    check_env(env)


# ------------------------------------------------------------------------------------------------ errors
def test_config_errors_name_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="env.kwargs.env 'no_such_taskset'"):
        VerifiersEnv(env="no_such_taskset")
    with pytest.raises(ConfigError, match="env.kwargs.args"):
        VerifiersEnv(env="mmgrpo_pi_qa", args={"num_tasks": "many"})
    with pytest.raises(ConfigError, match="env.kwargs.eval_tasks"):
        VerifiersEnv(env="mmgrpo_pi_qa", args={"num_tasks": 3}, eval_tasks=3)
    with pytest.raises(ConfigError, match="env.kwargs.max_turns"):
        VerifiersEnv(env="mmgrpo_pi_qa", max_turns=0)
    (tmp_path / "mmgrpo_pi_duo.py").write_text(
        "import verifiers.v1 as vf\n"
        "from mmgrpo_pi_qa import QATaskset\n"
        "class DuoConfig(vf.EnvConfig):\n"
        "    solver: vf.AgentConfig = vf.AgentConfig()\n"
        "    judge: vf.AgentConfig = vf.AgentConfig()\n"
        "class DuoEnv(vf.Env[DuoConfig]):\n"
        "    async def run(self, task, agents):\n"
        "        await agents.solver.run(task)\n"
        "__all__ = ['DuoEnv', 'QATaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"2 agent seats \(\['judge', 'solver'\]\)"):
        VerifiersEnv(env="mmgrpo_pi_duo")


def test_a_reward_that_raises_is_an_env_error_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "mmgrpo_pi_broken.py").write_text(
        "import verifiers.v1 as vf\n"
        "class T(vf.Task):\n"
        "    @vf.reward\n"
        "    async def boom(self, trace: vf.Trace) -> float:\n"
        "        raise KeyError('answer')\n"
        "class B(vf.Taskset[T, vf.TasksetConfig]):\n"
        "    def load(self):\n"
        "        yield T(vf.TaskData(prompt='hi'))\n"
        "__all__ = ['B']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = VerifiersEnv(env="mmgrpo_pi_broken")
    env.reset(seed=0)
    with pytest.raises(EnvError, match="TaskError: task T scoring: KeyError"):
        env.step("hello")  # the rollout keeps it as the episode's env_error (reward 0, counted)


# ------------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("pi_text") / "model")


def train(tmp_path: Path, model_dir: Path, env_block: str, name: str) -> list[dict]:
    """``mmgrpo train`` of a YAML alone in a fresh interpreter, the fixture tasksets on PYTHONPATH; its GRPO steps."""
    out = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"seed: 0\noutput_dir: {out}\n"
        f"model: {{path: {model_dir}, dtype: float32, device: cpu}}\n"
        f"env: {env_block}\n"
        "verifiers:\n  - {name: verifiers_rubric}\n"
        # a format warm start on digits: the tiny model learns to stop after a short reply, so turns end
        'warm_start: {steps: 30, batch_size: 8, target: "{random}", random_low: 0, random_high: 9, '
        "check_tasks: 4, min_skill: 0}\n"
        "grpo: {steps: 2, tasks_per_step: 2, group_size: 4, micro_batch_size: 8, max_new_tokens: 8}\n"
        "eval: {episodes: 4, batch_size: 4, max_new_tokens: 8}\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "train", str(config), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "stage" not in r and "step" in r]
    assert [r["step"] for r in steps] == [1, 2] and (out / "final").exists()
    return steps


def test_trains_single_turn_from_yaml(tmp_path, text_model_dir):
    steps = train(
        tmp_path, text_model_dir, "{name: verifiers, max_turns: 2, kwargs: {env: mmgrpo_pi_qa}}", "qa"
    )
    for r in steps:
        assert r["env_errors"] == 0 and r["turns"] == 1.0  # every episode ends after its one turn
        assert r["truncated_frac"] < 1.0, "no episode was scored"
        # the rubric's weighted sum, function by function (episodes the env scored)
        assert r["env/verifiers_reward"] == pytest.approx(r["env/correct"] + 0.5 * r["env/short"])
        # the reward: that sum on the scored episodes, 0 on the turns cut at max_new_tokens (never stepped)
        assert r["reward/verifiers_rubric"] == pytest.approx(
            (1 - r["truncated_frac"]) * r["env/verifiers_reward"]
        )
        assert r["reward"] == pytest.approx(r["reward/verifiers_rubric"])
    assert any(r["env/short"] > 0 for r in steps)


def test_trains_multi_turn_from_yaml(tmp_path, text_model_dir):
    block = "{name: verifiers, max_turns: 3, kwargs: {env: mmgrpo_pi_guess, max_turns: 3}}"
    steps = train(tmp_path, text_model_dir, block, "guess")
    for r in steps:
        assert r["env_errors"] == 0 and 1.0 <= r["turns"] <= 3.0
        assert 1.0 <= r["env/guesses"] <= 3.0 and 0.0 <= r["env/won"] <= 1.0
        assert r["env/verifiers_reward"] == pytest.approx(r["env/won"] + 0.1 * r["env/few_turns"])
    assert max(r["turns"] for r in steps) > 1.0, "the env's run answered no guess"
