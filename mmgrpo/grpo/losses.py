"""The GRPO policy loss: token log-probs, KL estimators, entropy and the clipped surrogate, as pure functions.

Read top to bottom, ``grpo_loss`` is the GRPO update (DeepSeekMath, arXiv 2402.03300) plus its variants:

    ratio     = exp(logp - old_logp)                                   per token (or per sequence, GSPO)
    surrogate = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    kl        = exp(ref_logp - logp) - (ref_logp - logp) - 1           k3 estimator (default), >= 0
    l         = -(surrogate - beta * kl + entropy_coef * entropy)      per policy token
    loss      = aggregate(l over policy tokens)

Where this departs from (or pins down) the papers:

- Gradient accumulation is exact: the normaliser of every aggregation is a whole-batch total the caller
  passes (``num_sequences``, ``num_tokens``), so the losses of the micro-batches SUM to the full-batch
  loss and so do their gradients. DeepSeekMath's 1/G sum_i 1/|o_i| sum_t is ``aggregation="sequence"``
  with num_sequences = G (times the number of tasks); DAPO's token mean is ``"token"``; Dr. GRPO's
  constant ``max_new_tokens * num_sequences`` is ``"constant"``.
- ``aggregation="bnpo"`` is TRL's: the token mean over THIS micro-batch's policy tokens (local
  normalisation), divided by ``num_micro_batches``. Under gradient accumulation the step's loss is then the
  mean over micro-batches of their token means, which equals the whole batch's token mean ("token") only
  when every micro-batch holds as many policy tokens: a micro-batch of short completions weighs as much as
  one of long completions, so its tokens weigh more. It is the one aggregation whose result depends on how
  the batch is split (TRL documents the same caveat).
- ``old_logp=None`` means num_iterations == 1: the old log-probs equal ``logp.detach()``, the ratio is 1
  and the gradient is the plain policy gradient, so the extra forward pass is skipped.
- The KL term is not multiplied by the ratio (as in DeepSeekMath and TRL) and is only computed where
  ``ref_logp`` is given; it is reported as a statistic even when beta == 0. ``kl_estimator`` picks
  Schulman's k1, k2, k3 (default) or verl's ``low_var_kl`` (k3 clamped to [-10, 10]); see
  :func:`kl_estimate` for their values and gradients. The reported ``kl`` is the chosen estimator's mean.
- The entropy bonus (``entropy``, ``entropy_coef``) is aggregated exactly like the policy term (same
  aggregation, same normaliser), so ``loss = policy_loss - entropy_coef * aggregate(entropy)``.
  :func:`token_entropy` computes it from the logits in row chunks.
- Dual clip (Ye et al. 2020): for A < 0 the objective is max(min(...), c * A), so a huge ratio on a bad
  token cannot push the loss without bound. c must be > 1.
- GSPO (arXiv 2507.18071): one ratio per sequence, s_i = exp(mean over its policy tokens of
  (logp - old_logp)), clipped per sequence and applied to every policy token of the sequence; the gradient
  reaches every token through the mean. With "sequence" aggregation this is exactly the paper's objective.
- ``clip_frac`` counts the policy tokens whose gradient was cut by a clip: the ratio left
  [1 - eps_low, 1 + eps_high] on the side the min picks (A > 0 and ratio > 1 + eps_high, or A < 0 and
  ratio < 1 - eps_low), plus, with dual clip, A < 0 and ratio > c.
- Masked positions (prompt, padding, tool tokens) are replaced by zeros with ``torch.where`` before any
  arithmetic, so garbage (inf, NaN) there gives neither NaN in the loss nor in the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mmgrpo.grpo.mismatch import sampler_weights

Aggregation = Literal["sequence", "token", "constant", "bnpo"]
Importance = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 1024) -> Tensor:
    """Log-prob (N, T) of each target token (N, T) under softmax(logits / temperature), logits (N, T, V).

    Computed in (at least) float32, ``chunk`` positions at a time (gather minus logsumexp), by a custom autograd
    function: neither the forward nor the saved state ever holds the full-vocabulary log-probabilities
    (or a float32 copy of the logits) of the whole micro-batch; the backward recomputes each chunk's
    softmax from the logits themselves. A bf16 model does not lose precision in the normaliser, and
    entries with logit -inf (probability 0) give no NaN.
    """
    _check_logprob_args(logits, targets, temperature, chunk)
    if logits.shape[0] * logits.shape[1] == 0:
        return logits.new_zeros(targets.shape, dtype=torch.float32)  # (0, T) or (N, 0)
    return _ChunkedTokenLogprob.apply(logits, targets.to(logits.device), float(temperature), chunk, False)[0]


def _check_logprob_args(logits: Tensor, targets: Tensor, temperature: float, chunk: int) -> None:
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; sampling at 0 gives no diversity anyway."
        )
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits (N, T, V) and targets (N, T), got {tuple(logits.shape)} and {tuple(targets.shape)}."
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}.")


def token_logprobs_entropy(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` (N, T), differentiable, and each position's entropy of softmax(logits /
    temperature), (N, T), without a graph (a metric), in the same pass over the logits: the entropy reuses
    each chunk's scaled logits and normaliser, where ``token_entropy`` takes a log-softmax of its own."""
    _check_logprob_args(logits, targets, temperature, chunk)
    if logits.shape[0] * logits.shape[1] == 0:
        zeros = logits.new_zeros(targets.shape, dtype=torch.float32)  # (0, T) or (N, 0)
        return zeros, zeros.clone()
    return _ChunkedTokenLogprob.apply(logits, targets.to(logits.device), float(temperature), chunk, True)


