"""The self_correct env: a single-turn env made two turns (answer, check, answer again), its statistics,
its config errors, and a rollout with the tiny models in which only the policy's turns are trained."""

from __future__ import annotations

import hashlib

import pytest

from mmgrpo import registry
from mmgrpo.env import ChatEnv, check_env, message_text, system, user
from mmgrpo.envs.counting import CountingEnv
from mmgrpo.envs.self_correct import DEFAULT_PROMPT, SelfCorrectEnv, is_correct
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import episode_metrics, rollout
from mmgrpo.verifier import Rewards

PROMPT = "Check your answer. If it is wrong, give the corrected answer inside <answer></answer>; otherwise repeat it."
METRICS = ("first_correct", "final_correct", "corrected", "broken")


@pytest.fixture(autouse=True)
def fresh_registry():
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


def make(**kw) -> SelfCorrectEnv:
    kw = {"env": "counting", "env_kwargs": {"max_count": 5}, "prompt": PROMPT, **kw}
    return registry.make_env("self_correct", **kw)


def _fingerprint(messages):
    out = []
    for m in messages:
        for p in m["content"]:
            value = hashlib.sha256(p["image"].tobytes()).hexdigest() if p["type"] == "image" else p["text"]
            out.append((m["role"], p["type"], value))
    return out


def _answer(n) -> str:
    return f"<answer>{n}</answer>"


# -- the protocol --------------------------------------------------------------------------------------------
def test_registered_as_a_builtin_and_passes_check_env():
    assert "self_correct" in registry.list_envs()
    assert registry.ENVS.source("self_correct") == "builtin"
    env = make()
    assert isinstance(env, SelfCorrectEnv) and isinstance(env.inner, CountingEnv)
    assert env.inner.max_count == 5
    check_env(env)  # two steps per episode, the last with no new messages
    check_env(make(env="text_math", env_kwargs={}), action="<answer>1</answer>")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_reset_is_the_inner_envs_reset(split):
    env, inner = make(), CountingEnv(max_count=5)
    messages, info = env.reset(seed=7, options={"split": split})
    expected, expected_info = inner.reset(seed=7, options={"split": split})
    assert _fingerprint(messages) == _fingerprint(expected)
    assert info == expected_info


def test_first_step_asks_to_check_and_the_second_ends():
    env = make()
    messages, info = env.reset(seed=0)
    obs, reward, terminated, truncated, step_info = env.step("I count <answer>2</answer>")
    assert obs == [user(PROMPT)] and obs[0]["role"] == "user" and message_text(obs[0]) == PROMPT
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert "metrics" not in step_info and step_info["answer"] == info["answer"]
    obs, reward, terminated, truncated, final = env.step(_answer(info["answer"]))
    assert (obs, reward, terminated, truncated) == ([], 0.0, True, False)
    assert final["first_answer"] == "2" and final["answer"] == info["answer"]
    assert set(final["metrics"]) == set(METRICS)
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("again")


def test_default_prompt_and_step_before_reset():
    env = registry.make_env("self_correct", env="text_math")
    assert env.prompt == DEFAULT_PROMPT == PROMPT
    with pytest.raises(EnvError, match="before reset"):
        env.step("<answer>1</answer>")
    env.reset(seed=0)
    with pytest.raises(EnvError, match="takes the assistant's text"):
        env.step(3)


