"""A lean decode step: one new token per row through the decoder layers, called directly; and a later
turn's block of new text tokens the same way (``LeanStep.block``).

A Hugging Face forward for one token per row spends most of its time outside the arithmetic on a small
model: output-capturing and deprecation wrappers, keyword plumbing through every layer, a new 4-D causal
mask built from the 2-D mask at every step, and (with the grouped-query setting mmgrpo uses for training
passes on the CPU) key/value heads expanded per query head. This step runs the same modules (embedding,
rotary embedding, norms, projections, MLP, LM head: LoRA-wrapped ones too) and the same cache layers, with
one boolean mask (N, 1, 1, L) read straight from the decode state and attention on the key/value heads
(the G query heads of a group as G query rows: no copies). For one decode loop the plain projections are
taken without their modules, q/k/v and gate/up each as one product (``LeanStep.joined``). Same numbers as
the model's forward (tested through the sampled = trained log-probs checks of every family, and in
tests/test_lean_decode.py).

Which models: it checks the layout, not the family name: every decoder layer made of exactly
``self_attn``, ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``, the attention of exactly q/k/v/o
projections (and per-head ``q_norm`` / ``k_norm``, as Qwen3's), a plain embedding, full attention in every
layer. That is the Llama-style stack of Qwen2, Qwen2-VL, Qwen2.5-VL, Qwen3, Qwen3-VL, Llama and LLaVA's
language model in the tiny families; Gemma 3 (extra norms, scaled embeddings, sliding layers), Idefics3's
text model and custom code decode through the model's own forward (``stepper`` returns None).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from mmgrpo.model import lean_gate
from mmgrpo.model.adapters import holds_shards, unwrap
from mmgrpo.model.prefix import SharedPrefix, grouped_attention

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PARTS = ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"q_norm", "k_norm"})
"""The child modules of a layer and of its attention that this step reproduces (the second set optional)."""
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
POSITION_DEPENDENT_ROPE = {"dynamic", "longrope"}
"""Rotary kinds that recompute their frequencies from the longest position they are called with."""
FUSE_MAX_BYTES = 64 * 2**20
"""A decode loop joins each layer's q, k, v projections into one product, and gate and up into one, when the
joined copies take at most this many bytes in all. On a small model a decode step is per-operator overhead
(with the plain projections called without their modules, the tiny model's step of 8 rows went from 2.0
to 1.8 ms); on a large one it is arithmetic, and the copies would cost memory (a 3B model's would be 3-4
GB), so it keeps the separate products."""


@dataclasses.dataclass(frozen=True)
class Joined:
    """One layer's projections for one decode loop (the weights as they are when it starts; a loop never
    changes them). ``qkv``: q, k, v stacked (Hq*D + 2*Hk*D, H), ``sizes`` their output widths; ``gate_up``:
    gate and up stacked (2I, H); ``o``, ``down``: a plain projection's own weight and bias, taken as they
    are (no copy); None where that part goes through its modules (LoRA-wrapped ones, other MLPs)."""

    qkv: Tensor | None
    qkv_bias: Tensor | None
    sizes: tuple[int, int, int]
    o: tuple[Tensor, Tensor | None] | None
    gate_up: Tensor | None
    silu: bool  # the MLP's activation is a plain SiLU
    down: tuple[Tensor, Tensor | None] | None


@dataclasses.dataclass(frozen=True)
class Rotations:
    """cos, sin (K, 1, D) of the text positions ``first`` .. ``first + K - 1`` (see ``LeanStep.rotations``)."""

    first: int
    cos: Tensor
    sin: Tensor

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (N, 1, D) at positions (N,), each within the table."""
        at = positions - self.first  # (N,)
        return self.cos.index_select(0, at), self.sin.index_select(0, at)


