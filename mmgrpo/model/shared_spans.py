"""A training pass that runs the opening a group's responses share once, not once per row.

Once a policy settles on how it starts a task, the G rows of a group begin alike: the zoom agent's final
model makes the same call in every row of most groups, and a row's first ~52 of 55 response tokens are the
call, the tool's message and the zoomed view, equal across the group (70% of its response tokens). Early
on, rows split (some zoom, some answer at once; zooms on different cells), yet the rows that zoom on the
same cell still agree up to the count.

Here each group's rows are sorted by their response and cut into spans (``plan``): rows that share at
least ``MIN_SPAN`` leading response tokens take one span, the rest stand alone. A span's shared tokens run
once, on its group's prompt cache, as one row (``response_blocks``); each member row then runs only its own
tail on the prompt + span cache (by index: the gradient of every member flows back into the one span, as
it already does into the one prompt). The span's log-probs (and entropies) are reduced once and given to
every member (``head.SpanBlock``). A span holds images only when its members' images are the same and lie
wholly inside it; otherwise it ends before the first image token. Same log-probs and gradients as the
model's forward over each whole row (tests/test_shared_spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmgrpo.model import engine
from mmgrpo.model import lean_pass as lean_pass_mod
from mmgrpo.model.adapters import CausalLMAdapter
from mmgrpo.model.batch import TokenBatch, VisionInputs
from mmgrpo.model.head import SpanBlock, final_hidden, plain_head
from mmgrpo.model.prefix import rows_of_cache, selects_rows
from mmgrpo.model.system_prefix import opening_stops

MIN_SPAN = 8
"""Rows take a shared span only when they share at least this many leading response tokens."""

MIN_SAVED = 0.15
"""The pass takes spans only when they save at least this share of the batch's response tokens; below,
the extra forward costs about what it saves (the plain shared-prompt pass runs instead)."""

SHARE_SPANS = True
"""False: every row runs its whole response (the tests compare both)."""


@dataclass
class Plan:
    """Spans of a batch, the shared ones first: ``owner`` (N,) each row's span, ``group`` (S,) each span's
    prompt (head index), ``length`` (S,) each span's shared input tokens (0: a row alone, after all the
    shared spans), ``rep`` (S,) a row of each span."""

    owner: Tensor
    group: Tensor
    length: Tensor
    rep: Tensor

    @property
    def saved(self) -> int:
        """Response tokens the spans run once instead of once per member."""
        members = torch.bincount(self.owner, minlength=len(self.length))  # (S,)
        return int(((members - 1) * self.length).sum())


def plan(batch: TokenBatch, G: int, adapter: CausalLMAdapter) -> Plan | None:
    """Each group's rows cut into spans of rows sharing a response opening (runs of rows in sorted order,
    chosen for the most tokens saved, ``_cut``); None when spans would save too little."""
    if not SHARE_SPANS or not adapter.continues_cache:
        return None
    lengths = batch.response_mask.sum(dim=1).tolist()  # (N,)
    vision_ids = opening_stops(adapter)
    rv = batch.response_vision if batch.has_response_images else None
    spans: list[tuple[int, int, list[int]]] = []  # (group, shared tokens, rows)
    for h in range(0, len(batch), G):
        rows = list(range(h, h + G))
        toks = {r: batch.response_ids[r, : lengths[r]].tolist() for r in rows}
        rows.sort(key=lambda r: toks[r])
        for run in _cut(rows, toks):
            k = _usable(run, toks, vision_ids, rv) if len(run) > 1 else 0
            if k >= MIN_SPAN:
                spans.append((h // G, k, run))
            else:  # too short to share: each row alone
                spans.extend((h // G, 0, [r]) for r in run)
    spans.sort(key=lambda sp: sp[1] == 0)  # the shared spans first (stable)
    owner = [0] * len(batch)
    for i, (_, _, rows) in enumerate(spans):
        for r in rows:
            owner[r] = i
    group, length, rep = ([sp[0] for sp in spans], [sp[1] for sp in spans], [sp[2][0] for sp in spans])
    p = Plan(*(torch.as_tensor(x, dtype=torch.long) for x in (owner, group, length, rep)))
    total = max(int(batch.response_mask.sum()), 1)
    return p if p.saved >= MIN_SAVED * total else None


def _only(v: VisionInputs, keep: list[bool]) -> VisionInputs:
    """``v`` with the images of the sequences not kept left out."""
    return VisionInputs(
        [s if k else {} for s, k in zip(v.seqs, keep, strict=True)],
        [c if k else 0 for c, k in zip(v.images_per_seq, keep, strict=True)],
        None if v.encoded is None else [e if k else None for e, k in zip(v.encoded, keep, strict=True)],
    )


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cut(rows: list[int], toks: dict[int, list[int]]) -> list[list[int]]:
    """Rows sorted by response, cut into runs that maximise the tokens saved, sum of (size - 1) x (the
    run's common prefix - 1), counting runs below ``MIN_SPAN`` as saving nothing (a small exact search)."""
    n = len(rows)
    best = [0] * (n + 1)  # best[b]: most saved over the first b rows
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        best[b], cut[b] = best[b - 1], b - 1
        common = None
        for a in range(b - 2, -1, -1):  # run rows[a:b]
            lcp = _lcp(toks[rows[a]], toks[rows[a + 1]])
            common = lcp if common is None else min(common, lcp)
            saved = (b - a - 1) * (common - 1) if common - 1 >= MIN_SPAN else 0
            if best[a] + saved > best[b]:
                best[b], cut[b] = best[a] + saved, a
    runs, b = [], n
    while b > 0:
        runs.append(rows[cut[b] : b])
        b = cut[b]
    return runs[::-1]


def _usable(run: list[int], toks: dict[int, list[int]], vision_ids: set[int], rv: VisionInputs | None) -> int:
    """How many leading response tokens the rows of ``run`` can run once: one less than their common
    prefix (the last shared token is each row's first input, so that its prediction of the next token,
    which differs, comes from the row's own pass), and before the first image token unless every row's
    images are the same and lie inside the span."""
    common = min(_lcp(toks[run[0]], toks[r]) for r in run[1:])
    k = common - 1
    first_vision = next((i for i, t in enumerate(toks[run[0]][:k]) if t in vision_ids), None)
    if first_vision is None:
        return k
    inside = all(not any(t in vision_ids for t in toks[r][k:]) for r in run)
    if inside and rv is not None and all(_same_images(rv, run[0], r) for r in run[1:]):
        return k
    return first_vision


def _same_images(rv: VisionInputs, a: int, b: int) -> bool:
    sa, sb = rv.seqs[a], rv.seqs[b]
    if sa.keys() != sb.keys() or rv.images_per_seq[a] != rv.images_per_seq[b]:
        return False
    return all(sa[k] is sb[k] or (sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k])) for k in sa)


