"""Per-token log-probs (and entropies) of a batch's responses from the engine's logit blocks.

The engine returns the logits of a training or reference pass as blocks (``engine.LogitBlock``): some rows
over a run of response columns, as the model produced them. Each block is reduced here to (n, width)
numbers first, and only those small tensors are placed into the batch's (N, T) grid: the (N, T, V) logits
are never padded, concatenated or gathered into row order (nor are those copies differentiated through),
and the positions past a pass's longest response are never scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mmgrpo.grpo.losses import token_entropy, token_logprobs, token_logprobs_entropy
from mmgrpo.model.engine import LogitBlock


def block_stats(
    blocks: Sequence[LogitBlock],
    targets: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token, (N, T), and with ``with_entropy`` each position's entropy of
    softmax(logits / temperature), (N, T) (differentiable with ``entropy_grad``, else a metric without a
    graph), from blocks covering the response columns; positions no block covers hold 0.

    targets: (N, T) response ids, on the logits' device.
    """
    N, T = targets.shape
    rows, cols, logps, ents = [], [], [], []
    for b in blocks:
        n, c, _ = b.logits.shape
        w = max(min(b.width, T - b.start), 0)  # the columns that predict a response token
        at = torch.arange(b.start, b.start + c, device=targets.device).clamp(max=max(T - 1, 0))  # (c,)
        r = b.rows.to(targets.device)  # (n,)
        tgt = targets[r[:, None], at[None, :]] if T > 0 else targets.new_zeros(n, c)  # (n, c)
        if with_entropy and not entropy_grad:  # a metric: read off the log-probs' own pass
            lp, h = token_logprobs_entropy(b.logits, tgt, temperature)  # (n, c), (n, c)
            ents.append(h[:, :w].reshape(-1))  # (n * w,)
        else:
            lp = token_logprobs(b.logits, tgt, temperature)  # (n, c)
            if with_entropy:
                ents.append(token_entropy(b.logits, temperature)[:, :w].reshape(-1))  # (n * w,) the bonus's
        logps.append(lp[:, :w].reshape(-1))  # (n * w,)
        rows.append(r[:, None].expand(n, w).reshape(-1))  # (n * w,)
        cols.append(at[None, :w].expand(n, w).reshape(-1))  # (n * w,)
    where = (torch.cat(rows), torch.cat(cols))
    lp = torch.cat(logps)  # (M,)
    logp = lp.new_zeros(N, T).index_put(where, lp)  # (N, T)
    if not with_entropy:
        return logp, None
    ent = torch.cat(ents)  # (M,)
    return logp, ent.new_zeros(N, T).index_put(where, ent)  # (N, T), (N, T)
