"""Token batches: N sequences in the prompt | response layout, and their vision inputs.

    prompt_ids   (N, P)  left-padded    every token before the first policy turn (system, user, images)
    response_ids (N, T)  right-padded   everything after it: policy turns and, in multi-turn episodes,
                                        the environment's turns in between (loss_mask 0 there)

Vision inputs are the processor's image tensors kept per sequence, so that any subset of rows can be
selected (micro-batches, the G copies of a prompt) without re-running the processor, whatever the model
family lays its pixels out as (Qwen-VL: patch rows and a (t, h, w) grid per image; LLaVA and Gemma 3: one
(C, H, W) tensor per image; Idefics3: sub-images with a pixel mask). The family's adapter
(``mmgrpo.model.adapters``) turns them into forward keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class VisionInputs:
    """Processor outputs for the images of a batch, one entry per sequence.

    seqs           list[dict[str, Tensor]]  per sequence, processor key -> that sequence's rows, image
                                            after image (e.g. ``pixel_values`` (patches, dim) and
                                            ``image_grid_thw`` (images, 3) for Qwen-VL); {} = no image
    images_per_seq list[int]                how many images (or videos) each sequence owns, in order

    Tensors are shared, not copied, when rows are selected or repeated.
    """

    seqs: list[dict[str, Tensor]] = field(default_factory=list)
    images_per_seq: list[int] = field(default_factory=list)
    encoded: list[Any] | None = None
    """Per sequence, its images' features from the vision encoder (computed once, without a graph, when the
    encoder is frozen: see ``Policy.encode_images``), or None. Forwards then take these instead of the
    pixels. Kept by ``select`` and ``concat_rows``; dropped when sequences are merged (new images)."""

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [{} for _ in self.images_per_seq]
        if len(self.seqs) != len(self.images_per_seq):
            raise ValueError(f"{len(self.seqs)} sequences of tensors but {len(self.images_per_seq)} counts")

    @staticmethod
    def none(n: int) -> VisionInputs:
        """n sequences without images."""
        return VisionInputs(images_per_seq=[0] * n)

    @property
    def empty(self) -> bool:
        return not any(self.seqs)

    def keys(self) -> list[str]:
        """The processor keys present, in order of first appearance."""
        return list(dict.fromkeys(k for s in self.seqs for k in s))

    def stacked(self, key: str) -> Tensor | None:
        """The rows of ``key`` of every sequence, concatenated in sequence order (None if absent)."""
        parts = [s[key] for s in self.seqs if key in s]
        return torch.cat(parts) if parts else None

    @property
    def pixel_values(self) -> Tensor | None:
        return self.stacked("pixel_values")

    @property
    def image_grid_thw(self) -> Tensor | None:
        return self.stacked("image_grid_thw")

    @property
    def has_encoded(self) -> bool:
        """Whether every sequence with images carries its encoder features (so no pixels are needed)."""
        if self.encoded is None or self.empty:
            return False
        return all(e is not None for e, s in zip(self.encoded, self.seqs, strict=True) if s)

    def without_encoded(self) -> VisionInputs:
        """The same images, features dropped (the forward encodes the pixels itself)."""
        return VisionInputs(self.seqs, self.images_per_seq)

    def select(self, rows: list[int]) -> VisionInputs:
        """The vision inputs of sequences ``rows`` (repeats allowed: the G copies of a prompt share one)."""
        return VisionInputs(
            [self.seqs[r] for r in rows],
            [self.images_per_seq[r] for r in rows],
            None if self.encoded is None else [self.encoded[r] for r in rows],
        )

    @staticmethod
    def concat_rows(parts: list[VisionInputs]) -> VisionInputs:
        """One VisionInputs whose sequences are those of ``parts``, in order (the rows of each part)."""
        encoded = None
        if parts and all(p.encoded is not None or p.empty for p in parts):
            encoded = [e for p in parts for e in (p.encoded or [None] * len(p.seqs))]
        return VisionInputs(
            [s for p in parts for s in p.seqs], [k for p in parts for k in p.images_per_seq], encoded
        )

    @staticmethod
    def _merge(dicts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """One sequence's tensors from several pieces of it, in order (one piece: its tensors, not copied)."""
        dicts = [d for d in dicts if d]
        if len(dicts) == 1:
            return dict(dicts[0])
        keys = list(dict.fromkeys(k for d in dicts for k in d))
        return {k: torch.cat([d[k] for d in dicts if k in d]) for k in keys}

    @staticmethod
    def one_sequence(chunks: list[VisionInputs]) -> VisionInputs:
        """The images of ``chunks`` (e.g. one per env turn of an episode) as a single sequence's."""
        seqs = [s for c in chunks for s in c.seqs]
        return VisionInputs([VisionInputs._merge(seqs)], [sum(k for c in chunks for k in c.images_per_seq)])

    @staticmethod
    def join(first: VisionInputs, then: VisionInputs) -> VisionInputs:
        """Per sequence, the images of ``first`` followed by those of ``then`` (same number of sequences)."""
        if then.empty:
            return first
        seqs = [VisionInputs._merge([a, b]) for a, b in zip(first.seqs, then.seqs, strict=True)]
        counts = [a + b for a, b in zip(first.images_per_seq, then.images_per_seq, strict=True)]
        return VisionInputs(seqs, counts)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        """On ``device``; floating-point tensors (pixels) cast to ``dtype``, integer ones (grids) kept."""

        def move(t: Tensor) -> Tensor:
            return t.to(
                device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype
            )

        return VisionInputs(
            [{k: move(v) for k, v in s.items()} for s in self.seqs], list(self.images_per_seq), self.encoded
        )