# -- the statistics, with a scripted policy ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("first_right", "final_right", "expected"),
    [
        (False, True, {"first_correct": 0, "final_correct": 1, "corrected": 1, "broken": 0}),
        (True, False, {"first_correct": 1, "final_correct": 0, "corrected": 0, "broken": 1}),
        (True, True, {"first_correct": 1, "final_correct": 1, "corrected": 0, "broken": 0}),
        (False, False, {"first_correct": 0, "final_correct": 0, "corrected": 0, "broken": 0}),
    ],
    ids=["wrong-right", "right-wrong", "right-right", "wrong-wrong"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_of_scripted_answers(first_right, final_right, expected, seed):
    env = make()
    _, info = env.reset(seed=seed)
    right, wrong = int(info["answer"]), int(info["answer"]) + 1
    first = right if first_right else wrong
    env.step(f"Let me count. <answer>{first}</answer>")
    *_, final = env.step(_answer(right if final_right else wrong))
    assert final["metrics"] == expected
    assert final["first_answer"] == str(first)


def test_answers_are_parsed_like_the_answer_verifiers():
    env = make()
    _, info = env.reset(seed=0)
    n = int(info["answer"])
    env.step("no tags at all, " + str(n))  # the right number outside the tag: wrong, as number_match says
    *_, final = env.step(f"<answer>{n}.0</answer>")  # a plain number equal to the answer: right
    assert final["first_answer"] is None
    assert final["metrics"] == {"first_correct": 0, "final_correct": 1, "corrected": 1, "broken": 0}
    env.reset(seed=0)
    env.step(f"<answer>{n + 1}</answer> hmm, no: <answer> {n} </answer>")  # the last tag counts, stripped
    *_, final = env.step("<answer></answer>")
    assert final["first_answer"] == str(n)
    assert final["metrics"] == {"first_correct": 1, "final_correct": 0, "corrected": 0, "broken": 1}


def test_is_correct():
    assert (
        is_correct("3", "3") and is_correct("3.0", 3) and is_correct("+3", "3") and is_correct("1,000", 1000)
    )
    assert not is_correct("4", "3") and not is_correct(None, "3") and not is_correct("3 apples", "3")
    assert is_correct(" Paris ", "paris") and not is_correct("Lyon", "Paris")
    assert is_correct("4", ["3", "4"]) and is_correct("cat", ("dog", "Cat"))


def test_statistics_follow_the_answer_field():
    class Capital(ChatEnv):
        def reset(self, *, seed=None, options=None):
            return [user("Capital of France?")], {"answer": "ignored", "city": "Paris"}

        def step(self, action):
            return [], 0.5, True, False, {"metrics": {"inner_thing": 2.0}}

    registry.register_env("capital", Capital)
    env = make(env="capital", env_kwargs={}, answer_field="city")
    env.reset(seed=0)
    env.step("<answer>Lyon</answer>")
    _, reward, terminated, _, final = env.step("<answer>paris</answer>")
    assert reward == 0.5 and terminated  # the inner env's reward for the final answer
    assert final["metrics"] == {
        "inner_thing": 2.0,
        "first_correct": 0,
        "final_correct": 1,
        "corrected": 1,
        "broken": 0,
    }
    with pytest.raises(EnvError, match=r"without the field 'solution' \(task keys: \['answer', 'city'\]\)"):
        make(env="capital", env_kwargs={}, answer_field="solution").reset(seed=0)


# -- config errors -------------------------------------------------------------------------------------------
def test_unknown_inner_env_suggests_the_name():
    with pytest.raises(ConfigError) as err:
        make(env="countng")
    message = str(err.value)
    assert "SelfCorrectEnv(env='countng')" in message and "Unknown env 'countng'" in message
    assert "Did you mean 'counting'?" in message


def test_bad_inner_kwargs_show_the_inner_signature():
    with pytest.raises(
        ConfigError, match=r"SelfCorrectEnv\(env='counting'\).*max_cont.*Did you mean 'max_count'"
    ):
        make(env_kwargs={"max_cont": 3})
    with pytest.raises(ConfigError, match=r"CountingEnv\(max_count=-1\)"):  # the inner env's own check
        make(env_kwargs={"max_count": -1})


@pytest.mark.parametrize(
    ("inner", "kwargs", "kind"),
    [
        ("tool_math", {}, "tool env"),
        ("self_correct", {"env": "counting"}, "self_correct env"),
    ],
)
def test_multi_turn_inner_env_is_refused(inner, kwargs, kind):
    with pytest.raises(ConfigError, match=rf"env='{inner}'.*{kind}.*wraps single-turn envs only"):
        make(env=inner, env_kwargs=kwargs)


def test_gym_inner_env_is_refused():
    with pytest.raises(ConfigError, match="gym adapter.*wraps single-turn envs only"):
        make(env="gym", env_kwargs={"env": "FrozenLake-v1"})


def test_an_inner_env_that_does_not_end_is_caught_at_its_step():
    class Chatty(ChatEnv):
        def reset(self, *, seed=None, options=None):
            return [system("Chat."), user("Hi")], {"answer": "1"}

        def step(self, action):
            return [user("go on")], 0.0, False, False, {}

    registry.register_env("chatty", Chatty)
    env = make(env="chatty", env_kwargs={})
    env.reset(seed=0)
    env.step("<answer>1</answer>")
    with pytest.raises(EnvError, match=r"'chatty' \(Chatty\) did not end its episode.*1 new message"):
        env.step("<answer>1</answer>")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"env": ""}, "expected the inner env's registered name"),
        ({"env_kwargs": ["max_count", 5]}, "expected a mapping of the inner env's keyword arguments"),
        ({"prompt": "  "}, "prompt=.*expected a non-empty str"),
        ({"answer_field": 3}, "answer_field=3.*name of the task field"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make(**kwargs)


def test_an_unknown_setting_names_the_factory():
    with pytest.raises(ConfigError, match=r"env 'self_correct'.*promt.*Did you mean 'prompt'"):
        make(promt="x")


def test_config_file_builds_the_env(tmp_path):
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import build_env_factory

    path = tmp_path / "sc.yaml"
    path.write_text(
        "env:\n"
        "  name: self_correct\n"
        "  max_turns: 2\n"
        "  kwargs:\n"
        "    env: counting\n"
        "    env_kwargs: {max_count: 5}\n"
        f'    prompt: "{PROMPT}"\n'
        "    answer_field: answer\n"
    )
    cfg = load_config(path)
    env = build_env_factory(cfg)()
    assert isinstance(env, SelfCorrectEnv) and env.prompt == PROMPT and cfg.env.max_turns == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("env: counting", "env: text_mat"))
    with pytest.raises(ConfigError, match="Did you mean 'text_math'"):
        build_env_factory(load_config(bad))


