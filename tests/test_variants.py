"""Loss and advantage variants against plain-loop references and hand-derived numbers.

bnpo aggregation, KL estimators, KL in the reward, adaptive KL coefficient, several rewards combined,
token entropy (and the entropy bonus), group-size schedule.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from mmgrpo.errors import DataError
from mmgrpo.grpo.advantages import combine_advantages, group_advantages, group_size_at
from mmgrpo.grpo.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalized_rewards,
    sequence_kl,
)
from mmgrpo.grpo.losses import (
    KL_ESTIMATORS,
    LossOutput,
    grpo_loss,
    kl_estimate,
    token_entropy,
    token_logprobs,
)
from mmgrpo.verifier import Episode, Rewards, Verifier

N, T = 6, 7
AGGREGATIONS = ["sequence", "token", "constant", "bnpo"]


# ---------------------------------------------------------------------------------------------------------
# plain-loop references (scalar math only)


def loop_kl(logp: float, ref: float, estimator: str) -> float:
    """One token's KL estimate, straight from the definitions."""
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = ref - logp
    if estimator == "k3":
        return math.exp(d) - d - 1
    d = min(max(d, -20.0), 20.0)  # low_var_kl (verl)
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)


def loop_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    ent=None,
    *,
    eps=0.2,
    beta=0.0,
    estimator="k3",
    aggregation="sequence",
    importance="token",
    entropy_coef=0.0,
    num_sequences=None,
    num_tokens=None,
    max_new_tokens=None,
    num_micro_batches=1,
):
    """(loss, mean KL, mean entropy) of the clipped surrogate with KL and entropy, one token at a time."""
    total, kl_sum, ent_sum, count = 0.0, 0.0, 0.0, 0
    for i in range(len(logp)):
        tokens = [t for t in range(len(logp[i])) if mask[i][t]]
        old_i = old[i] if old is not None else logp[i]
        if importance == "sequence" and tokens:
            seq_ratio = math.exp(sum(logp[i][t] - old_i[t] for t in tokens) / len(tokens))
        seq_sum = 0.0
        for t in tokens:
            r = seq_ratio if importance == "sequence" else math.exp(logp[i][t] - old_i[t])
            surrogate = min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            kl = loop_kl(logp[i][t], ref[i][t], estimator) if ref is not None else 0.0
            h = ent[i][t] if ent is not None else 0.0
            seq_sum += -(surrogate - beta * kl + entropy_coef * h)
            kl_sum, ent_sum, count = kl_sum + kl, ent_sum + h, count + 1
        if aggregation == "sequence":
            total += seq_sum / len(tokens) if tokens else 0.0
        else:
            total += seq_sum
    n_seq = num_sequences or len(logp)
    if aggregation == "sequence":
        loss = total / n_seq
    elif aggregation == "token":
        loss = total / (num_tokens or max(count, 1))
    elif aggregation == "bnpo":
        loss = total / max(count, 1) / num_micro_batches
    else:
        loss = total / (max_new_tokens * n_seq)
    c = max(count, 1)
    return loss, kl_sum / c, ent_sum / c


def loop_group_norm(values, scale="std_unbiased", eps=1e-6):
    """GRPO's normalisation of one group's rewards with the mean baseline, in plain Python."""
    g = len(values)
    mean = sum(values) / g
    if max(values) == min(values):
        return [0.0] * g
    if scale == "none":
        return [v - mean for v in values]
    var = sum((v - mean) ** 2 for v in values) / (g - 1 if scale == "std_unbiased" else g)
    return [(v - mean) / (math.sqrt(var) + eps) for v in values]


def loop_entropy(row):
    """Entropy of softmax(row) for one list of logits."""
    top = max(row)
    exps = [math.exp(z - top) for z in row]
    s = sum(exps)
    return -sum(e / s * math.log(e / s) for e in exps if e > 0)


def assert_values(actual: torch.Tensor, expected: list, atol: float = 1e-9) -> None:
    """Compare a tensor with (nested) hand-derived numbers."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def make_batch(seed=0):
    """Random float64 batch with entropies; row 2 has no policy tokens; masked positions hold garbage."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(N, T, generator=g, dtype=torch.float64)  # (N, T)
    old = logp + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)  # (N, T)
    ref = logp + 0.8 * torch.randn(N, T, generator=g, dtype=torch.float64)  # (N, T)
    ent = 3 * torch.rand(N, T, generator=g, dtype=torch.float64)  # (N, T)
    mask = torch.rand(N, T, generator=g) < 0.7  # (N, T)
    mask[2] = False
    mask[0, 0] = True
    adv = torch.randn(N, generator=g, dtype=torch.float64)  # (N,)
    clean = (logp.clone(), old.clone(), ref.clone(), ent.clone())
    logp[~mask], old[~mask], ref[~mask], ent[~mask] = -math.inf, math.nan, math.inf, math.nan
    return logp, old, ref, ent, adv, mask, clean


