"""DAPO's dynamic sampling and overlong handling, the group-size schedule: pure pieces by hand, then
through the trainer on the tiny VLM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.registry import register_verifier
from mmgrpo.rollout.sampling import longest_turn, overlong_penalty, zero_variance_groups
from mmgrpo.train import dynamic
from mmgrpo.train.trainer import Trainer

BASE = [
    "grpo.steps=1",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.max_new_tokens=6",
    "warm_start.steps=0",
    "env.kwargs.max_count=3",
]


def test_zero_variance_groups_by_id():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert zero_variance_groups(rewards, [7, 7, 3, 3, 9, 9]) == {7, 9}


def test_overlong_penalty_by_hand():
    # max_len 8, buffer 4: penalty starts after 8 - 4 = 4 tokens; 6 tokens -> -(6 - 4) / 4 = -0.5;
    # 8 tokens -> -1; a truncated episode -> -factor whatever its length
    lengths = torch.tensor([3, 4, 6, 8, 5])
    cut = torch.tensor([False, False, False, False, True])
    got = overlong_penalty(lengths, cut, max_len=8, buffer=4, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, cut, 8, 4, 0.5), got * 0.5)


def _even_seeds_only(**_):
    """Reward variance only for tasks with an even seed: odd-seed groups are all 0 (degenerate)."""

    def fn(episode):
        return 0.0 if episode.task["seed"] % 2 else len(episode.completion) / 10

    return fn


def _constant(**_):
    return lambda episode: 1.0


@pytest.fixture(autouse=True)
def _verifiers():
    register_verifier("test_even_only", _even_seeds_only, overwrite=True)
    register_verifier("test_constant", _constant, overwrite=True)


def _trainer(model, tmp_path, *sets):
    cfg = load_config(None, [f"model.path={model}", f"output_dir={tmp_path}", *BASE, *sets])
    return Trainer(cfg, progress=False)


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_variance(tiny_model_dir, tmp_path):
    tr = _trainer(
        tiny_model_dir, tmp_path, "verifiers=[{name: test_even_only}]", "grpo.dynamic_sampling=true"
    )
    batch, scored, stats = tr.collect(4)
    # round 1: seeds 0 (kept) and 1 (dropped); round 2: seeds 2 (kept) and 3 (dropped) -> 2 groups, full
    assert sorted({t.seed for t in batch.trajectories}) == [0, 2] and len(batch.trajectories) == 8
    assert stats == {
        "dynamic/rounds": 2,
        "dynamic/dropped_groups": 2,
        "dynamic/kept_groups": 2,
        "dynamic/gave_up": 0,
    }
    assert tr.task_cursor == 4 and len(batch.tokens) == 8 and scored.total.shape == (8,)
    assert zero_variance_groups(scored.total, batch.group_ids) == set()
    record = tr.train_step()  # the next step continues the stream at seed 4
    assert record["dynamic/kept_groups"] == 2 and tr.task_cursor == 8


def test_dynamic_sampling_gives_up_at_its_bound_and_says_so(tiny_model_dir, tmp_path, capsys):
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        "verifiers=[{name: test_constant}]",
        "grpo.dynamic_sampling=true",
        "grpo.max_sampling_rounds=2",
    )
    record = tr.train_step()
    assert (
        record["dynamic/rounds"] == 3
        and record["dynamic/gave_up"] == 1
        and record["dynamic/dropped_groups"] == 6
    )
    err = capsys.readouterr().err
    assert "dynamic sampling gave up after 3 rounds of 2 tasks: 0 of the 2 groups needed" in err
    assert "grpo.max_sampling_rounds" in (tmp_path / "warnings.log").read_text()
    assert tr.task_cursor == 6


def test_overlong_mask_leaves_truncated_episodes_out_of_the_loss(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.overlong=mask", "grpo.max_new_tokens=2")
    batch, _, _ = tr.collect(4)
    cut = [t.truncated for t in batch.trajectories]
    assert any(cut)  # a random model rarely ends its turn within 2 tokens
    mask = dynamic.trained_tokens(tr.cfg.grpo, batch).loss_mask
    for i, c in enumerate(cut):
        assert int(mask[i].sum()) == (0 if c else int(batch.tokens.loss_mask[i].sum()))


def test_soft_overlong_penalty_is_added_before_advantages(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.overlong=soft_penalty", "grpo.overlong_buffer=3")
    batch, scored, _ = tr.collect(4)
    shaped = dynamic.shape_rewards(tr.cfg.grpo, batch, scored.total)
    for i, t in enumerate(batch.trajectories):
        cut = t.truncation in ("max_new_tokens", "token_budget")
        want = -1.0 if cut else -max(0, t.num_policy_tokens - 3) / 3
        assert float(shaped[i] - scored.total[i]) == pytest.approx(want)


def test_longest_turn_reads_the_runs_of_the_loss_mask():
    assert longest_turn([1, 1, 1, 0, 0, 1, 1]) == 3 and longest_turn([0, 1, 0, 1]) == 1
    assert longest_turn([]) == 0 and longest_turn([1] * 5) == 5


def _three_turns(batch, truncation: str | None):
    """The batch with its first episode made a 3-turn episode of 3 x 10 policy tokens (5 env tokens
    between turns), ending as ``truncation`` says; the others untouched."""
    first = batch.trajectories[0]
    mask = [1] * 10 + [0] * 5 + [1] * 10 + [0] * 5 + [1] * 10
    fake = dataclasses.replace(
        first,
        loss_mask=mask,
        response_ids=[5] * len(mask),
        turns=3,
        truncated=truncation is not None,
        truncation=truncation,
    )
    return dataclasses.replace(batch, trajectories=[fake, *batch.trajectories[1:]])


def test_soft_overlong_penalty_compares_the_longest_turn_with_the_per_turn_limit(tiny_model_dir, tmp_path):
    """max_new_tokens=16 bounds each turn; 3 untruncated turns of 10 tokens are 30 tokens in all but never
    near the limit: no penalty (48bbbf8 compared the 30 with 16: -1.0). A turn cut at the limit: -1."""
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        "grpo.overlong=soft_penalty",
        "grpo.overlong_buffer=4",
        "grpo.max_new_tokens=16",
    )
    batch, scored, _ = tr.collect(4)
    shaped = dynamic.shape_rewards(tr.cfg.grpo, _three_turns(batch, None), scored.total)
    assert float(shaped[0] - scored.total[0]) == 0.0
    shaped = dynamic.shape_rewards(tr.cfg.grpo, _three_turns(batch, "max_new_tokens"), scored.total)
    assert float(shaped[0] - scored.total[0]) == -1.0
    shaped = dynamic.shape_rewards(
        tr.cfg.grpo, _three_turns(batch, "max_turns"), scored.total
    )  # turns are not length
    assert float(shaped[0] - scored.total[0]) == 0.0


def test_overlong_mask_keeps_episodes_ended_by_max_turns_and_logs_the_share(tiny_model_dir, tmp_path):
    """mask leaves out episodes cut for length only: one ended by max_turns (a tool loop) still trains
    (48bbbf8 dropped every truncated episode, silently); the share masked is in the step's record."""
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.overlong=mask", "grpo.max_new_tokens=16")
    batch, _, _ = tr.collect(4)
    sampled = int(batch.tokens.loss_mask[0].sum())
    assert sampled > 0
    for reason, kept in (
        ("max_turns", True),
        ("env", True),
        ("max_new_tokens", False),
        ("token_budget", False),
    ):
        fake = _three_turns(batch, reason)  # the episode's ending; its tokens stay the batch's
        assert int(dynamic.trained_tokens(tr.cfg.grpo, fake).loss_mask[0].sum()) == (
            sampled if kept else 0
        ), reason
    record = tr.train_step()
    assert "overlong/masked_frac" in record
    assert record["overlong/masked_frac"] <= record["truncated_frac"]


def test_group_size_schedule_changes_G_at_its_steps(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.steps=2", "grpo.group_size_schedule=[[0, 4], [1, 2]]")
    first, second = tr.train_step(), tr.train_step()
    assert (first["group_size"], first["num_episodes"]) == (4, 8)
    assert (second["group_size"], second["num_episodes"]) == (2, 4)