# -- rollout with the tiny models ------------------------------------------------------------------------------
class RowScriptedPolicy(Policy):
    """A Policy whose k-th turn gives row i the text ``script[k][i]`` (canonical ids plus end-of-turn)."""

    def __init__(self, base: Policy, script: list[list[str]]):
        super().__init__(base.model, base.processor, device=base.device)
        self.script, self.calls = script, 0

    def generate(self, prompt_ids, prompt_mask, vision, *, num_samples=1, **kw):
        texts = self.script[self.calls]
        self.calls += 1
        assert len(texts) == prompt_ids.shape[0] * num_samples
        return [self.encode_text(t) + [self.eos_token_id] for t in texts], [True] * len(texts)


def _check_masks(policy, batch, script, prompt):
    header = "\n<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"
    for i, t in enumerate(batch.trajectories):
        first = policy.encode_text(script[0][i]) + [policy.eos_token_id]
        final = policy.encode_text(script[1][i]) + [policy.eos_token_id]
        env_ids = policy.encode_continuation(t.messages[:-2], t.messages[-2:-1])[0]
        # the response is: first turn (trained), the wrapper's message (not trained), final turn (trained)
        assert t.response_ids == first + env_ids + final
        assert t.loss_mask == [1] * len(first) + [0] * len(env_ids) + [1] * len(final)
        assert policy.tokenizer.decode(env_ids) == header  # exactly the wrapper's message and the next header
        row = batch.tokens.loss_mask[i][batch.tokens.response_mask[i].bool()].tolist()
        assert row == t.loss_mask
        assert t.turns == 2 and not t.truncated and t.env_error is None
        assert t.completion == script[1][i] and message_text(t.messages[-1]) == script[1][i]
        assert t.messages[-2] == user(prompt)


