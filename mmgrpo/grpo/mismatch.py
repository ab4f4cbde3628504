"""The sampler and the trainer may disagree: measure it per token, and correct the loss for it.

GRPO's importance ratio compares the policy being trained with the policy that produced the rollouts, and
both are meant to be the same network. In practice the rollouts come from a sampler whose numbers differ
a little from the training pass: a decode step on a KV cache against a whole-sequence pass under bf16
autocast (about 2e-3 in log-prob on the tiny models), or another engine altogether (vLLM). The tokens were
drawn from the sampler's distribution q, the gradient is taken for the trainer's p; the unbiased policy
gradient then weighs each token by p/q. As TRL (``vllm_importance_sampling_correction``) and verl (rollout
correction) do, the weight is truncated at ``cap`` (truncated importance sampling, Ionides 2008 / Yao et
al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"), detached, and
multiplies each token's policy-gradient term.

    log_w  = old_logp - sampled_logp        per policy token (old: the trainer's log-probs before the update)
    w      = min(exp(log_w), cap)           detached
    mismatch/kl       = mean(exp(log_w) - 1 - log_w)   k3 estimate of KL(sampler || trainer)
    mismatch/max_abs  = max |log_w|
    mismatch/capped   = share of policy tokens with exp(log_w) > cap

Tokens the sampler gave no log-prob for (NaN: environment tokens, a Policy subclass's own sampler) get
weight 1 and are left out of the statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sampler_weights(
    old_logp: Tensor, sampled_logp: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights (N, T), detached, 1 outside the policy tokens, and the mismatch
    statistics (scalars, detached; 0 when no token has a sampled log-prob).

    old_logp (N, T) the trainer's log-probs of the sampled tokens before this update; sampled_logp (N, T)
    the sampler's (NaN where it gave none); mask (N, T) 1 on policy tokens; cap > 0."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    old, sampled = old_logp.detach().float(), sampled_logp.detach().float().to(old_logp.device)
    seen = mask.bool() & ~torch.isnan(sampled)  # (N, T) tokens with both numbers
    log_w = torch.where(seen, old - torch.nan_to_num(sampled), torch.zeros_like(old))  # (N, T) 0 elsewhere
    raw = torch.exp(log_w)  # (N, T) 1 elsewhere
    weights = raw.clamp(max=cap).to(old_logp.dtype)  # (N, T)
    n = seen.sum().clamp_min(1)  # ()
    stats = {
        "kl": ((raw - 1.0 - log_w) * seen).sum() / n,  # () k3, 0 elsewhere by construction
        "max_abs": log_w.abs().max() if seen.any() else torch.zeros(()),  # ()
        "capped": ((raw > cap) & seen).sum() / n,  # () share of tokens whose weight was cut
    }
    return weights, stats
