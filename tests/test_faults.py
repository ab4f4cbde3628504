"""FaultTracker and check_finite: faults are counted and shown once, the run stops only past the share."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmgrpo.errors import ConfigError, FaultError, MmgrpoError, NonFiniteError
from mmgrpo.train.faults import FaultTracker, check_finite, verifier_fault_kind
from mmgrpo.verifier import Episode, Rewards, Verifier


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


def _log(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ------------------------------------------------------------------------------------------------ errors
def test_new_errors_are_mmgrpo_errors():
    assert issubclass(FaultError, MmgrpoError)
    assert issubclass(NonFiniteError, MmgrpoError)


def test_bad_max_failure_frac_names_the_key(tmp_path):
    for bad in (-0.1, 1.5, "half", True, math.nan):
        with pytest.raises(ConfigError, match=r"faults\.max_failure_frac"):
            FaultTracker("e", tmp_path / "w.log", max_failure_frac=bad)


# ---------------------------------------------------------------------------------------------- env faults
def test_env_reset_failures_lines_counts_and_log(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("counting", log)
    tracker.env_reset_failures(3, [(12, "ValueError: no image")], total_tasks=4)
    line = (
        "mmgrpo: warning: step 3: env 'counting' failed to reset task seed 12: ValueError: no image; "
        "the task was left out"
    )
    assert _lines(capsys) == [line]
    assert _log(log) == [line]
    tracker.env_reset_failures(4, [(16, "E: a"), (17, "E: b")], total_tasks=4)
    assert tracker.metrics()["faults/env_reset"] == 3.0
    assert tracker.metrics()["faults/env_step"] == 0.0
    assert len(_log(log)) == 3


def test_env_step_failures_line(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("tool_math", log)
    tracker.env_step_failures(7, [(5, "RuntimeError: tool died")], total_episodes=16)
    line = (
        "mmgrpo: warning: step 7: env 'tool_math' raised in step() on task seed 5: RuntimeError: tool died; "
        "the episode ended there"
    )
    assert _lines(capsys) == [line]
    assert _log(log) == [line]
    assert tracker.metrics()["faults/env_step"] == 1.0
    assert tracker.metrics()["faults/env_reset"] == 0.0


def test_echo_limit_then_one_notice_and_the_rest_only_in_the_log(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("e", log, echo_limit=2, max_failure_frac=1.0)
    tracker.env_reset_failures(1, [(1, "E: x"), (2, "E: x")], total_tasks=4)
    tracker.env_step_failures(1, [(3, "E: y"), (4, "E: y"), (5, "E: y")], total_episodes=8)
    printed = _lines(capsys)
    assert len(printed) == 3
    assert "seed 1:" in printed[0] and "seed 2:" in printed[1]
    assert printed[2] == (
        f"mmgrpo: warning: more than 2 env faults or skipped batches; further ones are written only to {log}"
    )
    assert len(_log(log)) == 5  # every fault is in the log file
    tracker.env_step_failures(2, [(6, "E: z")], total_episodes=8)
    assert _lines(capsys) == []  # the notice is said once
    assert tracker.metrics()["faults/env_step"] == 4.0


def test_echo_false_prints_nothing_but_still_logs_and_counts(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("e", log, echo=False, max_failure_frac=1.0)
    tracker.env_reset_failures(1, [(1, "E: x")] * 8, total_tasks=8)
    tracker.verifier_failures(1, {"v": 4}, ["verifier 'v' failed on all 4 episodes: ValueError: bad"], n=4)
    tracker.skipped_batch(1, "nan")
    assert _lines(capsys) == []
    assert len(_log(log)) == 8 + 2 + 1
    assert tracker.metrics()["faults/env_reset"] == 8.0


def test_no_log_path_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = FaultTracker("e", None, echo_limit=0)
    tracker.env_reset_failures(1, [(1, "E: x")], total_tasks=4)
    assert list(tmp_path.iterdir()) == []
    assert _lines(capsys) == [
        "mmgrpo: warning: more than 0 env faults or skipped batches; further ones are not shown (no log "
        "file); see the faults/ counts in the metrics log"
    ]


# --------------------------------------------------------------------------------------------- the share
def test_exactly_the_threshold_does_not_raise(tmp_path):
    tracker = FaultTracker("e", tmp_path / "w.log", max_failure_frac=0.5, echo=False)
    tracker.env_reset_failures(1, [(1, "E: a"), (2, "E: b")], total_tasks=4)
    tracker.env_step_failures(1, [(1, "E: a")] * 8, total_episodes=16)
    tracker = FaultTracker("e", tmp_path / "w.log", max_failure_frac=0.3, echo=False)
    tracker.env_reset_failures(1, [(1, "E: a")] * 3, total_tasks=10)
    assert tracker.metrics()["faults/env_reset"] == 3.0


def test_above_the_threshold_raises_naming_seed_env_and_key(tmp_path):
    log = tmp_path / "w.log"
    tracker = FaultTracker("counting", log, max_failure_frac=0.5, echo=False)
    failed = [(21, "ValueError: corrupt image"), (22, "ValueError: other"), (23, "ValueError: other")]
    with pytest.raises(FaultError) as info:
        tracker.env_reset_failures(9, failed, total_tasks=4)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("step 9: env 'counting' failed to reset 3 of 4 tasks (75%)")
    assert "seed 21: ValueError: corrupt image" in message
    assert "faults.max_failure_frac = 0.5" in message
    assert "raise faults.max_failure_frac" in message and "Fix the env" in message
    assert tracker.metrics()["faults/env_reset"] == 3.0  # counted before the check
    assert _log(log)[-1] == f"mmgrpo: error: {message}"


def test_step_share_raises_with_episodes(tmp_path):
    tracker = FaultTracker("tool_math", None, max_failure_frac=0.25, echo=False)
    with pytest.raises(FaultError, match=r"step 2: env 'tool_math' raised in step\(\) on 5 of 16 episodes"):
        tracker.env_step_failures(2, [(s, "E: x") for s in range(5)], total_episodes=16)


def test_max_failure_frac_one_never_stops_and_zero_of_zero_is_fine(tmp_path):
    tracker = FaultTracker("e", None, max_failure_frac=1.0, echo=False)
    tracker.env_reset_failures(1, [(s, "E: x") for s in range(4)], total_tasks=4)
    tracker.env_step_failures(1, [], total_episodes=0)
    strict = FaultTracker("e", None, max_failure_frac=0.0, echo=False)
    strict.env_reset_failures(1, [], total_tasks=0)
    strict.env_reset_failures(1, [], total_tasks=4)
    with pytest.raises(FaultError):
        strict.env_reset_failures(2, [(1, "E: x")], total_tasks=4)


def test_total_below_the_failures_is_a_caller_bug():
    tracker = FaultTracker("e", None, echo=False)
    with pytest.raises(ValueError, match="total_tasks=1 is less than the 2 failures"):
        tracker.env_reset_failures(1, [(1, "E: x"), (2, "E: y")], total_tasks=1)


# ------------------------------------------------------------------------------------------------ verifiers
@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("verifier 'format' failed on all 8 episodes: ValueError: bad", ("format", "ValueError")),
        ("verifier 'x' failed on episode 3: KeyError: 'answer'", ("x", "KeyError")),
        ("verifier 'x' failed on episode 0: ZeroDivisionError: ", ("x", "ZeroDivisionError")),
        ("verifier 'x' failed on episode 0: mod.CustomError: y", ("x", "mod.CustomError")),
        ("Verifier 'x' returned nan for episode 3; rewards must be finite.", ("x", "returned nan")),
        ("Verifier 'x' returned -inf for episode 4; rewards must be finite.", ("x", "returned -inf")),
        (
            "Verifier 'x' returned str ('7: seven') for episode 2; a verifier must return a float.",
            ("x", "returned str"),
        ),
        (
            "verifier 'b' failed on all 4 episodes: Batched verifier 'b' returned 3 values for 4 episodes; it "
            "must return exactly one value per episode, in order.",
            ("b", "Batched verifier 'b' returned # values for # episodes; it mu"),
        ),
    ],
)
def test_verifier_fault_kind(message, kind):
    assert verifier_fault_kind(message) == kind


def test_verifier_fault_kind_prefers_the_longest_known_name():
    message = "verifier 'a' b' failed on episode 1: TypeError: no"
    assert verifier_fault_kind(message, ["a", "a' b"]) == ("a' b", "TypeError")


def test_kind_of_the_messages_rewards_really_writes():
    def flaky(ep: Episode) -> float:
        if ep.completion == "k":
            raise KeyError("answer")
        if ep.completion == "n":
            return math.nan
        raise ValueError("bad")

    def batched(episodes):
        raise RuntimeError("down")

    scored = Rewards(
        [Verifier("flaky", flaky), Verifier("batch", batched, batched=True)], include_env_reward=False
    ).score([Episode("k"), Episode("n"), Episode("v")])
    kinds = [verifier_fault_kind(e, list(scored.failures)) for e in scored.errors]
    assert kinds == [
        ("flaky", "KeyError"),
        ("flaky", "returned nan"),
        ("flaky", "ValueError"),
        ("batch", "RuntimeError"),
    ]


def test_each_kind_is_shown_once_per_run(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("e", log)
    errors = [
        "verifier 'format' failed on episode 0: ValueError: bad",
        "verifier 'format' failed on episode 1: KeyError: 'answer'",
        "verifier 'format' failed on episode 2: ValueError: also bad",
    ]
    tracker.verifier_failures(1, {"format": 3, "ok": 0}, errors, n=8)
    printed = _lines(capsys)
    assert printed == [
        "mmgrpo: warning: step 1: verifier 'format' failed on episode 0: ValueError: bad (first 'ValueError' "
        "failure of verifier 'format': it scores 0.0 there; more of this kind are only counted, in "
        "faults/verifier/format)",
        "mmgrpo: warning: step 1: verifier 'format' failed on episode 1: KeyError: 'answer' (first 'KeyError' "
        "failure of verifier 'format': it scores 0.0 there; more of this kind are only counted, in "
        "faults/verifier/format)",
    ]
    assert _log(log) == printed
    tracker.verifier_failures(
        2, {"format": 1, "ok": 0}, ["verifier 'format' failed on episode 5: ValueError: x"], 8
    )
    assert _lines(capsys) == []
    # the same exception type in another verifier is another kind
    tracker.verifier_failures(
        3, {"format": 0, "ok": 1}, ["verifier 'ok' failed on episode 2: ValueError: x"], 8
    )
    assert len(_lines(capsys)) == 1
    metrics = tracker.metrics()
    assert metrics["faults/verifier/format"] == 4.0
    assert metrics["faults/verifier/ok"] == 1.0


def test_a_verifier_failing_on_every_episode_is_said_once(tmp_path, capsys):
    tracker = FaultTracker("e", tmp_path / "warnings.log")
    first = "verifier 'fmt' failed on all 4 episodes: ValueError: bad"
    tracker.verifier_failures(5, {"fmt": 4}, [first], n=4)
    printed = _lines(capsys)
    assert len(printed) == 2
    assert printed[1].startswith(
        "mmgrpo: warning: step 5: verifier 'fmt' failed on all 4 episodes, so it scores 0 for every one: that "
        "trains on nothing while looking like a hard task. First error: " + first
    )
    tracker.verifier_failures(6, {"fmt": 4}, [first], n=4)
    assert _lines(capsys) == []
    assert tracker.metrics()["faults/verifier/fmt"] == 8.0


def test_no_episodes_is_not_all_failed(capsys):
    tracker = FaultTracker("e", None)
    tracker.verifier_failures(1, {"v": 0}, [], n=0)
    assert _lines(capsys) == []
    assert tracker.metrics()["faults/verifier/v"] == 0.0


# ------------------------------------------------------------------------------------------------ batches
def test_skipped_batch_counts_and_logs(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("e", log)
    tracker.skipped_batch(4, "step 4: the loss is nan")
    line = "mmgrpo: warning: step 4: the batch was skipped, no update: step 4: the loss is nan"
    assert _lines(capsys) == [line]
    assert _log(log) == [line]
    assert tracker.metrics() == {
        "faults/env_reset": 0.0,
        "faults/env_step": 0.0,
        "faults/skipped_batches": 1.0,
    }


# --------------------------------------------------------------------------------------------- state dict
def test_state_dict_round_trip_continues_and_does_not_reprint(tmp_path, capsys):
    log = tmp_path / "warnings.log"
    tracker = FaultTracker("e", log, echo_limit=1, max_failure_frac=1.0)
    tracker.env_reset_failures(1, [(1, "E: x"), (2, "E: x")], total_tasks=4)  # line, then the notice
    tracker.env_step_failures(1, [(3, "E: y")], total_episodes=8)
    message = "verifier 'fmt' failed on all 2 episodes: ValueError: bad"
    tracker.verifier_failures(1, {"fmt": 2}, [message], n=2)
    tracker.skipped_batch(1, "nan")
    before = tracker.metrics()
    state = json.loads(json.dumps(tracker.state_dict()))
    assert state == tracker.state_dict()
    capsys.readouterr()

    resumed = FaultTracker("e", log, echo_limit=1, max_failure_frac=1.0)
    resumed.load_state_dict(state)
    assert resumed.metrics() == before
    resumed.verifier_failures(2, {"fmt": 2}, [message], n=2)  # same kind, all failed again
    resumed.env_reset_failures(2, [(9, "E: z")], total_tasks=4)  # echo budget and notice already spent
    assert _lines(capsys) == []
    after = resumed.metrics()
    assert after["faults/env_reset"] == 3.0
    assert after["faults/env_step"] == 1.0
    assert after["faults/verifier/fmt"] == 4.0
    assert after["faults/skipped_batches"] == 1.0
    resumed.verifier_failures(3, {"fmt": 1}, ["verifier 'fmt' failed on episode 0: TypeError: t"], n=2)
    assert len(_lines(capsys)) == 1  # a new kind is still shown


def test_load_state_dict_rejects_something_else():
    with pytest.raises(ValueError, match="not a FaultTracker state"):
        FaultTracker("e", None).load_state_dict({"env_reset": 1})


# --------------------------------------------------------------------------------------------- check_finite
def test_check_finite_all_finite_is_none():
    per_verifier = {"a": torch.zeros(4), "b": torch.ones(4)}
    assert check_finite(1, per_verifier, advantages=torch.randn(4), loss=0.5) is None
    assert check_finite(1, per_verifier) is None


def test_check_finite_names_the_verifier_and_rows():
    values = torch.tensor([1.0, math.nan, 0.0, math.nan] + [0.0] * 12)
    message = check_finite(
        3, {"ok": torch.zeros(16), "numeric": values}, advantages=torch.full((16,), math.nan)
    )
    assert message is not None and "\n" not in message
    assert message.startswith("step 3: verifier 'numeric' returned nan for 2 of 16 episodes;")
    assert "'ok'" not in message
    assert "advantages" not in message  # the upstream culprit is named, not what it spoiled


def test_check_finite_names_several_verifiers_nan_and_inf():
    message = check_finite(
        2,
        {"a": torch.tensor([math.inf, 0.0]), "b": torch.tensor([math.nan, -math.inf])},
    )
    assert message is not None
    assert message.startswith(
        "step 2: verifier 'a' returned inf for 1 of 2 episodes; verifier 'b' returned nan for 1 and inf for 1 "
        "of 2 episodes;"
    )


def test_check_finite_inf_in_advantages():
    advantages = torch.tensor([0.5, math.inf, -0.5, 0.0])
    message = check_finite(8, {"a": torch.zeros(4)}, advantages=advantages, loss=math.nan)
    assert message is not None
    assert message.startswith("step 8: the advantages hold inf for 1 of 4 episodes")
    assert "huge magnitude" in message


def test_check_finite_nan_loss():
    message = check_finite(11, {"a": torch.zeros(4)}, advantages=torch.zeros(4), loss=float("nan"))
    assert message is not None
    assert message.startswith("step 11: the loss is nan")
    assert "lower grpo.lr" in message and "huge magnitude" in message
    assert check_finite(11, {}, loss=float("inf")).startswith("step 11: the loss is inf")
