"""Grounding: boxes the model draws, compared with the task's boxes by intersection over union (IoU).

Boxes are ``[x1, y1, x2, y2]`` (top-left, bottom-right). The task's boxes (field ``box`` for one object,
``boxes`` for several) are absolute pixels of the ORIGINAL image. The model's boxes are in the coordinates
it was trained to answer in, picked by ``coords``:

- ``"resized"`` (default): absolute pixels of the image the model saw after its processor resized it, as
  Qwen2.5-VL answers. The task gives both sizes, ``image_size = [w, h]`` (original) and
  ``model_image_size = [w, h]`` (resized); x is scaled by ``w / resized_w`` and y by ``h / resized_h``.
- ``"normalized_1000"``: a 0..1000 grid over the image, as Qwen2-VL and others answer; x is scaled by
  ``w / 1000`` and y by ``h / 1000`` (needs ``image_size``).
- ``"original"``: already absolute pixels of the original image; nothing is scaled.

The model's answer may be JSON -- ``[10, 20, 30, 40]``, ``{"bbox_2d": [...], "label": "cat"}`` (Qwen2.5-VL),
a list of either, inside a ```json fence or not -- or corner pairs ``(10,20),(30,40)`` (Qwen2-VL's
``<|box_start|>(x1,y1),(x2,y2)<|box_end|>``). See :func:`parse_boxes`.

Pure helpers: :func:`box_iou`, :func:`map_box`, :func:`parse_boxes`, :func:`match_boxes`. Verifier factories:
:func:`iou_reward` (continuous IoU of one box), :func:`iou_match` (1 when IoU >= threshold), :func:`box_f1`
(several boxes, greedily matched one-to-one at IoU >= threshold, scored by F1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode
from mmgrpo.verifiers.answers import _answer_text

__all__ = ["COORDS", "box_f1", "box_iou", "iou_match", "iou_reward", "map_box", "match_boxes", "parse_boxes"]

Box = tuple[float, float, float, float]

COORDS = ("resized", "original", "normalized_1000")
"""The coordinate systems a model's boxes may be in (see the module docstring)."""

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_BRACKETED_BOX = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")
_CORNERS = re.compile(
    rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)\s*,?\s*\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)"
)


