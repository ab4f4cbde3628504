"""Verifiers: the built-in format/answer checks, Rewards composition and failure counting, the TRL adapter."""

from __future__ import annotations

import math

import pytest
import torch

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode, Rewards, Verifier, check_verifier, extract_tag, from_trl
from mmgrpo.verifiers.answers import exact_match, number_match, parse_number
from mmgrpo.verifiers.format import format_reward


def ep(completion: str, answer: object = "3", **task: object) -> Episode:
    prompt = [{"role": "user", "content": [{"type": "text", "text": "How many?"}]}]
    reply = {"role": "assistant", "content": [{"type": "text", "text": completion}]}
    return Episode(completion=completion, messages=[*prompt, reply], task={"answer": answer, **task})


# -- extract_tag -------------------------------------------------------------------------------------------
def test_extract_tag_last_occurrence_stripped():
    assert extract_tag("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"
    assert extract_tag("<answer> 1 </answer>", strip=False) == " 1 "
    assert extract_tag("no tags") is None
    assert extract_tag("<answer>unclosed") is None
    assert extract_tag("<box>7</box>", tag="box") == "7"
    assert extract_tag("<answer></answer>") == ""


# -- format ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "completion, strict_score, loose_score",
    [
        ("<answer>3</answer>", 1.0, 1.0),
        ("  <answer>3</answer>\n", 1.0, 1.0),
        ("I count them. <answer>3</answer>", 0.0, 1.0),
        ("<answer>3</answer> done", 0.0, 1.0),
        ("<answer>1</answer><answer>2</answer>", 0.0, 1.0),
        ("3", 0.0, 0.0),
        ("<answer>3", 0.0, 0.0),
        ("<answer>multi\nline</answer>", 1.0, 1.0),
    ],
)
def test_format_strict_and_loose(completion, strict_score, loose_score):
    assert format_reward()(ep(completion)) == strict_score
    assert format_reward(strict=False)(ep(completion)) == loose_score


