"""Synthetic counting scenes: "How many red circles are in the image?" (registered env name ``counting``).

Each scene is drawn with Pillow on a ``grid x grid`` board: the target objects (and optional distractors of
other kinds) sit in distinct cells, centred in their cell. With the defaults (``image_size=112, grid=4``) a
cell is 28 px, which is exactly one merged vision token of Qwen2.5-VL (14-px patches merged 2x2), so every
object falls in its own token and the task tests counting, not resolution.

Determinism: a scene is a pure function of ``(seed, split)`` through
``random.Random(scene_seed(seed, split))`` with ``scene_seed = 2 * seed + (0 if split == "train" else 1)``:
train seeds map to even scene seeds and eval seeds to odd ones, so no train seed ever reproduces an eval scene.

The answer is the number of objects of the target kind (shape and colour); distractors are never that kind
but may share its shape or its colour, which is what makes them distractors.

Cluttered counting: with ``target_shape`` and ``target_color`` left None (the default) every scene draws its
own target kind, which the question names ("How many blue squares are in the image?"). ``min_distractors``
sets a floor on the number of distractors (uniform in ``[min_distractors, distractors]``), and
``near_misses=True`` makes every scene with distractors include near misses: a distractor of the target's shape
in another colour and one of the target's colour in another shape (one of the two, at random, when the scene
has a single distractor). With both options at their defaults the scenes are those of earlier versions, seed
for seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import product
from typing import Any

from PIL import Image, ImageDraw

from mmgrpo.data.shapes import PALETTE, SHAPES, cell_box, draw_shape
from mmgrpo.env import SingleTurnEnv, Task, check_split, image_part, system, text_part, user
from mmgrpo.errors import ConfigError, did_you_mean

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}

DEFAULT_SYSTEM_PROMPT = (
    "Count the objects the question asks about. Reply with the number only, inside <answer></answer>, "
    "e.g. <answer>3</answer>."
)
DEFAULT_QUESTION = "How many {color} {shape}s are in the image?"


def scene_seed(seed: int, split: str) -> int:
    """The scene generator's seed: even for train, odd for eval, so the two splits never share a scene."""
    return 2 * seed + (0 if check_split(split) == "train" else 1)


