"""A lean prompt encoding: a block of prompt tokens through the decoder layers called directly, the KV cache
filled as the model's forward would fill it.

Every GRPO step encodes its prompts three times: the rollout's prefill, the training pass and the
reference pass (``mmgrpo.model.system_prefix``: the batch's common opening once, then each prompt's
remainder as one left-padded block on it). On the tiny VLM of the vs-TRL counting benchmark (4 prompts of
68 tokens, one thread) the model's forward took about 4 ms for the opening (1 x 31 tokens, 0.5 ms of it
arithmetic) and 7 ms for the block (4 x 37 tokens with the image): output-capturing wrappers, keyword
plumbing, the masking utilities' 4-D mask, key/value heads copied per query head. ``PromptEncoder`` runs
the same modules (embedding, rotary embedding, norms, projections, MLP: LoRA-wrapped ones too) with one
additive mask and one attention call per layer, appends each layer's keys and values to the cache, and
returns the last column's logits. Images are placed as the model places them: its image features (the
cached ``mm_encoder_outputs``) scattered over the placeholder tokens by the model's own
``get_placeholder_mask``.

Which models: those whose layers ``mmgrpo.model.lean`` reproduces (``lean.stepper``), on the CPU, with the
lean passes on (``lean_pass.LEAN_PASSES``: the same switch, so the tests that compare the lean and plain
passes compare this too), no attention dropout while training, and outside the training passes of a
DDP-wrapped model. A block with images only for the
families whose forward embeds them as above (``SCATTERS_IMAGES``) and only from cached features; Qwen3-VL
also adds its image features inside the first layers (deepstack), so its image blocks take the model's
forward. Same numbers as the model's forward (tests/test_lean_prompt.py: logits, cache and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import DynamicCache

from mmgrpo.model import lean, lean_gate, lean_pass
from mmgrpo.model.adapters import CausalLMAdapter, holds_shards, unwrap
from mmgrpo.model.batch import VisionInputs

SCATTERS_IMAGES = frozenset({"qwen2_vl", "qwen2_5_vl", "llava"})
"""Model types whose forward puts image features in place of the image placeholders' embeddings and
does nothing else with them (read in the transformers sources these tiny families are built from)."""


class Encoded(dict):
    """What ``PromptEncoder`` returns, read like a model output: ``out["cache"]``, ``out.logits``."""

    @property
    def logits(self) -> Tensor:
        return self["logits"]


class PromptEncoder:
    """``encoder(ids, mask, vision, positions, cache)`` for the model it was made for (see ``for_model``)."""

    def __init__(self, model, adapter: CausalLMAdapter, step: lean.LeanStep) -> None:
        self.model, self.adapter, self.step = model, adapter, step
        m = unwrap(model)
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        self.inner = getattr(m, "model", None)  # the multimodal model: get_placeholder_mask
        self.config = m.config
        scatters = getattr(m.config, "model_type", None) in SCATTERS_IMAGES
        self.takes_images = (
            scatters and adapter.caches_encoder and hasattr(self.inner, "get_placeholder_mask")
        )
        """Whether blocks with images can be encoded here at all (from their cached features)."""

    def takes(self, vision: VisionInputs) -> bool:
        """Whether a block with these images can be encoded here (else the model's forward runs)."""
        if vision.empty:
            return True
        return self.takes_images and vision.has_encoded

    def encoded(self, vision: VisionInputs) -> VisionInputs:
        """``vision`` with its image features attached (one encoder call for all its images, with the
        caller's grad mode, so a training pass's gradient reaches the vision tower through them), where
        this encoder then takes the block; otherwise ``vision`` as it is, for the model's forward. The
        rollout's prompts come as pixels: their block took the model's forward before (0.08 s of a zoom
        step's prompt encoding, most of it the forward's plumbing around ~30 tokens a row)."""
        if vision.empty or vision.has_encoded or not self.takes_images or holds_shards(self.model):
            return vision
        params = next(self.model.parameters())
        features = self.adapter.encode_images(self.model, vision, params.device, params.dtype)
        return vision if features is None else VisionInputs(vision.seqs, vision.images_per_seq, features)

    def embed(self, ids: Tensor, vision: VisionInputs) -> Tensor:
        """The input embeddings of ids (n, W), image features over the placeholders: (n, W, H)."""
        h = self.step.text.embed_tokens(ids)  # (n, W, H)
        if vision.empty:
            return h
        kw = self.adapter.vision_kwargs(vision, h.device, h.dtype)
        features = torch.cat(kw["mm_encoder_outputs"]["image"].pooler_output, dim=0).to(h.device, h.dtype)
        where = self.inner.get_placeholder_mask(ids, inputs_embeds=h, image_features=features)
        where = where[0] if isinstance(where, tuple) else where  # Qwen-VL: (image, video); LLaVA: image
        return h.masked_scatter(where, features)  # (n, W, H)

    def __call__(self, ids: Tensor, mask: Tensor, vision: VisionInputs, positions: Tensor, cache) -> Encoded:
        """ids (n, W) a block, left-padded, after ``cache`` (None: nothing before it); mask (n, C + W) the
        cache's columns then the block's (0 on padding and holes); positions (n, W), or (3, n, W) with
        M-RoPE. Each real token attends the cache's real columns and the block's real tokens up to itself.
        Returns the logits of each row's last column, (n, 1, V), and the cache with the block appended."""
        step, tm = self.step, self.step.text
        n, W = ids.shape
        h = self.embed(ids, vision)  # (n, W, H)
        cos, sin = tm.rotary_emb(h, positions)  # (n, W, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (n, 1, W, D) broadcast over heads
        if cache is None:
            cache = DynamicCache(config=self.config)
        C = mask.shape[1] - W
        real = mask.bool()  # (n, C + W)
        # a padding column attends itself, so that no row of the softmax is empty; nothing reads it
        bias = lean.block_bias(real[:, :C], real[:, C:], h.dtype, attend_self=True)  # (n, W, C + W)
        bias = bias[:, None]  # (n, 1, W, C + W) additive
        for i, layer in enumerate(tm.layers):
            x = step.norm(layer.input_layernorm, h)  # (n, W, H)
            h = h + _attention(layer.self_attn, x, cos, sin, bias, cache, i)
            h = h + layer.mlp(step.norm(layer.post_attention_layernorm, h))
        logits = step.lm_head(step.norm(tm.norm, h[:, -1:]))  # (n, 1, V)
        return Encoded(logits=logits, cache=cache)


def _attention(attn, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, cache, i: int) -> Tensor:
    """One layer's self-attention for a block of W tokens per row on the cache's earlier columns:
    x (n, W, H) -> (n, W, H); the block's keys and values are appended to layer ``i`` of ``cache``."""
    n, W, _ = x.shape
    q, k, v = lean_pass.rotated_qkv(attn, x, cos, sin)  # (n, Hq, W, D), (n, Hk, W, D) twice
    Hq, D = q.shape[1], q.shape[3]
    keys, values = cache.update(k, v, i)  # (n, Hk, C + W, D) each, the block included
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=bias, scale=attn.scaling, enable_gqa=Hq != keys.shape[1]
    )  # (n, Hq, W, D)
    return attn.o_proj(out.transpose(1, 2).reshape(n, W, Hq * D))  # (n, W, H)


