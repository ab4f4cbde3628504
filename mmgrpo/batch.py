"""Token batches: N sequences in the prompt | response layout, and their vision inputs.

    prompt_ids   (N, P)  left-padded    every token before the first policy turn (system, user, images)
    response_ids (N, T)  right-padded   everything after it: policy turns and, in multi-turn episodes,
                                        the environment's turns in between (loss_mask 0 there)

Vision inputs (``pixel_values`` rows, one per 14x14 patch, and ``image_grid_thw``, one row per image)
travel with the batch in sequence order, so that any subset of rows can be selected (micro-batches, the
G copies of a prompt) without re-running the processor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class VisionInputs:
    """Processor outputs for the images of a batch, in sequence order.

    pixel_values   (num_patches, patch_dim)  rows of all images, image after image
    image_grid_thw (num_images, 3)           (t, h, w) patch grid of each image
    images_per_seq list[int]                 how many images each sequence owns, in order
    """

    pixel_values: Tensor | None = None
    image_grid_thw: Tensor | None = None
    images_per_seq: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.pixel_values is None

    def _spans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Per sequence, its (start, end) rows in image_grid_thw and in pixel_values."""
        patches = self.image_grid_thw.prod(dim=-1).tolist()  # (num_images,) patches per image
        img_spans, pix_spans, img, pix = [], [], 0, 0
        for k in self.images_per_seq:
            n_pix = int(sum(patches[img : img + k]))
            img_spans.append((img, img + k))
            pix_spans.append((pix, pix + n_pix))
            img, pix = img + k, pix + n_pix
        return img_spans, pix_spans

    def select(self, rows: list[int]) -> VisionInputs:
        """The vision inputs of sequences ``rows`` (repeats allowed: the G copies of a prompt share one)."""
        if self.empty:
            return VisionInputs(images_per_seq=[0] * len(rows))
        img_spans, pix_spans = self._spans()
        pix = [self.pixel_values[slice(*pix_spans[r])] for r in rows]
        grid = [self.image_grid_thw[slice(*img_spans[r])] for r in rows]
        return VisionInputs(torch.cat(pix), torch.cat(grid), [self.images_per_seq[r] for r in rows])

    @staticmethod
    def concat_rows(parts: list[VisionInputs]) -> VisionInputs:
        """One VisionInputs whose sequences are those of ``parts``, in order (the rows of each part)."""
        filled = [p for p in parts if not p.empty]
        per_seq = [k for p in parts for k in p.images_per_seq]
        if not filled:
            return VisionInputs(images_per_seq=per_seq)
        return VisionInputs(
            torch.cat([p.pixel_values for p in filled]),
            torch.cat([p.image_grid_thw for p in filled]),
            per_seq,
        )

    @staticmethod
    def one_sequence(chunks: list[VisionInputs]) -> VisionInputs:
        """The images of ``chunks`` (e.g. one per env turn of an episode) as a single sequence's."""
        if not chunks:
            return VisionInputs(images_per_seq=[0])
        joined = VisionInputs.concat_rows(chunks)
        return VisionInputs(joined.pixel_values, joined.image_grid_thw, [sum(joined.images_per_seq)])

    @staticmethod
    def join(first: VisionInputs, then: VisionInputs) -> VisionInputs:
        """Per sequence, the images of ``first`` followed by those of ``then`` (same number of sequences)."""
        if then.empty:
            return first
        if first.empty:
            return VisionInputs(then.pixel_values, then.image_grid_thw, list(then.images_per_seq))
        pieces = [
            part.select([r])
            for r in range(len(first.images_per_seq))
            for part in (first, then)
            if part.images_per_seq[r]
        ]
        joined = VisionInputs.concat_rows(pieces)
        counts = [a + b for a, b in zip(first.images_per_seq, then.images_per_seq, strict=True)]
        return VisionInputs(joined.pixel_values, joined.image_grid_thw, counts)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        if self.empty:
            return self
        return VisionInputs(
            self.pixel_values.to(device=device, dtype=dtype or self.pixel_values.dtype),
            self.image_grid_thw.to(device),
            list(self.images_per_seq),
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
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    vision: VisionInputs
    prompt_index: list[int] | None = None
    response_vision: VisionInputs | None = None

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
