"""A lean decode step: one new token per row through the decoder layers, called directly.

A Hugging Face forward for one token per row spends most of its time outside the arithmetic on a small
model: output-capturing and deprecation wrappers, keyword plumbing through every layer, a new 4-D causal
mask built from the 2-D mask at every step, and (with the grouped-query setting mmgrpo uses for training
passes on the CPU) key/value heads expanded per query head. This step runs the same modules (embedding,
rotary embedding, norms, projections, MLP, LM head: LoRA-wrapped ones too) and the same cache layers, with
one boolean mask (N, 1, 1, L) read straight from the decode state and attention on the key/value heads
(the G query heads of a group as G query rows: no copies). Same numbers as the model's forward (tested
through the sampled = trained log-probs checks of every family).

Layouts it knows: the Llama-style decoder layer (``input_layernorm``, ``self_attn`` with q/k/v/o
projections, ``post_attention_layernorm``, ``mlp``) of Qwen2, Qwen2-VL, Qwen2.5-VL, Llama and Qwen3 (with
its per-head q/k norms), full attention in every layer. Anything else (sliding windows, Qwen3-VL's
interleaved M-RoPE and deepstack, Gemma 3, Idefics3's text model, custom code) decodes through the model's
own forward: ``stepper`` returns None for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mmgrpo.model.adapters import unwrap
from mmgrpo.model.prefix import SharedPrefix, grouped_attention

LAYERS = {"Qwen2DecoderLayer", "Qwen2VLDecoderLayer", "Qwen2_5_VLDecoderLayer", "LlamaDecoderLayer", "Qwen3DecoderLayer"}
"""Decoder layer classes whose forward this step reproduces."""
MROPE_MODELS = {"qwen2_vl", "qwen2_5_vl"}
"""Model types whose rotary embedding takes 3-D positions (a text token: the same position three times)."""


class LeanStep:
    """``step(ids, positions, mask, cache) -> logits`` for the model it was made for (see ``stepper``)."""

    def __init__(self, text_model, lm_head, mrope: bool) -> None:
        self.text, self.lm_head, self.mrope = text_model, lm_head, mrope

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor, cache, prefix: SharedPrefix | None = None) -> Tensor:
        """ids (N,) the tokens fed, positions (N,) theirs, mask (N, L) of the sequence after they are
        added (1 = attend). Returns the next-token logits (N, V); the cache grows by one column per layer.
        With ``prefix`` the cache holds each row's own tokens only and the first ``prefix.length``
        columns of ``mask`` are its group's prompt (see mmgrpo.model.prefix)."""
        tm = self.text
        h = tm.embed_tokens(ids[:, None])  # (N, 1, H)
        pos = positions[:, None]  # (N, 1)
        cos, sin = tm.rotary_emb(h, pos.unsqueeze(0).expand(3, -1, -1) if self.mrope else pos)  # (N, 1, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, 1, D) broadcast over heads
        if prefix is None:
            attend = mask.bool()[:, None, None, :]  # (N, 1, 1, L)
        else:
            own = mask[:, prefix.length :]  # (N, R)
            neg = torch.finfo(h.dtype).min
            attend = torch.zeros(own.shape, dtype=h.dtype, device=h.device).masked_fill(own == 0, neg)
            attend = attend[:, None, None, :]  # (N, 1, 1, R) additive
        for i, layer in enumerate(tm.layers):
            x = layer.input_layernorm(h)
            h = h + self._attention(layer.self_attn, x, cos, sin, attend, cache.layers[i], prefix, i)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = tm.norm(h)  # (N, 1, H)
        return self.lm_head(h[:, -1, :])  # (N, V)

    @staticmethod
    def _attention(attn, x: Tensor, cos: Tensor, sin: Tensor, attend: Tensor, layer, prefix, i: int) -> Tensor:
        """One layer's self-attention for one new token per row: x (N, 1, H) -> (N, 1, H)."""
        N = x.shape[0]
        D = attn.head_dim
        q = attn.q_proj(x).view(N, 1, -1, D)  # (N, 1, Hq, D)
        k = attn.k_proj(x).view(N, 1, -1, D)  # (N, 1, Hk, D)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (N, Hq, 1, D), (N, Hk, 1, D)
        v = attn.v_proj(x).view(N, 1, -1, D).transpose(1, 2)  # (N, Hk, 1, D)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = layer.update(k, v)  # (N, Hk, L, D) each, the new column included
        Hq, Hk = q.shape[1], keys.shape[1]
        q = q.reshape(N, Hk, Hq // Hk, D)  # (N, Hk, G, D): a group's query heads as G query rows
        if prefix is not None:
            out = grouped_attention(q, keys, values, attend, prefix, i, attn.scaling)  # (N, Hk, G, D)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=attn.scaling)
        return attn.o_proj(out.reshape(N, 1, Hq * D))  # (N, 1, H)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x (N, heads, 1, D) with cos, sin (N, 1, 1, D) (the halves convention)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def stepper(model) -> LeanStep | None:
    """The lean step for ``model``, or None when its layout is not one this module knows."""
    m = unwrap(model)
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    config = m.config
    text_config = config.get_text_config()
    inner = getattr(m, "model", None)
    text = getattr(inner, "language_model", inner)
    lm_head = getattr(m, "lm_head", None)
    layers = getattr(text, "layers", None)
    if lm_head is None or layers is None or not all(type(x).__name__ in LAYERS for x in layers):
        return None
    if any(t != "full_attention" for t in (getattr(text_config, "layer_types", None) or [])):
        return None
    if getattr(text_config, "use_sliding_window", False) or getattr(text_config, "attn_logit_softcapping", None):
        return None
    if not all(hasattr(text, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return None
    return LeanStep(text, lm_head, config.model_type in MROPE_MODELS)
