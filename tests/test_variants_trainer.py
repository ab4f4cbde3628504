"""The GRPO variants through the trainer on the tiny VLM (their math is checked by hand in
tests/test_variants.py): each one trains, and the trainer hands each the right inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.registry import register_verifier
from mmgrpo.train import microbatch
from mmgrpo.train.trainer import Trainer

BASE = [
    "grpo.steps=2",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.max_new_tokens=6",
    "grpo.micro_batch_size=4",
    "warm_start.steps=0",
    "env.kwargs.max_count=3",
    "verifiers=[{name: test_len, weight: 1.0}, {name: test_big, weight: 0.5}]",
]


def _len(**_):
    return lambda e: len(e.completion) / 10


def _big(**_):
    return lambda e: 100.0 * (len(e.completion) % 3)


@pytest.fixture(autouse=True)
def _verifiers():
    register_verifier("test_len", _len, overwrite=True)
    register_verifier("test_big", _big, overwrite=True)


def _trainer(model, tmp_path, *sets):
    cfg = load_config(None, [f"model.path={model}", f"output_dir={tmp_path}", *BASE, *sets])
    return Trainer(cfg, progress=False)


@pytest.mark.parametrize(
    "sets",
    [
        ["grpo.aggregation=bnpo"],
        ["grpo.kl_estimator=k1"],
        ["grpo.kl_estimator=k2"],
        ["grpo.kl_estimator=low_var_kl"],
        ["grpo.kl_in=reward", "grpo.beta=0.1"],
        ["grpo.target_kl=0.01", "grpo.beta=0.05"],
        ["grpo.entropy_coef=0.01"],
        ["grpo.reward_combination=normalize_then_sum"],
    ],
    ids=lambda s: s[0],
)
def test_every_variant_trains(tiny_model_dir, tmp_path, sets):
    tr = _trainer(tiny_model_dir, tmp_path, *sets)
    before = [p.detach().clone() for p in tr.policy.model.parameters()]
    records = [tr.train_step(), tr.train_step()]
    assert all(math.isfinite(r["loss"]) and r["entropy"] > 0 for r in records)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.policy.model.parameters(), strict=True))


def test_adaptive_beta_follows_the_controller_rule(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.target_kl=0.01", "grpo.beta=0.05", "grpo.kl_horizon=10")
    first = tr.train_step()
    second = tr.train_step()
    # beta after a step: 0.05 * (1 + clip(kl / 0.01 - 1, -0.2, 0.2) / 10); step 1's kl is 0 (policy =
    # reference), so error = -1 -> clipped to -0.2: 0.05 * (1 - 0.02) = 0.049
    assert first["beta"] == 0.05 and first["kl"] == 0.0
    assert second["beta"] == pytest.approx(0.049)
    err = max(-0.2, min(0.2, second["kl"] / 0.01 - 1))
    assert tr.kl_ctl.beta == pytest.approx(0.049 * (1 + err / 10))


def test_kl_in_the_reward_is_beta_times_the_episodes_summed_kl(tiny_model_dir, tmp_path):
    from mmgrpo.grpo.kl_control import sequence_kl

    tr = _trainer(tiny_model_dir, tmp_path, "grpo.kl_in=reward", "grpo.beta=0.5", "grpo.kl_estimator=k1")
    tr.train_step()  # the policy moves away from the reference
    batch, _, _ = tr.collect(4)
    seq_kl, share = microbatch.reward_kl(
        tr.policy, tr.accelerator, batch.tokens, 4, tr.cfg.grpo
    )  # (N,), float
    penalty = 0.5 * seq_kl  # (N,) what train_step subtracts from the rewards
    # one process: its share is the whole token-mean KL
    assert share == pytest.approx(float(seq_kl.sum()) / int(batch.tokens.loss_mask.sum()), rel=1e-5)
    with torch.no_grad():
        now = tr.policy.logprobs(batch.tokens)
        ref = tr.policy.logprobs(batch.tokens, reference=True)
    mask = batch.tokens.loss_mask
    by_hand = [0.5 * float(((now[i] - ref[i]) * mask[i]).sum()) for i in range(len(mask))]  # k1 summed
    torch.testing.assert_close(penalty, torch.tensor(by_hand), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(penalty, 0.5 * sequence_kl(now, ref, mask, "k1").float(), atol=1e-6, rtol=1e-5)
    assert penalty.abs().max() > 0


def test_normalize_then_sum_weighs_a_small_reward_as_much_as_a_large_one(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.reward_combination=normalize_then_sum")
    batch, scored, _ = tr.collect(4)
    adv = tr.advantages(batch, scored, scored.total, 4)
    # by hand: each verifier normalised within its group, then 1.0 x len-term + 0.5 x big-term
    from mmgrpo.grpo.advantages import group_advantages

    ids = batch.group_ids
    want = group_advantages(scored.per_verifier["test_len"], 4, group_ids=ids) + 0.5 * group_advantages(
        scored.per_verifier["test_big"], 4, group_ids=ids
    )
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_kl_in_the_reward_is_logged_and_steers_the_adaptive_beta(tiny_model_dir, tmp_path):
    """kl_in=reward with target_kl: the loss runs with beta 0, so the KL the controller follows (and the
    log shows) is the reward's: the token mean of the episodes' KL to the reference. On 48bbbf8 it was 0 on
    every step and beta only shrank."""
    from mmgrpo.grpo.losses import kl_estimate

    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        "grpo.kl_in=reward",
        "grpo.beta=0.1",
        "grpo.target_kl=1e-6",
        "grpo.kl_horizon=10",
        "grpo.kl_estimator=k3",
        "grpo.lr=1e-2",
    )
    by_hand: list[float] = []
    real_update = tr.update

    def update(tokens, adv, G):  # the KL of the step's episodes, before the step moves the policy
        with torch.no_grad():
            now, ref = tr.policy.logprobs(tokens), tr.policy.logprobs(tokens, reference=True)
        mask = tokens.loss_mask.bool()
        by_hand.append(float(kl_estimate(now[mask], ref[mask], "k3").mean()))
        return real_update(tokens, adv, G)

    tr.update = update
    first, second = tr.train_step(), tr.train_step()
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # step 1: the policy is the reference
    assert second["kl"] > 1e-4 and second["kl"] == pytest.approx(by_hand[1], rel=1e-4)
    # beta: 0.1 -> 0.1 * (1 - 0.2 / 10) after step 1 (kl 0 < target), then up by 0.2 / 10 (kl >> target)
    assert second["beta"] == pytest.approx(0.098)
    assert tr.kl_ctl.beta == pytest.approx(0.098 * 1.02)
