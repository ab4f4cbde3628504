"""The GRPO loss against a plain-loop reference, hand-derived cases, and exact gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from mmgrpo.grpo.losses import grpo_loss, k3_kl, token_logprobs

N, T = 6, 7


def reference_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.2,
    beta=0.0,
    aggregation="sequence",
    importance="token",
    dual_clip=None,
    num_sequences=None,
    num_tokens=None,
    max_new_tokens=None,
):
    """The clipped surrogate with KL, one sequence and one token at a time, with scalar math only."""
    total, kl_sum, clip_count, ratio_sum, count = 0.0, 0.0, 0, 0.0, 0
    for i in range(len(logp)):
        tokens = [t for t in range(len(logp[i])) if mask[i][t]]
        old_i = old[i] if old is not None else logp[i]
        if importance == "sequence" and tokens:
            seq_ratio = math.exp(sum(logp[i][t] - old_i[t] for t in tokens) / len(tokens))
        seq_sum = 0.0
        for t in tokens:
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            r = seq_ratio if importance == "sequence" else math.exp(logp[i][t] - old_i[t])
            clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
            surrogate = min(r * a, clipped_r * a)
            was_clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            if dual_clip is not None and a < 0:
                surrogate = max(surrogate, dual_clip * a)
                was_clipped = was_clipped or r > dual_clip
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
            seq_sum += -(surrogate - beta * kl)
            kl_sum, clip_count, ratio_sum, count = (
                kl_sum + kl,
                clip_count + was_clipped,
                ratio_sum + r,
                count + 1,
            )
        if aggregation == "sequence":
            total += seq_sum / len(tokens) if tokens else 0.0
        else:
            total += seq_sum
    n_seq = num_sequences or len(logp)
    if aggregation == "sequence":
        loss = total / n_seq
    elif aggregation == "token":
        loss = total / (num_tokens or max(count, 1))
    else:
        loss = total / (max_new_tokens * n_seq)
    c = max(count, 1)
    return loss, kl_sum / c, clip_count / c, ratio_sum / c


def make_batch(seed=0, per_token_adv=False):
    """Random float64 batch; row 2 has no policy tokens; masked positions hold -inf / NaN garbage."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(N, T, generator=g, dtype=torch.float64)  # (N, T)
    # Old log-probs 0.4 nats away: many ratios fall outside [0.8, 1.28], so the clip is exercised.
    old = logp + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)  # (N, T)
    ref = logp + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)  # (N, T)
    mask = torch.rand(N, T, generator=g) < 0.7  # (N, T)
    mask[2] = False
    mask[0, 0] = True
    shape = (N, T) if per_token_adv else (N,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)  # (N,) or (N, T)
    clean = (logp.clone(), old.clone(), ref.clone())
    logp[~mask], old[~mask], ref[~mask] = -math.inf, math.nan, math.inf
    return logp, old, ref, adv, mask, clean


OLD_REF = {  # (use old_logp, use ref_logp, beta)
    "first_pass": (False, False, 0.0),
    "old": (True, False, 0.0),
    "old_ref": (True, True, 0.04),
    "ref_only_beta0": (False, True, 0.0),
}


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("old_ref", list(OLD_REF))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_matches_loop_reference(aggregation, importance, old_ref, dual_clip):
    use_old, use_ref, beta = OLD_REF[old_ref]
    logp, old, ref, adv, mask, (clean_logp, clean_old, clean_ref) = make_batch(seed=1)
    logp.requires_grad_(True)
    kwargs = dict(
        beta=beta,
        aggregation=aggregation,
        importance=importance,
        dual_clip=dual_clip,
        max_new_tokens=T if aggregation == "constant" else None,
    )
    out = grpo_loss(
        logp,
        old if use_old else None,
        ref if use_ref else None,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        **kwargs,
    )
    expected = reference_loss(
        clean_logp.tolist(),
        clean_old.tolist() if use_old else None,
        clean_ref.tolist() if use_ref else None,
        adv.tolist(),
        mask.tolist(),
        eps_low=0.2,
        eps_high=0.28,
        **kwargs,
    )
    got = (out.loss.item(), out.kl.item(), out.clip_frac.item(), out.ratio_mean.item())
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert not (out.kl.requires_grad or out.clip_frac.requires_grad or out.ratio_mean.requires_grad)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()
    if use_old and importance == "token":
        assert 0 < out.clip_frac.item() < 1  # the random ratios do exercise the clip


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_per_token_advantages_match_loop_reference(aggregation, importance):
    logp, old, ref, adv, mask, (clean_logp, clean_old, clean_ref) = make_batch(seed=2, per_token_adv=True)
    kwargs = dict(
        beta=0.1,
        aggregation=aggregation,
        importance=importance,
        dual_clip=2.5,
        max_new_tokens=10,
        num_sequences=9,
        num_tokens=40,
    )
    out = grpo_loss(logp, old, ref, adv, mask, **kwargs)
    expected = reference_loss(
        clean_logp.tolist(), clean_old.tolist(), clean_ref.tolist(), adv.tolist(), mask.tolist(), **kwargs
    )
    assert out.loss.item() == pytest.approx(expected[0], rel=1e-9)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("use_old", [False, True])
