"""Multi-turn decoding on one KV cache that lives across the turns of a batch of episodes.

Turn 1 encodes each of B prompts once and decodes G samples per prompt on the repeated cache (as
``engine.generate``). For every later turn only the tokens the cache does not hold yet are run: the last
token the policy sampled (a decode loop never feeds its final token) and the environment's new message,
images included. Earlier turns and the prompt are never encoded again, so the prompt stays computed once
per group in every turn.

Ragged rows, one cache. Rows end at different turns and stop at different lengths:

- finished episodes leave the cache (its rows are selected: compaction);
- after a row's stop token it is fed padding with mask 0 (``engine.decode``), so holes in the middle of
  a row are masked out;
- each turn's new tokens are left-padded into a block (mask 0 on the padding), so the last column of
  every row is its last real token and the next sample is read there; rows of very different lengths
  run in separate blocks and join again after, the shorter ones with mask-0 columns at the end;
- positions are explicit: each row carries the position its next token takes (``DecodeState.next_pos``).
  For Qwen-VL's 3-D M-RoPE, an image in the new tokens is laid out by the model's own ``get_rope_index``
  over the new block alone, shifted to the row's next position (its layout is translation invariant),
  and the row continues after the image's largest position.

Families (the adapter's ``continues_cache`` / ``images_on_cache``): text-only causal LMs, Qwen2-VL / Qwen2.5-VL / Qwen3-VL and LLaVA continue their cache with and
without images; Idefics3 / SmolVLM continue it when the new tokens hold no image. Gemma 3 (sliding-window
cache layers) and caches that cannot select rows fall back to encoding each live row's whole sequence
again (``supported`` says which); the tests compare both ways token for token.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from mmgrpo.model import engine, image_blocks, lean
from mmgrpo.model.batch import VisionInputs

LEAN_BLOCKS = True
"""Run a later turn's text block through the lean step (``LeanStep.block``: the prompt held once, no
copies; 71-77 -> 60-62 ms a tools step) instead of the model's forward over the materialised rows; a block
with images too where ``image_blocks.block_embeds`` builds its input embeddings (the zoom agent's view). Its
rounding differs from the model's forward by about 1e-6, so a run samples other episodes than with it off
after a few steps; the tools-lookup demo once lost the tools on such a path, from its reward (a per-call
cost on wrong answers), not from the rounding: ``tool_call_cost(only_when_right=True)``. The tests run
both ways."""


FEED_TWINS_ONCE = True
"""Rows of a later turn identical in everything the block reads (``TurnDecoder._twins``) run the block once:
the first of them does, the others take copies of its cache row and logits, then all decode on their own.
Late in a zoom run the G rows of a group share the call and the view, so the block runs for 1 row in 8.
The copies' rounding is their first's, which a batch of other rows could have changed by ~1e-7."""


def supported(policy) -> bool:
    """Whether ``policy``'s family continues a cache across turns at all (see the module docstring)."""
    return policy.adapter.continues_cache


class TurnDecoder:
    """The decode state of N episodes across their turns. Rows are named by episode index (0..N-1)."""

    def __init__(self, policy, *, temperature: float, top_p: float, top_k: int) -> None:
        self.policy = policy
        self.sampling = engine.Sampling(
            temperature, top_p, top_k, policy.stop_ids, policy.pad_token_id, return_logprobs=False
        )
        self.state: engine.DecodeState | None = None
        self.rows: list[int] = []  # episode index of each cache row
        self.G = 1  # episodes per prompt (set by ``first``): episode e belongs to group e // G
        self.in_cache: dict[int, int] = {}  # per episode, how many of its response ids the cache holds
        self.images_ok = policy.adapter.images_on_cache
        self.last_logprobs: list[list[float]] | None = None
        """With ``keep_logprobs``: each row's sampled log-probs of the last turn (tests compare them)."""
        self.keep_logprobs = False

    def can_continue(self, new_vision: list[VisionInputs]) -> bool:
        """Whether the next turn can run on the kept cache (False: re-encode, see ``supported``)."""
        if self.state is None or not self._plain_cache():
            return False
        return self.images_ok or all(v.empty for v in new_vision)

    def _plain_cache(self) -> bool:
        layers = getattr(self.state.cache, "layers", None)
        kinds = (DynamicLayer, engine._ReservedLayer)  # not sliding windows, not static caches
        return layers is not None and all(type(x) in kinds and x.keys.dim() == 4 for x in layers)

    # ------------------------------------------------------------------------------------------ turns
    @torch.no_grad()
    def first(self, prompt_ids: Tensor, prompt_mask: Tensor, vision: VisionInputs, G: int, max_new_tokens: int):
        """Turn 1 for B prompts x G samples: (completions, finished), rows b*G .. b*G+G-1 per prompt."""
        p = self.policy
        with self._mode():
            self.G = G
            logits, self.state = engine.start(p.model, p.adapter, prompt_ids, prompt_mask, vision, G, p.device)
            self.rows = list(range(logits.shape[0]))
            self.in_cache = dict.fromkeys(self.rows, 0)
            return self._decode(logits, max_new_tokens)

    @torch.no_grad()
    def next(
        self, episodes: list[int], responses: list[list[int]], new_vision: list[VisionInputs], max_new_tokens: int
    ):
        """The next turn of ``episodes`` (a subset of the rows still in the cache, in any order), whose
        response ids so far are ``responses`` (the cache holds a prefix of each) and whose latest env
        turn brought the images ``new_vision``. Returns (completions, finished) in ``episodes``' order.

        The new tokens run in a few blocks of rows of similar length (``engine.length_chunks``): on the
        tools recipe most rows bring 15-18 tokens and a few (a long tool error) 70-100, and one block
        would pad every row to the longest. The rows come back together after their blocks, a shorter
        block's rows with mask-0 columns at the end (as rows set aside in a decode loop)."""
        p = self.policy
        st = self.state
        where = {e: k for k, e in enumerate(self.rows)}
        pending = [r[self.in_cache[e] :] for e, r in zip(episodes, responses, strict=True)]
        twin = self._twins(episodes, responses, new_vision, where) if FEED_TWINS_ONCE else None
        if twin is not None:  # identical rows: the first of each runs the block, the others copy it after
            ones = sorted(set(twin))
            at = {k: i for i, k in enumerate(ones)}
            expand = torch.as_tensor([at[t] for t in twin], device=p.device)  # (n,) each row's first, as fed
            episodes_all, responses_all = list(episodes), responses
            episodes, responses = [episodes[k] for k in ones], [responses[k] for k in ones]
            pending, new_vision = [pending[k] for k in ones], [new_vision[k] for k in ones]
        engine.keep_rows(st, torch.as_tensor([where[e] for e in episodes], device=p.device))  # compaction
        self.rows = list(episodes)
        for e, r in zip(episodes, responses, strict=True):
            self.in_cache[e] = len(r)
        chunks = engine.length_chunks([len(x) for x in pending])  # the last one holds the longest rows
        *others, last = chunks if len(chunks) > 1 else [list(range(len(pending)))]
        logits, parked = None, []
        with self._mode():
            for rows in [*others, last]:
                idx = torch.as_tensor(rows, device=p.device)
                if rows is not last:  # a shorter block: its rows' own state, set aside until the end
                    part = engine.copy_rows(st, idx)
                elif others:  # the longest block runs on the state itself, its rows only
                    part = st
                    engine.keep_rows(st, idx)
                else:  # one block: every row, in order
                    part = st
                room = 0 if others else max_new_tokens  # bring_back re-allocates the cache anyway
                out = self._feed(part, [pending[i] for i in rows], VisionInputs.concat_rows([new_vision[i] for i in rows]), room)
                if part is not st:
                    parked.append((idx, engine.set_aside(part)))
                logits = out.new_empty((len(episodes), out.shape[1])) if logits is None else logits
                logits[idx] = out  # (n, V) in the episodes' order
            if others:
                engine.bring_back(st, idx, parked, len(episodes))
            if twin is not None:  # every row again, each twin a copy of its first's cache row and logits
                engine.keep_rows(st, expand)
                logits, self.rows = logits[expand], episodes_all
                for e, r in zip(episodes_all, responses_all, strict=True):
                    self.in_cache[e] = len(r)
            return self._decode(logits, max_new_tokens)

    def _twins(self, episodes, responses, new_vision, where) -> list[int] | None:
        """Per episode, the index of the first of ``episodes`` identical to it -- same group, same ids so
        far, same cache row layout (mask, next position, ids held) and the very same image tensors in its
        new turn (the processor ran once for a view shared in the group) -- or None when no two are. Late
        in a zoom run all G rows of a group make the same call and get the same view."""
        st, G = self.state, self.G
        mask, pos = st.mask.tolist(), st.next_pos.tolist()
        first: dict[tuple, int] = {}
        twin = []
        for k, (e, r, v) in enumerate(zip(episodes, responses, new_vision, strict=True)):
            row = where[e]
            images = tuple((key, id(t)) for seq in v.seqs for key, t in seq.items())
            key = (e // G, tuple(r), self.in_cache[e], pos[row], tuple(mask[row]), images)
            twin.append(first.setdefault(key, k))
        return twin if len(first) < len(twin) else None

    def _feed(self, st: engine.DecodeState, pending: list[list[int]], vision: VisionInputs, room: int) -> Tensor:
        """Run the rows' new tokens ``pending`` (n rows) on the state's cache, left-padded into one block:
        the state advances past them; returns the logits of each row's next token (n, V). ``room``: the
        tokens to reserve in the cache after the block (the turn after it)."""
        p = self.policy
        W = max(len(x) for x in pending)
        n = len(pending)
        ids = torch.full((n, W), p.pad_token_id, dtype=torch.long)  # (n, W) left-padded block
        bmask = torch.zeros((n, W), dtype=torch.long)  # (n, W)
        for k, x in enumerate(pending):
            ids[k, W - len(x) :] = torch.as_tensor(x, dtype=torch.long)
            bmask[k, W - len(x) :] = 1
        pos, after = p.adapter.block_positions(p.model, ids, bmask, vision, st.next_pos)  # (n, W) / (3, n, W)
        full = torch.cat([st.mask, bmask.to(st.mask)], dim=1)  # (n, L + W)
        step = lean.stepper(p.model, p.adapter.uses_mrope(p.model)) if engine.LEAN_DECODE else None
        if LEAN_BLOCKS and step is not None and st.prefix is not None:  # the lean step's block
            embeds = None if vision.empty else image_blocks.block_embeds(p, step, ids, vision)  # (n, W, H)
            if vision.empty or embeds is not None:
                engine.reserve(st.cache, W + room)
                dev = p.device
                logits = step.block(ids.to(dev), pos.to(dev), full, st.cache, st.prefix, step.joined(), embeds)
                st.mask, st.next_pos = full, after.to(p.device)
                return logits  # (n, V)
        vision = p.adapter.encode_repeats(p.model, vision, p.device, engine.model_dtype(p.model))
        kw = p.adapter.forward_kwargs(ids, full, vision, p.device, engine.model_dtype(p.model))
        kw["input_ids"] = ids.to(p.device)
        cache = st.cache if st.prefix is None else st.prefix.materialize(st.cache)  # the whole rows
        if st.prefix is None and room:
            engine.reserve(cache, W + room)  # the block and the turn after it
        logits = p.model(
            **kw, position_ids=pos.to(p.device), **{engine.cache_kwarg(p.model): cache}, use_cache=True
        ).logits[:, -1, :]  # (n, V)
        if st.prefix is not None:
            st.prefix.strip(cache, st.cache)  # the rows' own tokens, the block's included
        st.mask, st.next_pos = full, after.to(p.device)
        return logits

    def _decode(self, logits: Tensor, max_new_tokens: int):
        p = self.policy
        self.sampling.return_logprobs = self.keep_logprobs
        new, logps, fed = engine.decode(p.model, p.adapter, logits, self.state, self.sampling, max_new_tokens)
        completions, finished = p._cut_at_stop(new.tolist())
        for e, f in zip(self.rows, fed.tolist(), strict=True):
            self.in_cache[e] += f  # the sampled tokens the loop fed (all but a row's last, at most)
        if self.keep_logprobs:
            self.last_logprobs = [row[: len(c)] for row, c in zip(logps.tolist(), completions, strict=True)]
        return completions, finished

    def _mode(self):
        return _EvalMode(self.policy)


class _EvalMode:
    """The model in eval mode under the policy's autocast for the block; training mode restored after."""

    def __init__(self, policy) -> None:
        self.modes = contextlib.ExitStack()
        self.policy = policy

    def __enter__(self):
        self.modes.enter_context(self.policy.evaluating())
        self.modes.enter_context(self.policy.autocast())

    def __exit__(self, *exc):
        return self.modes.__exit__(*exc)
