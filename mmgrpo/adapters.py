"""Model-family adapters: everything that differs between Hugging Face model families, in one place.

The forward/decode engine (``mmgrpo.engine``) and the policy (``mmgrpo.policy``) ask the adapter; nothing
else names a family. An adapter answers:

- which forward keywords carry the images (``pixel_values``, ``image_grid_thw``, token-type ids);
- how positions are laid out: 1-D text positions that skip left padding, or Qwen-VL's 3-D M-RoPE
  positions (temporal, height, width) whose text part is offset per row (``rope_deltas``) after images;
- which token ids the policy must never sample (image placeholders have no image behind them);
- how vision parameters are named (to freeze the encoder or train the language side only).

Two adapters today: ``CausalLMAdapter`` (any text-only causal LM) and ``QwenVLAdapter`` (Qwen2-VL and
Qwen2.5-VL). A new family (LLaVA-style, Idefics3, Gemma 3) is one subclass and one line in
``adapter_for``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmgrpo.batch import VisionInputs
from mmgrpo.errors import ConfigError


def unwrap(model):
    """The bare Hugging Face model under an Accelerate / DDP wrapper."""
    return getattr(model, "module", model)


class CausalLMAdapter:
    """A text-only causal LM (Qwen2, Llama, ...): 1-D positions, no images."""

    name = "causal-lm"
    vision_param_keys: tuple[str, ...] = ("visual.", "vision_tower", "vision_model", "multi_modal_projector")

    def __init__(self, config) -> None:
        self.config = config
        self.image_token_id: int | None = None
        self.video_token_id: int | None = None
        self.suppress_ids: list[int] = []

    # ------------------------------------------------------------------------------------ forward keywords
    def forward_kwargs(
        self, ids: Tensor, mask: Tensor, vision: VisionInputs, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        """Keyword arguments of a forward / generate call for ids (N, L) and their images."""
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    # ------------------------------------------------------------------------------------------ positions
    def uses_mrope(self, model) -> bool:
        return False

    def text_positions(self, mask: Tensor, model) -> Tensor:
        """Positions that skip left padding: (N, L), or (3, N, L) for M-RoPE models."""
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, L)
        return pos.unsqueeze(0).expand(3, -1, -1) if self.uses_mrope(model) else pos

    def continuation_positions(self, full_mask: Tensor, start: int, delta: Tensor | None, model) -> Tensor:
        """Positions of columns ``start:`` of a left-padded sequence: (N, L) or (3, N, L) for M-RoPE."""
        pos = (full_mask.long().cumsum(-1) - 1)[:, start:]  # (N, L) text positions, padding skipped
        if delta is not None:
            pos = pos + delta  # (N, L)
        return pos.unsqueeze(0).expand(3, -1, -1) if self.uses_mrope(model) else pos

    def positions_given_to_prefill(self, mask: Tensor, vision: VisionInputs, model) -> Tensor | None:
        """Positions to pass to a prefill over ids with ``mask``; None lets the model compute them."""
        return self.text_positions(mask, model)

    def prefill_delta(self, model, vision: VisionInputs) -> Tensor | None:
        """The per-row offset (N, 1) of text positions after a prefill (M-RoPE with images), else None."""
        return None

    # --------------------------------------------------------------------------------------- parameters
    def is_vision_param(self, name: str) -> bool:
        return any(k in name for k in self.vision_param_keys)


class QwenVLAdapter(CausalLMAdapter):
    """Qwen2-VL / Qwen2.5-VL: ``pixel_values`` rows per 14x14 patch, ``image_grid_thw`` per image,
    ``mm_token_type_ids`` (0 text, 1 image, 2 video) and 3-D M-RoPE positions.

    When a sequence holds images the model computes its own positions (``get_rope_index``) and leaves
    the per-row text offset in ``model.model.rope_deltas``; later tokens continue at text position + delta.
    """

    name = "qwen-vl"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.image_token_id = getattr(config, "image_token_id", None)
        self.video_token_id = getattr(config, "video_token_id", None)
        # placeholders the policy must never sample: a generated image token has no image behind it
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        self.suppress_ids = sorted({i for a in names if (i := getattr(config, a, None)) is not None})

    def forward_kwargs(
        self, ids: Tensor, mask: Tensor, vision: VisionInputs, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        kw = super().forward_kwargs(ids, mask, vision, device, dtype)
        if not vision.empty:
            v = vision.to(device, dtype=dtype)
            kw["pixel_values"] = v.pixel_values
            kw["image_grid_thw"] = v.image_grid_thw
        tt = torch.zeros_like(ids, dtype=torch.int)  # (N, L) 0 text, 1 image, 2 video
        tt[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            tt[ids == self.video_token_id] = 2
        kw["mm_token_type_ids"] = tt.to(device)
        return kw

    def uses_mrope(self, model) -> bool:
        return hasattr(getattr(unwrap(model), "model", None), "rope_deltas")

    def positions_given_to_prefill(self, mask: Tensor, vision: VisionInputs, model) -> Tensor | None:
        if self.uses_mrope(model) and not vision.empty:
            return None  # the model's get_rope_index lays out the image patches in 3-D
        return self.text_positions(mask, model)

    def prefill_delta(self, model, vision: VisionInputs) -> Tensor | None:
        if self.uses_mrope(model) and not vision.empty:
            return unwrap(model).model.rope_deltas  # (N, 1) offset left by the images
        return None


def adapter_for(model) -> CausalLMAdapter:
    """The adapter of ``model``'s family (by its config)."""
    config = unwrap(model).config
    if getattr(config, "image_token_id", None) is not None and "qwen" in getattr(config, "model_type", ""):
        return QwenVLAdapter(config)
    if getattr(config, "image_token_id", None) is not None:
        raise ConfigError(
            f"model type '{config.model_type}' is a vision-language family mmgrpo has no adapter for yet; "
            "supported today: Qwen2-VL / Qwen2.5-VL and text-only causal LMs (add a subclass of "
            "mmgrpo.adapters.CausalLMAdapter and a line in adapter_for)"
        )
    return CausalLMAdapter(config)