def response_blocks(
    model, adapter: CausalLMAdapter, batch: TokenBatch, G: int, device, scored: bool = False
) -> list:
    """``engine.response_blocks_shared``'s blocks, with each span of shared response tokens run once
    (``plan``); the engine's own pass where no span is worth it."""
    p = plan(batch, G, adapter)
    if p is None:
        return engine.response_blocks_shared(model, adapter, batch, G, device, scored)
    N = len(batch)
    heads = list(range(0, N, G))
    owners = batch.row_prompts()
    pv = batch.vision.select([owners[h] for h in heads])
    first, cache, start, layout = engine.encode_heads(
        model, adapter, batch.prompt_ids[heads], batch.prompt_mask[heads], pv, device
    )  # (B, V), B rows, (B,), (B, P')
    if not selects_rows(cache):
        return engine.response_blocks_shared(model, adapter, batch, G, device, scored)
    plain = plain_head(model)
    head = plain if scored else None
    dtype = engine.model_dtype(model)
    rv_all = batch.response_vision if batch.has_response_images else None
    blocks: list = [engine.LogitBlock(torch.arange(N), first[torch.arange(N) // G].unsqueeze(1), 0, 1)]

    # the shared spans, one row each on its group's prompt cache; then the rows alone, whose cache rows
    # are their prompt's and padding
    L, s_max = int((p.length > 0).sum()), max(int(p.length.max()), 1)
    span_mask = (torch.arange(s_max)[None, :] < p.length[:, None]).long()  # (S, s_max)
    span_ids = torch.where(span_mask.bool(), batch.response_ids[p.rep, :s_max], 0)  # (S, s_max)
    vision_ids = torch.as_tensor(sorted(opening_stops(adapter)), dtype=torch.long)
    with_images = torch.isin(span_ids, vision_ids).any(dim=1)  # (S,)
    sv = (
        VisionInputs.none(L)
        if rv_all is None
        else _only(rv_all.select(p.rep[:L].tolist()), with_images[:L].tolist())
    )
    sv = adapter.encode_repeats(model, sv, device, dtype)
    g = p.group.to(device)  # (S,)
    span_layout = torch.cat([layout[g], span_mask.to(device, layout.dtype)], dim=1)  # (S, P' + s_max)
    live = rows_of_cache(cache, g[:L])  # the forward below appends the spans to it
    kw = adapter.forward_kwargs(span_ids[:L], span_layout[:L], sv, device, dtype)
    pos, after = adapter.block_positions(model, span_ids[:L], span_mask[:L], sv, start[g[:L]])
    after = torch.cat([after.cpu(), start[g[L:]].cpu()])  # (S,) where each span's rows go on
    kw.update(position_ids=pos.to(device), use_cache=True, **{engine.cache_kwarg(model): live})
    values = final_hidden(model, head, **kw) if head is not None else model(**kw).logits  # (L, s_max, H|V)
    span_cache = _with_rows_alone(live, cache, g[L:], s_max)  # (S rows)
    on_span = p.owner < L  # (N,) rows that take a shared span
    blocks.append(
        SpanBlock(
            p.rep[:L],
            values,
            torch.ones(L, dtype=torch.long),
            p.length[:L],
            torch.arange(N)[on_span],
            p.owner[on_span],
            head,
        )  # column j predicts response token j + 1 of every member, j < the span's length
    )

    # each row's own tail, from its span's last shared token, on the prompt + span cache
    lengths = batch.response_mask.sum(dim=1)  # (N,)
    begin = p.length[p.owner]  # (N,) the first response token a row runs itself
    tails = (lengths - begin).clamp(min=1)  # (N,)
    T = batch.response_ids.shape[1]
    lean_pass = lean_pass_mod.for_model(model, adapter) if plain is not None else None
    for rows in engine.length_chunks(tails.tolist()):
        idx = torch.as_tensor(rows, dtype=torch.long)
        n, t = len(rows), int(tails[idx].max())
        at = (begin[idx][:, None] + torch.arange(t)[None, :]).clamp(max=T - 1)  # (n, t)
        rmask = (torch.arange(t)[None, :] < (lengths[idx] - begin[idx])[:, None]).long()  # (n, t)
        ids = torch.where(rmask.bool(), batch.response_ids[idx[:, None], at], 0)  # (n, t)
        o = p.owner[idx]  # (n,) each row's span: its cache row
        rv = (
            VisionInputs.none(n) if rv_all is None else _only(rv_all.select(rows), (~with_images[o]).tolist())
        )
        rv = adapter.encode_repeats(model, rv, device, dtype)
        pos, _ = adapter.block_positions(model, ids, rmask, rv, after[o])
        o = o.to(device)
        if lean_pass is not None and rv.empty:  # text only: the decoder layers called directly
            hidden = lean_pass.hidden(
                ids.to(device), rmask.to(device), pos.to(device), span_layout[o], span_cache, o
            )
            out = hidden if head is not None else plain(hidden)  # (n, t, H|V)
        else:
            mask = torch.cat(
                [span_layout[o], rmask.to(device, span_layout.dtype)], dim=1
            )  # (n, P' + s_max + t)
            kw = adapter.forward_kwargs(ids, mask, rv, device, dtype)
            cache_kw = {engine.cache_kwarg(model): rows_of_cache(span_cache, o)}
            kw.update(position_ids=pos.to(device), use_cache=True, **cache_kw)
            out = final_hidden(model, head, **kw) if head is not None else model(**kw).logits  # (n, t, H|V)
        widths = lengths[idx] - begin[idx] - 1  # (n,) column j predicts response token begin + 1 + j
        blocks.append(SpanBlock(idx, out, begin[idx] + 1, widths, idx, torch.arange(n), head))
    return blocks


def _with_rows_alone(live, cache, groups: Tensor, width: int):
    """``live`` (a cache of the shared spans: prompt + span, (L, Hk, P' + width, D) per layer) with a row
    per row alone after them: its group's prompt from ``cache`` and ``width`` columns of zeros (masked)."""
    if len(groups) == 0:
        return live
    alone = rows_of_cache(cache, groups)
    for out, extra in zip(live.layers, alone.layers, strict=True):
        pad = extra.keys.new_zeros(*extra.keys.shape[:2], width, extra.keys.shape[3])  # (A, Hk, width, D)
        out.keys = torch.cat([out.keys, torch.cat([extra.keys, pad], dim=2)])  # (S, Hk, P' + width, D)
        pad = extra.values.new_zeros(*extra.values.shape[:2], width, extra.values.shape[3])
        out.values = torch.cat([out.values, torch.cat([extra.values, pad], dim=2)])
    return live
