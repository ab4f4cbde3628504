"""The sampler-mismatch correction (mmgrpo.grpo.mismatch) against a plain loop, and in the loss."""

from __future__ import annotations

import math

import pytest
import torch

from mmgrpo.grpo.losses import grpo_loss
from mmgrpo.grpo.mismatch import sampler_weights

NAN = float("nan")


def _loop(old, sampled, mask, cap):
    """Per token, by hand: w = min(exp(old - sampled), cap) where both numbers exist, else 1."""
    w, k3, seen, capped, biggest = [], 0.0, 0, 0, 0.0
    for i in range(len(old)):
        row = []
        for j in range(len(old[i])):
            if mask[i][j] and not math.isnan(sampled[i][j]):
                d = old[i][j] - sampled[i][j]
                row.append(min(math.exp(d), cap))
                k3 += math.exp(d) - 1 - d
                seen += 1
                capped += math.exp(d) > cap
                biggest = max(biggest, abs(d))
            else:
                row.append(1.0)
        w.append(row)
    return w, k3 / max(seen, 1), capped / max(seen, 1), biggest


def test_weights_and_statistics_equal_a_plain_loop():
    old = [[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -4.0, -1.0]]
    sampled = [[-1.0, -2.5, NAN, -1.0], [-0.1, -0.1, -4.0, NAN]]  # NaN: an env token, no sampler number
    mask = [[1, 1, 0, 1], [1, 1, 1, 0]]
    cap = 2.0
    w, stats = sampler_weights(torch.tensor(old), torch.tensor(sampled), torch.tensor(mask), cap)
    want_w, kl, capped, biggest = _loop(old, sampled, mask, cap)
    torch.testing.assert_close(w, torch.tensor(want_w))
    # by hand: row 0 token 1: exp(0.5) = 1.6487; token 3: exp(-2) = 0.1353; row 1 token 1: exp(-0.1) = 0.9048
    assert w[0, 1].item() == pytest.approx(math.exp(0.5)) and w[0, 3].item() == pytest.approx(math.exp(-2.0))
    assert stats["kl"].item() == pytest.approx(kl) and stats["capped"].item() == pytest.approx(capped)
    assert stats["max_abs"].item() == pytest.approx(biggest) == 2.0
    big = sampler_weights(torch.tensor([[0.0]]), torch.tensor([[-3.0]]), torch.tensor([[1]]), cap)
    assert big[0].item() == cap and big[1]["capped"].item() == 1.0  # exp(3) = 20.1, cut to the cap


def test_equal_sampler_gives_weight_one_and_the_loss_is_unchanged():
    torch.manual_seed(0)
    logp = torch.randn(4, 6).log_softmax(-1).requires_grad_()
    mask = torch.ones(4, 6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    plain = grpo_loss(logp, None, None, adv, mask)
    same = grpo_loss(logp, None, None, adv, mask, sampled_logp=logp.detach().clone(), sampler_cap=2.0)
    assert same.loss.item() == pytest.approx(plain.loss.item(), abs=0)
    assert same.mismatch["kl"].item() == 0.0 and same.mismatch["max_abs"].item() == 0.0


def test_the_weight_scales_each_tokens_policy_gradient():
    """One token, advantage 1, sequence aggregation: loss = -w * ratio / 1, so d loss / d logp = -w."""
    logp = torch.tensor([[-1.0]], requires_grad=True)
    out = grpo_loss(
        logp,
        None,
        None,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        sampled_logp=torch.tensor([[-1.5]]),
        sampler_cap=2.0,
    )
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(-math.exp(0.5))
    assert out.mismatch["max_abs"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("kv", [True, False], ids=["kept-cache", "re-encoded"])
def test_the_rollout_keeps_each_sampled_tokens_logprob_and_it_is_the_training_passs(tiny_model_dir, kv):
    """Multi-turn episodes with a tool's image mid-episode: the sampler's log-prob of every policy token is
    kept (NaN on env tokens and padding), and it equals the training pass's (float32: 1e-5)."""
    from mmgrpo.model.policy import Policy
    from mmgrpo.rollout.episodes import rollout
    from tests.test_multiturn import ZoomOnceEnv

    tiny_policy = Policy.from_pretrained(tiny_model_dir)
    vocab = tiny_policy.model.config.get_text_config().vocab_size
    tiny_policy.stop_ids = sorted(set(tiny_policy.stop_ids) | set(range(40, vocab, 3)))  # turns end early
    envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(8)]
    torch.manual_seed(0)
    tok = rollout(
        tiny_policy, envs, [3, 8], group_size=4, max_new_tokens=8, max_turns=3, kv_across_turns=kv
    ).tokens
    assert tok.sampled_logp is not None and tok.sampled_logp.shape == tok.response_ids.shape
    policy_tokens = tok.loss_mask.bool()
    assert not torch.isnan(tok.sampled_logp[policy_tokens]).any()
    assert torch.isnan(tok.sampled_logp[~policy_tokens]).all()  # env tokens and padding
    assert (tok.loss_mask == 0).logical_and(tok.response_mask == 1).any()  # there are env tokens
    with torch.no_grad():
        trained = tiny_policy.logprobs(tok)  # (N, T)
    gap = (trained[policy_tokens] - tok.sampled_logp[policy_tokens]).abs().max().item()
    assert gap < 1e-5
    sub = tok.select([1, 5, 6])  # micro-batches carry it
    torch.testing.assert_close(
        sub.sampled_logp, tok.sampled_logp[[1, 5, 6], : sub.response_ids.shape[1]], equal_nan=True
    )


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("bfloat16", 0.05)])
def test_a_train_step_logs_the_mismatch_and_corrects_for_it(tiny_model_dir, tmp_path, dtype, bound):
    """float32: the sampler and the training pass agree (max |log p gap| < 1e-5, no weight cut); bf16
    autocast: they differ by bf16 rounding, the step logs it and stays within the bound."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    sets = [
        f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        f"model.dtype={dtype}",
        "grpo.steps=1",
        "grpo.tasks_per_step=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=6",
        "warm_start.steps=0",
        "env.kwargs.max_count=3",
    ]
    trainer = Trainer(load_config(None, sets), progress=False)
    record = trainer.train_step()
    assert {"mismatch/kl", "mismatch/max_abs", "mismatch/capped"} <= set(record)
    assert 0 <= record["mismatch/max_abs"] < bound and record["mismatch/capped"] == 0.0
    if dtype == "bfloat16":
        assert record["mismatch/max_abs"] > 1e-5  # measured, not assumed away
    from mmgrpo.model import lean_gate

    verdicts = lean_gate.verdicts(
        trainer.policy.model
    )  # the fast paths were checked in this precision and kept
    assert verdicts == {"decode step": True, "training pass": True, "prompt encoding": True}, verdicts