class _ChunkedTokenLogprob(torch.autograd.Function):
    """logp = z[target] - logsumexp(z), z = logits / temperature, over chunks of positions; with
    ``with_entropy`` also H = -sum p log p per position, p = softmax(z) (no gradient), else an empty tensor.

    Saves the logits (already alive as the model's output, so no copy), the targets and the (N*T,)
    normalisers. Backward: d logp / d logits = (onehot(target) - softmax(z)) / temperature, per chunk.
    """

    @staticmethod
    def forward(
        ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        N, T, V = logits.shape
        flat = logits.reshape(N * T, V)  # (M, V) a view
        tgt = targets.reshape(N * T, 1).long()  # (M, 1)
        dtype = torch.promote_types(logits.dtype, torch.float32)  # at least float32
        out = torch.empty(N * T, dtype=dtype, device=logits.device)  # (M,)
        lse = torch.empty(N * T, dtype=dtype, device=logits.device)  # (M,)
        ent = torch.empty(N * T if with_entropy else 0, dtype=dtype, device=logits.device)  # (M,) or (0,)
        low = torch.finfo(dtype).min
        for s in range(0, N * T, chunk):
            z = _scaled(flat[s : s + chunk], dtype, temperature)  # (m, V) a view of the logits when t = 1
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)  # (m,)
            out[s : s + chunk] = z.gather(-1, tgt[s : s + chunk]).squeeze(-1) - lse[s : s + chunk]  # (m,)
            if with_entropy:  # p log p is 0 where p = 0: log p clamped to the dtype's min, p * min = -0
                logq = z - lse[s : s + chunk, None]  # (m, V) log-probabilities (new: z may be the logits)
                ent[s : s + chunk] = -(logq.exp() * logq.clamp_min_(low)).sum(dim=-1)  # (m,)
        ctx.save_for_backward(logits, tgt, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ent = ent.view(N, T) if with_entropy else ent  # (N, T) or (0,)
        ctx.mark_non_differentiable(ent)
        return out.view(N, T), ent

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_ent: Tensor | None = None):
        logits, tgt, lse = ctx.saved_tensors
        N, T, V = logits.shape
        t, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(N * T, V)  # (M, V)
        g = grad_out.reshape(N * T, 1).to(lse.dtype)  # (M, 1)
        grad = torch.empty_like(flat)  # (M, V) in the logits' dtype
        for s in range(0, N * T, chunk):
            z = _scaled(flat[s : s + chunk], lse.dtype, t)  # (m, V)
            dst = grad[s : s + chunk]
            gi = dst if dst.dtype == lse.dtype else torch.empty_like(z)  # (m, V) written in place
            torch.sub(z, lse[s : s + chunk, None], out=gi).exp_().mul_(-g[s : s + chunk])  # -p * g
            rows = torch.arange(gi.shape[0], device=gi.device)  # one target per row: a plain add there
            at = tgt[s : s + chunk, 0]
            gi[rows, at] += g[s : s + chunk, 0]  # + g at the target
            if t != 1.0:
                gi.div_(t)
            if gi is not dst:
                dst.copy_(gi)
        return grad.view(N, T, V), None, None, None, None