# -- pure helpers ------------------------------------------------------------------------------------------
def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes, in [0, 1].

    Continuous coordinates: ``[0, 0, 10, 10]`` has area 100. A box with ``x2 <= x1`` or ``y2 <= y1`` has no
    area, so its IoU with anything is 0.

    >>> box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == 25 / 175
    True
    """
    ax1, ay1, ax2, ay2 = a
    bx1, by1, bx2, by2 = b
    area_a = max(0.0, ax2 - ax1) * max(0.0, ay2 - ay1)
    area_b = max(0.0, bx2 - bx1) * max(0.0, by2 - by1)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = area_a + area_b - inter
    if area_a <= 0 or area_b <= 0 or union <= 0:
        return 0.0
    return inter / union


def _size(value: Any, name: str) -> tuple[float, float]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in value
        )
    ):
        return float(value[0]), float(value[1])
    raise VerifierError(f"{name} must be [width, height] with two positive numbers, got {value!r:.80}.")


def map_box(
    box: Sequence[float],
    coords: str = "resized",
    image_size: Sequence[float] | None = None,
    model_image_size: Sequence[float] | None = None,
) -> Box:
    """``box`` in the model's coordinates (``coords``) as absolute pixels of the original image.

    ``image_size`` = [w, h] of the original image (needed unless ``coords="original"``);
    ``model_image_size`` = [w, h] of the image the model saw (needed for ``coords="resized"``).

    >>> map_box([14, 28, 140, 280], "resized", image_size=[100, 200], model_image_size=[280, 560])
    (5.0, 10.0, 50.0, 100.0)
    >>> map_box([500, 500, 1000, 1000], "normalized_1000", image_size=[640, 480])
    (320.0, 240.0, 640.0, 480.0)
    """
    x1, y1, x2, y2 = (float(v) for v in box)
    if coords == "original":
        return x1, y1, x2, y2
    if image_size is None:
        raise VerifierError(f"coords={coords!r} needs the original image size [w, h]; got none.")
    width, height = _size(image_size, "image_size")
    if coords == "resized":
        if model_image_size is None:
            raise VerifierError(
                "coords='resized' needs the size [w, h] of the image the model saw; got none."
            )
        from_w, from_h = _size(model_image_size, "model_image_size")
    elif coords == "normalized_1000":
        from_w = from_h = 1000.0
    else:
        raise ConfigError(f"coords must be one of {', '.join(COORDS)}; got {coords!r}.")
    sx, sy = width / from_w, height / from_h
    return x1 * sx, y1 * sy, x2 * sx, y2 * sy


def _as_box(value: Any) -> Box | None:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    ):
        return tuple(float(v) for v in value)  # type: ignore[return-value]
    return None


def parse_boxes(text: str) -> list[Box]:
    """Every box written in ``text``, in order; ``[]`` when there is none.

    First every JSON-style array of exactly four numbers, ``[x1, y1, x2, y2]``, wherever it stands: alone,
    as the value of ``"bbox_2d"`` (Qwen2.5-VL) or any other key, nested in lists, inside a ```json fence
    or a sentence. The surrounding JSON need not be valid, so an answer cut off after its second box still
    gives two. Only when there is no such array: corner pairs ``(x1,y1),(x2,y2)`` (Qwen2-VL). Boxes are
    returned as written, corners not reordered (see :func:`box_iou` for inverted ones). Linear in the
    length of ``text``.

    >>> parse_boxes('```json\\n[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}]\\n```')
    [(10.0, 20.0, 30.0, 40.0)]
    >>> parse_boxes("<|box_start|>(1,2),(3,4)<|box_end|>")
    [(1.0, 2.0, 3.0, 4.0)]
    """
    if not isinstance(text, str):
        return []
    found = _BRACKETED_BOX.findall(text) or _CORNERS.findall(text)
    boxes = [tuple(float(v) for v in m) for m in found]
    return [b for b in boxes if all(math.isfinite(v) for v in b)]  # type: ignore[misc]


def match_boxes(
    predicted: Sequence[Sequence[float]], truth: Sequence[Sequence[float]], threshold: float = 0.5
) -> list[tuple[int, int, float]]:
    """A one-to-one matching of predicted to true boxes: ``[(pred_index, true_index, iou), ...]``.

    Greedy: every pair with IoU >= ``threshold`` (and > 0) is considered, highest IoU first (ties: lower
    predicted index, then lower true index), and a pair is kept when neither box is matched yet; the result
    is sorted by ``pred_index``. Greedy is not always a maximum matching: where true boxes overlap each
    other heavily it can, rarely, match one pair fewer than the best assignment would.
    """
    pairs = []
    for i, p in enumerate(predicted):
        for j, t in enumerate(truth):
            iou = box_iou(p, t)
            if iou >= threshold and iou > 0:
                pairs.append((-iou, i, j))
    pairs.sort()
    used_p: set[int] = set()
    used_t: set[int] = set()
    matched = []
    for neg_iou, i, j in pairs:
        if i in used_p or j in used_t:
            continue
        used_p.add(i)
        used_t.add(j)
        matched.append((i, j, -neg_iou))
    return sorted(matched)


# -- verifiers ---------------------------------------------------------------------------------------------
def _check_coords(name: str, coords: Any) -> None:
    if coords not in COORDS:
        raise ConfigError(f"{name}: coords must be one of {', '.join(COORDS)}; got {coords!r}.")


def _check_threshold(name: str, threshold: Any) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"{name}: threshold must be a number in (0, 1], got {threshold!r}.")
    return float(threshold)


def _required(episode: Episode, field: str, what: str) -> Any:
    if field not in episode.task:
        raise VerifierError(
            f"The task has no field '{field}' (task keys: {sorted(episode.task)}); it must hold {what}. Add it "
            f"to the env's reset() info or pass the verifier another field name."
        )
    return episode.task[field]


def _true_boxes(episode: Episode, field: str) -> list[Box]:
    """The task's boxes: one box, or a list of boxes (possibly empty)."""
    value = _required(episode, field, "the true box [x1, y1, x2, y2] (or a list of boxes) in original pixels")
    box = _as_box(value)
    if box is not None:
        return [box]
    if isinstance(value, (list, tuple)):
        boxes = [_as_box(b) for b in value]
        if all(b is not None for b in boxes):
            return boxes  # type: ignore[return-value]
    raise VerifierError(
        f"Task field '{field}' = {value!r:.80} is not a box [x1, y1, x2, y2] or a list of such boxes."
    )


def _predicted_boxes(
    episode: Episode, tag: str | None, coords: str, size_fields: tuple[str, str]
) -> list[Box] | None:
    """The model's boxes in original pixels; None when the tag is absent.

    The size fields ``coords`` needs are required even when there is no box, so a task missing them fails
    from the first episode on.
    """
    image_size = model_size = None
    if coords != "original":
        image_size = _required(episode, size_fields[0], f"the original image size [w, h] (coords={coords!r})")
    if coords == "resized":
        model_size = _required(
            episode, size_fields[1], "the size [w, h] of the image the model saw (coords='resized')"
        )
    text = _answer_text(episode, tag)
    if text is None:
        return None
    return [map_box(b, coords, image_size, model_size) for b in parse_boxes(text)]


def _single_iou(
    episode: Episode, tag: str | None, field: str, coords: str, size_fields: tuple[str, str]
) -> float:
    """IoU of the model's only box with the best of the task's accepted boxes; 0 unless exactly one box."""
    truth = _true_boxes(episode, field)
    predicted = _predicted_boxes(episode, tag, coords, size_fields)
    if not predicted or len(predicted) != 1 or not truth:
        return 0.0
    return max(box_iou(predicted[0], t) for t in truth)


def iou_reward(
    tag: str | None = "answer",
    field: str = "box",
    coords: str = "resized",
    image_size_field: str = "image_size",
    model_image_size_field: str = "model_image_size",
) -> Callable[[Episode], float]:
    """The IoU (0..1) of the one box inside ``<tag>`` with ``task[field]``, after mapping it to original pixels.

    ``coords``: ``"resized"`` (default, Qwen2.5-VL), ``"normalized_1000"`` (Qwen2-VL) or ``"original"``; see
    the module docstring. The task holds ``box`` ([x1, y1, x2, y2] in original pixels, or a list of accepted
    boxes: the best counts), ``image_size`` and, for ``"resized"``, ``model_image_size`` (field names
    settable). Tag absent, no box, or more than one box in the answer: 0.0. ``tag=None`` reads the whole
    completion (Qwen2.5-VL's bare ```json answer).
    """
    _check_coords("iou_reward", coords)
    sizes = (image_size_field, model_image_size_field)

    def iou_score(episode: Episode) -> float:
        return _single_iou(episode, tag, field, coords, sizes)

    return iou_score


def iou_match(
    tag: str | None = "answer",
    field: str = "box",
    coords: str = "resized",
    threshold: float = 0.5,
    image_size_field: str = "image_size",
    model_image_size_field: str = "model_image_size",
) -> Callable[[Episode], float]:
    """1.0 when the IoU of the one box inside ``<tag>`` with ``task[field]`` is >= ``threshold``, else 0.0.

    The same reading as ``iou_reward`` (which see for ``coords`` and the task fields).
    """
    _check_coords("iou_match", coords)
    limit = _check_threshold("iou_match", threshold)
    sizes = (image_size_field, model_image_size_field)

    def iou_match_score(episode: Episode) -> float:
        return 1.0 if _single_iou(episode, tag, field, coords, sizes) >= limit else 0.0

    return iou_match_score


def box_f1(
    tag: str | None = "answer",
    field: str = "boxes",
    coords: str = "resized",
    threshold: float = 0.5,
    image_size_field: str = "image_size",
    model_image_size_field: str = "model_image_size",
) -> Callable[[Episode], float]:
    """F1 of the boxes inside ``<tag>`` against the task's boxes, matched one-to-one at IoU >= ``threshold``.

    With ``m`` matched pairs (:func:`match_boxes`, greedy), ``P`` predicted and ``T`` true boxes:
    precision ``m/P``, recall ``m/T``, F1 ``2m / (P + T)``. So extra boxes cost precision and missed ones
    recall. ``task[field]`` is a list of boxes in original pixels (a single box is one object); when it is
    empty, an answer with no box scores 1.0 and one with boxes 0.0. Tag absent: 0.0. ``coords`` and the
    size fields: as for ``iou_reward``.
    """
    _check_coords("box_f1", coords)
    limit = _check_threshold("box_f1", threshold)
    sizes = (image_size_field, model_image_size_field)

    def f1_score(episode: Episode) -> float:
        truth = _true_boxes(episode, field)
        predicted = _predicted_boxes(episode, tag, coords, sizes)
        if predicted is None:
            return 0.0
        if not predicted and not truth:
            return 1.0
        matched = len(match_boxes(predicted, truth, limit))
        return 2.0 * matched / (len(predicted) + len(truth))

    return f1_score
