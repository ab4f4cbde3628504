"""The GRPO policy loss: token log-probs, the k3 KL estimator and the clipped surrogate, as pure functions.

Read top to bottom, ``grpo_loss`` is the GRPO update (DeepSeekMath, arXiv 2402.03300) plus its variants:

    ratio     = exp(logp - old_logp)                                   per token (or per sequence, GSPO)
    surrogate = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    kl        = exp(ref_logp - logp) - (ref_logp - logp) - 1           k3 estimator, >= 0
    l         = -(surrogate - beta * kl)                               per policy token
    loss      = aggregate(l over policy tokens)

Where this departs from (or pins down) the papers:

- Gradient accumulation is exact: the normaliser of every aggregation is a whole-batch total the caller
  passes (``num_sequences``, ``num_tokens``), so the losses of the micro-batches SUM to the full-batch
  loss and so do their gradients. DeepSeekMath's 1/G sum_i 1/|o_i| sum_t is ``aggregation="sequence"``
  with num_sequences = G (times the number of tasks); DAPO's token mean is ``"token"``; Dr. GRPO's
  constant ``max_new_tokens * num_sequences`` is ``"constant"``.
- ``old_logp=None`` means num_iterations == 1: the old log-probs equal ``logp.detach()``, the ratio is 1
  and the gradient is the plain policy gradient, so the extra forward pass is skipped.
- The KL term is not multiplied by the ratio (as in DeepSeekMath and TRL) and is only computed where
  ``ref_logp`` is given; it is reported as a statistic even when beta == 0.
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

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["sequence", "token", "constant"]
Importance = Literal["token", "sequence"]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob (N, T) of each target token (N, T) under softmax(logits / temperature), logits (N, T, V).

    Computed in float32 one sequence at a time (gather minus logsumexp), so the full (N, T, V)
    log-softmax is never materialised and a bf16 model does not lose precision in the normaliser.
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; sampling at 0 gives no diversity anyway."
        )
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits (N, T, V) and targets (N, T), got {tuple(logits.shape)} and {tuple(targets.shape)}."
        )
    rows = []
    for row_logits, row_targets in zip(logits, targets, strict=True):  # (T, V), (T,)
        z = row_logits.float() / temperature  # (T, V)
        picked = z.gather(-1, row_targets.long().unsqueeze(-1)).squeeze(-1)  # (T,)
        rows.append(picked - torch.logsumexp(z, dim=-1))  # (T,)
    if not rows:
        return logits.new_zeros(targets.shape, dtype=torch.float32)  # (0, T)
    return torch.stack(rows)  # (N, T)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = ref_logp - logp; >= 0."""
    d = ref_logp - logp  # (N, T)
    return (torch.expm1(d) - d).clamp_min(0.0)  # (N, T) expm1 is exact near d = 0; clamp guards rounding


@dataclass
class LossOutput:
    """What one call of ``grpo_loss`` returns. Statistics are token means over this micro-batch's policy tokens."""

    loss: Tensor
    """Scalar, differentiable; micro-batch losses sum to the full-batch loss."""
    kl: Tensor
    """Scalar, detached: mean k3 KL to the reference (0 when no ref_logp is given)."""
    clip_frac: Tensor
    """Scalar, detached: fraction of policy tokens whose gradient a clip cut (see the module docstring)."""
    ratio_mean: Tensor
    """Scalar, detached: mean importance ratio (1 at the first pass over fresh rollouts)."""


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
) -> LossOutput:
    """Clipped GRPO surrogate with optional k3 KL penalty on one micro-batch.

    logp (N, T) new log-probs (with grad); old_logp (N, T) or None (= logp.detach()); ref_logp (N, T) or
    None (required when beta > 0); advantages (N,) broadcast over tokens, or (N, T); mask (N, T), 1 for
    tokens the policy generated. num_sequences / num_tokens are the WHOLE batch's totals (defaults: this
    micro-batch's); max_new_tokens is required by aggregation="constant".
    """
    _check_args(
        logp, old_logp, ref_logp, advantages, mask, beta, aggregation, importance, dual_clip, max_new_tokens
    )
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

    # KL penalty to the frozen reference, in the loss (not in the reward).
    if ref_logp is not None:
        ref = torch.where(m, ref_logp.to(logp.dtype), zero)  # (N, T)
        kl = k3_kl(logp, ref)  # (N, T) 0 outside the mask
    else:
        kl = torch.zeros_like(logp)  # (N, T)

    per_token = -(surrogate - beta * kl)  # (N, T)
    per_token = torch.where(m, per_token, zero)  # (N, T) masked positions contribute nothing

    # Aggregation, normalised by whole-batch totals so that micro-batch losses sum to the batch loss.
    n_seq = logp.shape[0] if num_sequences is None else num_sequences
    if aggregation == "sequence":
        seq_mean = per_token.sum(dim=1) / seq_len.clamp_min(1)  # (N,) 0 for an empty sequence
        loss = seq_mean.sum() / max(n_seq, 1)  # ()
    elif aggregation == "token":
        denom = n_tok.clamp_min(1) if num_tokens is None else max(num_tokens, 1)
        loss = per_token.sum() / denom  # ()
    else:  # "constant" (Dr. GRPO)
        loss = per_token.sum() / (max_new_tokens * max(n_seq, 1))  # ()

    with torch.no_grad():  # statistics: token means over this micro-batch's policy tokens
        count = n_tok.clamp_min(1).to(logp.dtype)  # ()
        kl_mean = (kl * m).sum() / count  # ()
        clip_frac = (clipped & m).sum().to(logp.dtype) / count  # ()
        ratio_mean = torch.where(m, ratio, zero).sum() / count  # ()
    return LossOutput(loss=loss, kl=kl_mean, clip_frac=clip_frac, ratio_mean=ratio_mean)


def _check_args(
    logp, old_logp, ref_logp, advantages, mask, beta, aggregation, importance, dual_clip, max_new_tokens
):
    """Fail early, with the fix in the message, on arguments that would silently give a wrong loss."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (N, T), got shape {tuple(logp.shape)}.")
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
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
    if aggregation not in ("sequence", "token", "constant"):
        raise ValueError(f"aggregation must be 'sequence', 'token' or 'constant', got {aggregation!r}.")
    if importance not in ("token", "sequence"):
        raise ValueError(f"importance must be 'token' or 'sequence' (GSPO), got {importance!r}.")
    if aggregation == "constant" and not max_new_tokens:
        raise ValueError(
            "aggregation='constant' (Dr. GRPO) divides by max_new_tokens * num_sequences; pass max_new_tokens."
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (about 3 in the literature), got {dual_clip}.")
