"""The forward/decode engine: shared prefill, the decode loop and per-token response logits.

Functions of (model, adapter, tensors); the family-specific parts (forward keywords, positions) come from
``mmgrpo.model.adapters``. Layout (see ``mmgrpo.model.batch``): prompt_ids (N, P) left-padded, response_ids (N, T)
right-padded, so the log-prob of response token t is read from the logits at column P + t - 1.

Two ways to get response logits, with the same numbers (tested), both as blocks (``LogitBlock``: some
rows over a run of response columns, the model's output uncopied) that ``mmgrpo.model.token_stats`` reduces
to per-token numbers:

- full: one forward over prompt + response for every row;
- shared: when rows come in runs of G sharing a prompt, encode each prompt (and its images) once, repeat
  its key/value cache G times and run the G responses on it in one batched pass (3.9x faster on the
  counting demo's batch), images inside the responses (a tool's crop or zoom) included, laid out by the
  adapter's ``block_positions``; families whose adapter says ``images_on_cache = False`` take the full
  path for such responses.

Generation uses the same prefill: B prompts encoded once, G samples decoded on the repeated cache.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from mmgrpo.model import lean, lean_prompt, system_prefix
from mmgrpo.model import lean_pass as lean_pass_mod
from mmgrpo.model import prefix as prefix_mod
from mmgrpo.model.adapters import CausalLMAdapter, unwrap
from mmgrpo.model.batch import TokenBatch, VisionInputs
from mmgrpo.model.head import HiddenBlock, final_hidden, plain_head
from mmgrpo.model.prefix import SharedPrefix, plain_again, rows_of_cache, select_rows, selects_rows  # noqa: F401 (engine API)

LEAN_DECODE = True
"""Decode steps through ``mmgrpo.model.lean`` where the model's layout allows (False: always the model's
own forward; the tests compare both)."""


def cache_kwarg(model) -> str:
    """The forward keyword that takes a KV cache: ``cache`` in recent transformers, else past_key_values."""
    m = unwrap(model)
    m = m.get_base_model() if hasattr(m, "get_base_model") else m  # a LoRA wrapper takes **kwargs
    return _cache_kwarg_of(type(m))


@functools.cache
def _cache_kwarg_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters  # once per class: a decode step asks every time
    return "cache" if "cache" in params else "past_key_values"


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def prefill(
    model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, G: int, device
) -> tuple[Tensor, object, Tensor | None]:
    """Encode B sequences once and repeat the result G times (row b -> rows bG .. bG+G-1).

    ids, mask (B, L) left-padded; ``vision`` their images. Returns the logits predicting the next token
    (B*G, V), the KV cache repeated to B*G rows, and the per-row offset that M-RoPE models add to text
    positions after images ((B*G, 1) or None).
    """
    kw = adapter.forward_kwargs(ids, mask, vision, device, model_dtype(model))
    pos = adapter.positions_given_to_prefill(mask, vision, model)
    if pos is not None:
        kw["position_ids"] = pos.to(device)
    out = model(**kw, logits_to_keep=1, use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.x
    if G > 1 and not repeat_cache(cache, G):
        # a cache without batch repetition (custom / remote-code caches): encode each prompt G times
        rows = [b for b in range(ids.shape[0]) for _ in range(G)]
        return prefill(model, adapter, ids[rows], mask[rows], vision.select(rows), 1, device)
    first = out.logits[:, -1, :].repeat_interleave(G, dim=0)  # (N, V)
    delta = adapter.prefill_delta(model, vision)
    if delta is not None:
        delta = delta.to(device).repeat_interleave(G, dim=0)  # (N, 1)
    return first, cache, delta


def repeat_cache(cache, G: int) -> bool:
    """Repeat every row of ``cache`` G times in place ((B, ...) -> (B*G, ...), differentiable); False when
    the cache class cannot."""
    repeat = getattr(cache, "batch_repeat_interleave", None)
    layers = getattr(cache, "layers", None)
    # only layers of keys and values: a state-space or compressed layer may hold state it does not repeat
    if repeat is None or not layers or any(type(x) not in (*prefix_mod.PLAIN_LAYERS, _ReservedLayer) for x in layers):
        return False
    repeat(G)
    return True


class _ReservedLayer(DynamicLayer):
    """A growing KV-cache layer written in place into buffers with room for the tokens still to come,
    instead of concatenating (copying the whole cache) at every decode step. ``keys`` / ``values`` are
    views of the filled part, so everything that reads them (lengths, masks) sees a plain layer."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if n + m > self._room:  # more than reserved: grow the plain way
            return super().update(key_states, value_states, *args, **kwargs)
        self._kbuf[:, :, n : n + m] = key_states
        self._vbuf[:, :, n : n + m] = value_states
        self.keys, self.values = self._kbuf[:, :, : n + m], self._vbuf[:, :, : n + m]
        return self.keys, self.values