@dataclass
class TokenBatch:
    """N sequences in the prompt | response layout, everything the loss needs but the advantages.

    prompt_ids (N, P) left-padded; prompt_mask (N, P) 1 on real tokens
    response_ids (N, T) right-padded; response_mask (N, T) 1 on real tokens
    loss_mask (N, T) 1 only on policy-generated tokens (0 on padding and environment tokens)
    vision: the images of the DISTINCT prompts, one entry per prompt
    prompt_index: per row, which entry of ``vision`` (which distinct prompt) it belongs to; None means
                  row i has entry i. The G episodes of a group share one entry, so their pixels are held
                  once, and ``Policy.logprobs`` encodes their prompt once.
    response_vision: per row, the images inside its response (a tool's crop or zoom, in order), or None
                  when no response holds an image. Each belongs to its row only.
    sampled_logp: (N, T) float, the sampler's log-prob of each policy token as it was drawn (NaN on
                  environment tokens and padding), or None when the sampler gave none.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    vision: VisionInputs
    prompt_index: list[int] | None = None
    response_vision: VisionInputs | None = None
    sampled_logp: Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def row_prompts(self) -> list[int]:
        """Per row, its entry in ``vision``."""
        return list(range(len(self))) if self.prompt_index is None else list(self.prompt_index)

    @property
    def has_response_images(self) -> bool:
        return self.response_vision is not None and not self.response_vision.empty

    def row_vision(self) -> VisionInputs:
        """Per row, every image of its sequence in order: the prompt's, then the response's."""
        prompt = self.vision if self.prompt_index is None else self.vision.select(self.prompt_index)
        if not self.has_response_images:
            return prompt
        return VisionInputs.join(prompt, self.response_vision)

    def select(self, rows: list[int]) -> TokenBatch:
        """Rows ``rows``, with columns that are padding in every selected row trimmed away."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        pm, rm = self.prompt_mask[idx], self.response_mask[idx]  # (n, P), (n, T)
        p_keep = int(pm.sum(dim=1).max())  # left padding: keep the last p_keep columns
        t_keep = max(int(rm.sum(dim=1).max()), 1)  # right padding: keep the first t_keep columns
        P = pm.shape[1]
        owners = [self.row_prompts()[r] for r in rows]
        distinct = list(dict.fromkeys(owners))  # the prompts these rows use, in order of first use
        slot = {p: i for i, p in enumerate(distinct)}
        return TokenBatch(
            prompt_ids=self.prompt_ids[idx][:, P - p_keep :],
            prompt_mask=pm[:, P - p_keep :],
            response_ids=self.response_ids[idx][:, :t_keep],
            response_mask=rm[:, :t_keep],
            loss_mask=self.loss_mask[idx][:, :t_keep],
            vision=self.vision.select(distinct),
            prompt_index=[slot[p] for p in owners],
            response_vision=self.response_vision.select(rows) if self.has_response_images else None,
            sampled_logp=None if self.sampled_logp is None else self.sampled_logp[idx][:, :t_keep],
        )

    @staticmethod
    def concat(parts: list[TokenBatch], pad_token_id: int = 0) -> TokenBatch:
        """The rows of ``parts`` in order, as one batch (prompts re-padded on the left, responses on the
        right; each part keeps its own distinct prompts). E.g. the local batches of several processes."""
        P = max(b.prompt_ids.shape[1] for b in parts)
        T = max(b.response_ids.shape[1] for b in parts)

        def left(t: Tensor, fill: int) -> Tensor:  # (n, p) -> (n, P)
            return torch.nn.functional.pad(t, (P - t.shape[1], 0), value=fill)

        def right(t: Tensor, fill: int) -> Tensor:  # (n, t) -> (n, T)
            return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=fill)

        index, offset = [], 0
        for b in parts:
            index += [offset + p for p in b.row_prompts()]
            offset += len(b.vision.images_per_seq)
        has_resp = any(b.has_response_images for b in parts)
        return TokenBatch(
            prompt_ids=torch.cat([left(b.prompt_ids, pad_token_id) for b in parts]),
            prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in parts]),
            response_ids=torch.cat([right(b.response_ids, pad_token_id) for b in parts]),
            response_mask=torch.cat([right(b.response_mask, 0) for b in parts]),
            loss_mask=torch.cat([right(b.loss_mask, 0) for b in parts]),
            vision=VisionInputs.concat_rows([b.vision for b in parts]),
            prompt_index=index,
            response_vision=VisionInputs.concat_rows(
                [b.response_vision if b.has_response_images else VisionInputs.none(len(b)) for b in parts]
            )
            if has_resp
            else None,
            sampled_logp=torch.cat([right(b.sampled_logp, float("nan")) for b in parts])
            if all(b.sampled_logp is not None for b in parts)
            else None,
        )

    def shared_prompt_runs(self) -> int:
        """G when the rows come in consecutive runs of G (> 1) rows sharing one prompt, else 1."""
        keys = self.row_prompts()
        if not keys:
            return 1
        G = next((i for i, k in enumerate(keys) if k != keys[0]), len(keys))
        if G < 2 or len(keys) % G:
            return 1
        runs = [keys[i : i + G] for i in range(0, len(keys), G)]
        if any(len(set(r)) != 1 for r in runs) or len({r[0] for r in runs}) != len(runs):
            return 1
        return G


def pad_right(seqs: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Right-pad lists of ids: returns ids (N, T) and mask (N, T)."""
    T = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), max(T, 1)), pad, dtype=torch.long)  # (N, T)
    mask = torch.zeros((len(seqs), max(T, 1)), dtype=torch.long)  # (N, T)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask
