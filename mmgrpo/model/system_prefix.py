"""The opening every prompt of a batch shares (the system prompt, a tools block) encoded once per batch.

Prompts of one batch usually begin alike: on the tools recipe 8 prompts of 243 tokens share their first
200 (the system message with the tools' JSON schemas), on the counting demo 36 of 68. ``encode_prompts``
runs that common prefix once (one row), takes its cache by index for every prompt (differentiable: in a
training pass the gradient of all prompts flows into the one encoding), and runs each prompt's remainder
as one left-padded block on it with explicit positions. The cache then holds the prefix, a hole of
padding (mask 0) and the remainder; the layout mask it returns says so, and every later forward uses that
mask. Same numbers as encoding each prompt whole (tested in every family that continues a cache).

The prefix never reaches into an image: it stops before the first placeholder id (image tokens' features
and, for Qwen-VL, their 3-D positions belong to the block, laid out by ``adapter.block_positions``).

Prompts that open in more than one way (the zoom demo's bare questions beside its full prompts, for its
first ``grpo.bare_steps``) share no opening as a whole batch; ``encode_parts`` splits them by how they
open, encodes each part on its own opening and lays the parts' caches side by side.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from mmgrpo.model.adapters import CausalLMAdapter
from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.prefix import plain_again, rows_of_cache, selects_rows, take_rows

MIN_SHARED = 16
"""Fewer common tokens than this are not worth a second forward: the prompts are encoded whole."""

SPLIT_OPENINGS = True
"""False: prompts that open in several ways are encoded whole (the tests compare both)."""


def common_prefix(ids: Tensor, mask: Tensor, stop: set[int]) -> int:
    """How many leading real tokens all rows of left-padded ids (B, L) share, stopping before any id in
    ``stop`` (image placeholders) and leaving each row at least one token of its own."""
    rows = [r[m.bool()] for r, m in zip(ids, mask, strict=True)]
    n = min(len(r) for r in rows) - 1
    if n <= 0 or len(rows) < 2:
        return 0
    head = torch.stack([r[:n] for r in rows])  # (B, n)
    same = (head == head[:1]).all(dim=0)  # (n,)
    if stop:
        same &= ~torch.isin(head[0], torch.as_tensor(sorted(stop), dtype=head.dtype))
    return n if bool(same.all()) else int((~same).nonzero()[0])


def rows_by_opening(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """The rows of left-padded ids (B, L) grouped by their first ``MIN_SHARED`` real tokens, in order of
    first appearance: the ways a batch's prompts open."""
    keys: dict[tuple[int, ...], list[int]] = {}
    for r, (row, m) in enumerate(zip(ids, mask, strict=True)):
        keys.setdefault(tuple(row[m.bool()][:MIN_SHARED].tolist()), []).append(r)
    return list(keys.values())


def opening_stops(adapter: CausalLMAdapter) -> set[int]:
    """The ids an opening stops before: the placeholders the policy never samples and the image and
    video tokens (their features and positions belong to the block after the opening)."""
    media = (adapter.image_token_id, adapter.video_token_id)
    return set(adapter.suppress_ids) | {i for i in media if i is not None}


_OPENINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per frozen model (the KL reference copy), the last opening it encoded: (key, cache). Its opening is the
same at every step (same weights, same system prompt), so the reference pass encodes it once per run."""


def _frozen_key(model, head: Tensor, device) -> tuple | None:
    """What an opening's encoding depends on when ``model`` cannot change it: the ids, the device, the
    autocast dtype and the weights' in-place version counters (a copy into them, such as loading other
    weights, moves the sum). None when the model trains (a parameter requires grad) or a graph is kept."""
    if torch.is_grad_enabled() or any(p.requires_grad for p in model.parameters()):
        return None  # (stops at the first trainable parameter: a training model is not walked through)
    params = list(model.parameters())
    kind = torch.device(device).type
    cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return (tuple(head[0].tolist()), str(device), cast, sum(p._version for p in params), len(params))


def encode_prompts(
    model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, device, forward
) -> tuple[Tensor, object, Tensor, Tensor] | None:
    """Encode B left-padded prompts with their common opening run once. Returns the logits of each
    prompt's next token (B, V), the cache (B rows), the position each prompt's next token takes (B,), and
    the cache's mask (B, C + W) (prefix, padding, remainder); None when they share fewer than
    ``MIN_SHARED`` tokens, the family cannot continue a cache, or the remainder holds images the family
    cannot take on a cache (the caller then encodes them whole). ``forward`` runs the model: (ids, mask,
    vision, positions, cache) -> output with ``logits`` and the cache."""
    if not adapter.continues_cache or (not vision.empty and not adapter.images_on_cache):
        return None
    C = common_prefix(ids, mask, opening_stops(adapter))
    if C < MIN_SHARED:
        return None
    B = ids.shape[0]
    first_real = int(mask[0].nonzero()[0])
    head = ids[:1, first_real : first_real + C]  # (1, C)
    key = _frozen_key(model, head, device)
    kept = _OPENINGS.get(model)
    if key is not None and kept is not None and kept[0] == key:
        cache = kept[1]  # a frozen model's opening, encoded at an earlier step
    else:
        ones = torch.ones_like(head)
        pos = torch.arange(C)[None]  # (1, C)
        pos = pos.unsqueeze(0).expand(3, -1, -1) if adapter.uses_mrope(model) else pos
        out = forward(head, ones, VisionInputs.none(1), pos, None)
        cache = out["cache"] if "cache" in out else out.past_key_values
        if not selects_rows(cache):
            return None
        if key is not None:
            _OPENINGS[model] = (key, cache)
    cache = rows_of_cache(cache, torch.zeros(B, dtype=torch.long, device=device))  # (B, ...) by index
    rest = [r[m.bool()][C:] for r, m in zip(ids, mask, strict=True)]
    W = max(len(r) for r in rest)
    block = torch.full((B, W), int(ids[0, 0]), dtype=ids.dtype)  # (B, W) left-padded (pad value unused)
    bmask = torch.zeros((B, W), dtype=mask.dtype)
    for b, r in enumerate(rest):
        block[b, W - len(r) :], bmask[b, W - len(r) :] = r, 1
    layout = torch.cat([torch.ones((B, C), dtype=mask.dtype), bmask], dim=1)  # (B, C + W)
    positions, after = adapter.block_positions(model, block, bmask, vision, torch.full((B,), C))
    out = forward(block, layout, vision, positions, cache)
    return out.logits[:, -1, :], cache, after.to(device), layout.to(device)


def encode_whole(
    model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, device, forward
) -> tuple[Tensor, object, Tensor, Tensor]:
    """Encode B left-padded prompts whole, as one block from nothing (``forward`` as in ``encode_prompts``;
    the positions are the adapter's layout of the block, which for a whole prompt is the model's own):
    for prompts that share too little to open alike (the zoom demo mixes bare questions with full prompts)
    where the lean encoder takes them. Returns what ``encode_prompts`` returns, the layout being ``mask``."""
    start = torch.zeros(ids.shape[0], dtype=torch.long)
    positions, after = adapter.block_positions(model, ids, mask, vision, start)  # (B, L) / (3, B, L)
    out = forward(ids, mask, vision, positions, None)
    cache = out["cache"] if "cache" in out else out.past_key_values
    return out.logits[:, -1, :], cache, after.to(device), mask.to(device)


def encode_opened(
    model, adapter: CausalLMAdapter, ids, mask, vision: VisionInputs, device, forward, lean_encoder, whole
) -> tuple[Tensor, object, Tensor, Tensor] | None:
    """B prompts encoded on their openings: the common one once (``encode_prompts``); where there is none,
    each way the prompts open once (``encode_parts``), the parts that share nothing by ``encode_whole``
    where ``lean_encoder`` (mmgrpo.model.lean_prompt, or None) takes the images, else by ``whole`` (the
    caller's prefill: (ids, mask, vision) -> the tuple; the model's forward, as in a DDP training pass).
    Returns what ``encode_prompts`` returns, or None: the caller's ``whole`` for all of them then."""
    shared = encode_prompts(model, adapter, ids, mask, vision, device, forward)
    if shared is not None or not SPLIT_OPENINGS:
        return shared
    if lean_encoder is not None and lean_encoder.takes(v := lean_encoder.encoded(vision)):

        def lean_whole(i: Tensor, m: Tensor, part: VisionInputs):
            return encode_whole(model, adapter, i, m, part, device, forward)

        parts = encode_parts(model, adapter, ids, mask, v, device, forward, lean_whole)
        return parts if parts is not None else lean_whole(ids, mask, v)
    return encode_parts(model, adapter, ids, mask, vision, device, forward, whole)