# ---------------------------------------------------------------------------------------------------------
# 1. bnpo aggregation


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("num_micro_batches", [1, 3])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_bnpo_matches_loop_reference(importance, num_micro_batches, with_entropy):
    logp, old, ref, ent, adv, mask, (c_logp, c_old, c_ref, c_ent) = make_batch(seed=1)
    logp.requires_grad_(True)
    coef = 0.03 if with_entropy else 0.0
    out = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        beta=0.05,
        aggregation="bnpo",
        importance=importance,
        num_micro_batches=num_micro_batches,
        num_tokens=999,  # bnpo ignores the whole-batch totals: it normalises locally
        entropy=ent if with_entropy else None,
        entropy_coef=coef,
    )
    expected = loop_loss(
        c_logp.tolist(),
        c_old.tolist(),
        c_ref.tolist(),
        adv.tolist(),
        mask.tolist(),
        c_ent.tolist() if with_entropy else None,
        beta=0.05,
        aggregation="bnpo",
        importance=importance,
        entropy_coef=coef,
        num_micro_batches=num_micro_batches,
    )
    assert out.loss.item() == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


def test_bnpo_hand_derived_and_gradient_accumulation():
    # Ratio 1 (first pass), so l = -A per policy token. Row 0: 1 token, A = +1 (l = -1); row 1: 3 tokens,
    # A = -1 (l = +1 each).
    #   whole batch as one micro-batch: bnpo = (-1 + 3) / 4 = 0.5 (= "token"); d loss / d logp = -A / 4.
    #   two micro-batches [row 0], [row 1], num_micro_batches = 2:
    #     (-1 / 1) / 2 + (3 / 3) / 2 = -0.5 + 0.5 = 0.0, not 0.5: local normalisation weighs the short
    #     micro-batch's token 3x more; gradients -A / 1 / 2 = -0.5 on row 0 and -A / 3 / 2 = 0.1667 on row 1.
    #   "token" with num_tokens = 4 over the same split: -1 / 4 + 3 / 4 = 0.5, the whole-batch value.
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])  # (2, 4)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)  # (2,)
    logp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)  # (2, 4)

    full = grpo_loss(logp, None, None, adv, mask, aggregation="bnpo")
    (g_full,) = torch.autograd.grad(full.loss, logp)
    assert full.loss.item() == pytest.approx(0.5)
    assert_values(g_full, [[-0.25, 0, 0, 0], [0.25, 0.25, 0.25, 0]])

    halves = [
        grpo_loss(logp[r], None, None, adv[r], mask[r], aggregation="bnpo", num_micro_batches=2).loss
        for r in (slice(0, 1), slice(1, 2))
    ]
    (g_split,) = torch.autograd.grad(halves[0] + halves[1], logp)
    assert [h.item() for h in halves] == pytest.approx([-0.5, 0.5])
    assert_values(g_split, [[-0.5, 0, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0]])

    token = [
        grpo_loss(logp[r], None, None, adv[r], mask[r], aggregation="token", num_tokens=4).loss.item()
        for r in (slice(0, 1), slice(1, 2))
    ]
    assert sum(token) == pytest.approx(0.5)


def test_bnpo_equals_token_mean_when_micro_batches_hold_equal_token_counts():
    _, _, _, _, adv, _, (logp, old, ref, _) = make_batch(seed=2)  # the clean values: every token is used
    mask = torch.ones(N, T, dtype=torch.bool)  # (N, T) every micro-batch of 2 rows holds 2 * T tokens
    logp.requires_grad_(True)
    full = grpo_loss(logp, old, ref, adv, mask, beta=0.1, aggregation="token")
    parts = sum(
        grpo_loss(
            logp[i : i + 2],
            old[i : i + 2],
            ref[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            beta=0.1,
            aggregation="bnpo",
            num_micro_batches=3,
        ).loss
        for i in range(0, N, 2)
    )
    torch.testing.assert_close(parts, full.loss)
    torch.testing.assert_close(torch.autograd.grad(parts, logp)[0], torch.autograd.grad(full.loss, logp)[0])


def test_num_micro_batches_errors():
    logp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="only applies to aggregation='bnpo'"):
        grpo_loss(logp, None, None, adv, mask, aggregation="token", num_micro_batches=2)
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1"):
        grpo_loss(logp, None, None, adv, mask, aggregation="bnpo", num_micro_batches=0)
    with pytest.raises(ValueError, match="'bnpo'"):
        grpo_loss(logp, None, None, adv, mask, aggregation="mean")


