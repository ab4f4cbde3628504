"""A training pass over rows with distinct prompts that open alike: each opening encoded once.

A warm start's or SFT's batch gives every row its own task, so no two rows share a prompt and
``Policy.logprobs`` ran one full forward per row. Yet on a tool task every full prompt opens with the same
system text and tool schemas (the zoom agent: about 300 of its 344 prompt tokens), and a warm start that
mixes full prompts with bare ones (the question alone) has two such openings. Here the rows are split by
how their prompts open; a part whose rows share at least ``MIN_OPENING`` tokens runs through
``engine.response_blocks_shared`` with one row per prompt, where ``system_prefix.encode_prompts`` encodes the
opening once for the part (differentiable: the rows' gradients flow back into the one encoding), and the
other rows run as before. Same log-probs and gradients as the full forward (tests/test_openings.py); the
zoom agent's full-prompt warm-start step (16 rows) went from 0.63 to 0.24 s (one thread).
"""

from __future__ import annotations

import dataclasses

import torch

from mmgrpo.model import engine
from mmgrpo.model.adapters import CausalLMAdapter
from mmgrpo.model.batch import TokenBatch
from mmgrpo.model.system_prefix import common_prefix, opening_stops, rows_by_opening

MIN_OPENING = 64
"""A part of the batch takes the shared opening only when its rows' prompts open with at least this many
common tokens; below, the second forward costs about what it saves."""

SHARE_OPENINGS = True
"""False: rows with distinct prompts always run as one full forward (the tests compare both)."""


def opening_parts(batch: TokenBatch, adapter: CausalLMAdapter) -> list[tuple[list[int], bool]] | None:
    """The rows of ``batch`` split by their prompt's first ``MIN_SHARED`` real tokens, in order of first
    appearance, each with whether it takes the shared opening (two rows or more, sharing at least
    ``MIN_OPENING`` tokens before any image); None when no part would (the caller's full forward then)."""
    if not SHARE_OPENINGS or len(batch) < 2 or not adapter.continues_cache:
        return None
    stop = opening_stops(adapter)
    parts = []
    for rows in rows_by_opening(batch.prompt_ids, batch.prompt_mask):
        idx = torch.as_tensor(rows, dtype=torch.long)
        shared = (
            len(rows) > 1
            and common_prefix(batch.prompt_ids[idx], batch.prompt_mask[idx], stop) >= MIN_OPENING
        )
        parts.append((rows, shared))
    return parts if any(shared for _, shared in parts) else None


def response_blocks_openings(
    model,
    adapter: CausalLMAdapter,
    batch: TokenBatch,
    parts: list[tuple[list[int], bool]],
    device,
    scored: bool,
) -> list:
    """The response blocks of every row (``engine.response_blocks_shared`` on the parts that share an
    opening, ``engine.response_blocks_full`` on the others), their rows numbered in ``batch``."""
    blocks = []
    for rows, shared in parts:
        sub = batch.select(rows) if len(rows) < len(batch) else batch
        if shared:
            part = engine.response_blocks_shared(model, adapter, sub, 1, device, scored)
        else:
            part = engine.response_blocks_full(model, adapter, sub, device, scored)
        where = torch.as_tensor(rows, dtype=torch.long)
        blocks += [dataclasses.replace(b, rows=where[b.rows]) for b in part]
    return blocks
