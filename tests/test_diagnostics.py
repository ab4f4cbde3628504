"""Diagnostics: each check fires on its symptom (at the right step, with its numbers), a real run is quiet."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mmgrpo.train.diagnostics import CHECKS, Diagnostics, Finding, History, repetition, verdict

FIXTURE = Path(__file__).parent / "fixtures" / "healthy_counting_metrics.jsonl"


# ------------------------------------------------------------------------------------------------ streams
def base(step: int) -> dict:
    """A quiet record: flat reward (0.49/0.51 alternating), some signal, small KL, steady length."""
    return {
        "step": step,
        "reward": 0.5 + 0.01 * (-1) ** step,
        "reward/number_match": 0.45,
        "reward/format": 1.0,
        "reward_std_within_group": 0.4,
        "frac_zero_std_groups": 0.125,
        "adv_abs_mean": 0.7,
        "loss": 0.001,
        "kl": 0.02,
        "clip_frac": 0.0,
        "ratio_mean": 1.0,
        "grad_norm": 0.5,
        "lr": 3e-4,
        "completion_len": 20.0,
        "truncated_frac": 0.0,
        "num_episodes": 128,
        "entropy": 1.0,
        "repetition": 0.05,
    }


STUCK = {"frac_zero_std_groups": 1.0, "reward/number_match": 0.0, "reward": lambda s: 0.1 + 0.01 * (-1) ** s}
"""Overrides of a stuck run: every group all-equal, no answer right (reward 0.1 from the format alone)."""


def stream(n: int, start: int = 1, **changes) -> list[dict]:
    """Records ``start..n``: :func:`base` with each key of ``changes`` set to ``f(step)`` (or a constant)."""
    out = []
    for step in range(start, n + 1):
        record = base(step)
        for key, value in changes.items():
            v = value(step) if callable(value) else value
            if v is None:
                record.pop(key, None)
            else:
                record[key] = v
        out.append(record)
    return out


def after(step0: int, then, before=None):
    """A value that is ``before`` (the base value when None) up to ``step0`` and ``then`` after it."""

    def f(step):
        if step > step0:
            return then(step) if callable(then) else then
        return before

    return f


def feed(records, diag: Diagnostics | None = None, **kwargs) -> list[Finding]:
    diag = diag if diag is not None else Diagnostics(None, echo=False, **kwargs)
    found = []
    for record in records:
        found += diag.observe(record)
    return found


def fired(found: list[Finding]) -> list[tuple[str, int]]:
    return [(f.symptom, f.step) for f in found]


def _with_base(key: str, changer):
    """``changer(step)`` where it returns a value, else the base record's value of ``key``."""

    def f(step):
        v = changer(step)
        return base(step)[key] if v is None else v

    return f


def switch(key: str, step0: int, then):
    return {key: _with_base(key, after(step0, then))}


# ------------------------------------------------------------------------------------------------ healthy
def test_quiet_synthetic_stream_fires_nothing():
    assert feed(stream(300)) == []


def _fixture_records() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def test_fixture_is_a_real_grpo_run():
    records = _fixture_records()
    assert len(records) >= 300
    assert all("stage" not in r for r in records)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    # it learned: the last steps' reward is well above the first steps'
    first = sum(r["reward"] for r in records[:20]) / 20
    last = sum(r["reward"] for r in records[-20:]) / 20
    assert last > first + 0.3


@pytest.mark.parametrize("reward_max", [None, 1.1])
def test_healthy_counting_run_fires_nothing(reward_max, tmp_path, capsys):
    log = tmp_path / "diagnostics.log"
    diag = Diagnostics(log, echo=True, reward_max=reward_max)
    assert feed(_fixture_records(), diag) == []
    assert not log.exists()
    assert capsys.readouterr().err == ""


def test_healthy_run_with_warm_start_lines_fires_nothing():
    lines = [{"stage": "warm_start", "step": s, "nll": 5.0 / s} for s in range(1, 101)]
    assert feed(lines + _fixture_records()) == []


# --------------------------------------------------------------------------------------------- zero std
def test_zero_variance_fires_when_most_groups_are_flat():
    found = feed(stream(60, **{**STUCK, **switch("frac_zero_std_groups", 30, 1.0)}))
    assert fired(found) == [("zero-variance groups", 35)]
    line = found[0].line()
    assert line.startswith("mmgrpo: diagnosis: step 35: zero-variance groups: 56% of groups")
    assert "(frac_zero_std_groups, mean of steps 26-35; threshold 50%)" in line
    assert "while the reward stayed flat (0.1 -> 0.1)" in line
    assert "; try: " in line and "grpo.dynamic_sampling" in line and "grpo.group_size" in line