# ---------------------------------------------------------------------------------------------------------
# 2. KL estimators


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimate_matches_loop_reference(estimator):
    g = torch.Generator().manual_seed(3)
    logp = -5 * torch.rand(40, 30, generator=g, dtype=torch.float64)  # (40, 30)
    d = 30 * (2 * torch.rand(40, 30, generator=g, dtype=torch.float64) - 1)  # (40, 30) in [-30, 30]
    ref = logp + d  # (40, 30)
    got = kl_estimate(logp, ref, estimator)  # (40, 30)
    expected = [
        [loop_kl(a, b, estimator) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(logp.tolist(), ref.tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-9)


# logp = 0 and ref = [log 2, 3, -15, -25], so d = ref - logp = [0.6931, 3, -15, -25]:
#   k1 = logp - ref             = [-0.693147, -3, 15, 25]                     gradient 1
#   k2 = 0.5 (logp - ref)^2     = [0.240227, 4.5, 112.5, 312.5]               gradient logp - ref = k1
#   k3 = e^d - d - 1            = [2 - 0.693147 - 1 = 0.306853, e^3 - 4 = 16.085537,
#                                  e^-15 + 14 = 14.0000003, e^-25 + 24 = 24.0]
#                                                                             gradient 1 - e^d
#                                                                             = [-1, -19.085537, 0.9999997, 1.0]
#   low_var_kl = clamp(k3, -10, 10) = [0.306853, 10, 10, 10]                 gradient [-1, 0, 0, 0]
HAND_KL = {
    "k1": ([-0.693147, -3.0, 15.0, 25.0], [1.0, 1.0, 1.0, 1.0]),
    "k2": ([0.240227, 4.5, 112.5, 312.5], [-0.693147, -3.0, 15.0, 25.0]),
    "k3": ([0.306853, 16.085537, 14.0000003, 24.0], [-1.0, -19.085537, 0.9999997, 1.0]),
    "low_var_kl": ([0.306853, 10.0, 10.0, 10.0], [-1.0, 0.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimate_hand_derived_values_and_gradients(estimator):
    logp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)  # (1, 4)
    ref = torch.tensor([[math.log(2.0), 3.0, -15.0, -25.0]], dtype=torch.float64)  # (1, 4)
    kl = kl_estimate(logp, ref, estimator)  # (1, 4)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    values, grads = HAND_KL[estimator]
    assert kl[0].tolist() == pytest.approx(values, abs=1e-6)
    assert grad[0].tolist() == pytest.approx(grads, abs=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_grpo_loss_kl_estimators_match_loop_reference(aggregation, estimator):
    logp, old, ref, _, adv, mask, (c_logp, c_old, c_ref, _) = make_batch(seed=4)
    kwargs = dict(beta=0.07, aggregation=aggregation, max_new_tokens=T, num_sequences=8, num_tokens=30)
    out = grpo_loss(logp, old, ref, adv, mask, kl_estimator=estimator, **kwargs)
    loss, kl, _ = loop_loss(
        c_logp.tolist(),
        c_old.tolist(),
        c_ref.tolist(),
        adv.tolist(),
        mask.tolist(),
        estimator=estimator,
        **kwargs,
    )
    assert (out.loss.item(), out.kl.item()) == pytest.approx((loss, kl), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_grpo_loss_kl_gradient_per_estimator(estimator):
    # One policy token, A = 0, beta 0.1, logp = 0, ref = log 2 ("sequence" aggregation, N = 1):
    #   loss = 0.1 * kl and d loss / d logp = 0.1 * d kl / d logp, from the first column of HAND_KL:
    #   k1 -0.0693147 / 0.1, k2 0.0240227 / -0.0693147, k3 and low_var_kl 0.0306853 / -0.1.
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)  # (1, 1)
    ref = torch.full((1, 1), math.log(2.0), dtype=torch.float64)  # (1, 1)
    out = grpo_loss(logp, None, ref, torch.zeros(1), torch.ones(1, 1), beta=0.1, kl_estimator=estimator)
    out.loss.backward()
    values, grads = HAND_KL[estimator]
    assert out.loss.item() == pytest.approx(0.1 * values[0], abs=1e-7)
    assert logp.grad.item() == pytest.approx(0.1 * grads[0], abs=1e-7)
    assert out.kl.item() == pytest.approx(values[0], abs=1e-6)


def test_default_estimator_is_k3_bit_identical():
    logp, old, ref, _, adv, mask, _ = make_batch(seed=5)
    grads, losses = [], []
    for kwargs in ({}, {"kl_estimator": "k3"}):
        x = logp.clone().requires_grad_(True)
        out = grpo_loss(x, old, ref, adv, mask, beta=0.2, **kwargs)
        out.loss.backward()
        grads.append(x.grad)
        losses.append((out.loss.detach(), out.kl))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_estimators_ignore_garbage_outside_the_mask(estimator):
    logp, old, ref, _, adv, mask, _ = make_batch(seed=6)  # -inf / NaN / inf outside the mask
    logp.requires_grad_(True)
    out = grpo_loss(logp, old, ref, adv, mask, beta=0.1, kl_estimator=estimator)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and math.isfinite(out.kl.item())
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        grpo_loss(
            torch.zeros(1, 2), None, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), kl_estimator="k4"
        )
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "full")


# ---------------------------------------------------------------------------------------------------------
# 3. KL in the reward


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalized_rewards_match_loop_reference(estimator):
    logp, _, ref, _, _, mask, (c_logp, _, c_ref, _) = make_batch(seed=7)
    rewards = torch.rand(N, generator=torch.Generator().manual_seed(8), dtype=torch.float64)  # (N,)
    got = kl_penalized_rewards(rewards, logp, ref, mask, 0.3, estimator)  # (N,)
    expected = [
        r
        - 0.3
        * sum(loop_kl(c_logp[i, t].item(), c_ref[i, t].item(), estimator) for t in range(T) if mask[i, t])
        for i, r in enumerate(rewards.tolist())
    ]
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert got[2].item() == rewards[2].item()  # row 2 has no policy tokens: no penalty


def test_kl_penalized_rewards_hand_derived():
    # Row 0: policy tokens logp [-1, -2], ref [-1.5, -1] (third position masked, holding garbage);
    #   row 1: one token with logp == ref. rewards [1, 0], beta 0.1.
    #   k1: sum(logp - ref) = 0.5 - 1 = -0.5                   -> r0 = 1 - 0.1 * -0.5 = 1.05
    #   k2: 0.5 * (0.25 + 1) = 0.625                          -> r0 = 1 - 0.0625 = 0.9375
    #   k3: d = ref - logp = [-0.5, 1]: (e^-0.5 + 0.5 - 1) + (e^1 - 1 - 1) = 0.106531 + 0.718282 = 0.824812
    #                                                          -> r0 = 1 - 0.0824812 = 0.917519
    #   row 1: kl 0 for every estimator -> r1 = 0.
    rewards = torch.tensor([1.0, 0.0])  # (2,)
    logp = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, -math.inf, -math.inf]], requires_grad=True)  # (2, 3)
    ref = torch.tensor([[-1.5, -1.0, math.inf], [-0.5, 0.0, 0.0]])  # (2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # (2, 3)
    for estimator, r0 in (("k1", 1.05), ("k2", 0.9375), ("k3", 0.917519), ("low_var_kl", 0.917519)):
        got = kl_penalized_rewards(rewards, logp, ref, mask, 0.1, estimator)  # (2,)
        assert got.tolist() == pytest.approx([r0, 0.0], abs=1e-6)
        assert not got.requires_grad and got.dtype == torch.float32
    assert sequence_kl(logp, ref, mask, "k1").tolist() == pytest.approx([-0.5, 0.0])
    # beta = 0 leaves the rewards as they are; integer rewards come back as float32
    assert torch.equal(kl_penalized_rewards(rewards, logp, ref, mask, 0.0), rewards)
    assert kl_penalized_rewards(torch.tensor([1, 0]), logp, ref, mask, 0.1).dtype == torch.float32