def _scaled(logits: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """logits / temperature in ``dtype``; at temperature 1 in that dtype already, the logits themselves
    (no copy: callers never write into it)."""
    z = logits.to(dtype)
    return z if temperature == 1.0 else z / temperature


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = ref_logp - logp; >= 0."""
    d = ref_logp - logp  # (N, T)
    return (torch.expm1(d) - d).clamp_min(0.0)  # (N, T) expm1 is exact near d = 0; clamp guards rounding


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate (N, T) of KL(pi || pi_ref) from the log-probs (N, T) of tokens sampled from pi.

    With d = ref_logp - logp (http://joschu.net/blog/kl-approx.html):

    ====================  =====================================  ===========================================
    estimator             value                                  d value / d logp
    ====================  =====================================  ===========================================
    ``"k1"``              logp - ref_logp  (can be < 0)          1
    ``"k2"``              0.5 * (logp - ref_logp) ** 2           logp - ref_logp
    ``"k3"`` (default)    exp(d) - d - 1  (>= 0)                 1 - exp(d)
    ``"low_var_kl"``      k3 of clamp(d, -20, 20), clamped to    1 - exp(d) inside, 0 where the clamp bites
                          [-10, 10] (verl)
    ====================  =====================================  ===========================================

    k1 and k3 are unbiased estimates of the KL value on-policy; k2 is biased but low-variance. As a LOSS
    term their gradients differ: on-policy, k1's gradient (beta per token) is zero in expectation (E[grad
    log pi] = 0), so k1 belongs in the reward (:func:`mmgrpo.grpo.kl_control.kl_penalized_rewards`) rather
    than the loss; k2's expected gradient is that of KL(pi || pi_ref) and k3's that of KL(pi_ref || pi).
    ``low_var_kl`` clamps d first (as verl does) so that exp never overflows to inf and the gradient stays
    finite where the output clamp cuts it to 0.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape, got {tuple(logp.shape)} and {tuple(ref_logp.shape)}."
        )
    if estimator == "k3":
        return k3_kl(logp, ref_logp)  # (N, T)
    if estimator == "k1":
        return logp - ref_logp  # (N, T)
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()  # (N, T)
    if estimator == "low_var_kl":
        d = (ref_logp - logp).clamp(-20.0, 20.0)  # (N, T)
        return (torch.expm1(d) - d).clamp(0.0, 10.0)  # (N, T) k3 >= 0, so only the upper clamp ever bites
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}.")


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_rows: int = 8) -> Tensor:
    """Entropy (N, T) of softmax(logits / temperature) at every position, logits (N, T, V); differentiable.

    Computed ``chunk_rows`` sequences at a time in at least float32. When a gradient is needed each chunk
    runs under activation checkpointing, so neither the forward nor the autograd graph ever holds the
    full-vocabulary log-probs of more than one chunk: the backward pass recomputes them chunk by chunk
    (one extra softmax per chunk). Vocabulary entries with logit -inf (probability 0) contribute 0 and
    no NaN gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if logits.dim() != 3:
        raise ValueError(f"expected logits (N, T, V), got shape {tuple(logits.shape)}.")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}.")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:2], dtype=dtype)  # (0, T)
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, logits.shape[0], chunk_rows):
        chunk = logits[start : start + chunk_rows]  # (n, T, V)
        if with_grad:
            parts.append(
                checkpoint(_entropy_rows, chunk, temperature, use_reentrant=False, preserve_rng_state=False)
            )  # (n, T)
        else:
            parts.append(_entropy_rows(chunk, temperature))  # (n, T)
    return torch.cat(parts)  # (N, T)