def reserve(cache, extra: int) -> int:
    """Give every plain growing layer of ``cache`` room for ``extra`` more positions (see _ReservedLayer);
    other layer kinds (sliding windows, static caches) are left as they are. Returns how many changed."""
    changed = 0
    for layer in getattr(cache, "layers", []):
        if type(layer) is _ReservedLayer:
            if layer._room - layer.keys.shape[-2] >= extra:
                continue  # room enough already
            layer.__class__ = DynamicLayer  # reserve again, with the filled part copied over
        if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.dim() != 4:
            continue
        N, H, L, D = layer.keys.shape
        layer._kbuf = layer.keys.new_empty((N, H, L + extra, D))  # (N, H, L + extra, D)
        layer._vbuf = layer.values.new_empty((N, H, L + extra, layer.values.shape[-1]))
        layer._kbuf[:, :, :L], layer._vbuf[:, :, :L] = layer.keys, layer.values
        layer._room = L + extra
        layer.keys, layer.values = layer._kbuf[:, :, :L], layer._vbuf[:, :, :L]
        layer.__class__ = _ReservedLayer
        changed += 1
    return changed


def sample_tokens(
    logits: Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    suppress: list[int] | None = None,
    u: Tensor | None = None,
) -> Tensor:
    """One token per row from logits (N, V): greedy when temperature <= 0, else softmax(logits / T)
    restricted to the top_k tokens and to the smallest set whose probability reaches top_p. Returns (N,)."""
    logits = logits.float().clone()  # (N, V) never edit the caller's logits
    if suppress:
        logits[:, suppress] = float("-inf")
    if temperature <= 0:
        return logits.argmax(dim=-1)  # (N,)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(dim=-1)  # (N, V)
        drop = probs.cumsum(dim=-1) - probs > top_p  # (N, V) mass before this token already exceeds top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return sample_from(logits.softmax(dim=-1), u)  # (N,)


def sample_from(probs: Tensor, u: Tensor | None = None) -> Tensor:
    """One index per row of probs (N, V) (rows sum to 1), by inverse CDF: one uniform number per row and a
    binary search in the row's cumulative sums. The same distribution as ``torch.multinomial``, which on CPU
    draws an exponential variate for every vocabulary entry (20x slower at V = 830). Returns (N,)."""
    cdf = probs.cumsum(dim=-1)  # (N, V)
    if u is None:  # one uniform number per row (given: drawn by the caller, e.g. for rows set aside)
        u = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype)
    u = u.to(cdf.dtype) * cdf[:, -1:]  # (N, 1)
    # right=True: the first entry whose cumulative sum exceeds u, so a zero-probability entry (equal
    # cumulative sum to its left neighbour) is never picked
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # (N,)
    # rounding can put u at the very top of the cdf: take the last entry with probability > 0 then
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # (N,)
    return torch.minimum(idx, last)