def test_rollout_with_the_tiny_vlm_masks_the_wrappers_message(tiny_policy):
    env_kwargs = {"max_count": 5}
    answer = int(CountingEnv(**env_kwargs).reset(seed=3)[1]["answer"])
    right, wrong = _answer(answer), _answer(answer + 1)
    # rows: wrong->right, right->wrong, right->right, wrong->wrong
    script = [[wrong, right, right, wrong], ["Sorry. " + right, wrong, right, wrong]]
    policy = RowScriptedPolicy(tiny_policy, script)
    envs = [make(env_kwargs=env_kwargs) for _ in range(4)]
    batch = rollout(policy, envs, [3], group_size=4, max_new_tokens=40, max_turns=2)
    _check_masks(policy, batch, script, PROMPT)
    assert batch.tokens.has_response_images is False  # the image is the prompt's only
    # the verifiers score the final turn only
    rewards = Rewards([registry.make_verifier("number_match")]).score(batch.episodes)
    assert rewards.per_verifier["number_match"].tolist() == [1.0, 0.0, 1.0, 0.0]
    per_row = [t.env_metrics for t in batch.trajectories]
    assert [m["corrected"] for m in per_row] == [1.0, 0.0, 0.0, 0.0]
    assert [m["broken"] for m in per_row] == [0.0, 1.0, 0.0, 0.0]
    metrics = episode_metrics(batch.trajectories)
    assert metrics["env/first_correct"] == 0.5 and metrics["env/final_correct"] == 0.5
    assert metrics["env/corrected"] == 0.25 and metrics["env/broken"] == 0.25
    assert metrics["turns"] == 2.0 and metrics["truncated/max_turns"] == 0.0
    # corrected among first-wrong = corrected / (1 - first_correct), as the module docstring says
    assert metrics["env/corrected"] / (1 - metrics["env/first_correct"]) == 0.5


def test_rollout_with_the_tiny_text_model(tmp_path_factory):
    from mmgrpo.envs.text_math import TextMathEnv
    from mmgrpo.tiny.text import build_tiny_text_model

    text_policy = Policy.from_pretrained(build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "m"))
    prompt = "Are you sure? Answer again inside <answer></answer>."
    answers = [int(TextMathEnv().reset(seed=s)[1]["answer"]) for s in (0, 1)]
    script = [
        [_answer(answers[0] + 1), _answer(answers[0]), _answer(answers[1]), _answer(answers[1])],
        [_answer(answers[0]), _answer(answers[0]), _answer(answers[1] - 1), _answer(answers[1])],
    ]
    policy = RowScriptedPolicy(text_policy, script)
    envs = [make(env="text_math", env_kwargs={}, prompt=prompt) for _ in range(4)]
    batch = rollout(policy, envs, [0, 1], group_size=2, max_new_tokens=40, max_turns=2)
    _check_masks(policy, batch, script, prompt)
    metrics = episode_metrics(batch.trajectories)
    assert {k: metrics[f"env/{k}"] for k in METRICS} == {
        "first_correct": 0.75,
        "final_correct": 0.75,
        "corrected": 0.25,
        "broken": 0.25,
    }


def test_with_max_turns_1_episodes_are_cut_and_report_no_statistics(tiny_policy):
    policy = RowScriptedPolicy(tiny_policy, [[_answer(1), _answer(2)]])
    batch = rollout(policy, [make() for _ in range(2)], [0], group_size=2, max_new_tokens=40, max_turns=1)
    assert all(t.truncation == "max_turns" and not t.env_metrics for t in batch.trajectories)
    assert not any(k.startswith("env/") for k in episode_metrics(batch.trajectories))