def _entropy_rows(logits: Tensor, temperature: float) -> Tensor:
    """Entropy (n, T) of softmax(logits / temperature) for one chunk of logits (n, T, V)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (n, T, V)
    logp = torch.log_softmax(z, dim=-1)  # (n, T, V)
    finite = torch.isfinite(logp)  # (n, T, V) False only where p = 0 (logit -inf)
    safe = torch.where(finite, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))  # (n, T, V)
    return -(logp.exp() * safe).sum(dim=-1)  # (n, T) p log p = 0 where p = 0


@dataclass
class LossOutput:
    """What one call of ``grpo_loss`` returns. Statistics are token means over this micro-batch's policy tokens."""

    loss: Tensor
    """Scalar, differentiable; micro-batch losses sum to the full-batch loss."""
    kl: Tensor
    """Scalar, detached: mean KL estimate to the reference (``kl_estimator``, k3 by default; 0 without ref_logp)."""
    clip_frac: Tensor
    """Scalar, detached: fraction of policy tokens whose gradient a clip cut (see the module docstring)."""
    ratio_mean: Tensor
    """Scalar, detached: mean importance ratio (1 at the first pass over fresh rollouts)."""
    entropy: Tensor = field(default_factory=lambda: torch.zeros(()))
    """Scalar, detached: mean token entropy over the policy tokens (0 when no entropy is given)."""
    mismatch: dict[str, Tensor] | None = None
    """With ``sampled_logp``: the sampler / trainer mismatch (``mmgrpo.grpo.mismatch``: kl, max_abs, capped)."""


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    beta: float = 0.0,
    aggregation: Aggregation = "sequence",
    importance: Importance = "token",
    dual_clip: float | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    max_new_tokens: int | None = None,
    kl_estimator: KLEstimator = "k3",
    num_micro_batches: int = 1,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    sampled_logp: Tensor | None = None,
    sampler_cap: float | None = None,
) -> LossOutput:
    """Clipped GRPO surrogate with optional KL penalty and entropy bonus on one micro-batch.

    logp (N, T) new log-probs (with grad); old_logp (N, T) or None (= logp.detach()); ref_logp (N, T) or
    None (required when beta > 0); advantages (N,) broadcast over tokens, or (N, T); mask (N, T), 1 for
    tokens the policy generated. num_sequences / num_tokens are the WHOLE batch's totals (defaults: this
    micro-batch's); max_new_tokens is required by aggregation="constant".

    kl_estimator: "k1", "k2", "k3" (default) or "low_var_kl", see :func:`kl_estimate`.
    num_micro_batches: only for aggregation="bnpo", whose loss is this micro-batch's token mean divided by
        it (pass the number of micro-batches of the step, so that their losses add up to the mean of the
        micro-batch means); the other aggregations are already normalised by whole-batch totals.
    entropy (N, T), e.g. :func:`token_entropy`, with grad for a bonus: the loss becomes
        loss - entropy_coef * (entropy aggregated like the policy term). Given with entropy_coef == 0 it is
        only reported (``LossOutput.entropy``) and the loss is unchanged.
    sampled_logp (N, T): the sampler's log-probs of the tokens (NaN where none). The mismatch against the
        trainer's old log-probs is measured (``LossOutput.mismatch``), and with ``sampler_cap`` each token's
        policy-gradient term is weighted by min(p_old / p_sampler, cap) (see ``mmgrpo.grpo.mismatch``).
    """
    _check_args(
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        beta,
        aggregation,
        importance,
        dual_clip,
        max_new_tokens,
        kl_estimator,
        num_micro_batches,
        entropy,
        entropy_coef,
    )
    if sampled_logp is not None and sampled_logp.shape != logp.shape:
        raise ValueError(f"sampled_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(sampled_logp.shape)}.")
    m = mask.bool()  # (N, T) policy tokens
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)  # ()
    logp = torch.where(m, logp, zero)  # (N, T) garbage outside the mask is gone from here on
    if old_logp is None:
        old = logp.detach()  # (N, T) num_iterations == 1: ratio 1, gradient = policy gradient
    else:
        old = torch.where(m, old_logp.to(logp.dtype), zero)  # (N, T)
    adv = advantages.detach().to(logp.dtype)  # (N,) or (N, T)
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(logp)  # (N, T)
    seq_len = m.sum(dim=1)  # (N,) policy tokens per sequence
    n_tok = m.sum()  # () policy tokens in this micro-batch

    # Importance ratio: per token, or one per sequence (GSPO: geometric mean of the token ratios).
    log_ratio = logp - old  # (N, T) 0 outside the mask
    if importance == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / seq_len.clamp_min(1)  # (N,)
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logp)  # (N, T)
    ratio = torch.exp(log_ratio)  # (N, T)

    # Clipped surrogate (PPO), with the dual clip for negative advantages.
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # (N, T)
    surrogate = torch.min(ratio * adv, clipped_ratio * adv)  # (N, T)
    cut_high = (adv > 0) & (ratio > 1.0 + clip_eps_high)  # (N, T) the min picked the clipped branch
    cut_low = (adv < 0) & (ratio < 1.0 - clip_eps_low)  # (N, T)
    clipped = cut_high | cut_low  # (N, T)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip * adv), surrogate)  # (N, T)
        clipped = clipped | ((adv < 0) & (ratio > dual_clip))  # (N, T)
    mismatch = None
    if sampled_logp is not None:  # tokens drawn from the sampler q, trained for p: weigh by min(p/q, cap)
        weights, mismatch = sampler_weights(old, sampled_logp, m, sampler_cap or float("inf"))  # (N, T)
        if sampler_cap is not None:
            surrogate = surrogate * weights  # (N, T)

    # KL penalty to the frozen reference, in the loss (mmgrpo.grpo.kl_control puts it in the reward instead).
    if ref_logp is not None:
        ref = torch.where(m, ref_logp.to(logp.dtype), zero)  # (N, T)
        kl = kl_estimate(logp, ref, kl_estimator)  # (N, T) 0 outside the mask
    else:
        kl = torch.zeros_like(logp)  # (N, T)

    per_token = -(surrogate - beta * kl)  # (N, T)
    per_token = torch.where(m, per_token, zero)  # (N, T) masked positions contribute nothing
    if entropy is not None:
        ent = torch.where(m, entropy.to(logp.dtype), zero)  # (N, T) garbage outside the mask is gone
        if entropy_coef != 0.0:
            per_token = per_token - entropy_coef * ent  # (N, T) aggregated below like the policy term
    else:
        ent = torch.zeros_like(logp)  # (N, T)

    # Aggregation, normalised by whole-batch totals so that micro-batch losses sum to the batch loss.
    n_seq = logp.shape[0] if num_sequences is None else num_sequences
    if aggregation == "sequence":
        seq_mean = per_token.sum(dim=1) / seq_len.clamp_min(1)  # (N,) 0 for an empty sequence
        loss = seq_mean.sum() / max(n_seq, 1)  # ()
    elif aggregation == "token":
        denom = n_tok.clamp_min(1) if num_tokens is None else max(num_tokens, 1)
        loss = per_token.sum() / denom  # ()
    elif aggregation == "bnpo":  # TRL: this micro-batch's own token mean, then / micro-batches (local)
        loss = per_token.sum() / n_tok.clamp_min(1) / num_micro_batches  # ()
    else:  # "constant" (Dr. GRPO)
        loss = per_token.sum() / (max_new_tokens * max(n_seq, 1))  # ()

    with torch.no_grad():  # statistics: token means over this micro-batch's policy tokens
        count = n_tok.clamp_min(1).to(logp.dtype)  # ()
        kl_mean = (kl * m).sum() / count  # ()
        clip_frac = (clipped & m).sum().to(logp.dtype) / count  # ()
        ratio_mean = torch.where(m, ratio, zero).sum() / count  # ()
        entropy_mean = ent.detach().sum() / count  # () 0 when no entropy is given
    return LossOutput(
        loss=loss, kl=kl_mean, clip_frac=clip_frac, ratio_mean=ratio_mean, entropy=entropy_mean, mismatch=mismatch
    )