def test_kl_in_reward_before_group_normalisation():
    # One group of 2 with equal rewards [1, 1]: without KL both advantages are 0. Row 0 drifted by
    #   sum(logp - ref) = 0.5 (k1), row 1 not at all; beta 0.1 -> rewards [0.95, 1.0], mean 0.975,
    #   deviations -+0.025, unbiased std 0.05 / sqrt(2) = 0.035355 -> advantages [-0.7071, 0.7071].
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])  # (2, 2)
    ref = torch.tensor([[-1.25, -1.25], [-1.0, -1.0]])  # (2, 2)
    rewards = kl_penalized_rewards(torch.tensor([1.0, 1.0]), logp, ref, torch.ones(2, 2), 0.1, "k1")  # (2,)
    adv = group_advantages(rewards, 2, eps=1e-8)  # (2,)
    assert adv.tolist() == pytest.approx([-0.70711, 0.70711], abs=1e-4)


def test_kl_penalized_rewards_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta"):
        kl_penalized_rewards(torch.zeros(2), x, x, x, -0.1)
    with pytest.raises(ValueError, match="rewards must be"):
        kl_penalized_rewards(torch.zeros(3), x, x, x, 0.1)
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalized_rewards(torch.zeros(2), x, torch.zeros(2, 4), x, 0.1)


# ---------------------------------------------------------------------------------------------------------
# 4. adaptive KL coefficient


def test_adaptive_controller_hand_derived():
    # init 0.1, target 0.01, horizon 100:
    #   kl 0.02:  error clip(0.02 / 0.01 - 1 = 1, +-0.2) = 0.2   -> 0.1 * (1 + 0.2 / 100) = 0.1002
    #   kl 0.011: error 0.1                                       -> 0.1002 * 1.001 = 0.1003002
    #   kl 0:     error clip(-1) = -0.2                           -> 0.1003002 * 0.998 = 0.1000995996
    #   kl 0.02 with n_steps 10: 0.2 * 10 / 100 = 0.02            -> 0.1000995996 * 1.02 = 0.102101591592
    ctl = AdaptiveKLController(init_beta=0.1, target_kl=0.01, horizon=100)
    assert ctl.update(0.02) == pytest.approx(0.1002, rel=1e-12)
    assert ctl.update(0.011) == pytest.approx(0.1003002, rel=1e-12)
    assert ctl.update(0.0) == pytest.approx(0.1000995996, rel=1e-12)
    assert ctl.update(0.02, n_steps=10) == pytest.approx(0.102101591592, rel=1e-12)
    assert ctl.beta == pytest.approx(0.102101591592, rel=1e-12)
    assert ctl.update(torch.tensor(0.01)) == ctl.beta  # on target (a 0-d tensor works too): unchanged


