"""Tool messages the rows of a group repeat, tokenized once.

The G episodes of a group often get the same tool message: the zoom agent's rows zoom on the same cell of
the same image, the calculator's compute the same expression. Each episode's tool returns its own objects
(a new PIL image each time), so ``Policy.encode_continuation`` keys what it tokenized by content: the
text and each image's mode, size and pixel bytes. A message seen again gets the same ids and the same
pixel tensors (shared, not copied), which also lets a training pass encode a repeated image once
(``CausalLMAdapter.encode_repeats``). On the zoom agent the processor took 3.4 ms a message, 128 a step.
"""

from __future__ import annotations

import collections
import hashlib

from mmgrpo.model.batch import VisionInputs

KEPT = 64
"""How many tokenized messages are kept (the least recently used goes first): a step's distinct ones (16
groups) at about 0.3 MB of pixels each on the zoom agent."""


def content_key(text: str, images: list, videos: list) -> tuple | None:
    """What tokenizing ``text`` with ``images`` depends on; None (not kept) with videos or an image that is
    not a PIL image (a path, an array)."""
    from PIL import Image

    if videos or not all(isinstance(im, Image.Image) for im in images):
        return None
    digests = [(im.mode, im.size, hashlib.blake2b(im.tobytes(), digest_size=16).digest()) for im in images]
    return (text, *digests)


class KeptTokenizations:
    """The last ``KEPT`` tokenizations of a message: its ids and its vision inputs."""

    def __init__(self, size: int | None = None) -> None:
        self.size = KEPT if size is None else size
        self._kept: collections.OrderedDict[tuple, tuple[list[int], VisionInputs]] = collections.OrderedDict()

    def tokenize(self, text: str, images: list, videos: list, tokenize) -> tuple[list[int], VisionInputs]:
        """``text`` with its images (and videos) as ids and vision inputs: what was kept for this content,
        else ``tokenize([text], [images], [videos])``'s first row, kept. The content is hashed once."""
        key = content_key(text, images, videos)
        if key is not None and key in self._kept:
            self._kept.move_to_end(key)
            ids, vision = self._kept[key]
            return list(ids), VisionInputs([dict(s) for s in vision.seqs], list(vision.images_per_seq))
        ids, _, vision = tokenize([text], [images], [videos])
        out = ids[0].tolist()
        if key is not None and self.size > 0:
            self._kept[key] = (out, vision)
            if len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return list(out), vision
