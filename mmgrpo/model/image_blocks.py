"""A later turn's block that brings images, through the lean step on a prompt held once per group.

On the zoom agent the tool's message carries the enlarged cell: turn 2 of every zooming row is a block of
~30 tokens, ~16 of them image placeholders. The model's forward cannot take that block on a decode state
whose prompts are held once per group (``prefix.SharedPrefix``): it needs each row's whole cache, so the
group's ~344-token prompt was copied out per row (``materialize``), attended per row and stripped again --
0.11-0.15 s of a 0.56 s rollout from the demo's warm start. The lean step's ``block`` attends the prompt
once per group; all it lacks for an image block is the input embeddings, which here are built the way the
model's own forward builds them: the token embeddings with the image features (encoded once per distinct
view, ``adapter.encode_repeats``) scattered over the placeholders by the model's ``get_placeholder_mask``
(``lean_prompt.PromptEncoder.embed``). Positions are the adapter's ``block_positions`` (Qwen-VL's 3-D
layout of the block), the same ones the forward is given.

Which models: those of ``lean_prompt.SCATTERS_IMAGES`` (the forward does nothing else with the features;
Qwen3-VL adds them inside its first layers too, so its image blocks keep the model's forward), whose
adapter can cache encoder features, and not while the parameters are FSDP shards. Everything else: None,
and the caller runs the model's forward. Same episodes as the forward, token for token
(tests/test_image_blocks.py).
"""

from __future__ import annotations

from torch import Tensor

from mmgrpo.model import engine, lean
from mmgrpo.model.adapters import holds_shards
from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.lean_prompt import PromptEncoder

LEAN_IMAGE_BLOCKS = True
"""Take a later turn's block with images through the lean step where ``block_embeds`` can (False: the model's
forward on the rows' whole caches, as before; the tests run both ways)."""


def block_embeds(policy, step: lean.LeanStep, ids: Tensor, vision: VisionInputs) -> Tensor | None:
    """The input embeddings (n, W, H) of a block of ids (n, W) whose image placeholders take the features
    of ``vision`` (the block's images, sequence by sequence); None where the model's forward must take the
    block (see the module docstring)."""
    p = policy
    if not LEAN_IMAGE_BLOCKS or vision.empty or holds_shards(p.model):
        return None
    encoder = PromptEncoder(p.model, p.adapter, step)
    if not encoder.takes_images:  # before encode_repeats: the forward would encode the views again
        return None
    dtype = engine.model_dtype(p.model)
    vision = p.adapter.encode_repeats(p.model, vision, p.device, dtype)  # a view shared by rows: once
    vision = encoder.encoded(vision)  # the others (a video, or an encoder the family hides: still pixels)
    if not encoder.takes(vision):
        return None
    return encoder.embed(ids.to(p.device), vision)  # (n, W, H)