def _check_args(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    beta,
    aggregation,
    importance,
    dual_clip,
    max_new_tokens,
    kl_estimator,
    num_micro_batches,
    entropy,
    entropy_coef,
):
    """Fail early, with the fix in the message, on arguments that would silently give a wrong loss."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (N, T), got shape {tuple(logp.shape)}.")
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask), ("entropy", entropy)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}.")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be (N,) or (N, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}."
        )
    if beta > 0 and ref_logp is None:
        raise ValueError(
            f"beta={beta} > 0 needs ref_logp (the reference model's log-probs); pass it or set beta=0."
        )
    if aggregation not in ("sequence", "token", "constant", "bnpo"):
        raise ValueError(
            f"aggregation must be 'sequence', 'token', 'constant' or 'bnpo', got {aggregation!r}."
        )
    if importance not in ("token", "sequence"):
        raise ValueError(f"importance must be 'token' or 'sequence' (GSPO), got {importance!r}.")
    if aggregation == "constant" and not max_new_tokens:
        raise ValueError(
            "aggregation='constant' (Dr. GRPO) divides by max_new_tokens * num_sequences; pass max_new_tokens."
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (about 3 in the literature), got {dual_clip}.")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}.")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}.")
    if num_micro_batches != 1 and aggregation != "bnpo":
        raise ValueError(
            f"num_micro_batches={num_micro_batches} only applies to aggregation='bnpo'; "
            f"{aggregation!r} is normalised by whole-batch totals (num_sequences / num_tokens), pass 1."
        )
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(
            f"entropy_coef={entropy_coef} needs entropy (N, T), e.g. token_entropy(logits); pass it or set 0."
        )