def test_format_pattern_and_bad_config():
    fn = format_reward(pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    assert fn(ep("<think>a\nb</think> <answer>3</answer>")) == 1.0
    assert fn(ep("<answer>3</answer>")) == 0.0
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        format_reward(pattern="(")
    with pytest.raises(ConfigError, match="bare tag name"):
        format_reward(tag="<answer>")


# -- number_match ------------------------------------------------------------------------------------------
def test_number_match_basic():
    fn = number_match()
    assert fn(ep("<answer>3</answer>")) == 1.0
    assert fn(ep("<answer>4</answer>")) == 0.0
    assert fn(ep("3")) == 0.0  # no answer inside tags, no credit
    assert fn(ep("<answer> 3.0 </answer>")) == 1.0
    assert fn(ep("I think 4. <answer>3</answer>")) == 1.0
    assert fn(ep("<answer>three</answer>")) == 0.0
    assert fn(ep("<answer>3 apples</answer>")) == 0.0
    assert fn(ep("<answer>1,000</answer>", answer="1000")) == 1.0
    assert fn(ep("<answer>-2</answer>", answer=-2)) == 1.0
    assert fn(ep("<answer>+5</answer>", answer=5.0)) == 1.0
    assert fn(ep("<answer>4</answer>", answer=["3", "4"])) == 1.0


def test_number_match_tolerance():
    assert number_match(tolerance=0.5)(ep("<answer>3.4</answer>")) == 1.0
    assert number_match(tolerance=0.5)(ep("<answer>3.6</answer>")) == 0.0
    # relative: 5% of 200 = 10
    assert number_match(tolerance=0.05, relative=True)(ep("<answer>209</answer>", answer="200")) == 1.0
    assert number_match(tolerance=0.05, relative=True)(ep("<answer>211</answer>", answer="200")) == 0.0
    with pytest.raises(ConfigError, match="tolerance"):
        number_match(tolerance=-1)


def test_number_match_untagged_and_custom_field():
    assert number_match(tag=None)(ep(" 3 ")) == 1.0
    assert number_match(field="count")(ep("<answer>7</answer>", count=7)) == 1.0


def test_number_match_missing_field_names_it():
    with pytest.raises(VerifierError, match=r"no field 'count'.*\['answer'\]"):
        number_match(field="count")(ep("<answer>3</answer>"))


@pytest.mark.parametrize(
    "text, value",
    [("3", 3.0), ("-2", -2.0), ("+4.5", 4.5), (".5", 0.5), ("1,000,000", 1e6), ("1e3", 1000.0), (" 7 ", 7.0)],
)
def test_parse_number_accepts(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "three", "nan", "inf", "1,00", "3/4", "3 apples", "1_000", "--3"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


# -- exact_match -------------------------------------------------------------------------------------------
def test_exact_match():
    fn = exact_match()
    assert fn(ep("<answer> Red </answer>", answer="red")) == 1.0
    assert fn(ep("<answer>blue</answer>", answer="red")) == 0.0
    assert fn(ep("red", answer="red")) == 0.0
    assert exact_match(case_sensitive=True)(ep("<answer>Red</answer>", answer="red")) == 0.0
    assert exact_match(strip=False)(ep("<answer> red</answer>", answer="red")) == 0.0
    assert exact_match(tag=None)(ep("red\n", answer="red")) == 1.0
    assert fn(ep("<answer>3</answer>", answer=3)) == 1.0


# -- Rewards -----------------------------------------------------------------------------------------------
def test_rewards_weighted_sum_by_hand():
    episodes = [ep("<answer>3</answer>"), ep("<answer>4</answer>"), ep("3")]
    episodes[2].env_reward = 0.25
    rewards = Rewards(
        [Verifier("correct", number_match(), weight=2.0), Verifier("format", format_reward(), weight=0.5)]
    )
    out = rewards.score(episodes)
    # correct: [1, 0, 0]; format: [1, 1, 0]; env: [0, 0, 0.25]
    # total = 2*correct + 0.5*format + env = [2.5, 0.5, 0.25]
    torch.testing.assert_close(out.total, torch.tensor([2.5, 0.5, 0.25]))
    assert out.total.dtype == torch.float32 and out.total.shape == (3,)
    torch.testing.assert_close(out.per_verifier["correct"], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(out.per_verifier["format"], torch.tensor([1.0, 1.0, 0.0]))
    assert out.failures == {"correct": 0, "format": 0}
    assert out.errors == []
    no_env = Rewards(rewards.verifiers, include_env_reward=False).score(episodes)
    torch.testing.assert_close(no_env.total, torch.tensor([2.5, 0.5, 0.0]))


def test_rewards_empty_batch():
    out = Rewards([Verifier("format", format_reward())]).score([])
    assert out.total.shape == (0,) and out.per_verifier["format"].shape == (0,)


def test_raising_verifier_is_a_counted_zero_and_others_unaffected():
    def picky(episode: Episode) -> float:
        if "4" in episode.completion:
            raise ValueError("cannot handle fours")
        return 1.0

    episodes = [ep("<answer>3</answer>"), ep("<answer>4</answer>")]
    out = Rewards([Verifier("picky", picky), Verifier("format", format_reward())]).score(episodes)
    torch.testing.assert_close(out.per_verifier["picky"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out.per_verifier["format"], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(out.total, torch.tensor([2.0, 1.0]))
    assert out.failures == {"picky": 1, "format": 0}
    assert len(out.errors) == 1 and "picky" in out.errors[0] and "cannot handle fours" in out.errors[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None, [1.0]])
def test_non_finite_or_non_number_is_a_failure(bad):
    episodes = [ep("a"), ep("b")]
    out = Rewards([Verifier("bad", lambda e: bad if e.completion == "a" else 0.5)]).score(episodes)
    torch.testing.assert_close(out.per_verifier["bad"], torch.tensor([0.0, 0.5]))
    assert out.failures == {"bad": 1}
    assert torch.isfinite(out.total).all()


def test_bools_and_tensor_scalars_are_numbers():
    out = Rewards([Verifier("b", lambda e: True), Verifier("t", lambda e: torch.tensor(0.5))]).score(
        [ep("x")]
    )
    torch.testing.assert_close(out.total, torch.tensor([1.5]))
    assert out.failures == {"b": 0, "t": 0}


def test_batched_verifier_and_wrong_length():
    episodes = [ep("ab"), ep("abcd")]
    good = Verifier("length", lambda eps: [len(e.completion) / 4 for e in eps], batched=True)
    short = Verifier("short", lambda eps: [1.0], batched=True)
    raising = Verifier("raising", lambda eps: 1 / 0, batched=True)
    out = Rewards([good, short, raising]).score(episodes)
    torch.testing.assert_close(out.per_verifier["length"], torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(out.per_verifier["short"], torch.tensor([0.0, 0.0]))
    assert out.failures == {"length": 0, "short": 2, "raising": 2}
    assert any("1 values for 2 episodes" in e for e in out.errors)
    assert any("ZeroDivisionError" in e for e in out.errors)


def test_missing_task_field_failure_message():
    out = Rewards([Verifier("count", number_match(field="count"))]).score([ep("<answer>3</answer>")])
    assert out.failures == {"count": 1}
    assert "no field 'count'" in out.errors[0] and "answer" in out.errors[0]


def test_duplicate_names_are_a_config_error():
    with pytest.raises(ConfigError, match="'format'"):
        Rewards([Verifier("format", format_reward()), Verifier("format", format_reward(strict=False))])


def test_verifier_validation():
    with pytest.raises(ConfigError, match="weight"):
        Verifier("x", format_reward(), weight=math.nan)
    with pytest.raises(ConfigError, match="callable"):
        Verifier("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Verifier objects"):
        Rewards([format_reward()])  # type: ignore[list-item]


def test_check_verifier_is_strict():
    episodes = [ep("<answer>3</answer>"), ep("x")]
    assert check_verifier(Verifier("format", format_reward()), episodes) == [1.0, 0.0]
    with pytest.raises(VerifierError, match="raised ZeroDivisionError"):
        check_verifier(Verifier("boom", lambda e: 1 / 0), episodes)
    with pytest.raises(VerifierError, match="finite"):
        check_verifier(Verifier("nan", lambda e: math.nan), episodes)
    with pytest.raises(VerifierError, match="must return a float"):
        check_verifier(Verifier("str", lambda e: "1"), episodes)
    with pytest.raises(VerifierError, match="1 values for 2 episodes"):
        check_verifier(Verifier("short", lambda eps: [1.0], batched=True), episodes)
    with pytest.raises(VerifierError, match="expects a mmgrpo Verifier"):
        check_verifier(format_reward(), episodes)  # type: ignore[arg-type]


# -- from_trl ----------------------------------------------------------------------------------------------
def accuracy_reward(completions, answer, **kwargs):
    """Written exactly as a TRL user would, for conversational data."""
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]  # noqa: B905 (as in TRL docs)


def test_from_trl_conversational():
    v = from_trl(accuracy_reward, weight=2.0)
    assert v.name == "accuracy_reward" and v.weight == 2.0 and v.batched
    out = Rewards([v]).score([ep(" 3 "), ep("4")])
    torch.testing.assert_close(out.total, torch.tensor([2.0, 0.0]))
    assert out.failures == {"accuracy_reward": 0}


def test_from_trl_plain_strings_and_kwargs():
    seen = {}

    def contains_answer(completions, prompts, answer, **kwargs):
        seen.update(prompts=prompts, kwargs=kwargs)
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]  # noqa: B905 (as in TRL docs)

    v = from_trl(contains_answer, name="contains", conversational=False)
    episodes = [ep("it is 3", difficulty=1), ep("it is 5", answer="4")]
    assert check_verifier(v, episodes) == [1.0, 0.0]
    assert seen["prompts"] == [episodes[0].messages[:1], episodes[1].messages[:1]]  # without the reply
    assert seen["kwargs"] == {"difficulty": [1, None]}  # missing in the second task -> None
    assert "completion_ids" not in seen["kwargs"]


def test_from_trl_none_means_not_applicable():
    def only_first(completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    out = Rewards([from_trl(only_first)]).score([ep("a"), ep("b"), ep("c")])
    torch.testing.assert_close(out.total, torch.tensor([1.0, 0.0, 0.0]))
    assert out.failures == {"only_first": 0}


def test_from_trl_wrong_length_and_raising_are_failures():
    out = Rewards([from_trl(lambda completions, **kw: [1.0], name="short"), from_trl(accuracy_reward)]).score(
        [ep("3", answer="3"), ep("3", answer="3")]
    )
    assert out.failures == {"short": 2, "accuracy_reward": 0}
    torch.testing.assert_close(out.total, torch.tensor([1.0, 1.0]))


def test_number_distance_gives_partial_credit():
    from mmgrpo.verifiers.answers import number_distance

    def score(fn, text, answer="3"):
        return fn(Episode(completion=text, task={"answer": answer}))

    near = number_distance()  # scale 1: off by one -> 1 - 1/2
    assert [score(near, f"<answer>{k}</answer>") for k in (3, 4, 2, 5, 0)] == [1.0, 0.5, 0.5, 0.0, 0.0]
    wide = number_distance(scale=3)  # off by k -> 1 - k/4
    assert [score(wide, f"<answer>{k}</answer>") for k in (3, 4, 5, 6, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert score(near, "3") == 0.0 and score(near, "<answer>x</answer>") == 0.0
    assert score(near, "<answer>4</answer>", answer=["4", "9"]) == 1.0  # the closest accepted target
    with pytest.raises(ConfigError, match="scale"):
        number_distance(scale=0)
