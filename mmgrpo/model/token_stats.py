"""Per-token log-probs (and entropies) of a batch's responses from the engine's logit blocks.

The engine returns the logits of a training or reference pass as blocks (``engine.LogitBlock``): some rows
over a run of response columns, as the model produced them. Each block is reduced here to (n, width)
numbers first, and only those small tensors are placed into the batch's (N, T) grid: the (N, T, V) logits
are never padded, concatenated or gathered into row order (nor are those copies differentiated through),
and the positions past a pass's longest response are never scored. A block of final hidden states
(``mmgrpo.model.head.HiddenBlock``) goes through the head at the positions asked for only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mmgrpo.grpo.losses import token_entropy, token_logprobs, token_logprobs_entropy
from mmgrpo.model.engine import LogitBlock
from mmgrpo.model.head import HiddenBlock


def block_stats(
    blocks: Sequence[LogitBlock | HiddenBlock],
    targets: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    scored: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token, (N, T), and with ``with_entropy`` each position's entropy of
    softmax(logits / temperature), (N, T) (differentiable with ``entropy_grad``, else a metric without a
    graph), from blocks covering the response columns; positions no block covers hold 0, and so do the
    positions of a ``HiddenBlock`` outside ``scored``.

    targets: (N, T) response ids, on the logits' device; scored: (N, T) bool, needed by hidden blocks.
    """
    N, T = targets.shape
    rows, cols, logps, ents = [], [], [], []
    for b in blocks:
        r, at, logits, w = _scored(b, scored, T) if isinstance(b, HiddenBlock) else _columns(b, T)
        tgt = targets[r[:, None], at] if T > 0 else targets.new_zeros(at.shape)  # (n, c)
        if with_entropy and not entropy_grad:  # a metric: read off the log-probs' own pass
            lp, h = token_logprobs_entropy(logits, tgt, temperature)  # (n, c), (n, c)
            ents.append(h[:, :w].reshape(-1))  # (n * w,)
        else:
            lp = token_logprobs(logits, tgt, temperature)  # (n, c)
            if with_entropy:
                ents.append(token_entropy(logits, temperature)[:, :w].reshape(-1))  # (n * w,) the bonus's
        logps.append(lp[:, :w].reshape(-1))  # (n * w,)
        rows.append(r[:, None].expand(-1, w).reshape(-1))  # (n * w,)
        cols.append(at[:, :w].reshape(-1))  # (n * w,)
    where = (torch.cat(rows), torch.cat(cols))
    lp = torch.cat(logps)  # (M,)
    logp = lp.new_zeros(N, T).index_put(where, lp)  # (N, T)
    if not with_entropy:
        return logp, None
    ent = torch.cat(ents)  # (M,)
    return logp, ent.new_zeros(N, T).index_put(where, ent)  # (N, T), (N, T)


def _columns(b: LogitBlock, T: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """A logit block's rows (n,), the response column of each of its logits (n, c), the logits (n, c, V)
    and how many of the c columns predict a response token."""
    n, c, _ = b.logits.shape
    r = b.rows.to(b.logits.device)  # (n,)
    at = torch.arange(b.start, b.start + c, device=r.device).clamp(max=max(T - 1, 0))  # (c,)
    return r, at[None, :].expand(n, c), b.logits, max(min(b.width, T - b.start), 0)


def _scored(b: HiddenBlock, scored: Tensor | None, T: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """A hidden block's scored positions as a block of K rows of one column each: their rows (K,), columns
    (K, 1), logits (K, 1, V) from the head, width 1."""
    if scored is None:
        raise ValueError("a block of hidden states needs the positions to score (block_stats' scored=)")
    r = b.rows.to(b.hidden.device)  # (n,)
    w = max(min(b.width, T - b.start), 0)
    at = torch.arange(b.start, b.start + w, device=r.device)  # (w,)
    i, j = scored.to(r.device)[r[:, None], at[None, :]].nonzero(as_tuple=True)  # (K,), (K,)
    logits = b.head(b.hidden[i, j])  # (K, V)
    return r[i], at[j][:, None], logits[:, None, :], 1
