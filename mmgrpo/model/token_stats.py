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
from mmgrpo.model.head import HiddenBlock, SpanBlock


def block_stats(
    blocks: Sequence[LogitBlock | HiddenBlock | SpanBlock],
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
        if isinstance(b, SpanBlock):
            r, at, lp, h = _span(b, targets, scored, temperature, with_entropy, entropy_grad)  # (E,) each
            rows.append(r)
            cols.append(at)
            logps.append(lp)
            if with_entropy:
                ents.append(h)
            continue
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


def _span(
    b: SpanBlock, targets: Tensor, scored: Tensor | None, temperature: float, with_entropy: bool, grad: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A span block's numbers for every member row: rows (E,), columns (E,), log-probs (E,) and entropies
    (E,) or None. Each source position is reduced once; its members take copies (so the gradient of a
    shared position is the sum of its members')."""
    n, c = b.values.shape[:2]
    T = targets.shape[1]
    dev = b.values.device
    j = torch.arange(c, device=dev)  # (c,)
    at = b.starts.to(dev)[:, None] + j  # (n, c) the response column each position predicts
    keep = (j[None, :] < b.widths.to(dev)[:, None]) & (at < T)  # (n, c)
    members, owner = b.members.to(dev), b.owner.to(dev)  # (m,), (m,)
    at_safe = at.clamp(max=max(T - 1, 0))  # (n, c)
    if b.head is not None:  # only what some member scores goes through the head
        if scored is None:
            raise ValueError("a span of hidden states needs the positions to score (block_stats' scored=)")
        wanted = scored.to(dev)[members[:, None], at_safe[owner]].int()  # (m, c)
        keep &= torch.zeros(n, c, dtype=torch.int32, device=dev).index_add_(0, owner, wanted) > 0
    i, jj = keep.nonzero(as_tuple=True)  # (K,), (K,)
    src = b.src_rows.to(dev)
    if b.head is not None:
        logits = b.head(b.values[i, jj])[:, None, :]  # (K, 1, V)
        tgt = targets[src[i], at[i, jj]][:, None]  # (K, 1)
        if with_entropy and not grad:
            lp, h = token_logprobs_entropy(logits, tgt, temperature)
        else:
            lp = token_logprobs(logits, tgt, temperature)
            h = token_entropy(logits, temperature) if with_entropy else None
        lp, h = lp[:, 0], (h[:, 0] if h is not None else None)  # (K,)
    else:  # the logits as the model gave them, reduced whole, then the kept positions read off
        tgt = targets[src[:, None], at_safe]  # (n, c)
        if with_entropy and not grad:
            lp, h = token_logprobs_entropy(b.values, tgt, temperature)  # (n, c) each
        else:
            lp = token_logprobs(b.values, tgt, temperature)
            h = token_entropy(b.values, temperature) if with_entropy else None
        lp, h = lp[i, jj], (h[i, jj] if h is not None else None)  # (K,)
    # every kept position of source i, once per member of i
    counts = torch.bincount(owner, minlength=n)  # (n,)
    by_source = members[torch.argsort(owner, stable=True)]  # (m,) members grouped by source
    first = torch.cumsum(counts, 0) - counts  # (n,) where each source's members begin
    reps = counts[i]  # (K,)
    e = torch.repeat_interleave(torch.arange(len(i), device=dev), reps)  # (E,) the entry each copy is of
    within = torch.arange(len(e), device=dev) - torch.repeat_interleave(torch.cumsum(reps, 0) - reps, reps)
    rows = by_source[first[i][e] + within]  # (E,)
    return rows, at[i, jj][e], lp[e], (h[e] if h is not None else None)