@torch.no_grad()
def generate(
    model,
    adapter: CausalLMAdapter,
    ids: Tensor,
    mask: Tensor,
    vision: VisionInputs,
    *,
    G: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_ids: list[int],
    pad_token_id: int,
    device,
    return_logprobs: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Sample G continuations of each of B left-padded sequences with one encoding each: the decode loop
    of HF generate, minus the G-fold prefill. A row stops at the first of ``stop_ids``.

    Returns the new ids (B*G, t <= max_new_tokens), pad after the stop token, and the log-probability of
    each sampled token under the distribution the loss reads (softmax of logits / temperature, before
    top-p / top-k; temperature 1 when greedy), (B*G, t) -- what training recomputes for its ratio (None
    without ``return_logprobs``).
    """
    logits, state = start(model, adapter, ids, mask, vision, G, device)  # (N, V)
    sampling = Sampling(temperature, top_p, top_k, stop_ids, pad_token_id, return_logprobs)
    new, logps, _ = decode(model, adapter, logits, state, sampling, max_new_tokens)
    return new, logps


class DecodeState:
    """What a decode loop continues from: the KV cache of N rows, its attention mask (N, L) (0 on left
    padding and on the columns a finished row was fed padding), and the position the next token of each
    row takes, (N,) (for M-RoPE models the text position, the same on all three axes).

    With ``prefix`` (mmgrpo.model.prefix) each group's prompt is held once there and ``cache`` holds each
    row's own tokens only; ``mask`` still covers the whole sequence, prompt first."""

    def __init__(self, cache, mask: Tensor, next_pos: Tensor, prefix: SharedPrefix | None = None) -> None:
        self.cache, self.mask, self.next_pos, self.prefix = cache, mask, next_pos, prefix

    def unshare(self) -> None:
        """Every row's prompt copied in front of its own tokens: a plain cache (for the model's forward)."""
        if self.prefix is not None:
            self.cache, self.prefix = self.prefix.materialize(self.cache), None


@torch.no_grad()
def start(model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, G: int, device):
    """Prefill B left-padded prompts for G samples each: the logits of each row's first token (B*G, V)
    and the decode state. Where the lean step runs (``LEAN_DECODE``, a known layout) the prompts stay one
    row per group (a ``SharedPrefix``); otherwise the cache is repeated G times."""
    first, cache, begin, layout = encode_heads(model, adapter, ids, mask, vision, device)  # (B, V)
    lean_ok = LEAN_DECODE and lean.stepper(model, adapter.uses_mrope(model)) is not None
    rows_mask = layout.repeat_interleave(G, dim=0)  # (N, P')
    next_pos = begin.repeat_interleave(G, dim=0)  # (N,)
    if G > 1 and lean_ok and selects_rows(cache):
        prefix, own = SharedPrefix.split(cache, layout, G)
        return first.repeat_interleave(G, dim=0), DecodeState(own, rows_mask, next_pos, prefix)
    if G == 1 or repeat_cache(cache, G):
        return first.repeat_interleave(G, dim=0), DecodeState(cache, rows_mask, next_pos)
    # a cache that can neither select nor repeat its rows: encode each prompt G times
    first, cache, delta = prefill(model, adapter, ids, mask, vision, G, device)
    return first, DecodeState(cache, mask.repeat_interleave(G, dim=0).to(device), next_positions(mask, G, delta, device))


def encode_heads(
    model, adapter: CausalLMAdapter, ids: Tensor, mask: Tensor, vision: VisionInputs, device
):
    """B prompts encoded once each (their common opening once for all: mmgrpo.model.system_prefix).
    Returns the next-token logits (B, V), the cache (B rows), each prompt's next position (B,) and the
    cache's mask (B, P')."""

    lean_encoder = lean_prompt.for_model(model, adapter)  # None: the model's own forward

    def forward(i, m, v, positions, cache):
        if lean_encoder is not None and lean_encoder.takes(v := lean_encoder.encoded(v)):
            return lean_encoder(i.to(device), m.to(device), v, positions.to(device), cache)
        kw = adapter.forward_kwargs(i, m, v, device, model_dtype(model))
        extra = {} if cache is None else {cache_kwarg(model): cache}
        return model(**kw, position_ids=positions.to(device), logits_to_keep=1, use_cache=True, **extra)

    def whole(i: Tensor, m: Tensor, v: VisionInputs):  # the prompts from nothing, the model's own way
        first, cache, delta = prefill(model, adapter, i, m, v, 1, device)
        return first, cache, next_positions(m, 1, delta, device), m.to(device)

    shared = system_prefix.encode_opened(model, adapter, ids, mask, vision, device, forward, lean_encoder, whole)
    return shared if shared is not None else whole(ids, mask, vision)


class Sampling:
    """How tokens are drawn and when a row stops (see ``sample_tokens``)."""

    def __init__(self, temperature, top_p, top_k, stop_ids, pad_token_id, return_logprobs=True) -> None:
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.stop_ids, self.pad_token_id, self.return_logprobs = list(stop_ids), pad_token_id, return_logprobs


def next_positions(mask: Tensor, G: int, delta: Tensor | None, device) -> Tensor:
    """The position of the first new token of each of B left-padded rows repeated G times, (B*G,):
    the row's real token count, plus the M-RoPE offset its images left (``delta``, (B*G, 1))."""
    pos = mask.long().sum(dim=1).repeat_interleave(G, dim=0).to(device)  # (N,)
    return pos if delta is None else pos + delta.reshape(-1).to(device)


def decode(
    model, adapter: CausalLMAdapter, logits: Tensor, state: DecodeState, sampling: Sampling, max_new_tokens: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Sample up to ``max_new_tokens`` per row from ``logits`` (N, V) on, feeding each token to ``state``
    (its cache, mask and positions advance in place). A row stops at its first stop id; after it the row
    is fed padding with mask 0, so the cache stays a correct record of every row for a later turn.

    Rows that stopped are set aside once they are at least half of those decoding (``PARK``): the loop
    goes on with the others only, and the rows set aside come back at the end with mask-0 columns in
    place of the steps they missed, so the state holds every row again. (On the tools recipe the answer
    turn stops after 6 tokens for half the rows and after 40 for a few.)

    Returns the new ids (N, t), pad after each row's stop; their log-probs (N, t) or None; and how many of
    each row's new tokens are in the cache, (N,): the last sampled token of the turn never is (it would be
    fed only to predict a token nobody samples).
    """
    reserve(state.cache, max_new_tokens)
    mrope = adapter.uses_mrope(model)
    lean_step = lean.stepper(model, mrope) if LEAN_DECODE else None  # None: the model's own forward
    if lean_step is None:
        state.unshare()
    joined = lean_step.joined() if lean_step is not None else None  # this loop's joined projections
    table = None  # this loop's rotary table: every position it feeds is within next_pos .. + max_new_tokens
    if lean_step is not None and len(state.next_pos):
        first, last = int(state.next_pos.min()), int(state.next_pos.max()) + max_new_tokens
        table = lean_step.rotations(first, last)
    N = logits.shape[0]
    device = logits.device
    rows = torch.arange(N, device=device)  # (n,) the original row of each row decoding
    parked: list[tuple[Tensor, dict]] = []  # rows set aside, with their state
    done = torch.zeros(N, dtype=torch.bool, device=device)  # (n,)
    fed = torch.zeros(N, dtype=torch.long, device=device)  # (N,) new tokens of each row in the cache
    stops = torch.as_tensor(sampling.stop_ids, device=device)  # (S,)
    steps, logps = [], []
    t = sampling.temperature
    for k in range(max_new_tokens):
        # every row draws its number, set aside or not: the samples never depend on who was set aside
        every = len(rows) == N  # no row set aside yet: the rows are 0..N-1 in order
        u = None if t <= 0 else torch.rand(N, 1, device=device) if every else torch.rand(N, 1, device=device)[rows]
        nxt = sample_tokens(logits, t, sampling.top_p, sampling.top_k, adapter.suppress_ids, u)  # (n,)
        nxt = nxt.masked_fill(done, sampling.pad_token_id)  # (n,)
        if every:
            steps.append(nxt)  # (N,)
        else:
            steps.append(torch.full((N,), sampling.pad_token_id, dtype=nxt.dtype, device=device).index_copy(0, rows, nxt))
        if sampling.return_logprobs:
            scaled = logits.float() / (t if t > 0 else 1.0)  # (n, V)
            lp = torch.log_softmax(scaled, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)  # (n,)
            logps.append(torch.zeros(N, dtype=lp.dtype, device=device).index_copy(0, rows, lp))
        real = ~done  # (n,) this token belongs to its row's turn
        done |= torch.isin(nxt, stops)
        stopped = int(done.sum())
        if stopped == len(rows) or len(steps) == max_new_tokens:
            break
        if PARK and len(rows) >= 8 and stopped * 2 >= len(rows):
            live, out = (~done).nonzero().squeeze(1), done.nonzero().squeeze(1)  # (n',), (n - n',)
            parked.append((rows[out], set_aside(state, out)))
            keep_rows(state, live)
            reserve(state.cache, max_new_tokens - k)
            rows, logits, nxt, real, done = rows[live], logits[live], nxt[live], real[live], done[live]
        state.mask = torch.cat([state.mask, real[:, None].to(state.mask.dtype)], dim=1)  # (n, L + 1)
        if lean_step is not None:
            logits = lean_step(nxt, state.next_pos, state.mask, state.cache, state.prefix, joined, table)  # (n, V)
        else:
            pos = state.next_pos[:, None]  # (n, 1)
            logits = model(
                input_ids=nxt[:, None],
                attention_mask=state.mask,
                position_ids=pos.unsqueeze(0).expand(3, -1, -1) if mrope else pos,
                **{cache_kwarg(model): state.cache},
                use_cache=True,
            ).logits[:, -1, :]  # (n, V)
        step_real = real.long()  # (n,)
        state.next_pos = state.next_pos + step_real
        fed.index_add_(0, rows, step_real)
    if parked:
        bring_back(state, rows, parked, N)
    if not steps:
        empty = torch.zeros((N, 0), device=device)
        return empty.long(), empty, fed
    return torch.stack(steps, dim=1), torch.stack(logps, dim=1) if logps else None, fed  # (N, t), (N, t)


PARK = True
"""Set finished rows aside during a decode loop (False: every row to the end; the tests compare both)."""


def set_aside(state: DecodeState, rows: Tensor | None = None) -> dict:
    """The state of ``rows`` (n,) (a copy; None: every row, as it is): their own cache columns, mask, next
    positions, groups."""

    def take(x: Tensor) -> Tensor:
        return x if rows is None else x[rows.to(x.device)]

    return {
        "keys": [take(layer.keys) for layer in state.cache.layers],  # (n, Hk, R, D) each
        "values": [take(layer.values) for layer in state.cache.layers],
        "mask": take(state.mask),  # (n, L)
        "next_pos": take(state.next_pos),  # (n,)
        "group": None if state.prefix is None else take(state.prefix.group),
    }


def copy_rows(state: DecodeState, rows: Tensor) -> DecodeState:
    """A new state of ``rows`` (n,) only (copies of their cache rows); ``state`` is left as it is."""
    prefix = None
    if state.prefix is not None:
        prefix = copy.copy(state.prefix)  # the prompt tensors shared, the row layout its own
        prefix.select(rows)
    return DecodeState(rows_of_cache(state.cache, rows), state.mask[rows], state.next_pos[rows], prefix)


def keep_rows(state: DecodeState, rows: Tensor) -> None:
    """The state of ``rows`` (n,) only, in that order (a copy of their cache rows)."""
    select_rows(state.cache, rows)
    if state.prefix is not None:
        state.prefix.select(rows)
    state.mask, state.next_pos = state.mask[rows], state.next_pos[rows]


def bring_back(state: DecodeState, rows: Tensor, parked: list[tuple[Tensor, dict]], N: int) -> None:
    """Every one of the N rows in the state again, in order: ``state`` holds the rows ``rows`` and is the
    longest; each ``parked`` entry (rows, ``set_aside`` of them) is shorter or as long and gets mask-0
    columns at the end for what it lacks (its cache rows end with holes, as a finished row's always do)."""
    R, L = state.cache.layers[0].keys.shape[-2], state.mask.shape[1]
    for i, layer in enumerate(state.cache.layers):
        keys = layer.keys.new_zeros((N, *layer.keys.shape[1:]))  # (N, Hk, R, D)
        values = layer.values.new_zeros((N, *layer.values.shape[1:]))
        keys[rows], values[rows] = layer.keys, layer.values
        for at, snap in parked:
            r = snap["keys"][i].shape[-2]
            keys[at, :, :r], values[at, :, :r] = snap["keys"][i], snap["values"][i]
        plain_again(layer)
        layer.keys, layer.values = keys, values
    mask = state.mask.new_zeros((N, L))  # (N, L)
    mask[rows] = state.mask
    next_pos = state.next_pos.new_zeros(N)
    next_pos[rows] = state.next_pos
    group = None if state.prefix is None else torch.zeros(N, dtype=torch.long)
    if group is not None:
        group[rows.cpu()] = state.prefix.group
    for at, snap in parked:
        mask[at, : snap["mask"].shape[1]] = snap["mask"]
        next_pos[at] = snap["next_pos"]
        if group is not None:
            group[at.cpu()] = snap["group"]
    state.mask, state.next_pos = mask, next_pos
    if state.prefix is not None:
        state.prefix.regroup(group)
    assert R == state.cache.layers[0].keys.shape[-2] and L == state.mask.shape[1]


@dataclasses.dataclass(frozen=True)
class LogitBlock:
    """Logits of some rows of a batch over a run of response columns, as the model returned them (no copy):
    ``logits[:, j]`` predicts response token ``start + j`` of each row in ``rows``, for j < ``width``; the
    columns past ``width`` (at most one, left there so that no slice copies the logits) predict nothing."""

    rows: Tensor  # (n,) long: the rows of the batch
    logits: Tensor  # (n, c, V), c >= width
    start: int
    width: int


def _logits_full(model, adapter: CausalLMAdapter, batch: TokenBatch, device, head=None) -> Tensor:
    """One forward over prompt + response, (N, T + 1, V): column t predicts response token t (the last
    column predicts nothing); with ``head`` (``mmgrpo.model.head``) the final hidden states, (N, T + 1, H)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # (N, P + T)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)  # (N, P + T)
    T = batch.response_ids.shape[1]
    vision = batch.row_vision()  # prompt images, then the images of the response, per row
    kw = adapter.forward_kwargs(ids, mask, vision, device, model_dtype(model))
    pos = adapter.positions_given_to_prefill(mask, vision, model)
    if pos is not None:
        kw["position_ids"] = pos.to(device)
    if head is not None:
        return final_hidden(model, head, **kw, logits_to_keep=T + 1, use_cache=False)  # (N, T + 1, H)
    return model(**kw, logits_to_keep=T + 1, use_cache=False).logits  # (N, T + 1, V)


def response_logits_full(model, adapter: CausalLMAdapter, batch: TokenBatch, device) -> Tensor:
    """One forward over prompt + response: logits predicting each response token, (N, T, V)."""
    return _logits_full(model, adapter, batch, device)[:, :-1, :]  # column P+t-1 predicts token t


def response_blocks_full(
    model, adapter: CausalLMAdapter, batch: TokenBatch, device, scored: bool = False
) -> list[LogitBlock | HiddenBlock]:
    """``response_logits_full`` as one block, without the slice's copy; with ``scored``, as final hidden
    states where the model's head allows (``mmgrpo.model.head``: only the scored positions get logits)."""
    N, T = batch.response_ids.shape
    head = plain_head(model) if scored else None
    out = _logits_full(model, adapter, batch, device, head)  # (N, T + 1, V) or (N, T + 1, H)
    if head is not None:
        return [HiddenBlock(torch.arange(N), out, 0, T, head)]
    return [LogitBlock(torch.arange(N), out, 0, T)]


def response_blocks_shared(
    model, adapter: CausalLMAdapter, batch: TokenBatch, G: int, device, scored: bool = False
) -> list[LogitBlock | HiddenBlock]:
    """Encode each of the N/G distinct prompts once (their common opening once for all) and run the
    responses on its KV cache, images inside the responses (a tool's crop or zoom) included, their
    positions from ``adapter.block_positions``.

    The responses run in a few passes of rows of similar length (``length_chunks``), each trimmed to its
    longest row, so that one long multi-turn episode does not pad every row of the batch to its length;
    each pass takes its rows' prompt caches by index (differentiable: gradients flow back into the one
    prompt encoding). Each pass gives two blocks: the prompt's last logits (token 0) and the pass's own
    (tokens 1..). Nothing is padded to the batch's longest response or gathered back into row order:
    ``mmgrpo.model.token_stats`` reduces each block to per-token numbers first (on the tools recipe the
    (64, T, V) copies, gathers and their backward were 0.15 s of a 1.1 s step).

    How many forwards a pass runs depends on its episodes, so DDP's processes run different numbers of
    them: the Accelerator is made without DDP's per-forward buffer broadcast (``make_accelerator``).
    ``scored``: the passes' blocks hold final hidden states where the model's head allows
    (``mmgrpo.model.head``), so that only the positions scored later go through the head.
    """
    N, P = batch.prompt_ids.shape
    heads = list(range(0, N, G))  # first row of each group
    owners = batch.row_prompts()
    pv = batch.vision.select([owners[h] for h in heads])
    first, cache, start, layout = encode_heads(
        model, adapter, batch.prompt_ids[heads], batch.prompt_mask[heads], pv, device
    )  # (B, V), B rows, (B,), (B, P')
    if not selects_rows(cache):  # a custom cache: one pass on the prompts repeated G times
        return _responses_on_repeated(model, adapter, batch, G, device)
    plain = plain_head(model)
    head = plain if scored else None
    lean_pass = lean_pass_mod.for_model(model, adapter) if plain is not None else None
    group = torch.arange(N) // G  # (N,) each row's prompt (head)
    lengths = batch.response_mask.sum(dim=1)  # (N,)
    rv_all = batch.response_vision if batch.has_response_images else None
    blocks = []
    for rows in length_chunks(lengths.tolist()):
        idx = torch.as_tensor(rows, dtype=torch.long)
        t = max(int(lengths[idx].max()), 1)
        g = group[idx].to(device)  # (n,)
        rv = rv_all.select(rows) if rv_all is not None else VisionInputs.none(len(rows))
        rv = adapter.encode_repeats(model, rv, device, model_dtype(model))  # a repeated image once
        ids, rmask = batch.response_ids[idx, :t], batch.response_mask[idx, :t]  # (n, t)
        blocks.append(LogitBlock(idx, first[g].unsqueeze(1), 0, 1))  # (n, 1, V)
        if lean_pass is not None and rv.empty:  # text only: the decoder layers called directly
            pos, _ = adapter.block_positions(model, ids, rmask, rv, start[g])
            ids, rmask = ids.to(device), rmask.to(device)
            hidden = lean_pass.hidden(ids, rmask, pos.to(device), layout[g], cache, g)  # (n, t, H)
            if head is not None:
                blocks.append(HiddenBlock(idx, hidden, 1, t - 1, head))
            else:
                blocks.append(LogitBlock(idx, plain(hidden), 1, t - 1))  # (n, t, V)
            continue
        full_mask = torch.cat([layout[g], rmask.to(device)], dim=1)  # (n, P' + t)
        kw = adapter.forward_kwargs(ids, full_mask, rv, device, model_dtype(model))
        pos, _ = adapter.block_positions(model, ids, rmask, rv, start[g])
        kw.update(position_ids=pos.to(device), use_cache=True, **{cache_kwarg(model): rows_of_cache(cache, g)})
        if head is not None:  # (n, t, H): column j gives the logits of response token j + 1
            blocks.append(HiddenBlock(idx, final_hidden(model, head, **kw), 1, t - 1, head))
        else:  # (n, t, V): column j predicts response token j + 1
            blocks.append(LogitBlock(idx, model(**kw).logits, 1, t - 1))
    return blocks


def _responses_on_repeated(model, adapter, batch, G, device) -> list[LogitBlock]:
    """One pass over every row on the prompt cache repeated G times (caches that cannot select rows)."""
    N, P = batch.prompt_ids.shape
    T = batch.response_ids.shape[1]
    heads = list(range(0, N, G))
    pv = batch.vision.select([batch.row_prompts()[h] for h in heads])
    first, cache, delta = prefill(model, adapter, batch.prompt_ids[heads], batch.prompt_mask[heads], pv, G, device)
    start = next_positions(batch.prompt_mask[heads], G, delta, device)  # (N,)
    rv = batch.response_vision if batch.has_response_images else VisionInputs.none(N)
    full_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(device)  # (N, P + T)
    kw = adapter.forward_kwargs(batch.response_ids, full_mask, rv, device, model_dtype(model))
    pos, _ = adapter.block_positions(model, batch.response_ids, batch.response_mask, rv, start)
    rest = model(**kw, position_ids=pos.to(device), **{cache_kwarg(model): cache}, use_cache=True).logits
    rows = torch.arange(N)
    return [LogitBlock(rows, first.unsqueeze(1), 0, 1), LogitBlock(rows, rest, 1, T - 1)]  # (N, 1, V), (N, T, V)


def length_chunks(lengths: list[int], overhead: int = 512, most: int = 4) -> list[list[int]]:
    """Rows cut into at most ``most`` passes of similar length: sorted by length, cut where the padded
    area (rows x longest row, summed over passes) plus ``overhead`` tokens per pass is least (an exact
    search over the cuts, one (n + 1, n) table per pass count; between equal costs, the earliest cuts).
    e.g. 20 rows of 50 tokens and one of 150: two passes (20 x 50 + 150 + 2 x 512 = 2174 padded tokens,
    against 21 x 150 + 512 = 3662); equal lengths: one pass."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    L = [max(lengths[i], 1) for i in order]
    n = len(L)
    lens = torch.tensor(L, dtype=torch.float64)  # (n,) sorted
    i = torch.arange(n + 1, dtype=torch.float64)[:, None]  # (n + 1, 1) rows placed before a pass
    j = torch.arange(1, n + 1, dtype=torch.float64)[None, :]  # (1, n) rows placed after it
    pass_cost = torch.where(i < j, (j - i) * lens[None, :] + overhead, torch.inf)  # (n + 1, n): rows i..j-1
    back: list[list[int]] = []  # back[k - 1][j - 1]: where the k-th pass starts when it ends at row j

    def cuts(end: int, k: int) -> list[int]:
        return [] if k == 0 else [*cuts(back[k - 1][end - 1], k - 1), end]

    prev = torch.full((n + 1,), torch.inf, dtype=torch.float64)  # (n + 1,) least cost of j rows in k - 1 passes
    prev[0] = 0
    ends = []  # (cost, cuts) of all n rows in k passes
    for k in range(1, most + 1):
        total = prev[:, None] + pass_cost  # (n + 1, n)
        low, arg = total.min(dim=0)  # (n,) least cost and the first start that gives it (ties: the earliest)
        back.append(arg.tolist())
        prev = torch.cat([prev.new_full((1,), torch.inf), low])
        if torch.isfinite(low[-1]):
            ends.append((int(low[-1]), cuts(n, k)))
    _, cuts_n = min(ends)
    bounds = [0, *cuts_n]
    return [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