def test_adaptive_controller_matches_loop_reference():
    kls = (0.03 * torch.rand(50, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).tolist()
    ctl = AdaptiveKLController(0.05, 0.012, 20)
    beta = 0.05
    for k, kl in enumerate(kls):
        n = 1 + k % 3
        error = min(max(kl / 0.012 - 1, -0.2), 0.2)
        beta = beta * (1 + error * n / 20)
        assert ctl.update(kl, n_steps=n) == pytest.approx(beta, rel=1e-12)


@pytest.mark.parametrize("via", ["json", "torch"])
def test_controller_state_survives_a_checkpoint(via, tmp_path):
    kls = (0.03 * torch.rand(20, generator=torch.Generator().manual_seed(10), dtype=torch.float64)).tolist()
    straight = AdaptiveKLController(0.05, 0.01, 10)
    for kl in kls:
        straight.update(kl)

    first = AdaptiveKLController(0.05, 0.01, 10)
    for kl in kls[:10]:
        first.update(kl)
    state = first.state_dict()
    assert state == {"beta": first.beta} and all(type(v) is float for v in state.values())
    if via == "json":
        state = json.loads(json.dumps(state))
    else:
        buf = io.BytesIO()
        torch.save({"kl_controller": state}, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)["kl_controller"]
    resumed = AdaptiveKLController(0.05, 0.01, 10)  # built from the config, then the saved beta
    resumed.load_state_dict(state)
    for kl in kls[10:]:
        resumed.update(kl)
    assert resumed.beta == straight.beta  # bit for bit


def test_fixed_controller():
    ctl = FixedKLController(0.04)
    assert ctl.update(123.0) == 0.04 and ctl.update(0.0, n_steps=50) == 0.04 and ctl.beta == 0.04
    other = FixedKLController(0.0)
    other.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert other.beta == 0.04 and other.state_dict() == {"beta": 0.04}


def test_controller_errors():
    with pytest.raises(ValueError, match="init_beta"):
        AdaptiveKLController(0.0, 0.01, 10)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.01, 0)
    ctl = AdaptiveKLController(0.1, 0.01, 10)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        ctl.update(math.nan)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(0.0, n_steps=50)  # 1 - 0.2 * 50 / 10 = 0: beta would reach 0
    with pytest.raises(ValueError, match="'beta'"):
        ctl.load_state_dict({"value": 0.1})
    with pytest.raises(ValueError, match="saved beta"):
        ctl.load_state_dict({"beta": math.inf})
    with pytest.raises(ValueError, match="beta"):
        FixedKLController(-1.0)
    assert ctl.beta == 0.1  # the failed calls changed nothing


# ---------------------------------------------------------------------------------------------------------
# 5. several rewards combined


def test_combine_hand_derived_large_scale_reward():
    # One group of 4; "correct" [1, 1, 0, 0] and "length" [0, 100, 0, 100], weights 1 and 1.
    #   sum_then_normalize: sums [1, 101, 0, 100], mean 50.5, deviations [-49.5, 50.5, -50.5, 49.5],
    #     unbiased variance (2450.25 + 2550.25 + 2550.25 + 2450.25) / 3 = 3333.667, std 57.7379
    #     -> [-0.8573, 0.8747, -0.8747, 0.8573]: the correct, short row 0 gets a NEGATIVE advantage.
    #   normalize_then_sum: correct -> [0.866, 0.866, -0.866, -0.866] (deviations +-0.5 / sqrt(1/3)),
    #     length -> [-0.866, 0.866, -0.866, 0.866]; sum [0, 1.7321, -1.7321, 0].
    per = {"correct": torch.tensor([1.0, 1.0, 0.0, 0.0]), "length": torch.tensor([0.0, 100.0, 0.0, 100.0])}
    w = {"correct": 1.0, "length": 1.0}
    a = combine_advantages(per, w, None, 4, "sum_then_normalize", eps=1e-8)
    b = combine_advantages(per, w, None, 4, "normalize_then_sum", eps=1e-8)
    assert a.tolist() == pytest.approx([-0.8573, 0.8747, -0.8747, 0.8573], abs=1e-4)
    assert b.tolist() == pytest.approx([0.0, 1.7321, -1.7321, 0.0], abs=1e-4)
    assert a[0] < 0 and abs(b[0]) < 1e-6 and not torch.allclose(a, b)  # correct + short: punished vs neutral


