"""A lean training pass: each row's response tokens on its group's prompt cache, through the decoder layers
called directly, with the graph kept.

A training or reference pass (``engine.response_blocks_shared``) runs the responses of a batch on the KV
cache of their prompts. Through the model's own forward, a block of 32 rows x 16 tokens on the tiny model
spends part of its time outside the arithmetic: output-capturing wrappers, keyword plumbing through every
layer, a 4-D mask built by the masking utilities, key/value heads copied per query head, RMS norms as
seven operators each; and the backward walks one autograd node per operator. This pass runs the same
modules (embedding, rotary embedding, norms, projections, MLP: LoRA-wrapped ones too) on the same cache
rows with one additive mask and one attention call per layer on the key/value heads, and returns the final
hidden states for ``mmgrpo.model.head`` to score. On the vs-TRL counting shape (4 prompts x G, 16 tokens,
one thread, 12 steps alternated in one process) the whole GRPO step went from 118.2 to 114.0 ms at G = 8
and from 161.4 to 159.0 ms at G = 16 (medians).

Which models: on the CPU, those whose layers ``mmgrpo.model.lean`` reproduces (``lean.stepper``: the Llama-style
stack of Qwen2/2.5/3-VL, LLaVA, Qwen3, Llama), in a pass whose responses hold no images (a tool's image
goes through the model's forward, which embeds it) and without attention dropout while training. Same
numbers as the model's forward (tests/test_lean_pass.py: log-probs and every gradient, to 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mmgrpo.model import lean, lean_gate
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.prefix import take_rows

LEAN_PASSES = True
"""Run text-only response passes through ``LeanPass`` where the model allows (False: always the model's
own forward; the tests compare both)."""


class LeanPass:
    """``hidden(...)`` for the model whose lean step is ``step`` (see ``for_model``)."""

    def __init__(self, step: lean.LeanStep) -> None:
        self.step = step

    def hidden(
        self, ids: Tensor, rmask: Tensor, positions: Tensor, prompt_mask: Tensor, cache, group: Tensor
    ) -> Tensor:
        """Final hidden states (n, t, H) of response tokens ids (n, t) (padding after a row's end: rmask 0),
        at ``positions`` (n, t), or (3, n, t) with M-RoPE, each row on its group's prompt: ``cache`` holds
        B prompts (one row each, (B, Hk, P, D) per layer), ``group`` (n,) says whose, ``prompt_mask``
        (n, P) which of that prompt's columns are real. Column j of a row attends its prompt's real
        columns and the row's real tokens up to j. Differentiable into the cache and every weight."""
        step, tm = self.step, self.step.text
        n, t = ids.shape
        h = tm.embed_tokens(ids)  # (n, t, H)
        cos, sin = tm.rotary_emb(h, positions)  # (n, t, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (n, 1, t, D) broadcast over heads
        bias = lean.block_bias(prompt_mask.bool(), rmask.bool(), h.dtype)[:, None]  # (n, 1, t, P + t)
        norm = step.norm
        for i, layer in enumerate(tm.layers):
            x = norm(layer.input_layernorm, h)  # (n, t, H)
            keys, values = cache.layers[i].keys, cache.layers[i].values  # (B, Hk, P, D) each
            h = h + _attention(layer.self_attn, x, cos, sin, bias, keys, values, group)
            h = h + layer.mlp(norm(layer.post_attention_layernorm, h))
        return norm(tm.norm, h)  # (n, t, H)


def _attention(
    attn, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, keys: Tensor, values: Tensor, group: Tensor
) -> Tensor:
    """One layer's self-attention for t tokens per row on its group's prompt keys / values:
    x (n, t, H) -> (n, t, H); bias (n, 1, t, P + t)."""
    n, t, _ = x.shape
    q, k, v = rotated_qkv(attn, x, cos, sin)  # (n, Hq, t, D), (n, Hk, t, D) twice
    Hq, D = q.shape[1], q.shape[3]
    k = torch.cat([take_rows(keys, group), k], dim=2)  # (n, Hk, P + t, D)
    v = torch.cat([take_rows(values, group), v], dim=2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
    )  # (n, Hq, t, D)
    return attn.o_proj(out.transpose(1, 2).reshape(n, t, Hq * D))  # (n, t, H)


def rotated_qkv(attn, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's queries, keys and values of x (n, t, H) through its modules (LoRA-wrapped ones too), the
    per-head norms (Qwen3) and the rotation applied: (n, Hq, t, D), (n, Hk, t, D), (n, Hk, t, D); cos, sin
    (n, 1, t, D)."""
    n, t, _ = x.shape
    D = attn.head_dim
    q, k, v, _ = lean._project(attn, x, None)  # (n, t, Hq*D), (n, t, Hk*D) twice
    q, k = q.view(n, t, -1, D), k.view(n, t, -1, D)  # (n, t, Hq, D), (n, t, Hk, D)
    v = v.view(n, t, -1, D).transpose(1, 2)  # (n, Hk, t, D)
    if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    Hq = q.shape[2]
    qk = torch.cat([q, k], dim=2).transpose(1, 2)  # (n, Hq + Hk, t, D)
    q, k = lean._rotate(qk, cos, sin).split([Hq, qk.shape[1] - Hq], dim=1)  # (n, Hq, t, D), (n, Hk, t, D)
    return q, k, v


def for_model(model, adapter) -> LeanPass | None:
    """The lean pass for ``model``, or None where its own forward must run: ``LEAN_PASSES`` off, a model
    off the CPU, a layout the lean step does not reproduce (or FSDP shards), or attention dropout that
    training would apply. Off the CPU the per-operator overhead this pass removes is a small share of a
    pass, and SDPA's grouped-query form with a mask may fall back to a kernel that holds every score
    (on long responses, gigabytes); the model's forward keeps its memory-efficient kernel there."""
    if not LEAN_PASSES:
        return None
    if next(unwrap(model).parameters()).device.type != "cpu":
        return None
    mrope = adapter.uses_mrope(model)
    step = lean.stepper(model, mrope)
    if step is None:
        return None
    if model.training and any(getattr(x.self_attn, "attention_dropout", 0.0) for x in step.text.layers):
        return None
    passes = LeanPass(step)
    return (
        passes if lean_gate.agrees(model, "training pass", lambda p: probe_pairs(passes, p, mrope)) else None
    )


def probe_pairs(passes: LeanPass, p: lean_gate.Probe, mrope: bool) -> list[tuple[Tensor, Tensor]]:
    """The pass's logits for the probe's last columns as responses on its prompts (the model's own cache,
    one group per row) beside the forward's log-probs there."""
    ids, P = p.ids, p.prompt  # (N, T)
    N, T = ids.shape
    ones = torch.ones_like(ids)  # (N, T)
    group = torch.arange(N, device=ids.device)  # (N,)
    hidden = passes.hidden(
        ids[:, P:], ones[:, P:], p.positions(P, T, mrope), ones[:, :P], p.prefill(P), group
    )
    return [(passes.step.lm_head(hidden), p.logprobs[:, P:])]  # (N, T - P, V) each