def test_micro_batches_sum_to_full_batch(aggregation, importance, use_old):
    logp, old, ref, adv, mask, _ = make_batch(seed=3)
    logp.requires_grad_(True)
    totals = dict(num_sequences=N, num_tokens=int(mask.sum()), max_new_tokens=T)
    kwargs = dict(beta=0.05, aggregation=aggregation, importance=importance, **totals)

    def loss_of(rows):
        return grpo_loss(
            logp[rows], old[rows] if use_old else None, ref[rows], adv[rows], mask[rows], **kwargs
        ).loss

    full = loss_of(slice(0, N))
    (full_grad,) = torch.autograd.grad(full, logp)
    halves = [loss_of(slice(0, 2)), loss_of(slice(2, N))]  # the first half holds 2 rows, the second 4
    (halves_grad,) = torch.autograd.grad(halves[0] + halves[1], logp)
    torch.testing.assert_close(halves[0] + halves[1], full)
    torch.testing.assert_close(halves_grad, full_grad)
    # ... and accumulating .grad over two separate backward passes gives the same.
    for h in (loss_of(slice(0, 2)), loss_of(slice(2, N))):
        h.backward()
    torch.testing.assert_close(logp.grad, full_grad)


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gradient_matches_finite_differences(importance, dual_clip):
    logp, old, ref, adv, mask, _ = make_batch(seed=4)
    logp = torch.where(mask, logp, torch.zeros_like(logp)).requires_grad_(
        True
    )  # gradcheck perturbs every entry

    def f(x):
        return grpo_loss(x, old, ref, adv, mask, beta=0.1, importance=importance, dual_clip=dual_clip).loss

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-7, atol=1e-6)


def test_first_pass_gradient_is_policy_gradient():
    # old_logp None: ratio = exp(logp - sg(logp)) = 1 and d ratio / d logp = 1, so with "sequence"
    # aggregation d loss / d logp[i, t] = -A_i * m[i, t] / len_i / N (no clipping: 1 is inside the range).
    logp, _, _, adv, mask, _ = make_batch(seed=5)
    logp.requires_grad_(True)
    out = grpo_loss(logp, None, None, adv, mask)
    out.loss.backward()
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)  # (N, 1)
    expected = -adv[:, None] * mask / lengths / N  # (N, T)
    torch.testing.assert_close(logp.grad, expected.to(logp.dtype))
    assert out.ratio_mean.item() == 1.0 and out.clip_frac.item() == 0.0 and out.kl.item() == 0.0