def test_sum_then_normalize_equals_group_advantages_of_the_rewards_total():
    # The real Rewards composition (total accumulated in Python floats, then float32), values exact in float32.
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, 40, (24,), generator=g).tolist()
    correct = (torch.rand(24, generator=g) < 0.5).tolist()
    episodes = [Episode(completion="x" * n, task={"ok": c}) for n, c in zip(lengths, correct, strict=True)]
    rewards = Rewards(
        [
            Verifier("correct", lambda ep: 1.0 if ep.task["ok"] else 0.0, weight=1.0),
            Verifier("format", lambda ep: 0.5 if len(ep.completion) % 3 else 0.0, weight=0.3),
            Verifier("length", lambda ep: len(ep.completion) / 8, weight=-0.01),
        ],
        include_env_reward=False,
    )
    scored = rewards.score(episodes)
    weights = {v.name: v.weight for v in rewards.verifiers}
    ids = [k // 6 for k in range(24)]
    perm = torch.randperm(24, generator=g).tolist()
    shuffled_ids = [ids[i] for i in perm]
    for scale in ("std_unbiased", "std_biased", "none"):
        for baseline in ("mean", "rloo"):
            got = combine_advantages(
                scored.per_verifier, weights, None, 6, "sum_then_normalize", baseline, scale, 1e-6
            )
            assert torch.equal(
                got, group_advantages(scored.total, 6, baseline=baseline, scale=scale, eps=1e-6)
            )
            per_shuffled = {k: v[perm] for k, v in scored.per_verifier.items()}
            got = combine_advantages(per_shuffled, weights, shuffled_ids, 6, baseline=baseline, scale=scale)
            expected = group_advantages(
                scored.total[perm], 6, group_ids=shuffled_ids, baseline=baseline, scale=scale
            )
            assert torch.equal(got, expected)


@pytest.mark.parametrize("scale", ["std_unbiased", "std_biased", "none"])
def test_normalize_then_sum_matches_loop_reference(scale):
    g = torch.Generator().manual_seed(12)
    per = {
        "a": (torch.rand(12, generator=g) < 0.5).double(),  # (12,) 0/1
        "b": 50 * torch.rand(12, generator=g, dtype=torch.float64),  # (12,) large scale
        # (12,) constant in group 0
        "c": torch.tensor([0.3] * 4 + torch.rand(8, generator=g).tolist(), dtype=torch.float64),
    }
    weights = {"a": 1.0, "b": 0.5, "c": -2.0}
    got = combine_advantages(per, weights, None, 4, "normalize_then_sum", "mean", scale, 1e-6)
    expected = [0.0] * 12
    for name, r in per.items():
        for start in range(0, 12, 4):
            for k, a in enumerate(loop_group_norm(r[start : start + 4].tolist(), scale, 1e-6)):
                expected[start + k] += weights[name] * a
    assert got.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # "c" is constant in group 0, so there it contributes exactly 0: group 0 = a + 0.5 b alone
    without_c = combine_advantages(
        {"a": per["a"], "b": per["b"]},
        {"a": 1.0, "b": 0.5},
        None,
        4,
        "normalize_then_sum",
        "mean",
        scale,
        1e-6,
    )
    assert torch.equal(got[:4], without_c[:4]) and not torch.allclose(got[4:], without_c[4:])


def test_combine_errors():
    r = torch.zeros(4)
    with pytest.raises(ValueError, match="no weight for \\['b'\\]"):
        combine_advantages({"a": r, "b": r}, {"a": 1.0}, None, 4)
    with pytest.raises(ValueError, match="unknown verifiers \\['z'\\]"):
        combine_advantages({"a": r}, {"a": 1.0, "z": 1.0}, None, 4)
    with pytest.raises(ValueError, match="mode"):
        combine_advantages({"a": r}, {"a": 1.0}, None, 4, mode="gdpo")
    with pytest.raises(ValueError, match="empty"):
        combine_advantages({}, {}, None, 4)
    with pytest.raises(DataError, match="one length"):
        combine_advantages({"a": r, "b": torch.zeros(5)}, {"a": 1.0, "b": 1.0}, None, 4)
    with pytest.raises(DataError, match="NaN"):
        combine_advantages(
            {"a": torch.tensor([0.0, 1.0, math.nan, 0.0])}, {"a": 1.0}, None, 4, "normalize_then_sum"
        )


# ---------------------------------------------------------------------------------------------------------
# 6. entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("chunk_rows", [1, 2, 8, 100])
def test_token_entropy_matches_categorical_and_loop(temperature, chunk_rows):
    g = torch.Generator().manual_seed(13)
    logits = 3 * torch.randn(5, 4, 11, generator=g, dtype=torch.float64)  # (N, T, V)
    got = token_entropy(logits, temperature, chunk_rows)  # (N, T)
    expected = torch.distributions.Categorical(logits=logits / temperature).entropy()  # (N, T)
    torch.testing.assert_close(got, expected)
    loop = [[loop_entropy([z / temperature for z in pos]) for pos in row] for row in logits.tolist()]
    assert got.tolist()[3] == pytest.approx(loop[3], rel=1e-12)


def test_token_entropy_hand_derived_and_gradient():
    # Uniform over 4: H = log 4 = 1.386294, gradient 0 (dH/dz_j = -p_j (log p_j + H) = 0).
    # p = [1/4, 3/4, 0, 0] (logits [0, log 3, -inf, -inf]): H = 0.25 log 4 + 0.75 log(4/3)
    #   = 0.346574 + 0.215762 = 0.562335; dH/dz = [-0.25 (log 0.25 + H), -0.75 (log 0.75 + H), 0, 0]
    #   = [0.205990, -0.205990, 0, 0]. With temperature 2 and logits [0, 2 log 3, ...]: same p, same H,
    #   gradient halved.
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]],
        dtype=torch.float64,
        requires_grad=True,
    )  # (1, 2, 4)
    h = token_entropy(logits)  # (1, 2)
    h.sum().backward()
    assert h[0].tolist() == pytest.approx([1.386294, 0.562335], abs=1e-6)
    assert_values(logits.grad[0], [[0, 0, 0, 0], [0.205990, -0.205990, 0, 0]], atol=1e-6)
    hot = torch.tensor(
        [[[0.0, 2 * math.log(3.0), -math.inf, -math.inf]]], dtype=torch.float64, requires_grad=True
    )
    h2 = token_entropy(hot, temperature=2.0)  # (1, 1)
    h2.sum().backward()
    assert h2.item() == pytest.approx(0.562335, abs=1e-6)
    assert hot.grad[0, 0].tolist() == pytest.approx([0.102995, -0.102995, 0, 0], abs=1e-6)


