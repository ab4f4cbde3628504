"""Count dots that are only readable after ``zoom``: "How many red dots are in cell 5?" (env name ``zoom_count``).

The image (default 336 x 336, white) is divided into the 3 x 3 grid of the ``zoom`` tool (``mmgrpo.toolbox.image``;
cells numbered 1 2 3 / 4 5 6 / 7 8 9). One cell, drawn at random per task, is framed and holds 1..``max_count``
small red dots; the question names that cell. Optionally other cells hold distractors: framed boxes of dots of
another colour (``distractors``) or empty frames (``empty_frames``). Both are off by default, to keep the task
within reach of the tiny model.

Why zoom is needed. The tiny Qwen2.5-VL's processor caps an image at ``max_pixels = 28 * 28 * 16`` pixels, so the
336-px image reaches the model as 112 x 112 (4 x 4 merged vision tokens of 28 px): a factor 3 down. A dot of
radius 4 px (an 8 px disc of 52 pixels) becomes a speck ~2.7 px wide, its red blended with the white around it
(tests/test_zoom_count.py measures ~3.5 clearly red pixels left per dot), 9.3 px from the next layout position; a
whole cell (37 px) spans little more than one token, so a token covers 3 x 3 dot positions and the dots of a
cell share a few tokens (in about half of the scenes fewer tokens hold red than there are dots). The specks are
still apart at the pixel level (a flood fill could count them); what is lost is their size and one token per
dot. ``zoom(cell)`` shows the 112-px cell as a 112 x 112 view (1:1 at the default size): there the dots are laid
out like the ``counting`` env, on a 4 x 4 grid of 28-px squares, one dot centred per square, i.e. one dot per
vision token. A smaller ``dot_radius`` makes the overview harder still (at 2.5 most specks are pink, not red).

Drawing. Every box is laid out in the coordinates of the zoomed view (``zoom_size`` px, default 112) and scaled
down by ``(image_size / 3) / zoom_size`` onto the big image, so what ``zoom`` shows is the layout as designed,
whatever ``image_size`` is (exactly so at 336, where the scale is 1).

Demonstrations for the warm start (``warm_start.source: env``) teach only the call syntax: each is, with
probability ``call_prob``, a ``zoom`` call on a *random* cell followed by a random count, else a random count
at once. Which cell to zoom on, and reading the dots, is left to GRPO. With ``demo_cell="named"`` the call is
on the named cell (what the skill drill teaches; ``mmgrpo demo --task zoom`` uses it, with ``cell_reward``
paying for the first zoom on the named cell): reading the dots is GRPO's part.

Determinism: a task is a pure function of ``(seed, split)`` through ``counting.scene_seed`` (train seeds map to
even generator seeds, eval seeds to odd ones), so the splits never share a scene.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw

from mmgrpo.env import DemoTurn, Shown, Task, image_part, message_images, system, text_part, user
from mmgrpo.envs.counting import BACKGROUNDS, PALETTE, scene_seed
from mmgrpo.envs.tool_env import ToolEnv
from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox.image import image_tools
from mmgrpo.tools.runner import Tool, tool_call_text

GRID = 3
"""The image is ``GRID x GRID`` cells: the grid of ``image_tools``' ``zoom`` (its default)."""
DOT_GRID = 4
"""A box holds its dots on a ``DOT_GRID x DOT_GRID`` layout of the zoomed view (28-px squares at 112 px)."""
FRAME_INSET, FRAME_WIDTH = 2, 2
"""The frame of a box, in pixels of the zoomed view, measured from the cell's edge."""
FRAME_COLOR = (90, 90, 90)
TARGET_COLOR = "red"
IMAGE_TOOLS = ("crop", "zoom")
DEMO_CELLS = ("random", "named")

DEFAULT_SYSTEM_PROMPT = (
    "Use a tool when you need it, then answer with the number only, inside <answer></answer>."
)
DEFAULT_QUESTION = "How many red dots are in cell {cell}? Use zoom to look closer."