def _names(kwarg: str, value: Any, valid: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ConfigError(
            f"CountingEnv({kwarg}={value!r}): expected a non-empty list of {what} names, e.g. "
            f"{kwarg}={list(valid[:2])!r}"
        )
    for v in value:
        _name(kwarg, v, valid, what)
    if len(set(value)) != len(value):
        raise ConfigError(f"CountingEnv({kwarg}={value!r}): names must be distinct")
    return tuple(value)


def _name(kwarg: str, value: Any, valid: Sequence[str], what: str) -> str:
    if value not in valid:
        raise ConfigError(
            f"CountingEnv({kwarg}=...): unknown {what} {value!r}; valid {what}s are {list(valid)}."
            f"{did_you_mean(str(value), valid)}"
        )
    return value


def _int(kwarg: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"CountingEnv({kwarg}={value!r}): expected an int >= {low}")
    return value


class CountingEnv(SingleTurnEnv):
    """Count the objects of one kind in a synthetic scene; the answer is the count as a string.

    Args (all keyword):
        image_size: side of the square image in pixels (default 112).
        grid: the board is ``grid x grid`` cells of ``image_size / grid`` px; one object per cell (default 4).
        min_count, max_count: the target count is uniform in ``[min_count, max_count]`` (0 allowed; default
            1..5); ``max_count + distractors <= grid * grid``.
        shapes, colors: the vocabulary of scene objects (``SHAPES``, ``PALETTE``).
        target_shape, target_color: None draws the target kind per scene from ``shapes`` / ``colors``;
            a name fixes it for every scene.
        distractors: the most objects of other kinds per scene; the actual number is uniform in
            ``[min_distractors, distractors]`` and each distractor kind is drawn from ``shapes x colors`` minus
            the target.
        min_distractors: the fewest distractors per scene, ``0 <= min_distractors <= distractors`` (default 0).
        near_misses: when True, a scene with distractors always holds a near miss of each sort: one of the
            target's shape in another colour, one of the target's colour in another shape (a single distractor
            is one of the two, at random); the others are drawn as above. Needs every possible target's shape
            in ``shapes`` and colour in ``colors``, and at least two of each (default False).
        background: ``"white"``, ``"black"`` or ``"gray"``.
        object_scale: object size as a fraction of the cell side, in (0, 1] (default 0.7).
        system_prompt: the system message.
        question: the question template, formatted with ``color`` and ``shape``.
        question_first: put the question before the image in the user message (default False: image
            first). In a causal model the image's tokens then see which kind is asked about.

    ``reset`` info: ``answer`` (str), ``count`` (int), ``target`` (e.g. ``"red circle"``),
    ``num_distractors`` (int), ``boxes`` (the target objects' boxes ``[x0, y0, x1, y1]`` in pixels,
    x1 and y1 exclusive), plus ``seed`` and ``split`` added by ``SingleTurnEnv.reset``.
    """

    def __init__(
        self,
        *,
        image_size: int = 112,
        grid: int = 4,
        min_count: int = 1,
        max_count: int = 5,
        shapes: Sequence[str] = ("circle", "square", "triangle"),
        colors: Sequence[str] = ("red", "green", "blue", "yellow"),
        target_shape: str | None = None,
        target_color: str | None = None,
        distractors: int = 0,
        min_distractors: int = 0,
        near_misses: bool = False,
        background: str = "white",
        object_scale: float = 0.7,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question: str = DEFAULT_QUESTION,
        question_first: bool = False,
    ) -> None:
        self.grid = _int("grid", grid, 1)
        self.image_size = _int("image_size", image_size, 1)
        if image_size < 8 * grid:
            raise ConfigError(
                f"CountingEnv(image_size={image_size}, grid={grid}): cells of {image_size / grid:.1f} px are too "
                f"small to draw in; use image_size >= 8 * grid = {8 * grid}"
            )
        self.min_count = _int("min_count", min_count, 0)
        self.max_count = _int("max_count", max_count, 0)
        if max_count < min_count:
            raise ConfigError(
                f"CountingEnv(min_count={min_count}, max_count={max_count}): need min_count <= max_count"
            )
        self.distractors = _int("distractors", distractors, 0)
        if max_count + distractors > grid * grid:
            raise ConfigError(
                f"CountingEnv(max_count={max_count}, distractors={distractors}, grid={grid}): one object per "
                f"cell needs max_count + distractors <= grid * grid = {grid * grid}; lower max_count or "
                "distractors, or raise grid"
            )
        self.min_distractors = _int("min_distractors", min_distractors, 0)
        if min_distractors > distractors:
            raise ConfigError(
                f"CountingEnv(min_distractors={min_distractors}, distractors={distractors}): the number of "
                "distractors is uniform in [min_distractors, distractors], so min_distractors must be <= "
                f"distractors; raise distractors to at least {min_distractors} or lower min_distractors"
            )
        if not isinstance(near_misses, bool):
            raise ConfigError(f"CountingEnv(near_misses={near_misses!r}): expected true or false")
        self.near_misses = near_misses
        self.shapes = _names("shapes", shapes, SHAPES, "shape")
        self.colors = _names("colors", colors, tuple(PALETTE), "color")
        self.target_shape = (
            None if target_shape is None else _name("target_shape", target_shape, SHAPES, "shape")
        )
        self.target_color = (
            None if target_color is None else _name("target_color", target_color, tuple(PALETTE), "color")
        )
        self.background = _name("background", background, tuple(BACKGROUNDS), "background")
        if (
            isinstance(object_scale, bool)
            or not isinstance(object_scale, (int, float))
            or not 0 < object_scale <= 1
        ):
            raise ConfigError(f"CountingEnv(object_scale={object_scale!r}): expected a number in (0, 1]")
        self.object_scale = float(object_scale)
        if not isinstance(system_prompt, str):
            raise ConfigError(
                f"CountingEnv(system_prompt=...): expected a str, got {type(system_prompt).__name__}"
            )
        self.system_prompt = system_prompt
        try:
            question.format(color="red", shape="circle")
        except (AttributeError, KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"CountingEnv(question={question!r}): expected a str template using only {{color}} and "
                f"{{shape}}, e.g. {DEFAULT_QUESTION!r} ({type(e).__name__}: {e})"
            ) from None
        self.question = question
        if not isinstance(question_first, bool):
            raise ConfigError(f"CountingEnv(question_first={question_first!r}): expected true or false")
        self.question_first = question_first
        if distractors > 0:
            for kind in product(self._target_shapes, self._target_colors):
                if not self._other_kinds(kind):
                    raise ConfigError(
                        f"CountingEnv(distractors={distractors}): no distractor kind differs from the target "
                        f"{kind[1]} {kind[0]}; add shapes or colors, or set distractors=0"
                    )
                if near_misses:
                    self._check_near_misses(kind)

    def _check_near_misses(self, target: tuple[str, str]) -> None:
        shape, color = target
        same_shape, same_color = self._near_miss_kinds(target)
        if same_shape and same_color:
            return
        if not same_shape:
            what, why = (
                f"a {shape} in another colour",
                f"shapes={list(self.shapes)} lacks {shape!r}"
                if shape not in self.shapes
                else f"colors={list(self.colors)} has no colour but {color!r}",
            )
        else:
            what, why = (
                f"a {color} object of another shape",
                f"colors={list(self.colors)} lacks {color!r}"
                if color not in self.colors
                else f"shapes={list(self.shapes)} has no shape but {shape!r}",
            )
        raise ConfigError(
            f"CountingEnv(near_misses=True): the target {color} {shape} has no near miss, since no distractor "
            f"can be {what} ({why}); near misses need every target shape in shapes and every target colour in "
            "colors, with at least two shapes and two colors; fix those or set near_misses=false"
        )

    @property
    def _target_shapes(self) -> tuple[str, ...]:
        return self.shapes if self.target_shape is None else (self.target_shape,)

    @property
    def _target_colors(self) -> tuple[str, ...]:
        return self.colors if self.target_color is None else (self.target_color,)

    def _other_kinds(self, target: tuple[str, str]) -> list[tuple[str, str]]:
        return [k for k in product(self.shapes, self.colors) if k != target]

    def _near_miss_kinds(
        self, target: tuple[str, str]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The distractor kinds of the target's shape in another colour, and of its colour in another shape."""
        shape, color = target
        others = self._other_kinds(target)
        return [k for k in others if k[0] == shape], [k for k in others if k[1] == color]

    def layout(self, seed: int, split: str = "train") -> tuple[tuple[str, str], int, list[dict[str, Any]]]:
        """The scene of ``(seed, split)`` before drawing: the target kind ``(shape, color)``, the drawn count
        (the answer) and every object as ``{"shape", "color", "cell", "box"}``, the ``count`` targets first,
        then the distractors (``box`` as in ``info["boxes"]``)."""
        rng = random.Random(scene_seed(seed, split))
        shape = rng.choice(self._target_shapes)
        color = rng.choice(self._target_colors)
        count = rng.randint(self.min_count, self.max_count)
        num_distractors = rng.randint(self.min_distractors, self.distractors)
        cells = rng.sample(range(self.grid * self.grid), count + num_distractors)
        others = self._other_kinds((shape, color))
        if self.near_misses and num_distractors > 0:
            same_shape, same_color = self._near_miss_kinds((shape, color))
            if num_distractors == 1:
                near = [rng.choice(rng.choice((same_shape, same_color)))]
            else:
                near = [rng.choice(same_shape), rng.choice(same_color)]
            distractor_kinds = near + [rng.choice(others) for _ in range(num_distractors - len(near))]
        else:
            distractor_kinds = [rng.choice(others) for _ in range(num_distractors)]
        kinds = [(shape, color)] * count + distractor_kinds
        objects = [
            {"shape": k[0], "color": k[1], "cell": cell, "box": self._box(cell)}
            for cell, k in zip(cells, kinds, strict=True)
        ]
        return (shape, color), count, objects

    def make_task(self, seed: int, split: str) -> Task:
        (shape, color), count, objects = self.layout(seed, split)
        num_distractors = len(objects) - count

        image = Image.new("RGB", (self.image_size, self.image_size), BACKGROUNDS[self.background])
        draw = ImageDraw.Draw(image)
        boxes = [self._draw(draw, o["cell"], (o["shape"], o["color"])) for o in objects]
        question = self.question.format(color=color, shape=shape)
        parts = (text_part(question), image_part(image)) if self.question_first else (image_part(image), text_part(question))
        messages = [system(self.system_prompt), user(*parts)]
        info = {
            "answer": str(count),
            "count": count,
            "target": f"{color} {shape}",
            "num_distractors": num_distractors,
            "boxes": boxes[:count],
        }
        return Task(messages=messages, info=info)

    def _box(self, cell: int) -> list[int]:
        """The box [x0, y0, x1, y1] of the object in ``cell``, in pixel edges (x1, y1 exclusive)."""
        return cell_box(cell, self.image_size, self.grid, self.object_scale)

    def _draw(self, draw: ImageDraw.ImageDraw, cell: int, kind: tuple[str, str]) -> list[int]:
        """Draw one object centred in ``cell``; return its box [x0, y0, x1, y1] in pixel edges (x1, y1 exclusive)."""
        box = self._box(cell)
        draw_shape(draw, box, kind[0], PALETTE[kind[1]])
        return box

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A completion that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"