def for_model(model, adapter: CausalLMAdapter) -> PromptEncoder | None:
    """The lean prompt encoder for ``model``, or None where its own forward must run (the conditions of
    ``lean_pass.for_model``: the lean passes on, the CPU, a layout the lean step reproduces, no attention
    dropout while training), and not in a training pass of a DDP-wrapped model: DDP readies its gradient
    hooks in its own forward, so such a pass must run one (the response passes call the layers directly)."""
    passes = lean_pass.for_model(model, adapter)
    if passes is None:
        return None
    if torch.is_grad_enabled() and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    encoder = PromptEncoder(model, adapter, passes.step)
    mrope = adapter.uses_mrope(model)
    return (
        encoder
        if lean_gate.agrees(model, "prompt encoding", lambda p: probe_pairs(encoder, p, mrope))
        else None
    )


def probe_pairs(encoder: PromptEncoder, p: lean_gate.Probe, mrope: bool) -> list[tuple[Tensor, Tensor]]:
    """The encoder's last-column logits for the probe's prompt from nothing, then for the rest as a block
    on the cache it filled, beside the forward's log-probs at those columns."""
    ids, P = p.ids, p.prompt  # (N, T)
    N, T = ids.shape
    ones, none = torch.ones_like(ids), VisionInputs.none(N)  # (N, T)
    head = encoder(ids[:, :P], ones[:, :P], none, p.positions(0, P, mrope), None)
    tail = encoder(ids[:, P:], ones, none, p.positions(P, T, mrope), head["cache"])
    return [(head.logits[:, -1], p.logprobs[:, P - 1]), (tail.logits[:, -1], p.logprobs[:, T - 1])]