class LeanStep:
    """``step(ids, positions, mask, cache) -> logits`` for the model it was made for (see ``stepper``)."""

    def __init__(self, text_model, lm_head, mrope: bool) -> None:
        self.text, self.lm_head, self.mrope = text_model, lm_head, mrope
        norms = [text_model.norm] + [
            n for x in text_model.layers for n in (x.input_layernorm, x.post_attention_layernorm)
        ]
        self.plain_norms = {id(n) for n in norms if _is_plain_rms_norm(n)}
        self.gated_mlps = {id(x.mlp) for x in text_model.layers if _is_gated_mlp(x.mlp)}

    def _rotary(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary embedding's cos, sin (N, 1, D) at text positions (N,) (M-RoPE: all three alike)."""
        pos = positions[:, None]  # (N, 1)
        return self.text.rotary_emb(h[:, None], pos.unsqueeze(0).expand(3, -1, -1) if self.mrope else pos)

    @torch.no_grad()
    def rotations(self, first: int, last: int) -> Rotations | None:
        """The rotary embedding's cos and sin at every text position ``first`` .. ``last``, computed once
        for a decode loop. A step then takes its rows' by index instead of calling the rotary embedding
        (about 20 operators, 56 us a step on the tiny model); each position's values are an element-wise
        function of it, so they are the same (tests/test_lean_decode.py). None for the rotary kinds whose
        frequencies depend on the longest position of the call (dynamic NTK, LongRoPE)."""
        if str(getattr(self.text.rotary_emb, "rope_type", "default")) in POSITION_DEPENDENT_ROPE:
            return None
        w = self.text.embed_tokens.weight  # (V, H): the hidden states' dtype and device
        pos = torch.arange(first, last + 1, device=w.device)  # (K,)
        h = w.new_zeros((len(pos), 1))  # (K, 1): the rotary embedding reads only its dtype and device
        cos, sin = self._rotary(h, pos)  # (K, 1, D)
        return Rotations(first, cos, sin)

    @torch.no_grad()
    def joined(self) -> list[Joined] | None:
        """Each layer's projections for one decode loop (see ``Joined``), from the weights as they are now;
        None when the stacked copies would exceed ``FUSE_MAX_BYTES`` (every projection then goes through
        its module)."""
        out, size = [], 0
        for layer in self.text.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [attn.q_proj, attn.k_proj, attn.v_proj]
            qkv = qkv_bias = gate_up = None
            if all(_plain(m) for m in parts) and len({m.bias is None for m in parts}) == 1:
                qkv = torch.cat([m.weight for m in parts])  # (Hq*D + 2*Hk*D, H)
                qkv_bias = None if parts[0].bias is None else torch.cat([m.bias for m in parts])
            # a gated MLP whose gate and up have not been wrapped (LoRA) since the step was made
            gated = id(mlp) in self.gated_mlps and _plain(mlp.gate_proj) and _plain(mlp.up_proj)
            if gated:
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2I, H)
            sizes = tuple(getattr(m, "out_features", 0) for m in parts)
            silu = gated and type(mlp.act_fn) is torch.nn.SiLU
            down = _own(mlp.down_proj) if gated else None
            out.append(Joined(qkv, qkv_bias, sizes, _own(attn.o_proj), gate_up, silu, down))
            size += sum(t.numel() * t.element_size() for t in (qkv, qkv_bias, gate_up) if t is not None)
        return None if size > FUSE_MAX_BYTES else out

    def __call__(
        self,
        ids: Tensor,
        positions: Tensor,
        mask: Tensor,
        cache,
        prefix: SharedPrefix | None = None,
        joined: list[Joined] | None = None,
        table: Rotations | None = None,
    ) -> Tensor:
        """ids (N,) the tokens fed, positions (N,) theirs, mask (N, L) of the sequence after they are
        added (1 = attend). Returns the next-token logits (N, V); the cache grows by one column per layer.
        With ``prefix`` the cache holds each row's own tokens only and the first ``prefix.length``
        columns of ``mask`` are its group's prompt (see mmgrpo.model.prefix). ``joined``: this decode
        loop's ``joined()`` (None: every projection through its module); ``table``: this loop's
        ``rotations`` (None: the rotary embedding called on ``positions``)."""
        tm = self.text
        h = tm.embed_tokens(ids)  # (N, H)
        if table is not None:
            cos, sin = table.at(positions)  # (N, 1, D)
        else:
            cos, sin = self._rotary(h, positions)  # (N, 1, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, 1, D) broadcast over heads
        if prefix is None:
            attend = mask.bool()[:, None, None, :]  # (N, 1, 1, L)
        else:
            own = mask[:, prefix.length :]  # (N, R)
            neg = torch.finfo(h.dtype).min
            attend = torch.zeros(own.shape, dtype=h.dtype, device=h.device).masked_fill(own == 0, neg)
            attend = attend[:, None, None, :]  # (N, 1, 1, R) additive
        norm = self.norm
        for i, layer in enumerate(tm.layers):
            j = joined[i] if joined is not None else None
            x = norm(layer.input_layernorm, h)
            h = h + self._attention(layer.self_attn, x, cos, sin, attend, cache.layers[i], prefix, i, j)
            h = h + self._mlp(layer, norm(layer.post_attention_layernorm, h), j)
        h = norm(tm.norm, h)  # (N, H)
        return self.lm_head(h)  # (N, V)

    def block(
        self,
        ids: Tensor,
        positions: Tensor,
        mask: Tensor,
        cache,
        prefix: SharedPrefix,
        joined: list[Joined] | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """W new tokens per row, left-padded, on a decode state whose prompts are held once per group
        (``prefix``). ``embeds`` (N, W, H): the block's input embeddings when they are not the ids' own
        (image features over the placeholders, ``mmgrpo.model.image_blocks``). ids (N, W); positions
        (N, W), or (3, N, W) with M-RoPE; mask (N, P + R + W) of the sequence after the block, its last W
        columns the block's (0 on padding). Each token attends its group's prompt, the row's own tokens
        and the block's tokens up to itself. Returns each row's next-token logits (N, V), read at the
        block's last column; the cache grows by W columns per layer."""
        tm = self.text
        N, W = ids.shape
        h = tm.embed_tokens(ids) if embeds is None else embeds  # (N, W, H)
        cos, sin = tm.rotary_emb(h, positions)  # (N, W, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, W, D) broadcast over heads
        own = mask[:, prefix.length :].bool()  # (N, R + W)
        bias = block_bias(own[:, :-W], own[:, -W:], h.dtype)  # (N, W, R + W)
        norm = self.norm
        for i, layer in enumerate(tm.layers):
            j = joined[i] if joined is not None else None
            x = norm(layer.input_layernorm, h)  # (N, W, H)
            h = h + self._block_attention(layer.self_attn, x, cos, sin, bias, cache.layers[i], prefix, i, j)
            h = h + self._mlp(layer, norm(layer.post_attention_layernorm, h), j)
        return self.lm_head(norm(tm.norm, h[:, -1]))  # (N, V)

    @staticmethod
    def _mlp(layer, x: Tensor, j: Joined | None) -> Tensor:
        """The layer's MLP on x (..., H); with ``j``, gate and up in one product and no module calls."""
        if j is not None and j.gate_up is not None:  # down(act(gate x) * up x)
            mlp = layer.mlp
            gate, up = F.linear(x, j.gate_up).chunk(2, dim=-1)  # (..., I) each
            return _linear(mlp.down_proj, j.down, (F.silu(gate) if j.silu else mlp.act_fn(gate)) * up)
        return layer.mlp(x)

    @staticmethod
    def _block_attention(
        attn, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, layer, prefix, i: int, joined: Joined | None
    ) -> Tensor:
        """One layer's self-attention for W new tokens per row: x (N, W, H) -> (N, W, H); bias (N, W, R + W)
        additive over the row's own tokens and the block."""
        N, W, _ = x.shape
        D = attn.head_dim
        q, k, v, _ = _project(attn, x, joined)  # (N, W, Hq*D), (N, W, Hk*D) twice
        q, k, v = q.reshape(N, W, -1, D), k.reshape(N, W, -1, D), v.reshape(N, W, -1, D)  # (N, W, heads, D)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        Hq = q.shape[2]
        qk = torch.cat([q, k], dim=2).transpose(1, 2)  # (N, Hq + Hk, W, D)
        q, k = _rotate(qk, cos, sin).split([Hq, qk.shape[1] - Hq], dim=1)  # (N, Hq, W, D), (N, Hk, W, D)
        keys, values = layer.update(k, v.transpose(1, 2))  # (N, Hk, R + W, D) each, the block included
        Hk = keys.shape[1]
        g = Hq // Hk
        q = q.reshape(N, Hk, g * W, D)  # (N, Hk, g*W, D): a group's query heads' tokens as query rows
        C = bias.shape[-1]
        rest = bias[:, None, None].expand(N, 1, g, W, C).reshape(N, 1, g * W, C)  # (N, 1, g*W, R + W)
        out = grouped_attention(q, keys, values, rest, prefix, i, attn.scaling)  # (N, Hk, g*W, D)
        out = out.reshape(N, Hq, W, D).transpose(1, 2).reshape(N, W, Hq * D)  # (N, W, Hq*D)
        return _linear(attn.o_proj, joined.o if joined is not None else None, out)  # (N, W, H)

    def norm(self, module, x: Tensor) -> Tensor:
        """``module(x)``, as one fused RMS norm when ``module`` was found to be a plain one."""
        if id(module) in self.plain_norms:
            return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
        return module(x)

    @staticmethod
    def _attention(
        attn,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attend: Tensor,
        layer,
        prefix,
        i: int,
        joined: Joined | None,
    ) -> Tensor:
        """One layer's self-attention for one new token per row: x (N, H) -> (N, H)."""
        N = x.shape[0]
        D = attn.head_dim
        q, k, v, qkv = _project(attn, x, joined)  # (N, Hq*D), (N, Hk*D) twice
        Hq = q.shape[-1] // D
        v = v.reshape(N, -1, 1, D)  # (N, Hk, 1, D)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
            qk = torch.cat([attn.q_norm(q.reshape(N, -1, 1, D)), attn.k_norm(k.reshape(N, -1, 1, D))], dim=1)
        elif qkv is not None:
            qk = qkv[:, : q.shape[-1] + k.shape[-1]].view(N, -1, 1, D)  # (N, Hq + Hk, 1, D): joined already
        else:
            qk = torch.cat([q.reshape(N, -1, 1, D), k.reshape(N, -1, 1, D)], dim=1)  # (N, Hq + Hk, 1, D)
        q, k = _rotate(qk, cos, sin).split([Hq, qk.shape[1] - Hq], dim=1)  # one rotation of both
        keys, values = layer.update(k, v)  # (N, Hk, L, D) each, the new column included
        Hk = keys.shape[1]
        q = q.reshape(N, Hk, Hq // Hk, D)  # (N, Hk, G, D): a group's query heads as G query rows
        if prefix is not None:
            out = grouped_attention(q, keys, values, attend, prefix, i, attn.scaling)  # (N, Hk, G, D)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=attn.scaling)
        return _linear(
            attn.o_proj, joined.o if joined is not None else None, out.reshape(N, Hq * D)
        )  # (N, H)


def _project(attn, x: Tensor, joined: Joined | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v of x (..., H): (..., Hq*D), (..., Hk*D), (..., Hk*D), in one product when the layer's
    projections are ``joined`` (then also that product, (..., Hq*D + 2*Hk*D), of which they are views)."""
    if joined is not None and joined.qkv is not None:
        nq, nk, _ = joined.sizes
        qkv = F.linear(x, joined.qkv, joined.qkv_bias)
        return qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :], qkv
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), None


def _plain(module) -> bool:
    return type(module) is torch.nn.Linear


def _own(module) -> tuple[Tensor, Tensor | None] | None:
    """A plain linear's weight and bias (the parameters themselves), else None."""
    return (module.weight, module.bias) if _plain(module) else None


def _linear(module, own: tuple[Tensor, Tensor | None] | None, x: Tensor) -> Tensor:
    """``module(x)``; with ``own`` (a plain linear's weight and bias) the product without the module call."""
    return F.linear(x, *own) if own is not None else module(x)


def _is_plain_rms_norm(module) -> bool:
    """Whether ``module`` computes ``weight * x / sqrt(mean(x^2) + eps)`` (checked on a probe vector, so
    that a variant such as Gemma's ``(1 + weight)`` never passes for it)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return False
    probe = torch.linspace(-2.0, 3.0, weight.shape[0], device=weight.device, dtype=weight.dtype)[None]
    with torch.no_grad():
        want = module(probe)
        got = F.rms_norm(probe, (weight.shape[0],), weight, eps)
    return want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-5, atol=1e-6))


def _is_gated_mlp(mlp) -> bool:
    """Whether ``mlp`` computes ``down(act(gate(x)) * up(x))`` with plain bias-free linear gate and up
    (checked on a probe, so that another MLP with the same children never passes for it)."""
    if {n for n, _ in mlp.named_children()} != MLP_PARTS:
        return False
    gate, up = mlp.gate_proj, mlp.up_proj
    if not all(type(m) is torch.nn.Linear and m.bias is None for m in (gate, up)):
        return False
    w = gate.weight
    probe = torch.linspace(-2.0, 3.0, w.shape[1], device=w.device, dtype=w.dtype)[None]
    with torch.no_grad():
        want = mlp(probe)
        got = mlp.down_proj(mlp.act_fn(gate(probe)) * up(probe))
    return want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-5, atol=1e-6))


def block_bias(earlier: Tensor, block: Tensor, dtype: torch.dtype, attend_self: bool = False) -> Tensor:
    """The additive mask (n, W, C + W) of a block of W new tokens per row after C earlier columns: each
    token attends the earlier columns that are real (``earlier`` (n, C), bool) and the block's real tokens
    (``block`` (n, W), bool) up to itself; 0 where it attends, the dtype's min elsewhere. ``attend_self``:
    every token attends itself too, padding included, so that no row of the softmax is empty."""
    n, C = earlier.shape
    W = block.shape[1]
    causal = torch.ones((W, W), dtype=torch.bool, device=block.device).tril()  # (W, W): t sees <= t
    own = block[:, None, :] & causal  # (n, W, W)
    if attend_self:
        own = own | torch.eye(W, dtype=torch.bool, device=block.device)
    allowed = torch.cat([earlier[:, None, :].expand(n, W, C), own], dim=2)  # (n, W, C + W)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=block.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x (N, heads, 1, D) with cos, sin (N, 1, 1, D) (the halves convention)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stepper(model, mrope: bool = False) -> LeanStep | None:
    """The lean step for ``model``, made and checked once per model: None where the model's own forward
    must run (``lean_gate``: a model type off the list, a config the step ignores, a layout it does not
    reproduce, or a decode step / block whose numbers differ from the forward's), and while the model
    holds FSDP shards (the step reads the layers' weights directly)."""
    key = unwrap(model)
    if holds_shards(key):
        return None
    if key not in _STEPS:
        step = make_stepper(model, mrope)
        check = None if step is None else (lambda p: probe_pairs(step, p, mrope))
        _STEPS[key] = (step if lean_gate.agrees(model, "decode step", check) else None,)
    return _STEPS[key][0]


def probe_pairs(step: LeanStep, p: lean_gate.Probe, mrope: bool) -> list[tuple[Tensor, Tensor]]:
    """The step's logits on the probe beside the forward's log-probs at the same columns: a decode step on
    the model's own prompt cache; then, on that prompt held as a shared prefix, a block of 3 tokens and a
    decode step after it (the later-turn path)."""
    ids, P = p.ids, p.prompt  # (N, T)
    ones = torch.ones_like(ids)  # (N, T)
    pos = p.positions(P, P + 1, False)[:, 0]  # (N,)
    first = step(ids[:, P], pos, ones[:, : P + 1], p.prefill(P))  # (N, V)
    prefix, rest = SharedPrefix.split(p.prefill(P), ones[:, :P], 1)
    W = 3
    block = step.block(ids[:, P : P + W], p.positions(P, P + W, mrope), ones[:, : P + W], rest, prefix)
    after = step(ids[:, P + W], pos + W, ones[:, : P + W + 1], rest, prefix)  # (N, V)
    return [(first, p.logprobs[:, P]), (block, p.logprobs[:, P + W - 1]), (after, p.logprobs[:, P + W])]


def make_stepper(model, mrope: bool = False) -> LeanStep | None:
    """The lean step for ``model`` (``mrope``: its rotary embedding takes 3-D positions, see the
    adapter's ``uses_mrope``), or None when its layout is not the one this module reproduces."""
    if lean_gate.refusal(model) is not None:  # a model type off the list, a config the step ignores
        return None
    m = lean_gate.bare(model)
    text_config = m.config.get_text_config()
    inner = getattr(m, "model", None)
    text = getattr(inner, "language_model", inner)
    lm_head = getattr(m, "lm_head", None)
    layers = getattr(text, "layers", None)
    if (
        lm_head is None
        or not layers
        or not all(hasattr(text, a) for a in ("embed_tokens", "rotary_emb", "norm"))
    ):
        return None
    if type(text.embed_tokens) is not torch.nn.Embedding:  # e.g. Gemma's scaled embedding
        return None
    if any(t != "full_attention" for t in (getattr(text_config, "layer_types", None) or [])):
        return None
    if getattr(text_config, "use_sliding_window", False) or getattr(
        text_config, "attn_logit_softcapping", None
    ):
        return None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        parts = {n for n, _ in layer.named_children()}
        own = {n for n, _ in attn.named_children()} if attn is not None else set()
        if parts != LAYER_PARTS or not (
            own == ATTENTION_PARTS[0] or own == ATTENTION_PARTS[0] | ATTENTION_PARTS[1]
        ):
            return None
        if not (hasattr(attn, "head_dim") and hasattr(attn, "scaling")):
            return None
    return LeanStep(text, lm_head, mrope)