def _one_token(ratio, a, **kwargs):
    """Loss of a single policy token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)  # (1, 1)
    old = torch.zeros(1, 1, dtype=torch.float64)  # (1, 1)
    out = grpo_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), torch.ones(1, 1), **kwargs)
    out.loss.backward()
    return out.loss.item(), out.clip_frac.item(), logp.grad.item()


def test_hand_derived_clipping():
    # ratio 1.5, A = +1, eps 0.2: min(1.5 * 1, clip(1.5) * 1 = 1.2) = 1.2 -> loss -1.2, clipped, no gradient.
    assert _one_token(1.5, 1.0) == pytest.approx((-1.2, 1.0, 0.0))
    # Same with clip-higher eps_high 0.28 (DAPO): min(1.5, 1.28) = 1.28.
    assert _one_token(1.5, 1.0, clip_eps_high=0.28) == pytest.approx((-1.28, 1.0, 0.0))
    # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, unclipped; d loss / d logp = -A * ratio = 1.5.
    assert _one_token(1.5, -1.0) == pytest.approx((1.5, 0.0, 1.5))
    # ratio 0.5, A = -1: min(-0.5, clip(0.5) * -1 = -0.8) = -0.8 -> loss 0.8, clipped.
    assert _one_token(0.5, -1.0) == pytest.approx((0.8, 1.0, 0.0))
    # ratio 0.5, A = +1: min(0.5, 0.8) = 0.5 -> loss -0.5, unclipped; gradient -A * ratio = -0.5.
    assert _one_token(0.5, 1.0) == pytest.approx((-0.5, 0.0, -0.5))
    # Dual clip c = 3, ratio 4, A = -1: min(-4, -1.2) = -4, then max(-4, 3 * -1) = -3 -> loss 3, clipped.
    assert _one_token(4.0, -1.0, dual_clip=3.0) == pytest.approx((3.0, 1.0, 0.0))
    # ... but ratio 2 is under the cap: max(min(-2, -1.2), -3) = -2 -> loss 2, gradient 2.
    assert _one_token(2.0, -1.0, dual_clip=3.0) == pytest.approx((2.0, 0.0, 2.0))


def test_hand_derived_gspo():
    # Token log-ratios [log 2, 0] -> s = exp((log 2 + 0) / 2) = sqrt(2) = 1.4142 for both tokens.
    # A = +1, eps 0.2: min(1.4142, 1.2) = 1.2 on both tokens -> sequence mean -> loss -1.2, all clipped.
    logp = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)  # (1, 2)
    old = torch.zeros(1, 2, dtype=torch.float64)  # (1, 2)
    out = grpo_loss(logp, old, None, torch.tensor([1.0]), torch.ones(1, 2), importance="sequence")
    assert (out.loss.item(), out.clip_frac.item(), out.ratio_mean.item()) == pytest.approx(
        (-1.2, 1.0, math.sqrt(2))
    )
    # A = -1: min(-1.4142, -1.2) = -1.4142, unclipped; d loss / d logp_t = -A * s / len = sqrt(2) / 2 per token.
    logp.requires_grad_(True)
    out = grpo_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1, 2), importance="sequence")
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.sqrt(2))
    assert logp.grad[0].tolist() == pytest.approx([math.sqrt(2) / 2] * 2)


def test_hand_derived_aggregations():
    # Ratio 1 (first pass), so l = -A on each policy token. Sequence 0 has 1 token with A = +1 (l = -1),
    # sequence 1 has 3 tokens with A = -1 (l = +1 each).
    #   sequence: (-1 / 1 + 3 / 3) / 2 = 0;  token: (-1 + 3) / 4 = 0.5;  constant (max_new_tokens 4): 2 / 8 = 0.25.
    logp = torch.zeros(2, 4)  # (2, 4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])  # (2, 4)
    adv = torch.tensor([1.0, -1.0])  # (2,)
    assert grpo_loss(logp, None, None, adv, mask, aggregation="sequence").loss.item() == pytest.approx(0.0)
    assert grpo_loss(logp, None, None, adv, mask, aggregation="token").loss.item() == pytest.approx(0.5)
    out = grpo_loss(logp, None, None, adv, mask, aggregation="constant", max_new_tokens=4)
    assert out.loss.item() == pytest.approx(0.25)


def test_hand_derived_kl():
    # ref - logp = log 2 on the one token: k3 = 2 - log 2 - 1 = 0.30685; beta 0.1, A = 0 -> loss 0.030685.
    logp = torch.tensor([[0.0, -1.0]])  # (1, 2) second token masked
    ref = torch.tensor([[math.log(2.0), 5.0]])  # (1, 2)
    out = grpo_loss(logp, None, ref, torch.tensor([0.0]), torch.tensor([[1, 0]]), beta=0.1)
    assert out.kl.item() == pytest.approx(1 - math.log(2), rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * (1 - math.log(2)), rel=1e-6)


def test_empty_micro_batch_is_zero_not_nan():
    logp = torch.full((2, 3), -math.inf, requires_grad=True)  # (2, 3)
    for aggregation in ("sequence", "token", "constant"):
        out = grpo_loss(
            logp, None, None, torch.ones(2), torch.zeros(2, 3), aggregation=aggregation, max_new_tokens=3
        )
        assert out.loss.item() == 0.0 and out.kl.item() == 0.0 and out.ratio_mean.item() == 0.0
        out.loss.backward()
        assert (logp.grad == 0).all()


def test_argument_errors():
    logp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, None, None, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        grpo_loss(logp, None, None, adv, mask, aggregation="constant")
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, None, None, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(logp, None, None, adv, mask, dual_clip=0.5)


def test_k3_kl_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(6)
    logp, ref = torch.randn(50, 40, generator=g), torch.randn(50, 40, generator=g)  # (50, 40)
    assert (k3_kl(logp, ref) >= 0).all()
    assert (k3_kl(logp, logp) == 0).all()
    small = torch.tensor([1e-4, -1e-4, 1e-7])  # (3,) near-equal log-probs: k3 ~ d^2 / 2
    assert k3_kl(torch.zeros(3), small).tolist() == pytest.approx([5e-9, 5e-9, 5e-15], rel=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_token_logprobs_match_categorical(temperature):
    g = torch.Generator().manual_seed(7)
    logits = 4 * torch.randn(3, 5, 11, generator=g)  # (N, T, V)
    targets = torch.randint(0, 11, (3, 5), generator=g)  # (N, T)
    expected = torch.distributions.Categorical(logits=logits / temperature).log_prob(targets)  # (N, T)
    torch.testing.assert_close(token_logprobs(logits, targets, temperature), expected)
    got = token_logprobs(logits.bfloat16(), targets, temperature)  # (N, T)
    assert got.dtype == torch.float32
    bf16_expected = torch.distributions.Categorical(logits=logits.bfloat16().float() / temperature).log_prob(
        targets
    )
    torch.testing.assert_close(got, bf16_expected)


def test_token_logprobs_gradient_flows():
    logits = torch.randn(2, 3, 5, requires_grad=True)  # (N, T, V)
    token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature,chunk", [(1.0, 1024), (0.7, 7)])
def test_logprobs_with_entropy_in_one_pass_match_the_two_functions(temperature, chunk):
    """The fused pass gives token_logprobs' values and gradient, and token_entropy's values (a -inf logit
    included), the entropy without a graph."""
    from mmgrpo.grpo.losses import token_entropy, token_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 40, generator=g)).requires_grad_()  # (N, T, V)
    with torch.no_grad():
        logits[0, 0, :4] = float("-inf")
    targets = torch.randint(4, 40, (3, 5), generator=g)  # (N, T)
    logp, ent = token_logprobs_entropy(logits, targets, temperature, chunk)
    want_logp = token_logprobs(logits, targets, temperature)
    assert torch.equal(logp, want_logp)
    assert torch.allclose(ent, token_entropy(logits.detach(), temperature), atol=1e-5)
    assert ent.isfinite().all() and not ent.requires_grad and logp.requires_grad
    (got,) = torch.autograd.grad((logp * torch.arange(15.0).view(3, 5)).sum(), logits)
    (want,) = torch.autograd.grad((want_logp * torch.arange(15.0).view(3, 5)).sum(), logits)
    assert torch.allclose(got, want, atol=1e-7)
    empty_logp, empty_ent = token_logprobs_entropy(logits[:, :0], targets[:, :0], temperature)
    assert empty_logp.shape == empty_ent.shape == (3, 0)