def test_token_entropy_gradient_matches_unchunked_and_finite_differences():
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(5, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)  # (N, T, V)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)  # (N, T) a weighting, so the rows differ
    (chunked,) = torch.autograd.grad((token_entropy(logits, 0.8, chunk_rows=2) * w).sum(), logits)
    full = torch.distributions.Categorical(logits=logits / 0.8).entropy()  # (N, T)
    (plain,) = torch.autograd.grad((full * w).sum(), logits)
    torch.testing.assert_close(chunked, plain)
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, 0.8, chunk_rows=2), (logits,))


def test_token_entropy_holds_no_full_vocabulary_tensor_for_backward():
    # Every tensor the autograd graph keeps is a view of the logits themselves (the chunk inputs of the
    # checkpoints); the float32 log-probs of all chunks are recomputed in backward, never stored.
    logits = torch.randn(6, 4, 50, requires_grad=True)  # (N, T, V)
    storages = []

    def pack(t):
        storages.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = token_entropy(logits, 1.0, chunk_rows=2)  # (N, T)
    assert storages and set(storages) == {logits.untyped_storage().data_ptr()}
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_token_entropy_dtypes_and_edges():
    logits = torch.randn(3, 2, 7)  # (N, T, V)
    with torch.no_grad():
        no_grad = token_entropy(logits.bfloat16())  # (N, T)
    assert no_grad.dtype == torch.float32 and not no_grad.requires_grad
    assert token_entropy(torch.zeros(0, 4, 7)).shape == (0, 4)
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(logits, 0.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        token_entropy(logits, 1.0, chunk_rows=0)
    with pytest.raises(ValueError, match=r"\(N, T, V\)"):
        token_entropy(logits[0])


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_entropy_bonus_matches_loop_reference(aggregation, importance):
    logp, old, ref, ent, adv, mask, (c_logp, c_old, c_ref, c_ent) = make_batch(seed=15)
    ent.requires_grad_(True)
    kwargs = dict(
        beta=0.04,
        aggregation=aggregation,
        importance=importance,
        entropy_coef=0.01,
        max_new_tokens=T,
        num_sequences=7,
        num_tokens=35,
    )
    out = grpo_loss(logp, old, ref, adv, mask, entropy=ent, num_micro_batches=1, **kwargs)
    loss, _, ent_mean = loop_loss(
        c_logp.tolist(), c_old.tolist(), c_ref.tolist(), adv.tolist(), mask.tolist(), c_ent.tolist(), **kwargs
    )
    assert (out.loss.item(), out.entropy.item()) == pytest.approx((loss, ent_mean), rel=1e-9, abs=1e-12)
    assert not out.entropy.requires_grad
    out.loss.backward()
    assert torch.isfinite(ent.grad).all() and (ent.grad[~mask] == 0).all() and (ent.grad[mask] < 0).all()


def test_entropy_bonus_hand_derived():
    # One sequence, 2 policy tokens, A = 0 (no policy term), entropies [1.0, 0.5], coef 0.1:
    #   sequence: -0.1 * (1.5 / 2) / 1 = -0.075, d loss / d entropy = -0.1 / 2 = -0.05 per token
    #   token (num_tokens 10): -0.1 * 1.5 / 10 = -0.015;  constant (max_new_tokens 4): -0.1 * 1.5 / 4 = -0.0375
    #   bnpo (2 micro-batches): -0.1 * (1.5 / 2) / 2 = -0.0375;  reported entropy: mean 0.75 every time.
    logp, mask, adv = torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), torch.zeros(1)
    ent = torch.tensor([[1.0, 0.5, math.nan]], requires_grad=True)  # (1, 3) the masked NaN is ignored
    cases = [
        ({"aggregation": "sequence"}, -0.075),
        ({"aggregation": "token", "num_tokens": 10}, -0.015),
        ({"aggregation": "constant", "max_new_tokens": 4}, -0.0375),
        ({"aggregation": "bnpo", "num_micro_batches": 2}, -0.0375),
    ]
    for kwargs, expected in cases:
        out = grpo_loss(logp, None, None, adv, mask, entropy=ent, entropy_coef=0.1, **kwargs)
        assert out.loss.item() == pytest.approx(expected) and out.entropy.item() == pytest.approx(0.75)
    out = grpo_loss(logp, None, None, adv, mask, entropy=ent, entropy_coef=0.1)
    out.loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])


