"""A None from a TRL reward function, handled as TRL's GRPOTrainer handles it (trl 1.x ``_calculate_rewards``
and ``_generate_and_score_completions``): the sample does not count for that function (NaN, then nansum over
the functions and nanmean for its logged mean); a sample every function skipped is left out of its group's
baseline and standard deviation and gets advantage 0; the Nones are counted in the step's metrics; None is
not a failure and does not reach the fault policy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmgrpo.grpo.advantages import combine_advantages, group_advantages
from mmgrpo.train.faults import check_finite
from mmgrpo.verifier import Episode, Rewards, Verifier, check_verifier, from_trl


def trl_returning(values, name):
    """A TRL reward function returning ``values`` (one per completion, None = skip)."""

    def fn(completions, **kwargs):
        assert len(completions) == len(values)
        return list(values)

    fn.__name__ = name
    return fn


def episodes(n):
    return [Episode(completion=f"c{i}") for i in range(n)]


def test_a_none_is_skipped_not_a_failure_and_the_total_is_the_nansum():
    rewards = Rewards(
        [
            from_trl(trl_returning([1.0, None, None, 0.0], "f1")),
            from_trl(trl_returning([None, None, 1.0, 1.0], "f2"), weight=0.5),
        ]
    )
    out = rewards.score(episodes(4), keep_nonfinite=True)
    torch.testing.assert_close(out.total, torch.tensor([1.0, 0.0, 0.5, 0.5]))  # nansum of w * r
    assert out.failures == {"f1": 0, "f2": 0}
    assert out.none_counts() == {"f1": 2, "f2": 2}
    assert out.unscored.tolist() == [False, True, False, False]  # row 1: every function returned None
    assert out.mean_scored("f1") == 0.5 and out.mean_scored("f2") == 1.0  # nanmean: (1 + 0) / 2, (1 + 1) / 2
    assert check_finite(1, out.per_verifier) is None  # the fault policy sees finite values
    assert check_verifier(from_trl(trl_returning([None, 2], "g")), episodes(2)) == [None, 2.0]


def test_a_plain_verifier_returning_none_is_still_a_failure():
    out = Rewards([Verifier("plain", lambda ep: None)]).score(episodes(2))
    assert out.failures == {"plain": 2} and out.none_counts() == {"plain": 0}


def test_advantages_leave_the_unscored_out_of_the_baseline():
    # one group of G = 4; row 1 unscored. Kept rewards [1, 0.5, 0.5]: mean 2/3, deviations [1/3, -1/6, -1/6],
    # unbiased variance (1/9 + 1/36 + 1/36) / 2 = 1/12, std = 0.288675; advantages d / std, row 1 exactly 0
    total = torch.tensor([1.0, 0.0, 0.5, 0.5])
    valid = torch.tensor([True, False, True, True])
    adv = group_advantages(total, 4, valid=valid, eps=0.0)
    std = math.sqrt(1 / 12)
    torch.testing.assert_close(adv, torch.tensor([(1 / 3) / std, 0.0, (-1 / 6) / std, (-1 / 6) / std]))
    assert adv[1].item() == 0.0
    # without the mask the unscored row's 0.0 would be a reward: the baseline drops to 0.5
    assert group_advantages(total, 4, eps=0.0)[0].item() == pytest.approx(0.5 / total.std().item())
    # RLOO on the kept rows: row 0's baseline is the mean of the other kept rows, (0.5 + 0.5) / 2
    rloo = group_advantages(total, 4, valid=valid, baseline="rloo", scale="none")
    torch.testing.assert_close(rloo, torch.tensor([0.5, 0.0, -0.25, -0.25]))
    # a group with one kept row has no baseline: zeros; group ids in any order give the same rows
    lone = group_advantages(torch.tensor([1.0, 2.0]), 2, valid=torch.tensor([True, False]))
    assert lone.tolist() == [0.0, 0.0]
    ids = [7, 7, 7, 7]
    torch.testing.assert_close(group_advantages(total, 4, group_ids=ids, valid=valid, eps=0.0), adv)


def test_normalize_then_sum_leaves_each_functions_none_out_of_its_own_statistics():
    # f1 over rows 0, 3 (1, 0): advantages +-0.7071 (std of two values 1 and 0 is 0.7071); f2 over rows 2, 3
    # (1, 1): constant, zeros. Total: f1's advantages, weight 1, and 0 elsewhere
    per = {"f1": torch.tensor([1.0, 0.0, 0.0, 0.0]), "f2": torch.tensor([0.0, 0.0, 1.0, 1.0])}
    valid = {"f1": torch.tensor([True, False, False, True]), "f2": torch.tensor([False, False, True, True])}
    adv = combine_advantages(per, {"f1": 1.0, "f2": 0.5}, None, 4, "normalize_then_sum", eps=0.0, valid=valid)
    torch.testing.assert_close(adv, torch.tensor([0.5 / math.sqrt(0.5), 0.0, 0.0, -0.5 / math.sqrt(0.5)]))


def test_a_training_step_excludes_and_counts_the_nones(tmp_path, tiny_model_dir):
    """Task 0's rows skip the TRL reward function (None), task 1's are scored by completion length: task 0's
    episodes get advantage 0 and are left out of the logged reward; the step logs how many were None."""
    from mmgrpo.config.core import load_config
    from mmgrpo.registry import register_verifier
    from mmgrpo.train.trainer import Trainer

    def length_or_skip(completions, skip, **kwargs):
        return [None if s else len(c[0]["content"]) / 10 for c, s in zip(completions, skip, strict=True)]

    register_verifier("test_length_or_skip", length_or_skip, overwrite=True)
    rows = [
        {"question": "Say hi.", "answer": "hi", "skip": True},
        {"question": "Say yo.", "answer": "yo", "skip": False},
    ]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(
        f"""
seed: 0
output_dir: {tmp_path / "out"}
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
env: {{name: text_qa, kwargs: {{path: {data}, eval_fraction: 0.0}}}}
verifiers: [{{name: test_length_or_skip}}]
warm_start: {{steps: 0}}
grpo: {{steps: 1, tasks_per_step: 2, group_size: 4, max_new_tokens: 6, micro_batch_size: 8, temperature: 1.0}}
"""
    )
    trainer = Trainer(load_config(tmp_path / "run.yaml"), progress=False)
    seen = {}
    advantages = trainer.advantages

    def spy(batch, scored, rewards, G):
        seen["adv"], seen["scored"], seen["batch"] = advantages(batch, scored, rewards, G), scored, batch
        return seen["adv"]

    trainer.advantages = spy
    record = trainer.train()
    adv, scored, batch = seen["adv"], seen["scored"], seen["batch"]
    skipped = torch.tensor([t.seed == 0 for t in batch.trajectories])  # (8,) task seed 0: the 'skip' row
    assert int(skipped.sum()) == 4
    assert scored.unscored.tolist() == skipped.tolist()
    assert adv[skipped].tolist() == [0.0] * 4
    kept = scored.total[~skipped]  # task 1's lengths / 10, normalised among themselves
    expected = group_advantages(kept, 4, eps=trainer.cfg.grpo.adv_eps)
    torch.testing.assert_close(adv[~skipped], expected)
    assert record["reward_none"] == 4 and record["reward_unscored"] == 4
    assert record["verifier_failures"] == 0
    assert record["reward"] == pytest.approx(float(kept.mean()))
    assert record["reward/test_length_or_skip"] == pytest.approx(float(kept.mean()))
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["reward_none"] == 4