def test_zero_variance_from_the_start_waits_for_two_windows():
    assert fired(feed(stream(60, **STUCK))) == [("zero-variance groups", 20)]


def test_zero_variance_silent_while_the_reward_rises():
    rising = stream(60, **{**STUCK, "reward": lambda s: 0.01 * s})
    assert feed(rising) == []


def test_zero_variance_silent_when_the_groups_can_be_all_correct():
    # nearly solved: 60% all-equal groups, but 90% of answers are right: most of those groups are all-correct
    nearly = {"frac_zero_std_groups": 0.6, "reward/number_match": 0.9, "reward/format": 1.0}
    assert feed(stream(80, **nearly)) == []
    assert (
        feed(
            stream(80, frac_zero_std_groups=1.0, reward=1.05, **{"reward/number_match": None}), reward_max=1.1
        )
        == []
    )
    # the same share with few right answers is stuck
    found = feed(stream(60, **{**nearly, "reward/number_match": 0.05}))
    assert fired(found) == [("zero-variance groups", 20)]
    assert "at most 5% can be all at the maximum reward" in found[0].line()
    # reward_max known: the total reward bounds it, whatever the verifier keys say
    stuck = stream(80, **{**STUCK, "reward/number_match": 1.0}, **{"reward/format": 1.0})
    assert fired(feed(stuck, reward_max=1.1)) == [("zero-variance groups", 20), ("zero-variance groups", 70)]


# ---------------------------------------------------------------------------------------------------- KL
def test_kl_low_fires_when_the_policy_does_not_move():
    found = feed(stream(60, **switch("kl", 20, 1e-5)))
    assert fired(found) == [("KL too low", 40)]
    line = found[0].line()
    assert "step 40: KL too low: kl 1e-05 (mean of steps 21-40; threshold 0.001)" in line
    assert "adv_abs_mean 0.70" in line and "grpo.lr" in line and "grpo.beta" in line


def test_kl_low_silent_without_reference_or_without_signal_or_while_learning():
    assert feed(stream(60, kl=0.0)) == []  # beta = 0: KL not measured
    assert feed(stream(60, kl=1e-5, adv_abs_mean=0.0)) == []  # no advantages: the zero-variance case
    assert feed(stream(60, kl=1e-5, reward=lambda s: 0.01 * s)) == []  # the reward rises


def test_kl_high_fires_when_kl_grows_several_fold():
    growth = {31: 0.1, 32: 0.3, 33: 0.9, 34: 2.0}
    found = feed(stream(40, kl=lambda s: growth.get(s, 0.02 if s < 31 else 3.0)))
    assert fired(found) == [("KL too high", 33)]
    line = found[0].line()
    assert "kl grew 5.0x or more in 3 steps: 0.02 (mean of steps 21-30) -> 0.1, 0.3, 0.9 (steps 31-33" in line
    assert "lower grpo.lr" in line and "raise grpo.beta" in line


def test_kl_high_fires_when_kl_stays_high():
    found = feed(stream(30, kl=6.0))
    assert fired(found) == [("KL too high", 10)]
    assert "kl 6 (median of steps 1-10; threshold 5)" in found[0].line()


def test_kl_single_spikes_do_not_fire():
    spikes = {8: 0.078, 9: 0.147, 37: 0.5, 60: 0.9, 61: 0.05, 62: 0.9}
    assert feed(stream(80, kl=lambda s: spikes.get(s, 0.02))) == []


# ------------------------------------------------------------------------------------------------ length
def test_length_growth_fires_while_the_reward_is_flat():
    found = feed(stream(80, **switch("completion_len", 50, 32.0), **switch("truncated_frac", 50, 0.5)))
    assert fired(found) == [("completion length growing", 59)]
    line = found[0].line()
    assert "completion_len 20.0 -> 25.4 tokens (+27%, steps 20-39 vs 40-59; threshold +25%)" in line
    assert "truncated_frac 0.00 -> 0.2" in line and "while the reward stayed flat (0.5 -> 0.5)" in line
    assert "grpo.max_new_tokens" in line and "grpo.aggregation=token" in line


def test_length_growth_needs_two_windows():
    assert fired(feed(stream(60, completion_len=lambda s: 20.0 if s <= 20 else 40.0))) == [
        ("completion length growing", 40)
    ]


def test_length_growth_silent_while_the_reward_rises():
    longer = stream(80, completion_len=lambda s: 20 + s, reward=lambda s: 0.01 * s)
    assert feed(longer) == []


