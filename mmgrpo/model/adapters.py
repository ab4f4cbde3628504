"""Model-family adapters: everything that differs between Hugging Face model families, in one place.

The forward/decode engine (``mmgrpo.model.engine``) and the policy (``mmgrpo.model.policy``) ask the adapter; nothing
else names a family. An adapter answers:

- how one sequence's processor output becomes its vision tensors (``vision_of``) and how the tensors of
  several sequences become forward keywords (``forward_kwargs``): Qwen-VL concatenates patch rows and grids,
  LLaVA and Gemma 3 stack one (C, H, W) tensor per image, Idefics3 stacks sub-images under one batch row;
- which token-type ids the forward takes (Qwen-VL ``mm_token_type_ids``, Gemma 3 ``token_type_ids``, whose
  image tokens attend to each other both ways);
- how positions are laid out: 1-D text positions that skip left padding, or Qwen-VL's 3-D M-RoPE
  positions (temporal, height, width) whose text part is offset per row (``rope_deltas``) after images;
- which token ids the policy must never sample (image placeholders have no image behind them);
- how vision parameters are named (to freeze the encoder, give it its own learning rate, keep LoRA off it).

Stop ids are not the adapter's: they come from the checkpoint's generation_config (see ``Policy``).

| family (model_type)                       | adapter           | vision tensors per sequence            |
|-------------------------------------------|-------------------|----------------------------------------|
| any text-only causal LM (qwen2, llama...) | CausalLMAdapter   | none                                   |
| qwen2_vl, qwen2_5_vl, qwen3_vl            | QwenVLAdapter     | pixel_values (patches, dim), grid_thw  |
| llava                                     | LlavaAdapter      | pixel_values (images, C, H, W)         |
| idefics3, smolvlm                         | Idefics3Adapter   | pixel_values + pixel_attention_mask    |
| gemma3                                    | Gemma3Adapter     | pixel_values (images, C, H, W)         |

A new family is one subclass and one entry in ``FAMILIES``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError
from mmgrpo.model.batch import VisionInputs

TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
"""Processor outputs that describe the text; the adapter rebuilds token types from the ids itself."""


def unwrap(model):
    """The bare Hugging Face model under an Accelerate / DDP wrapper."""
    return getattr(model, "module", model)


def embedding_parameters(model) -> list[torch.nn.Parameter]:
    """The input token embedding's and the output head's weights (one when they are tied)."""
    bare = unwrap(model)
    out: list[torch.nn.Parameter] = []
    for module in (bare.get_input_embeddings(), bare.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and all(weight is not p for p in out):
            out.append(weight)
    return out


SHARDS_FLAG = "mmgrpo_holds_shards"
"""The attribute mmgrpo.train.fsdp sets on a model it shards: True while the parameters are shards, False
while they are gathered (so that asking is one attribute read, not a walk over the parameters)."""


def holds_shards(model) -> bool:
    """True while ``model``'s parameters are FSDP shards (DTensors, not gathered): only the model's own
    forward may then use them (it gathers each layer); code that reads weights directly (the lean decode
    step, the image-feature cache) must not."""
    return bool(getattr(unwrap(model), SHARDS_FLAG, False))


class CausalLMAdapter:
    """A text-only causal LM (Qwen2, Llama, ...): 1-D positions, no images."""

    name = "causal-lm"
    vision_param_keys: tuple[str, ...] = ("visual.", "vision_tower", "vision_model", "multi_modal_projector")

    def __init__(self, config) -> None:
        self.config = config
        self.image_token_id: int | None = None
        self.video_token_id: int | None = None
        self.suppress_ids: list[int] = []

    # ------------------------------------------------------------------------------------ vision tensors
    vision_keys: tuple[str, ...] = ()
    """Processor outputs passed to the forward (others, e.g. bookkeeping counts, are dropped)."""
    batched_keys: tuple[str, ...] = ()
    """Keys whose processor output carries a leading batch dimension per text (Idefics3's sub-images)."""

    def vision_of(self, enc: dict[str, Any]) -> dict[str, Tensor]:
        """One sequence's vision tensors from the processor output of that single sequence."""
        out = {}
        for k in self.vision_keys:
            v = enc.get(k)
            if isinstance(v, Tensor):
                out[k] = v[0] if k in self.batched_keys else v
        return out

    def split_vision(self, enc: dict[str, Any], counts: list[int]) -> list[dict[str, Tensor]] | None:
        """Per-sequence vision tensors from ONE processor call over several texts with ``counts`` images
        each (every count >= 1), or None when the family needs one processor call per text."""
        return None

    def vision_kwargs(self, vision: VisionInputs, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Forward keywords carrying the images of the sequences of ``vision``, in order."""
        if vision.empty:
            return {}
        v = vision.to(device, dtype=dtype)
        cached = vision.has_encoded and self.caches_encoder
        kw = {k: v.stacked(k) for k in v.keys() if not (cached and k in self.encoder_only_keys)}
        if cached:  # the features computed once by encode_images stand in for the pixels
            kw["mm_encoder_outputs"] = {"image": merge_encoded([e for e in vision.encoded if e is not None])}
        for k in self.batched_keys:
            if k in kw:
                kw[k] = kw[k].unsqueeze(
                    0
                )  # (1, images, ...): the model matches images to placeholders in order
        return kw

    def token_type_kwargs(self, ids: Tensor) -> dict[str, Tensor]:
        """Token-type ids the family's forward wants for ids (N, L), if any."""
        return {}

    # ------------------------------------------------------------------------------- encoder features
    caches_encoder: bool = False
    """Whether image features can be computed once (``encode_images``) and passed to later forwards as
    ``mm_encoder_outputs`` in place of the pixels."""
    encoder_keys: tuple[str, ...] = ()
    """Vision keys the family's ``get_image_features`` takes."""
    encoder_only_keys: tuple[str, ...] = ("pixel_values", "pixel_attention_mask")
    """Vision keys only the encoder reads: left out of a forward that is given cached features."""

    def encoder_config_kwargs(self) -> dict[str, Any]:
        """Extra keywords of ``get_image_features`` that the forward fills from the config."""
        return {}

    def encode_images(self, model, vision: VisionInputs, device, dtype) -> list[Any] | None:
        """Each sequence's image features, from ONE call of the model's ``get_image_features`` over all
        the images of ``vision`` (None for a sequence without images); None when the family cannot cache
        them or a sequence holds a video. Runs with whatever grad mode the caller set."""
        if not self.caches_encoder or vision.empty or any(k not in self.vision_keys for k in vision.keys()):
            return None
        if any(k.endswith("videos") or k == "video_grid_thw" for k in vision.keys()):
            return None
        inner = _inner_model(model)
        if inner is None or not hasattr(inner, "get_image_features"):
            return None
        kw = self.vision_kwargs(vision.without_encoded(), device, dtype)
        kw = {k: v for k, v in kw.items() if k in self.encoder_keys}
        out = inner.get_image_features(**kw, **self.encoder_config_kwargs(), return_dict=True)
        with_images = [s for s in vision.seqs if s]
        images = [n for n, s in zip(vision.images_per_seq, vision.seqs, strict=True) if s]
        rows = [int(s["pixel_values"].shape[0]) for s in with_images]  # images, or sub-images (Idefics3)
        parts = iter(split_encoded(out, images, rows))
        return [next(parts) if s else None for s in vision.seqs]

    def encode_repeats(self, model, vision: VisionInputs, device, dtype) -> VisionInputs:
        """``vision`` with its image features attached, each distinct sequence encoded once, when some
        sequences are the same tensors (the G rows of a group given the same zoomed view: the processor
        ran once for it, see ``Policy.encode_continuation``); otherwise ``vision`` unchanged, for the forward
        to encode. With a graph the features of a repeated sequence are one encoding used several times,
        so its gradient is the sum over the rows, as when each row encodes its own copy. On the zoom agent's
        steps about 16 distinct views of 128. Not for FSDP shards (an encoder call outside the forward, on
        some processes only, would desynchronise their collectives)."""
        if vision.empty or vision.has_encoded or not self.caches_encoder or holds_shards(model):
            return vision
        first: dict[tuple, int] = {}
        owner = [
            first.setdefault(tuple((k, id(v)) for k, v in s.items()), i) if s else None
            for i, s in enumerate(vision.seqs)
        ]  # per sequence, the first sequence holding the same tensors
        distinct = sorted({o for o in owner if o is not None})
        if len(distinct) == sum(o is not None for o in owner):
            return vision  # nothing repeats: the forward encodes as usual
        encoded = self.encode_images(model, vision.select(distinct), device, dtype)
        if encoded is None:
            return vision
        by_seq = dict(zip(distinct, encoded, strict=True))
        encoded_per_seq = [None if o is None else by_seq[o] for o in owner]
        return VisionInputs(vision.seqs, vision.images_per_seq, encoded_per_seq)

    # ------------------------------------------------------------------------------------ forward keywords
    def forward_kwargs(
        self, ids: Tensor, mask: Tensor, vision: VisionInputs, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        """Keyword arguments of a forward / generate call for ids (N, L) and their images."""
        kw = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        kw.update(self.vision_kwargs(vision, device, dtype))
        kw.update({k: v.to(device) for k, v in self.token_type_kwargs(ids).items()})
        return kw

    def speed_up(self, model) -> int:
        """Swap in equivalent, faster forwards for parts of ``model`` (see QwenVLAdapter); the count."""
        return 0

    # ------------------------------------------------------------------------------------------ positions
    def uses_mrope(self, model) -> bool:
        return False

    def text_positions(self, mask: Tensor, model) -> Tensor:
        """Positions that skip left padding: (N, L), or (3, N, L) for M-RoPE models."""
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, L)
        return pos.unsqueeze(0).expand(3, -1, -1) if self.uses_mrope(model) else pos

    def positions_given_to_prefill(self, mask: Tensor, vision: VisionInputs, model) -> Tensor | None:
        """Positions to pass to a prefill over ids with ``mask``; None lets the model compute them."""
        return self.text_positions(mask, model)

    continues_cache = True
    """Whether a filled KV cache can be continued with a block of new tokens whose rows hold holes
    (mask 0) and explicit positions: multi-turn decoding on one cache (mmgrpo.model.turns)."""
    images_on_cache = True
    """Whether that block may hold images (the forward embeds them on top of a filled cache)."""

    def block_positions(
        self, model, ids: Tensor, mask: Tensor, vision: VisionInputs, start: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Positions of a block of new tokens ids (n, W) (padding: mask 0) that follows a cache whose
        rows continue at ``start`` (n,): (n, W), or (3, n, W) for M-RoPE; and each row's next position
        after the block, (n,)."""
        start = start.to(mask.device)
        rel = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (n, W) text positions inside the block
        pos = start[:, None] + rel  # (n, W)
        after = start + mask.long().sum(dim=1)  # (n,)
        return (pos.unsqueeze(0).expand(3, -1, -1) if self.uses_mrope(model) else pos), after

    def prefill_delta(self, model, vision: VisionInputs) -> Tensor | None:
        """The per-row offset (N, 1) of text positions after a prefill (M-RoPE with images), else None."""
        return None

    # --------------------------------------------------------------------------------------- parameters
    def is_vision_param(self, name: str) -> bool:
        return any(k in name for k in self.vision_param_keys)


class VisionLanguageAdapter(CausalLMAdapter):
    """Common ground of the image-text-to-text families: an image placeholder id from the config, never
    sampled, and the ``pixel_values`` of every image."""

    name = "vision-language"
    vision_keys = ("pixel_values",)
    placeholder_attrs: tuple[str, ...] = ("image_token_id",)
    caches_encoder = True
    encoder_keys = ("pixel_values",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.image_token_id = _config_id(config, "image_token_id", "image_token_index")
        self.video_token_id = _config_id(config, "video_token_id")
        # placeholders the policy must never sample: a generated image token has no image behind it
        self.suppress_ids = sorted(
            {i for a in self.placeholder_attrs if (i := _config_id(config, a)) is not None}
        )

    def split_vision(self, enc: dict[str, Any], counts: list[int]) -> list[dict[str, Tensor]] | None:
        # one row per image in every vision tensor (LLaVA, Gemma 3): split by the counts
        total = sum(counts)
        keys = [k for k in self.vision_keys if isinstance(enc.get(k), Tensor)]
        if self.batched_keys or any(enc[k].shape[0] != total for k in keys):
            return None
        return [
            dict(zip(keys, parts, strict=True))
            for parts in zip(*(enc[k].split(counts) for k in keys), strict=True)
        ]


class QwenVLAdapter(VisionLanguageAdapter):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ``pixel_values`` rows per 14x14 (Qwen3: 16x16) patch,
    ``image_grid_thw`` per image (videos: ``pixel_values_videos``, ``video_grid_thw``),
    ``mm_token_type_ids`` (0 text, 1 image, 2 video) and 3-D M-RoPE positions.

    When a sequence holds images the model computes its own positions (``get_rope_index``) and leaves
    the per-row text offset in ``model.model.rope_deltas``; later tokens continue at text position + delta.
    """

    name = "qwen-vl"
    vision_keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    encoder_keys = ("pixel_values", "image_grid_thw")  # the grid stays in the forward (3-D positions)
    placeholder_attrs = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

    def token_type_kwargs(self, ids: Tensor) -> dict[str, Tensor]:
        tt = torch.zeros_like(ids, dtype=torch.int)  # (N, L) 0 text, 1 image, 2 video
        tt[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            tt[ids == self.video_token_id] = 2
        return {"mm_token_type_ids": tt}

    def split_vision(self, enc: dict[str, Any], counts: list[int]) -> list[dict[str, Tensor]] | None:
        if "image_grid_thw" not in enc or "video_grid_thw" in enc:
            return None
        grid = enc["image_grid_thw"]  # (images, 3)
        patches = grid.prod(dim=-1).split(counts)  # per text, its images' patch counts
        rows = enc["pixel_values"].split([int(p.sum()) for p in patches])  # pixel rows per text
        return [
            {"pixel_values": r, "image_grid_thw": g} for r, g in zip(rows, grid.split(counts), strict=True)
        ]

    def uses_mrope(self, model) -> bool:
        return hasattr(_inner_model(model), "rope_deltas")

    def speed_up(self, model) -> int:
        """The patch embedding as the matrix product it is: its Conv3d has kernel = stride = the whole
        (C, T, P, P) patch that the processor already flattened, so a convolution over a 1x1x1 output is a
        dot product with the flattened kernel. Same numbers (tested), without the 3-D convolution kernels
        (whose backward is slow on CPU and on some GPU stacks). Returns how many modules changed."""
        changed = 0
        for module in unwrap(model).modules():
            proj = getattr(module, "proj", None)
            if type(module).__name__.endswith("PatchEmbed") and isinstance(proj, torch.nn.Conv3d):
                if tuple(proj.kernel_size) == tuple(proj.stride) and proj.padding == (0, 0, 0):
                    module.forward = types.MethodType(_patch_embed_as_linear, module)
                    changed += 1
        return changed

    def positions_given_to_prefill(self, mask: Tensor, vision: VisionInputs, model) -> Tensor | None:
        if self.uses_mrope(model) and not vision.empty:
            return None  # the model's get_rope_index lays out the image patches in 3-D
        return self.text_positions(mask, model)

    def prefill_delta(self, model, vision: VisionInputs) -> Tensor | None:
        if self.uses_mrope(model) and not vision.empty:
            return _inner_model(model).rope_deltas  # (N, 1) offset left by the images
        return None

    def block_positions(
        self, model, ids: Tensor, mask: Tensor, vision: VisionInputs, start: Tensor
    ) -> tuple[Tensor, Tensor]:
        """With images in the block: the model's own 3-D layout of the block alone (text from 0, each
        image in (t, h, w) after it), shifted to each row's start -- the layout is translation invariant,
        so this equals the positions of those tokens in the whole sequence."""
        if vision.empty or not self.uses_mrope(model):
            return super().block_positions(model, ids, mask, vision, start)
        grids = {k: vision.stacked(k).cpu() for k in ("image_grid_thw", "video_grid_thw") if k in vision.keys()}
        ids, mask = ids.cpu(), mask.cpu()
        rel, delta = _inner_model(model).get_rope_index(
            ids, mm_token_type_ids=self.token_type_kwargs(ids)["mm_token_type_ids"], attention_mask=mask, **grids
        )  # (3, n, W), (n, 1): delta = largest position + 1 - real tokens
        start = start.cpu()
        after = start + mask.long().sum(dim=1) + delta.reshape(-1).cpu()  # (n,)
        return rel.cpu() + start[None, :, None], after


class LlavaAdapter(VisionLanguageAdapter):
    """LLaVA-1.5 style: a CLIP/SigLIP tower, ``pixel_values`` (images, C, H, W), one fixed-size block of
    ``<image>`` tokens per image, plain 1-D positions."""

    name = "llava"
    vision_keys = ("pixel_values", "image_sizes")
    vision_param_keys = ("vision_tower", "multi_modal_projector")
    encoder_keys = ("pixel_values", "image_sizes")

    def encoder_config_kwargs(self) -> dict[str, Any]:
        c = self.config
        return {
            "vision_feature_layer": c.vision_feature_layer,
            "vision_feature_select_strategy": c.vision_feature_select_strategy,
        }


class Idefics3Adapter(VisionLanguageAdapter):
    """Idefics3 / SmolVLM: a SigLIP tower and a pixel-shuffle connector. The processor returns
    ``pixel_values`` (1, sub-images, C, H, W) and ``pixel_attention_mask`` per text; the sub-images of all
    sequences go in one batch row (the model fills the ``<image>`` placeholders in order and drops all-zero
    padding images)."""

    name = "idefics3"
    images_on_cache = False  # not tested on a filled cache: a turn with images encodes again
    vision_keys = ("pixel_values", "pixel_attention_mask")
    batched_keys = ("pixel_values", "pixel_attention_mask")
    encoder_keys = ("pixel_values", "pixel_attention_mask")
    vision_param_keys = ("vision_model", "connector")


class Gemma3Adapter(VisionLanguageAdapter):
    """Gemma 3: a SigLIP tower, ``pixel_values`` (images, C, H, W), and ``token_type_ids`` (1 on image
    tokens) with which image tokens attend to each other in both directions (text stays causal)."""

    name = "gemma3"
    continues_cache = False  # its sliding-window cache layers keep only the last window of a row
    images_on_cache = False  # training on a shared prompt cache with response images: gradients off by 2e-3
    vision_param_keys = ("vision_tower", "multi_modal_projector")
    placeholder_attrs = ("image_token_id", "image_token_index", "boi_token_index", "eoi_token_index")

    def token_type_kwargs(self, ids: Tensor) -> dict[str, Tensor]:
        return {"token_type_ids": (ids == self.image_token_id).long()}  # (N, L)


FAMILIES: dict[str, type[CausalLMAdapter]] = {
    "qwen2_vl": QwenVLAdapter,
    "qwen2_5_vl": QwenVLAdapter,
    "qwen3_vl": QwenVLAdapter,
    "llava": LlavaAdapter,
    "idefics3": Idefics3Adapter,
    "smolvlm": Idefics3Adapter,
    "gemma3": Gemma3Adapter,
}
"""Vision-language model types with an adapter (config.model_type -> adapter class)."""


def _patch_embed_as_linear(module, hidden_states: Tensor) -> Tensor:
    """Forward of a Qwen-VL ``PatchEmbed`` as a product with its flattened Conv3d kernel: (patches,
    C*T*P*P) -> (patches, embed_dim). Bound to the module as a method, so a deep copy (the reference)
    binds it to the copy's own weights."""
    w = module.proj.weight  # (embed_dim, C, T, P, P)
    x = hidden_states.reshape(-1, w[0].numel()).to(w.dtype)  # (patches, C*T*P*P)
    return torch.nn.functional.linear(x, w.reshape(w.shape[0], -1), module.proj.bias)


def split_encoded(out, images: list[int], rows: list[int]) -> list[Any]:
    """Cut one ``get_image_features`` output into per-sequence outputs of the same class.

    ``pooler_output`` is a tuple with one tensor per image (Qwen-VL, LLaVA), cut by ``images``; a list
    with one tensor for the one batch row that holds every sub-image (Idefics3), cut by ``rows``; or one
    tensor with a leading row per image (Gemma 3), cut by ``rows``. Qwen3-VL's ``deepstack_features`` (per layer, one tensor per image) are cut per layer.
    """
    pooled = out.pooler_output
    per_image = _offsets(images)  # (start, end) of each sequence's images
    if isinstance(pooled, (tuple, list)) and len(pooled) == sum(images):
        cut = [tuple(pooled[a:b]) for a, b in per_image]
    elif isinstance(pooled, (tuple, list)) and len(pooled) == 1:  # one batch row holding every sub-image
        per_row = pooled[0].shape[0] // max(sum(rows), 1)  # feature rows per (sub-)image, Idefics3
        cut = [(t,) for t in pooled[0].split([r * per_row for r in rows])]
    elif isinstance(pooled, (tuple, list)):
        raise ValueError(f"cannot split image features of {len(pooled)} parts over {sum(images)} images")
    else:
        cut = list(pooled.split(rows))
    deep = getattr(out, "deepstack_features", None)
    deep_cut = None
    if deep is not None:
        deep_cut = [[tuple(layer[a:b]) for layer in deep] for a, b in per_image]
    parts = []
    for i, p in enumerate(cut):
        fields = {"pooler_output": p}
        if deep_cut is not None:
            fields["deepstack_features"] = deep_cut[i]
        parts.append(type(out)(**fields))
    return parts


def merge_encoded(parts: list[Any]) -> Any:
    """The inverse of :func:`split_encoded`: several sequences' features as one output, in order."""
    first = parts[0]
    if isinstance(first.pooler_output, (tuple, list)):
        pooled = tuple(t for p in parts for t in p.pooler_output)
    else:
        pooled = torch.cat([p.pooler_output for p in parts])
    fields = {"pooler_output": pooled}
    if getattr(first, "deepstack_features", None) is not None:
        layers = len(first.deepstack_features)
        fields["deepstack_features"] = [
            tuple(t for p in parts for t in p.deepstack_features[k]) for k in range(layers)
        ]
    return type(first)(**fields)


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive slices of the given sizes."""
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def _config_id(config, *names: str) -> int | None:
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int):
            return v
    return None


def _inner_model(model):
    """The decoder-holding ``.model`` of a (possibly LoRA-wrapped) image-text-to-text model."""
    m = unwrap(model)
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return getattr(m, "model", None)


def adapter_for(model) -> CausalLMAdapter:
    """The adapter of ``model``'s family (by its config)."""
    config = unwrap(model).config
    model_type = getattr(config, "model_type", "")
    if model_type in FAMILIES:
        return FAMILIES[model_type](config)
    if _config_id(config, "image_token_id", "image_token_index") is not None or hasattr(
        config, "vision_config"
    ):
        raise ConfigError(
            f"model type '{model_type}' is a vision-language family mmgrpo has no adapter for yet; "
            f"supported: {', '.join(sorted(FAMILIES))} and text-only causal LMs. Add a subclass of "
            "mmgrpo.model.adapters.VisionLanguageAdapter (its vision keys, token types, placeholder ids, vision "
            "parameter names) and an entry in mmgrpo.model.adapters.FAMILIES."
        )
    return CausalLMAdapter(config)