def test_entropy_reported_only_leaves_the_loss_bit_identical():
    logp, old, ref, ent, adv, mask, _ = make_batch(seed=16)
    base = grpo_loss(logp, old, ref, adv, mask, beta=0.1)
    logged = grpo_loss(logp, old, ref, adv, mask, beta=0.1, entropy=ent)  # entropy_coef 0
    assert torch.equal(base.loss, logged.loss)
    assert base.entropy.item() == 0.0 and logged.entropy.item() > 0
    old_form = LossOutput(base.loss, base.kl, base.clip_frac, base.ratio_mean)  # the 4 fields of before
    assert old_form.entropy.item() == 0.0


def test_entropy_micro_batches_sum_to_full_batch():
    logp, old, ref, ent, adv, mask, _ = make_batch(seed=17)
    logp.requires_grad_(True)
    ent.requires_grad_(True)
    for aggregation in ("sequence", "token", "constant"):
        kwargs = dict(
            beta=0.05,
            aggregation=aggregation,
            num_sequences=N,
            num_tokens=int(mask.sum()),
            max_new_tokens=T,
            entropy_coef=0.02,
        )

        def loss_of(rows, kwargs=kwargs):
            return grpo_loss(
                logp[rows], old[rows], ref[rows], adv[rows], mask[rows], entropy=ent[rows], **kwargs
            ).loss

        full = torch.autograd.grad(loss_of(slice(0, N)), (logp, ent))
        split = torch.autograd.grad(loss_of(slice(0, 2)) + loss_of(slice(2, N)), (logp, ent))
        torch.testing.assert_close(split, full)


def test_entropy_from_logits_end_to_end():
    # logits -> (token_logprobs, token_entropy) -> grpo_loss -> backward: the gradient reaches the logits and
    # the entropy part equals the gradient of the plain (unchunked) entropy.
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(4, 5, 9, generator=g, dtype=torch.float64, requires_grad=True)  # (N, T, V)
    targets = torch.randint(0, 9, (4, 5), generator=g)  # (N, T)
    mask = torch.rand(4, 5, generator=g) < 0.8  # (N, T)
    adv = torch.randn(4, generator=g, dtype=torch.float64)  # (N,)

    def loss_with(entropy_fn):
        logp = token_logprobs(logits, targets).double()  # (N, T)
        ent = entropy_fn(logits)  # (N, T)
        return grpo_loss(logp, None, None, adv, mask, aggregation="token", entropy=ent, entropy_coef=0.1).loss

    (chunked,) = torch.autograd.grad(loss_with(lambda x: token_entropy(x, chunk_rows=3)), logits)
    (plain,) = torch.autograd.grad(
        loss_with(lambda x: torch.distributions.Categorical(logits=x).entropy()), logits
    )
    torch.testing.assert_close(chunked, plain)


def test_entropy_argument_errors():
    logp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
        grpo_loss(logp, None, None, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy must have the shape"):
        grpo_loss(logp, None, None, adv, mask, entropy=torch.zeros(2, 4), entropy_coef=0.1)


# ---------------------------------------------------------------------------------------------------------
# 7. group-size schedule


def test_group_size_at():
    schedule = [(0, 16), (100, 8)]
    assert [group_size_at(s, schedule, 4) for s in (0, 1, 99, 100, 101, 10**6)] == [16, 16, 16, 8, 8, 8]
    # before the first entry, and without a schedule, the default holds
    assert [group_size_at(s, [(50, 12), (200, 6)], 4) for s in (0, 49, 50, 199, 200)] == [4, 4, 12, 12, 6]
    assert group_size_at(7, [], 8) == 8


@pytest.mark.parametrize(
    "schedule, default, step, match",
    [
        ([(100, 8), (0, 16)], 8, 0, "sorted by from_step"),
        ([(0, 16), (0, 8)], 8, 0, "sorted by from_step with no step twice"),
        ([(0, 16), (100, 1)], 8, 0, "G must be >= 2"),
        ([(-5, 16)], 8, 0, "from_step must be >= 0"),
        ([(0, 16, 3)], 8, 0, "pair"),
        ([(0, 16)], 1, 0, "default group size must be >= 2"),
        ([(0, 16)], 8, -1, "step must be >= 0"),
    ],
)
def test_group_size_at_errors(schedule, default, step, match):
    with pytest.raises(ValueError, match=match):
        group_size_at(step, schedule, default)