# -------------------------------------------------------------------------------------------- repetition
def test_repetition_rising_fires():
    found = feed(stream(60, **switch("repetition", 30, 0.5)))
    assert fired(found) == [("repetition rising", 34)]
    line = found[0].line()
    assert "repetition 0.05 -> 0.23" in line and "steps 15-24 vs 25-34" in line
    assert "entropy bonus" in line


# ------------------------------------------------------------------------------------------------ entropy
def test_entropy_collapse_fires_while_the_reward_is_flat():
    found = feed(stream(60, **switch("entropy", 30, 0.05)))
    assert fired(found) == [("entropy collapse", 40)]
    line = found[0].line()
    assert "entropy 0.05 (mean of steps 31-40) is 5% of its early value 1 (threshold 10%)" in line
    assert "grpo.clip_eps_high=0.28" in line and "grpo.temperature" in line


def test_entropy_collapse_silent_while_learning_or_solved():
    rising = stream(80, entropy=lambda s: 1.0 if s <= 30 else 0.05, reward=lambda s: 0.01 * s)
    assert feed(rising) == []
    solved = stream(80, entropy=lambda s: 1.0 if s <= 30 else 0.05, reward=1.1)
    assert feed(solved, reward_max=1.1) == []


def test_entropy_collapse_fires_when_low_even_if_rising_a_little():
    slow = stream(60, entropy=lambda s: 1.0 if s <= 20 else 0.05, reward=lambda s: 0.007 * s)
    found = feed(slow, reward_max=1.1)
    assert fired(found) == [("entropy collapse", 30)]
    assert "while the reward is low (0.17" in found[0].line() and "of at most 1.1)" in found[0].line()
    assert feed(slow) == []  # without reward_max, "low" is unknown and the reward is not flat


# ----------------------------------------------------------------------------------------------- answers
def test_answer_collapse_fires_when_some_right_answers_are_never_given():
    """counting_hard's seed 1: only 1, 3 and 5 given to counts of 1-5 (coverage 0.6)."""
    found = feed(stream(60, answer_coverage=0.6))
    assert fired(found) == [("answer collapse", 20)]  # as soon as the window holds 20 steps
    line = found[0].line()
    assert "the episodes gave 60% of their tasks' true answers (mean of steps 1-20; threshold 80%)" in line
    assert "mmgrpo eval" in line and "grpo.beta" in line


def test_answer_collapse_silent_while_answers_cover_or_solved_or_not_logged():
    assert feed(stream(80, answer_coverage=lambda s: 1.0 if s % 10 else 0.6)) == []  # a dip is noise
    solved = stream(80, answer_coverage=0.6, reward=1.1)
    assert feed(solved, reward_max=1.1) == []  # one answer per task left: solved
    assert feed(stream(80)) == []  # tasks without a few short answers log no coverage


# -------------------------------------------------------------------------------------------- oscillation
def test_reward_oscillation_fires():
    found = feed(stream(40, reward=lambda s: (0.2 if s % 2 else 0.8) if s > 30 else base(s)["reward"]))
    assert fired(found) == [("reward oscillation", 35)]
    line = found[0].line()
    assert "the reward moved 0.257 per step on average and changed direction 10 times in steps 24-35" in line
    assert "range 0.2..0.8; thresholds 6 changes and 0.25 per step, 6x what sampling alone gives)" in line
    assert "lower grpo.lr" in line and "grpo.tasks_per_step" in line


def test_reward_noise_of_a_small_batch_is_not_oscillation():
    noisy = stream(80, reward=lambda s: 0.3 if s % 2 else 0.7, num_episodes=8, reward_std_within_group=0.5)
    assert feed(noisy) == []


# ------------------------------------------------------------------------------------ rate limit, warmup
def test_cooldown_limits_each_symptom():
    found = feed(stream(100, **STUCK))
    assert fired(found) == [("zero-variance groups", 20), ("zero-variance groups", 70)]
    found = feed(stream(45, **STUCK), cooldown=10)
    assert [step for _, step in fired(found)] == [20, 30, 40]


def test_cooldown_is_per_symptom():
    found = feed(stream(45, **STUCK, kl=6.0))
    assert fired(found) == [("KL too high", 10), ("zero-variance groups", 20)]


def test_warmup_holds_findings_back():
    assert fired(feed(stream(40, kl=6.0), warmup=30)) == [("KL too high", 30)]
    assert fired(feed(stream(40, kl=6.0), warmup=0)) == [("KL too high", 10)]