def encode_parts(
    model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, device, forward, whole
) -> tuple[Tensor, object, Tensor, Tensor] | None:
    """Prompts split by their first ``MIN_SHARED`` real tokens, each part encoded on its own: its common
    opening once (``encode_prompts``), or by ``whole`` ((ids, mask, vision) -> the same tuple, or None)
    where it shares too little; the parts' caches then laid side by side (``side_by_side``). Returns what
    ``encode_prompts`` returns, rows in the order of ``ids``; None when the prompts open in one way only,
    no two open alike, or a part cannot be encoded."""
    parts = rows_by_opening(ids, mask)
    if len(parts) < 2 or all(len(rows) < 2 for rows in parts):
        return None
    encoded, order = [], []
    for rows in parts:
        idx = torch.as_tensor(rows, dtype=torch.long)
        width = int(mask[idx].sum(dim=1).max())  # left padding: the part keeps its own widest prompt
        part_ids, part_mask, part_vision = ids[idx, -width:], mask[idx, -width:], vision.select(rows)
        done = encode_prompts(model, adapter, part_ids, part_mask, part_vision, device, forward)
        done = done if done is not None else whole(part_ids, part_mask, part_vision)
        if done is None or not _lays_flat(done[1], done[3].shape[1]):
            return None
        encoded.append(done)
        order += rows
    return side_by_side(encoded, torch.as_tensor(order, dtype=torch.long))


def _lays_flat(cache, width: int) -> bool:
    """Whether every layer of ``cache`` holds keys and values for each of the ``width`` columns of its mask
    (not a custom cache, nor a sliding window that dropped columns), so that padding them lines up."""
    return selects_rows(cache) and all(layer.keys.shape[-2] == width for layer in cache.layers)


def side_by_side(parts: list[tuple], order: Tensor) -> tuple[Tensor, object, Tensor, Tensor]:
    """Encoded parts (logits (b, V), cache of b rows, next positions, cache mask (b, P_k)) as one: each
    part's cache and mask left-padded with mask-0 columns to the widest P, the rows stacked and put back
    in prompt order (``order`` (B,): the prompt of each stacked row). Keys already carry their rotary
    positions and the mask hides the padding, so every row attends to what it did in its part
    (differentiable: the gradient flows back into each part's encoding)."""
    width = max(p[3].shape[1] for p in parts)
    back = torch.argsort(order)  # (B,) the stacked row of each prompt

    def stack(tensors: list[Tensor], dim: int) -> Tensor:  # left-pad dimension ``dim`` to width, stack rows
        padded = []
        for t in tensors:
            pad = [0, 0] * (t.dim() - 1 - dim) + [width - t.shape[dim], 0]
            padded.append(F.pad(t, pad))
        return torch.cat(padded)

    first = torch.cat([p[0] for p in parts])[back.to(parts[0][0].device)]  # (B, V)
    after = torch.cat([p[2] for p in parts])[back.to(parts[0][2].device)]  # (B,)
    layout = stack([p[3] for p in parts], 1)[back.to(parts[0][3].device)]  # (B, P)
    caches = [p[1] for p in parts]
    cache = copy.copy(caches[0])
    cache.layers = []
    for i, layer in enumerate(caches[0].layers):
        new = plain_again(copy.copy(layer))
        for name in ("keys", "values"):  # (b, Hk, P_k, D) each -> (B, Hk, P, D)
            stacked = stack([getattr(c.layers[i], name) for c in caches], 2)
            setattr(new, name, take_rows(stacked, back.to(stacked.device)))
        cache.layers.append(new)
    return first, cache, after, layout