def _int(kwarg: str, value: Any, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ConfigError(f"ZoomCountEnv({kwarg}={value!r}): expected an int {bound}")
    return value


def _number(kwarg: str, value: Any, low: float, high: float, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(
            f"ZoomCountEnv({kwarg}={value!r}): expected a number in [{low:g}, {high:g}]; {hint}"
        )
    return float(value)


class ZoomCountEnv(ToolEnv):
    """Count the red dots of one named grid cell, too small to count without the ``zoom`` tool.

    Args (all keyword):
        image_size: side of the square image in pixels, a multiple of 3 (default 336, so that a cell is 112 px
            and ``zoom`` shows it 1:1).
        zoom_size: side of a ``zoom`` / ``crop`` result in pixels (default 112: 4 x 4 vision tokens).
        min_count, max_count: the dot count is uniform in ``[min_count, max_count]`` (default 1..4, at most 16).
        dot_radius: dot radius in pixels of the zoomed view (default 4; at most 0.35 of a layout square,
            9.8 px at 112); on the big image it is ``dot_radius * (image_size / 3) / zoom_size``.
        distractors: the most other cells holding a box of dots of ``distractor_color`` (1..``max_count`` each);
            the actual number is uniform in ``[0, distractors]`` (default 0, at most 8).
        distractor_color: a ``counting.PALETTE`` colour other than red (default ``"blue"``).
        empty_frames: frame every cell that holds nothing, so that the frame does not point at the target
            (default False).
        tools: the image tools offered, ``["zoom"]`` (default) or ``["zoom", "crop"]`` (an entry may also be
            written ``{name: zoom}``; their settings are the env's ``zoom_size``).
        call_prob: the share of demonstrations that call ``zoom`` before answering (default 0.5; the rest
            answer at once). Answers in demonstrations are random counts.
        demo_cell: which cell the demonstrations zoom on: ``"random"`` (default: they teach the call's syntax
            only) or ``"named"`` (the question's cell, as the skill drill teaches it: random-cell
            demonstrations after the drills wear the copied cell number down again).
        cell_reward: an env reward paid once per episode, at its first ``zoom`` on the named cell (default 0:
            none). A process reward for looking in the right place: without it the tiny model's calls
            drifted off the named cell under GRPO before the count could pay for the right one.
        system_prompt: the system message.
        question: the question template, formatted with ``cell``.
        timeout_s, max_result_chars, max_calls_per_turn: the tool runner's limits.

    ``reset`` info: ``answer`` (str), ``count`` (int), ``cell`` (1..9), ``distractor_cells`` (list of int), plus
    ``seed``, ``split`` and ``tools`` (the JSON schemas) added by ``ToolEnv.reset``. Step infos add
    ``metrics: {"right_cell": 0.0 | 1.0}`` (whether the episode has zoomed on the named cell so far).
    """

    def __init__(
        self,
        *,
        image_size: int = 336,
        zoom_size: int = 112,
        min_count: int = 1,
        max_count: int = 4,
        dot_radius: float = 4,
        distractors: int = 0,
        distractor_color: str = "blue",
        empty_frames: bool = False,
        tools: Sequence[str] = ("zoom",),
        call_prob: float = 0.5,
        demo_cell: str = "random",
        cell_reward: float = 0.0,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question: str = DEFAULT_QUESTION,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        max_calls_per_turn: int = 4,
    ) -> None:
        super().__init__(
            timeout_s=timeout_s, max_result_chars=max_result_chars, max_calls_per_turn=max_calls_per_turn
        )
        self.image_size = _int("image_size", image_size, 3 * DOT_GRID * 2)
        if image_size % GRID:
            raise ConfigError(
                f"ZoomCountEnv(image_size={image_size}): the zoom grid is {GRID} x {GRID}, so image_size must be "
                f"a multiple of {GRID}, e.g. {image_size - image_size % GRID} or {image_size + GRID - image_size % GRID}"
            )
        self.zoom_size = _int("zoom_size", zoom_size, DOT_GRID * 8)
        self.max_count = _int("max_count", max_count, 1, DOT_GRID * DOT_GRID)
        self.min_count = _int("min_count", min_count, 0, max_count)
        square = zoom_size / DOT_GRID
        self.dot_radius = _number(
            "dot_radius", dot_radius, 0.5, 0.35 * square, f"a dot must fit in its {square:g}-px layout square"
        )
        if self.dot_radius * self.scale < 0.5:
            raise ConfigError(
                f"ZoomCountEnv(dot_radius={dot_radius}, image_size={image_size}, zoom_size={zoom_size}): dots "
                f"would be {2 * self.dot_radius * self.scale:.2f} px wide on the image, too small to draw; raise "
                "image_size or dot_radius"
            )
        self.distractors = _int("distractors", distractors, 0, GRID * GRID - 1)
        others = [c for c in PALETTE if c != TARGET_COLOR]
        if distractor_color not in others:
            raise ConfigError(
                f"ZoomCountEnv(distractor_color={distractor_color!r}): expected one of {others}."
                f"{did_you_mean(str(distractor_color), others)}"
            )
        self.distractor_color = distractor_color
        if not isinstance(empty_frames, bool):
            raise ConfigError(f"ZoomCountEnv(empty_frames={empty_frames!r}): expected true or false")
        self.empty_frames = empty_frames
        if isinstance(tools, Sequence) and not isinstance(tools, str):
            tools = [self._tool_name(i, t) for i, t in enumerate(tools)]
        if (
            isinstance(tools, str)
            or not isinstance(tools, Sequence)
            or any(t not in IMAGE_TOOLS for t in tools)
            or "zoom" not in tools
            or len(set(tools)) != len(tools)
        ):
            bad = [t for t in tools if t not in IMAGE_TOOLS] if isinstance(tools, Sequence) else []
            hint = did_you_mean(str(bad[0]), IMAGE_TOOLS) if bad and not isinstance(tools, str) else ""
            raise ConfigError(
                f"ZoomCountEnv(tools={tools!r}): expected distinct names from {list(IMAGE_TOOLS)} including "
                f"'zoom' (the question and the demonstrations use it), e.g. ['zoom'] or ['zoom', 'crop'].{hint}"
            )
        self.tool_names = tuple(tools)
        self.call_prob = _number("call_prob", call_prob, 0.0, 1.0, "it is a probability")
        if demo_cell not in DEMO_CELLS:
            raise ConfigError(
                f"ZoomCountEnv(demo_cell={demo_cell!r}): expected one of {list(DEMO_CELLS)}."
                f"{did_you_mean(str(demo_cell), DEMO_CELLS)}"
            )
        self.demo_cell = demo_cell
        self.cell_reward = _number(
            "cell_reward", cell_reward, 0.0, 1.0, "it is added to the verifiers' reward"
        )
        if not isinstance(system_prompt, str):
            raise ConfigError(
                f"ZoomCountEnv(system_prompt=...): expected a str, got {type(system_prompt).__name__}"
            )
        self.system_prompt = system_prompt
        try:
            question.format(cell=5)
        except (AttributeError, KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"ZoomCountEnv(question={question!r}): expected a str template using only {{cell}}, e.g. "
                f"{DEFAULT_QUESTION!r} ({type(e).__name__}: {e})"
            ) from None
        self.question = question

    @staticmethod
    def _tool_name(i: int, entry: Any) -> Any:
        """A ``tools`` entry's name: a name, or ``{name: zoom}`` (the image tools' settings are the env's)."""
        if not isinstance(entry, Mapping):
            return entry
        from mmgrpo.toolbox import tool_entry

        name, settings = tool_entry(entry, f"ZoomCountEnv: tools[{i}]", "e.g. zoom or {name: zoom}")
        if settings:
            raise ConfigError(
                f"ZoomCountEnv: tools[{i}]: tool {name!r}: unknown setting {next(iter(settings))!r}. The image "
                "tools take their settings from the env: zoom_size (the side of a result in pixels); the grid "
                f"is fixed at {GRID} x {GRID}"
            )
        return name

    @property
    def scale(self) -> float:
        """Pixels of the big image per pixel of the zoomed view (1.0 at the defaults)."""
        return self.image_size / GRID / self.zoom_size

    def make_task(self, seed: int, split: str) -> Task:
        rng = random.Random(scene_seed(seed, split))
        cells = range(1, GRID * GRID + 1)
        cell = rng.choice(cells)
        count = rng.randint(self.min_count, self.max_count)
        squares = DOT_GRID * DOT_GRID
        boxes = {cell: (TARGET_COLOR, rng.sample(range(squares), count))}
        others = [c for c in cells if c != cell]
        distractor_cells = sorted(rng.sample(others, rng.randint(0, self.distractors)))
        for c in distractor_cells:
            boxes[c] = (self.distractor_color, rng.sample(range(squares), rng.randint(1, self.max_count)))
        if self.empty_frames:
            boxes.update({c: (self.distractor_color, []) for c in others if c not in boxes})

        image = Image.new("RGB", (self.image_size, self.image_size), BACKGROUNDS["white"])
        draw = ImageDraw.Draw(image)
        for c, (color, dots) in boxes.items():
            self._draw_box(draw, c, PALETTE[color], dots)
        messages = [
            system(self.system_prompt),
            user(image_part(image), text_part(self.question.format(cell=cell))),
        ]
        info = {"answer": str(count), "count": count, "cell": cell, "distractor_cells": distractor_cells}
        return Task(messages=messages, info=info)

    def _draw_box(
        self, draw: ImageDraw.ImageDraw, cell: int, fill: tuple[int, int, int], dots: Sequence[int]
    ) -> None:
        """Frame ``cell`` and draw a dot centred in each layout square of ``dots`` (0..15, row by row).

        Positions are computed in the zoomed view (``zoom_size`` px) and mapped onto the big image."""
        s, side = self.scale, self.image_size // GRID
        row, col = divmod(cell - 1, GRID)

        def at(x: float, y: float) -> tuple[float, float]:  # zoomed-view pixel -> big-image pixel
            return col * side + x * s, row * side + y * s

        z = self.zoom_size
        x0, y0 = at(FRAME_INSET, FRAME_INSET)
        x1, y1 = at(z - FRAME_INSET, z - FRAME_INSET)
        draw.rectangle(
            [round(x0), round(y0), round(x1) - 1, round(y1) - 1],
            outline=FRAME_COLOR,
            width=max(1, round(FRAME_WIDTH * s)),
        )
        square, r = z / DOT_GRID, self.dot_radius * s
        for d in dots:
            dr, dc = divmod(d, DOT_GRID)
            cx, cy = at((dc + 0.5) * square, (dr + 0.5) * square)
            draw.ellipse([round(cx - r), round(cy - r), round(cx + r) - 1, round(cy + r) - 1], fill=fill)

    def episode_tools(self, task: Task) -> list[Tool | Callable[..., Any]]:
        """``zoom`` (and ``crop`` if asked for) bound to the task's image."""
        (image,) = message_images(task.messages)
        crop, zoom = image_tools(image, out_size=self.zoom_size, grid=GRID)
        named = {"crop": crop, "zoom": zoom}
        return [named[name] for name in self.tool_names]

    def call_flags(self, info: dict[str, Any], calls: list) -> dict[str, bool]:
        """``right_cell`` (logged as ``env/right_cell``): the episode zoomed on the cell the question
        names, so which cell the policy looks at is visible apart from whether it answers right."""
        return {
            "right_cell": any(c.name == "zoom" and c.arguments.get("cell") == info["cell"] for c in calls)
        }

    def step(self, action: str) -> tuple[list, float, bool, bool, dict[str, Any]]:
        """``ToolEnv.step``, plus ``cell_reward`` at the episode's first zoom on the named cell."""
        had = getattr(self, "_flags", {}).get("right_cell", False)  # (step before reset: super() says so)
        obs, reward, terminated, truncated, info = super().step(action)
        if self.cell_reward and not had and self._flags.get("right_cell", False):
            reward += self.cell_reward
        return obs, reward, terminated, truncated, info

    def demonstration(self, info: dict[str, Any], rng: random.Random) -> list[str]:
        """A random count, after a ``zoom`` call with probability ``call_prob`` (on a random cell, or on
        the named one with ``demo_cell="named"``)."""
        answer = f"<answer>{rng.randint(self.min_count, self.max_count)}</answer>"
        if rng.random() < self.call_prob:
            named = self.demo_cell == "named"
            cell = info["cell"] if named else rng.randint(1, GRID * GRID)
            return [tool_call_text("zoom", {"cell": cell}), answer]
        return [answer]

    skill = "copy the question's cell number into the zoom call, then answer in <answer></answer>"

    def skill_probe(self, info: dict[str, Any]) -> list[DemoTurn]:
        """The warm start's drill and check (``warm_start.drill_steps``): the ``zoom`` call on the named cell,
        taught, then the answer with its tags taught and the true count shown, not taught (counting is
        GRPO's part). The tags are taught so that the drills keep the answer's form too: after
        ``grpo.bare_steps`` they run again on full prompts, where 300 bare GRPO steps had left the policy
        writing 40-50 tokens after the zoomed view instead of an answer (format 0.00 for 20 steps)."""
        count = Shown(str(info["answer"]))
        return [tool_call_text("zoom", {"cell": info["cell"]}), ("<answer>", count, "</answer>")]

    @staticmethod
    def reference_turns(info: dict[str, Any]) -> list[str]:
        """The intended episode: zoom on the named cell, then answer."""
        return [tool_call_text("zoom", {"cell": info["cell"]}), f"<answer>{info['answer']}</answer>"]

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A final answer that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"