def test_bad_arguments():
    for kwargs in (
        {"warmup": -1},
        {"cooldown": 0},
        {"history": 0},
        {"reward_max": math.nan},
        {"cooldown": True},
    ):
        with pytest.raises(ValueError):
            Diagnostics(None, echo=False, **kwargs)


# ------------------------------------------------------------------------------------- missing keys, NaN
def test_missing_keys_fire_nothing_and_do_not_raise():
    assert feed([{"step": s, "reward": 0.5} for s in range(1, 100)]) == []
    assert feed([{"step": s} for s in range(1, 100)]) == []
    assert feed([{} for _ in range(100)]) == []
    old = stream(100, entropy=None, repetition=None)  # a run from before entropy and repetition
    assert feed(old) == []


def test_nan_values_fire_nothing_and_do_not_raise():
    nan = math.nan
    keys = ("reward", "frac_zero_std_groups", "kl", "completion_len", "entropy", "repetition", "adv_abs_mean")
    assert feed(stream(100, **dict.fromkeys(keys, nan))) == []
    assert feed(stream(100, **{**STUCK, "reward": nan})) == []
    assert feed(stream(100, kl=math.inf, reward="high", step=None)) == []


def test_some_nan_steps_do_not_hide_a_symptom():
    kl = lambda s: math.nan if s % 4 == 0 else 6.0  # noqa: E731
    assert fired(feed(stream(30, kl=kl))) == [("KL too high", 10)]


def test_a_record_without_step_counts_on():
    records = [{k: v for k, v in r.items() if k != "step"} for r in stream(30, kl=6.0)]
    assert fired(feed(records)) == [("KL too high", 10)]


# ------------------------------------------------------------------------------------------------ output
def test_findings_go_to_the_log_and_stderr(tmp_path, capsys):
    log = tmp_path / "run" / "diagnostics.log"
    found = feed(stream(100, **STUCK), Diagnostics(log, echo=True))
    lines = [f.line() for f in found]
    assert log.read_text().splitlines() == lines
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == lines
    assert all("\n" not in line for line in lines)


def test_echo_false_prints_nothing(tmp_path, capsys):
    log = tmp_path / "diagnostics.log"
    feed(stream(40, kl=6.0), Diagnostics(log, echo=False))
    assert capsys.readouterr().err == ""
    assert len(log.read_text().splitlines()) == 1


def test_finding_line():
    finding = Finding("KL too low", "kl 1e-05 (mean of steps 1-20)", "raise grpo.lr", 20)
    assert (
        finding.line()
        == "mmgrpo: diagnosis: step 20: KL too low: kl 1e-05 (mean of steps 1-20); try: raise grpo.lr"
    )


def test_every_check_is_documented_with_its_thresholds():
    for check in CHECKS:
        assert check.__doc__ and ":data:`" in check.__doc__
        assert check(History([])) is None  # an empty history says nothing


# -------------------------------------------------------------------------------------------- state dict
def test_state_dict_round_trip_continues_the_same(tmp_path):
    records = stream(100, **STUCK, entropy=lambda s: 1.0 if s <= 45 else 0.01, kl=math.nan)
    whole = fired(feed(records))
    assert whole == [("zero-variance groups", 20), ("entropy collapse", 55), ("zero-variance groups", 70)]
    for cut in (5, 15, 40, 60):
        first = Diagnostics(None, echo=False)
        part = fired(feed(records[:cut], first))
        state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # plain JSON, no NaN
        second = Diagnostics(None, echo=False)
        second.load_state_dict(state)
        assert part + fired(feed(records[cut:], second)) == whole, cut
        assert second.state_dict() == json.loads(json.dumps(_state_after(records), allow_nan=False))


def _state_after(records) -> dict:
    diag = Diagnostics(None, echo=False)
    feed(records, diag)
    return diag.state_dict()


def test_history_is_bounded():
    diag = Diagnostics(None, echo=False, history=30)
    feed(stream(500), diag)
    assert len(diag.state_dict()["history"]) == 30


def test_load_state_dict_rejects_other_things():
    with pytest.raises(ValueError, match="not a Diagnostics state"):
        Diagnostics(None, echo=False).load_state_dict({"env_reset": 0})


def test_a_rewound_step_forgets_the_future():
    diag = Diagnostics(None, echo=False)
    assert fired(feed(stream(25, **STUCK), diag)) == [("zero-variance groups", 20)]
    # the run resumed from a checkpoint at step 10 without the diagnostics state: history after it is gone
    assert fired(feed(stream(30, start=11, **STUCK), diag)) == [("zero-variance groups", 20)]


