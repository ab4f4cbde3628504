"""A group's prompt held once in the decode cache, and attention that reads it once per group.

Sampling G episodes per prompt used to repeat each prompt's keys and values G times, and every decode
step then read the prompt G times per layer: on the tools recipe (a 243-token prompt, responses of about
50) four fifths of the cache are prompt copies. Here the prompt cache stays as the prefill left it, one
row per group (``SharedPrefix``), and each episode's cache row holds only its own tokens. A decode step's
attention (``grouped_attention``) scores the queries of all rows of a group against their prompt in one
product, scores each row against its own tokens, and takes one softmax over both parts: the numbers of
attention over the concatenated row (to float rounding; tested against the model's forward).

Rows are laid out in a grid of groups x slots (``GroupGrid``): after episodes end, a group keeps fewer
live rows, and the grid pads it; a decode step moves queries and probabilities in and out of the grid by
index, never the keys. The model's own forward (a turn's new block, images included) runs on the
concatenated cache (``materialize``), once per turn.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import cache_utils


class GroupGrid:
    """Rows (n,) laid out as groups x slots: ``slot`` (n,) a row's cell, ``groups`` the distinct groups in
    grid order, ``S`` the slots per group. A full batch of B groups x G rows in order is the identity."""

    def __init__(self, group: Tensor) -> None:
        group = group.cpu()
        self.groups = torch.unique(group)  # (B',) sorted
        rank = torch.searchsorted(self.groups, group)  # (n,) each row's group in grid order
        counts = torch.bincount(rank, minlength=len(self.groups))  # (B',)
        self.S = int(counts.max())
        within = torch.zeros_like(rank)
        seen: dict[int, int] = {}
        for i, r in enumerate(rank.tolist()):  # a row's place among its group's rows
            within[i] = seen.get(r, 0)
            seen[r] = within[i].item() + 1
        self.slot = rank * self.S + within  # (n,)
        self.n, self.B = len(group), len(self.groups)
        self.identity = bool((self.slot == torch.arange(self.n)).all()) and self.n == self.B * self.S

    def to_grid(self, x: Tensor) -> Tensor:
        """Per-row x (n, H, g, K) -> per-group (B', H, S * g, K), empty cells zero."""
        n, H, g, K = x.shape
        if not self.identity:
            grid = x.new_zeros((self.B * self.S, H, g, K))
            grid[self.slot.to(x.device)] = x
            x = grid
        return x.view(self.B, self.S, H, g, K).transpose(1, 2).reshape(self.B, H, self.S * g, K)

    def from_grid(self, y: Tensor, g: int) -> Tensor:
        """The inverse of ``to_grid`` for y (B', H, S * g, K): per-row (n, H, g, K)."""
        B, H, _, K = y.shape
        y = y.view(B, H, self.S, g, K).transpose(1, 2).reshape(B * self.S, H, g, K)
        return y if self.identity else y[self.slot.to(y.device)]


class SharedPrefix:
    """Per layer the prompt keys / values of all B groups, (B, Hk, P, D), their mask (B, P), and each
    row's group (n,); for attention, the same of the groups that have rows (B', ...), the mask as an
    additive bias per row, and the row grid."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], mask: Tensor, group: Tensor) -> None:
        self.all_keys, self.all_values = keys, values
        self.all_mask = mask  # (B, P) 1 = a real prompt token
        self.group = group.cpu()  # (n,) index into the B groups
        self._layout()

    @classmethod
    def split(cls, cache, mask: Tensor, G: int) -> tuple[SharedPrefix, object]:
        """A prefill cache of B prompts (one row each) as their prefix, shared by G rows per prompt, and
        an empty cache of the same class for the B * G rows' own tokens."""
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        group = torch.arange(mask.shape[0]).repeat_interleave(G)  # (B * G,)
        rest = copy.copy(cache)
        rest.layers = []
        for layer in cache.layers:
            new = copy.copy(layer)
            B, H, _, D = layer.keys.shape
            new.keys = layer.keys.new_zeros((B * G, H, 0, D))  # (N, Hk, 0, D)
            new.values = layer.values.new_zeros((B * G, H, 0, layer.values.shape[-1]))
            rest.layers.append(new)
        return cls(keys, values, mask.to(keys[0].device), group), rest

    def _layout(self) -> None:
        live = torch.unique(self.group)  # (B',) the groups with rows, sorted
        B = self.all_keys[0].shape[0]
        if len(live) == B:
            self.keys, self.values, mask, local = self.all_keys, self.all_values, self.all_mask, self.group
        else:  # only the groups with rows take part in attention
            at = live.to(self.all_keys[0].device)
            self.keys = [k[at] for k in self.all_keys]
            self.values = [v[at] for v in self.all_values]
            mask, local = self.all_mask[at], torch.searchsorted(live, self.group)
        self.grid = GroupGrid(local)
        neg = torch.finfo(self.keys[0].dtype).min
        bias = torch.zeros(mask.shape, dtype=self.keys[0].dtype, device=self.keys[0].device)
        bias = bias.masked_fill(mask == 0, neg)[:, None, None, :]  # (B', 1, 1, P)
        self.group_bias = bias  # (B', 1, 1, P) in grid order
        self.row_bias = bias[local.to(bias.device)]  # (n, 1, 1, P)

    @property
    def length(self) -> int:
        return self.all_keys[0].shape[-2]

    def select(self, rows: Tensor) -> None:
        """Keep the rows ``rows`` (n,) (episodes that go on), in that order."""
        self.regroup(self.group[rows.cpu()])

    def regroup(self, group: Tensor) -> None:
        """The rows are now these, each of group ``group`` (n,)."""
        self.group = group.cpu()
        self._layout()

    def materialize(self, rest) -> object:
        """A cache of ``rest``'s class with each row's prompt in front of its own tokens (for a forward of
        the model's own); ``rest`` is left as it is."""
        full = copy.copy(rest)
        full.layers = []
        idx = self.group.to(self.all_keys[0].device)
        for i, layer in enumerate(rest.layers):
            new = plain_again(copy.copy(layer))
            new.keys = torch.cat([self.all_keys[i][idx], layer.keys], dim=-2)  # (n, Hk, P + R, D)
            new.values = torch.cat([self.all_values[i][idx], layer.values], dim=-2)
            full.layers.append(new)
        return full

    def strip(self, full, rest) -> None:
        """Back from ``materialize`` after a forward appended columns: ``rest`` takes each row's own part
        of ``full`` (everything after the prompt)."""
        P = self.length
        for layer, f in zip(rest.layers, full.layers, strict=True):
            plain_again(layer)
            layer.keys, layer.values = f.keys[:, :, P:], f.values[:, :, P:]


def plain_again(layer):
    """``layer`` as the plain growing layer it was before engine's ``reserve`` gave it room (a layer with
    ``_room`` in its dict): the room's buffers dropped, ``keys`` / ``values`` kept. Returns ``layer``."""
    if "_room" in layer.__dict__:
        layer.__class__ = layer.__class__.__mro__[1]
        for attr in ("_kbuf", "_vbuf", "_room"):
            layer.__dict__.pop(attr, None)
    return layer


def grouped_attention(
    q: Tensor, keys: Tensor, values: Tensor, rest_bias: Tensor, prefix: SharedPrefix, layer: int, scale: float
) -> Tensor:
    """Attention of one new token per row over its group's prompt and its own tokens.

    q (n, Hk, g, D): the g query heads of each key/value head; keys, values (n, Hk, R, D) the rows' own
    tokens; rest_bias (n, 1, 1, R) additive (0 or the dtype's min). Returns (n, Hk, g, D).
    """
    if (
        MERGED
        and prefix.length >= MERGED_MIN_PREFIX
        and _FLASH_CPU is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
    ):
        if q.dtype == keys.dtype == values.dtype == prefix.keys[layer].dtype == prefix.values[layer].dtype:
            return _merged_attention(q, keys, values, rest_bias, prefix, layer, scale)
    g = q.shape[2]
    grid = prefix.grid
    s_pre = torch.matmul(grid.to_grid(q), prefix.keys[layer].transpose(-1, -2))  # (B', Hk, S*g, P)
    s_pre = grid.from_grid(s_pre, g) * scale + prefix.row_bias  # (n, Hk, g, P)
    s_own = torch.matmul(q, keys.transpose(-1, -2)) * scale + rest_bias  # (n, Hk, g, R)
    p = torch.cat([s_pre, s_own], dim=-1).float().softmax(dim=-1).to(q.dtype)  # (n, Hk, g, P + R)
    P = s_pre.shape[-1]
    out = grid.from_grid(torch.matmul(grid.to_grid(p[..., :P]), prefix.values[layer]), g)  # (n, Hk, g, D)
    return out + torch.matmul(p[..., P:], values)


MERGED = True
"""On the CPU, take ``grouped_attention`` as two flash-attention calls merged (``_merged_attention``; a
64-row decode step 5.2 -> 4.8 ms); False: the products by hand everywhere (the tests compare both; the
rounding differs by about 1e-6, see ``mmgrpo.model.turns.LEAN_BLOCKS``)."""
MERGED_MIN_PREFIX = 128
"""The merged form only for prompts of at least this many positions: below, the two flash-attention calls
cost more than the products by hand. One layer's ``grouped_attention``, one thread, 4 or 8 prompts x G = 8
or 16, 8-30 own tokens: at P = 32-100 by hand took 86-253 us against merged 101-259 us (the counting step,
P = 68: 98 against 116 us at G = 8, 150 against 191 us at G = 16); from P = 243 on, merged 159-410 us
against 162-489 us."""
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""The CPU flash-attention kernel: it returns each query's log-sum-exp with its output, so that attention
over two key sets (a group's prompt, a row's own tokens) can be taken in two calls and merged exactly."""


def _merged_attention(
    q: Tensor, keys: Tensor, values: Tensor, rest_bias: Tensor, prefix: SharedPrefix, layer: int, scale: float
) -> Tensor:
    """``grouped_attention`` on the CPU in two flash-attention calls, one over each group's prompt (all its
    rows' queries at once) and one over each row's own tokens, merged by their log-sum-exps: softmax over
    the union = each part's softmax weighted by exp(lse_part - lse_union). Fewer operators per layer than
    scoring, concatenating and normalising by hand: a lean decode step of 64 rows on the tiny model (243-
    token prompts) went from 5.2 to 4.8 ms. Same shapes and numbers (to float rounding) as by hand."""
    g = q.shape[2]
    grid = prefix.grid
    pre_bias = prefix.group_bias.to(q.dtype)  # (B', 1, 1, P)
    out_pre, lse_pre = _FLASH_CPU(
        grid.to_grid(q), prefix.keys[layer], prefix.values[layer], attn_mask=pre_bias, scale=scale
    )[:2]
    out_pre = grid.from_grid(out_pre, g)  # (n, Hk, g, D)
    lse_pre = grid.from_grid(lse_pre[..., None], g).float()  # (n, Hk, g, 1)
    own_bias = rest_bias.to(q.dtype)  # (n, 1, 1, R)
    out_own, lse_own = _FLASH_CPU(q, keys, values, attn_mask=own_bias, scale=scale)[:2]  # (n, Hk, g, D)
    lse_own = lse_own[..., None].float()  # (n, Hk, g, 1)
    lse = torch.logaddexp(lse_pre, lse_own)  # (n, Hk, g, 1)
    return (out_pre * (lse_pre - lse).exp() + out_own * (lse_own - lse).exp()).to(q.dtype)


PLAIN_LAYERS = tuple(
    getattr(cache_utils, name)
    for name in ("DynamicLayer", "DynamicSlidingWindowLayer")
    if hasattr(cache_utils, name)
)
"""Cache layers that hold keys and values and nothing else: the kinds whose rows mmgrpo repeats and selects
(a state-space, linear-attention or compressed layer holds state that batch repetition may not cover)."""


def selects_rows(cache) -> bool:
    """Whether ``cache`` is made of layers with key / value tensors whose rows can be taken by index (the
    prompt held once per group, ``rows_of_cache``); custom caches without them are repeated instead."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(getattr(x, "keys", None), Tensor) for x in layers)


def rows_of_cache(cache, rows: Tensor):
    """A new cache of the same class holding batch rows ``rows`` (n,) of ``cache`` (by index, see
    ``take_rows``: the gradient flows back into ``cache``'s tensors); ``cache`` itself is left as it is."""
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = plain_again(copy.copy(layer))  # a reserved layer's room belongs to all rows
        if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None:
            new.keys, new.values = take_rows(layer.keys, rows), take_rows(layer.values, rows)
        out.layers.append(new)
    return out


def take_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x.index_select(0, rows)``: x (B, ...) -> (n, ...). When a gradient is needed, its backward sums
    the rows' gradients with ``index_add`` on a contiguous copy: the gradient arriving from attention is a
    strided view, on which the CPU's ``index_add`` falls back to an element-wise ``scatter_add`` (a
    (32, 2, 68, 32) -> 4 rows sum 289 us, against 43 us contiguous; 8 ms of a 170 ms counting step)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x.index_select(0, rows)
    return _TakeRows.apply(x, rows)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.rows_of = x.shape[0]
        return x.index_select(0, rows)  # (n, ...)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows_of, *grad.shape[1:]))  # (B, ...)
        return out.index_add_(0, rows, grad.contiguous()), None


def select_rows(cache, rows: Tensor) -> None:
    """Keep the batch rows ``rows`` (n,) of every layer of ``cache``, in that order (a copy; a reserved
    layer becomes a plain one, to be reserved again)."""
    for layer in cache.layers:
        keys, values = layer.keys[rows], layer.values[rows]  # (n, H, L, D)
        plain_again(layer)
        layer.keys, layer.values = keys, values
