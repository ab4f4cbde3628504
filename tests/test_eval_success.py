"""``mmgrpo eval`` says what success means: the env's rule, else the metric verifier's, else a score >= 0.5
said to be the default; the mean score beside it; every env that evaluation made closed, also on Ctrl-C."""

from __future__ import annotations

import pytest

from mmgrpo.envs.text_math import TextMathEnv
from mmgrpo.errors import ConfigError
from mmgrpo.rollout import evaluation
from mmgrpo.rollout.evaluation import evaluate
from mmgrpo.rollout.success import SuccessRule, choose_rule, env_rule, successes, verifier_rule
from mmgrpo.verifier import Rewards, Verifier


def test_the_rule_comes_from_the_env_then_the_verifier_then_the_default():
    by_verifier = SuccessRule("verifier", "exact score == 1", 1.0)
    assert choose_rule("game won", True, by_verifier).describe() == "env: game won"
    assert choose_rule(None, True, by_verifier).describe() == "env: info['metrics']['success']"
    assert choose_rule(None, False, by_verifier).describe() == "verifier: exact score == 1"
    default = choose_rule(None, False, None)
    assert default.describe() == "score >= 0.5, the default" and default.source == "default"


def test_successes_under_each_rule():
    scores = [0.89, 0.5, 1.0, 0.2]
    assert successes(SuccessRule("default", "score >= 0.5", 0.5), scores, [None] * 4) == [
        True,
        True,
        True,
        False,
    ]
    assert successes(SuccessRule("verifier", "x", 1.0), scores, [None] * 4) == [False, False, True, False]
    # the env's word counts, whatever the score: a shaped 0.89 for a lost game is no success
    assert successes(SuccessRule("env", "game won"), scores, [0.0, None, 1.0, 1.0]) == [
        False,
        False,
        True,
        True,
    ]


def test_declarations_are_checked():
    class Env:
        success_rule = ""

    with pytest.raises(ConfigError, match="success_rule"):
        env_rule(Env())

    def fn(episode):
        return 1.0

    assert verifier_rule(fn, "v") is None
    fn.success_at = 0.9
    assert verifier_rule(fn, "v") == SuccessRule("verifier", "v score >= 0.9", 0.9)
    fn.success_at = "high"
    with pytest.raises(ConfigError, match="success_at"):
        verifier_rule(fn, "v")


class CountedMath(TextMathEnv):
    made: list[CountedMath] = []

    def __init__(self) -> None:
        super().__init__(ops=("+",), low=0, high=2)
        self.closed = 0
        CountedMath.made.append(self)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def text_policy(tmp_path_factory):
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.text import build_tiny_text_model

    return Policy.from_pretrained(build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model"))


def _rewards(**declared) -> Rewards:
    def half(episode) -> float:  # every episode scores 0.5: a success by the default rule only
        return 0.5

    for key, value in declared.items():
        setattr(half, key, value)
    return Rewards([Verifier("half", half)])


def test_evaluate_reports_score_and_success_with_its_rule_and_closes_every_env(text_policy):
    CountedMath.made.clear()
    result = evaluate(text_policy, CountedMath, _rewards(), episodes=5, metric="half", batch_size=2)
    assert (result.score, result.success, result.accuracy, result.correct) == (0.5, 1.0, 1.0, 5)
    assert (result.success_rule, result.success_source) == ("score >= 0.5, the default", "default")
    assert len(CountedMath.made) == 2 and all(env.closed == 1 for env in CountedMath.made)
    assert {"score", "success", "success_rule", "success_source", "accuracy"} <= set(result.to_json())
    assert all(sample["success"] for sample in result.samples)

    declared = evaluate(
        text_policy,
        CountedMath,
        _rewards(success_at=1.0, success_rule="score == 1"),
        episodes=3,
        metric="half",
    )
    assert (declared.score, declared.success, declared.accuracy) == (0.5, 0.0, 0.0)
    assert declared.success_rule == "verifier: half score == 1"


def test_envs_are_closed_when_evaluation_is_interrupted(text_policy, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "rollout", interrupted)
    CountedMath.made.clear()
    with pytest.raises(KeyboardInterrupt):
        evaluate(text_policy, CountedMath, _rewards(), episodes=4, metric="half", batch_size=4)
    assert len(CountedMath.made) == 4 and all(env.closed == 1 for env in CountedMath.made)