# -------------------------------------------------------------------------------------------- repetition
def test_repetition_word_ngrams():
    assert repetition(["the cat sat on the mat"]) == 0.0
    assert repetition(["the the the the the the"]) == pytest.approx(3 / 4)  # 4 trigrams, 1 distinct
    assert repetition(["a b c a b c a b c"]) == pytest.approx(4 / 7)  # 7 trigrams, 3 distinct
    assert repetition(["a b a b a b"], n=2) == pytest.approx(3 / 5)


def test_repetition_character_ngrams_for_short_texts():
    assert repetition(["<answer>3</answer>"]) == 0.0  # markup is not a loop
    assert repetition(["3" * 14]) == pytest.approx(2 / 3)  # 3 twelve-grams, 1 distinct
    assert repetition(["ab" * 12]) == pytest.approx(11 / 13)
    assert repetition(["", "x"]) == 0.0  # too short for one n-gram


def test_repetition_is_a_mean_over_texts():
    assert repetition(["the the the the the the", "the cat sat on the mat"]) == pytest.approx(3 / 8)
    assert repetition([]) == 0.0
    with pytest.raises(ValueError):
        repetition(["a"], n=0)


# ----------------------------------------------------------------------------------------------- verdict
def test_verdict_all_zeros():
    ok, line = verdict([[0.0] * 8 for _ in range(4)], format_rate=None)
    assert not ok
    assert line.startswith("cannot learn yet: every reward is 0")
    assert "warm start" in line and "SFT cold start" in line and "\n" not in line
    ok, line = verdict([[0.0] * 8 for _ in range(4)], format_rate=0.0)
    assert not ok and "well-formatted" in line and "format warm start" in line
    ok, line = verdict([[0.0] * 8 for _ in range(4)], format_rate=1.0)
    assert not ok and "format is fine" in line and "SFT cold start" in line


def test_verdict_all_ones():
    ok, line = verdict([[1.0] * 8 for _ in range(4)], format_rate=1.0, reward_max=1.0)
    assert not ok and "solved" in line and "nothing to learn" in line
    ok, line = verdict([[1.0] * 8 for _ in range(4)], format_rate=None)
    assert not ok and "every reward is 1" in line and "solved" in line


def test_verdict_mixed_groups_can_learn():
    groups = [[0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]]
    ok, line = verdict(groups, format_rate=0.9)
    assert ok
    assert line == "can learn: 60% of groups (3/5) have reward variance, mean reward 0.5, format rate 0.90"


def test_verdict_too_few_groups_with_variance():
    groups = [[0.0] * 8] * 5 + [[1.0] * 8] * 4 + [[0.0] * 7 + [1.0]]
    ok, line = verdict(groups, format_rate=None)
    assert not ok and "10% of groups (1/10)" in line and "grpo.group_size" in line


def test_verdict_nearly_all_zero_or_all_max():
    ok, line = verdict([[0.0] * 63 + [1.0]], format_rate=None)
    assert not ok and "nearly every reward is 0" in line
    ok, line = verdict([[1.0] * 63 + [0.0]], format_rate=None, reward_max=1.0)
    assert not ok and "nearly solved" in line


def test_verdict_edge_cases():
    assert verdict([], None)[0] is False
    assert verdict([[math.nan, math.nan]], None)[0] is False
    ok, line = verdict([[0.0], [1.0]], None)
    assert not ok and "grpo.group_size >= 2" in line
    ok, line = verdict([[0.0, 1.0, math.nan], [1.0, 0.0]], None)
    assert ok and "(2/2)" in line


def test_probe_says_cannot_learn_yet_on_the_fresh_model_and_can_learn_after_the_warm_start(
    tiny_model_dir, warm_model_dir, capsys
):
    from pathlib import Path

    from mmgrpo.cli.app import main

    cfg = str(Path(__file__).resolve().parent.parent / "examples" / "counting_tiny.yaml")
    sets = ["--set", "grpo.tasks_per_step=8", "--set", "grpo.group_size=8"]
    assert main(["probe", cfg, "--model", str(tiny_model_dir), "--steps", "1", *sets, "--no-progress"]) == 0
    fresh = capsys.readouterr().out
    assert "verdict: cannot learn yet" in fresh
    assert main(["probe", cfg, "--model", str(warm_model_dir), "--steps", "1", *sets, "--no-progress"]) == 0
    warm = capsys.readouterr().out
    assert "verdict: can learn" in warm
    print(fresh.splitlines()[-1], "|", warm.splitlines()[-1])
