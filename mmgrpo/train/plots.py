"""Pictures of a run, for a person to glance at instead of reading numbers.

Two PNGs, drawn with Pillow only (no matplotlib):

- ``plot_metrics``: one small line chart per metric of a run's ``metrics.jsonl`` (reward going up, KL
  staying small, the fraction of zero-variance groups falling, completion length, held-out accuracy),
  so that "is it learning, and is it still healthy?" is answered in one look. Each panel shows the raw
  per-step values as a thin light line and a centred moving average (window about 5% of the steps) as a
  thick line; a sparse metric such as ``eval_accuracy`` (logged every k steps) is drawn as points joined
  by a line. The warm start's records (``{"stage": "warm_start", ...}``) get their own "warm start nll"
  panel, on the warm start's own step axis. NaN and inf values are skipped.
- ``sample_grid``: a contact sheet of task images with what the model answered below each one, in green
  when the verifier said right and red when it said wrong, with a matching frame around the image, so
  that failure patterns (e.g. "always wrong when circles touch") can be seen rather than searched for.

Everything is drawn at twice the size and scaled down, which smooths the lines. Usage::

    from mmgrpo.train.plots import plot_metrics
    plot_metrics("runs/demo/run/metrics.jsonl", "runs/demo/run/metrics.png")
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from mmgrpo.errors import DataError

DEFAULT_KEYS = (
    "reward",
    "reward/number_match",
    "kl",
    "frac_zero_std_groups",
    "completion_len",
    "eval_accuracy",
)
WARM_START_TITLE = "warm start nll"

# final-size layout of plot_metrics, in pixels
WIDTH = 900
HEADER_H = 30
PANEL_H = 190
_SS = 2  # supersampling factor: draw at _SS x size, then downscale (smooth lines)

# tab10-like palette, one colour per panel in order; the warm start panel is grey
PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (188, 189, 34),
    (23, 190, 207),
]
WARM_COLOUR = (110, 110, 110)
WHITE = (255, 255, 255)
TEXT = (40, 40, 40)
MUTED = (120, 120, 120)
GRID = (232, 232, 232)
AXIS = (190, 190, 190)

# sample_grid layout and colours
GRID_PAD = 8
CAPTION_H = 20
FRAME = 3
CORRECT_COLOUR = (0, 150, 60)
WRONG_COLOUR = (210, 30, 30)
UNKNOWN_COLOUR = (0, 0, 0)
UNJUDGED_FRAME = (210, 210, 210)


# ------------------------------------------------------------------------------------------- reading
def read_metrics(metrics_path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(GRPO step records, warm start records) of a ``metrics.jsonl``; DataError if there is no GRPO step.

    A GRPO record is one with a ``step`` and no ``stage``; a record with ``stage == "warm_start"`` belongs
    to the warm start; other stages are ignored. Blank lines are skipped.
    """
    path = Path(metrics_path)
    grpo: list[dict[str, Any]] = []
    warm: list[dict[str, Any]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not a JSON object ({e.msg}); each line must be one."
                ) from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}.")
            if "stage" in record:
                if record["stage"] == "warm_start":
                    warm.append(record)
            elif "step" in record:
                grpo.append(record)
    if not grpo:
        raise DataError(
            f"{path}: no GRPO step records (objects with a 'step' and no 'stage'); "
            "is this the metrics.jsonl of a run that trained at least one step?"
        )
    return grpo, warm


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) pairs of ``key`` over the records where it is a finite number, in step order."""
    points = []
    for i, record in enumerate(records):
        value = _finite(record.get(key))
        if value is not None:
            step = _finite(record.get("step"))
            points.append((step if step is not None else float(i), value))
    return sorted(points)


def present_keys(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """The keys, in the given order and without repeats, that have at least one finite value: one panel each."""
    return [k for k in dict.fromkeys(keys) if series(records, k)]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average over ``window // 2`` neighbours each side (an even window grows by one).

    The window shrinks at the ends, so the output has the input's length and no lag.
    """
    half = max(window, 1) // 2
    cumsum = [0.0]
    for v in values:
        cumsum.append(cumsum[-1] + v)
    n = len(values)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        out.append((cumsum[hi] - cumsum[lo]) / (hi - lo))
    return out


# ------------------------------------------------------------------------------------------- drawing
@lru_cache(maxsize=16)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if 1_000 <= abs(v) < 10_000_000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick positions (1, 2 or 5 times a power of ten apart, at least 1) within [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    step = max(step, 1.0)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _blend(colour: tuple[int, int, int], amount: float) -> tuple[int, int, int]:
    """``amount`` of the colour over white (0 = white, 1 = the colour)."""
    return tuple(round(255 + (c - 255) * amount) for c in colour)  # type: ignore[return-value]


def _text_width(font: ImageFont.FreeTypeFont | ImageFont.ImageFont, text: str) -> float:
    return font.getlength(text)


def _draw_panel(
    draw: ImageDraw.ImageDraw,
    box: tuple[int, int, int, int],
    title: str,
    points: list[tuple[float, float]],
    x_range: tuple[float, float],
    colour: tuple[int, int, int],
    sparse: bool,
) -> None:
    """One line chart inside ``box`` (x0, y0, x1, y1), in supersampled pixels."""
    s = _SS
    x0, y0, x1, y1 = box
    title_font, tick_font = _font(14 * s), _font(11 * s)
    left, right, top, bottom = x0 + 50 * s, x1 - 14 * s, y0 + 30 * s, y1 - 24 * s

    values = [v for _, v in points]
    draw.text((x0 + 10 * s, y0 + 8 * s), title, fill=TEXT, font=title_font)
    last = f"last {_fmt(values[-1])}"
    draw.text((x1 - 14 * s - _text_width(tick_font, last), y0 + 11 * s), last, fill=MUTED, font=tick_font)

    lo, hi = min(values), max(values)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):  # constant series: a flat line in the middle
        lo, hi = lo - 0.5, hi + 0.5
        y_labels = [(values[0], 0.5)]
    else:
        y_labels = [(hi, 0.0), (lo, 1.0)]
    pad = 4 * s  # keep the extremes off the frame
    xlo, xhi = x_range
    xspan = xhi - xlo if xhi > xlo else 1.0

    def px(step: float) -> float:
        return left + pad + (step - xlo) / xspan * (right - left - 2 * pad)

    def py(value: float) -> float:
        return bottom - pad - (value - lo) / (hi - lo) * (bottom - top - 2 * pad)

    # grid, frame, ticks
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + pad + frac * (bottom - top - 2 * pad)
        draw.line([(left, y), (right, y)], fill=GRID, width=s)
    for step in _nice_ticks(xlo, xhi):
        x = px(step)
        draw.line([(x, top), (x, bottom)], fill=GRID, width=s)
        label = _fmt(step)
        draw.text((x - _text_width(tick_font, label) / 2, bottom + 5 * s), label, fill=MUTED, font=tick_font)
    draw.line([(left, bottom), (right, bottom)], fill=AXIS, width=s)
    draw.line([(left, top), (left, bottom)], fill=AXIS, width=s)
    for value, frac in y_labels:
        label = _fmt(value)
        y = top + pad + frac * (bottom - top - 2 * pad)
        draw.text(
            (left - 6 * s - _text_width(tick_font, label), y - 7 * s), label, fill=MUTED, font=tick_font
        )

    # data
    xy = [(px(st), py(v)) for st, v in points]
    if sparse or len(xy) == 1:
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2 * s, joint="curve")
        r = 3 * s
        for x, y in xy:
            draw.ellipse([(x - r, y - r), (x + r, y + r)], fill=colour)
        return
    window = max(1, round(0.05 * len(values)))
    if window > 1:
        draw.line(xy, fill=_blend(colour, 0.35), width=s, joint="curve")
        smooth = moving_average(values, window)
        xy = [(x, py(v)) for (x, _), v in zip(xy, smooth, strict=True)]
    draw.line(xy, fill=colour, width=3 * s, joint="curve")


def _columns(n_panels: int) -> int:
    return 1 if n_panels == 1 else 2 if n_panels in (2, 4) else 3


def metrics_image_size(n_panels: int) -> tuple[int, int]:
    """(width, height) of plot_metrics' PNG for ``n_panels`` panels."""
    rows = math.ceil(n_panels / _columns(n_panels))
    return WIDTH, HEADER_H + rows * PANEL_H


def plot_metrics(
    metrics_path: str | Path,
    out_path: str | Path,
    keys: Sequence[str] = DEFAULT_KEYS,
    header: str | None = None,
) -> Path:
    """Draw one line chart per key of ``keys`` present in the run's metrics, plus the warm start's nll.

    ``header``: the line above the panels (default: the run's folder name and its number of GRPO steps).

    Keys absent from every GRPO record are skipped; the panels are laid out in 2 or 3 columns (1 for a
    single panel), ``metrics_image_size(n_panels)`` pixels in all. Returns ``out_path`` as a Path.
    """
    metrics_path = Path(metrics_path)
    grpo, warm = read_metrics(metrics_path)
    panels: list[tuple[str, list[tuple[float, float]], tuple[float, float], tuple[int, int, int], bool]] = []
    steps = [st for st, _ in series(grpo, "step")] or [0.0, float(len(grpo) - 1)]
    x_range = (min(steps), max(steps))
    if tuple(keys) == DEFAULT_KEYS:  # multi-turn runs: how the tool use changed, and the env's own metrics
        seen = {k for r in grpo for k in r}
        keys = [*keys, *(k for k in ("tools/used_frac", "tools/failures") if k in seen)]
        keys += sorted(k for k in seen if k.startswith("env/"))
    for i, key in enumerate(present_keys(grpo, keys)):
        points = series(grpo, key)
        sparse = len(points) < 0.5 * len(grpo)
        panels.append((key, points, x_range, PALETTE[i % len(PALETTE)], sparse))
    warm_points = series(warm, "nll")
    if warm_points:
        warm_range = (warm_points[0][0], warm_points[-1][0])
        panels.append((WARM_START_TITLE, warm_points, warm_range, WARM_COLOUR, False))
    if not panels:
        raise DataError(
            f"{metrics_path}: none of the keys {list(keys)} has a finite value in any GRPO step; "
            f"keys present include {sorted({k for r in grpo for k in r})[:12]}."
        )

    width, height = metrics_image_size(len(panels))
    s, cols = _SS, _columns(len(panels))
    image = Image.new("RGB", (width * s, height * s), WHITE)
    draw = ImageDraw.Draw(image)
    run = metrics_path.parent.name or metrics_path.name
    header = header or f"{run}  ·  {len(grpo)} GRPO steps  ·  thin line: per step, thick line: moving average"
    draw.text((10 * s, 8 * s), header, fill=TEXT, font=_font(13 * s))
    panel_w = width * s // cols
    for i, (title, points, xr, colour, sparse) in enumerate(panels):
        row, col = divmod(i, cols)
        x0, y0 = col * panel_w, (HEADER_H + row * PANEL_H) * s
        _draw_panel(draw, (x0, y0, x0 + panel_w, y0 + PANEL_H * s), title, points, xr, colour, sparse)
    image = image.resize((width, height), Image.Resampling.LANCZOS)

    return save_image(image, out_path)


# --------------------------------------------------------------------------------------- sample grid
def _truncate(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, max_width: float) -> str:
    """``text`` on one line, cut with an ellipsis so that it fits in ``max_width`` pixels."""
    text = " ".join(text.split())
    if _text_width(font, text) <= max_width:
        return text
    while text and _text_width(font, text + "…") > max_width:
        text = text[:-1]
    return text.rstrip() + "…"


def grid_image_size(
    image_sizes: Sequence[tuple[int, int]], columns: int = 8, scale: int = 2
) -> tuple[int, int]:
    """(width, height) of sample_grid's PNG for images of these sizes."""
    tile_w = max(w for w, _ in image_sizes) * scale + 2 * FRAME
    tile_h = max(h for _, h in image_sizes) * scale + 2 * FRAME
    cols = min(columns, len(image_sizes))
    rows = math.ceil(len(image_sizes) / cols)
    return cols * (tile_w + GRID_PAD) + GRID_PAD, rows * (tile_h + CAPTION_H + GRID_PAD) + GRID_PAD


def sample_grid(
    images: list[Image.Image],
    captions: list[str],
    correct: list[bool | None],
    out_path: str | Path,
    columns: int = 8,
    scale: int = 2,
) -> Path:
    """A contact sheet: each image upscaled ``scale`` x (NEAREST) in a frame, its caption below.

    Frame and caption are green when ``correct`` is True, red when False, black (light grey frame) when None;
    captions longer than the tile are cut with an ellipsis. Tiles are the size of the largest image;
    ``grid_image_size`` gives the PNG's size. Returns ``out_path`` as a Path.
    """
    if not images:
        raise DataError("sample_grid: no images given; pass at least one.")
    if not len(images) == len(captions) == len(correct):
        raise DataError(
            f"sample_grid: {len(images)} images, {len(captions)} captions and {len(correct)} correct flags; "
            "pass one caption and one flag per image."
        )
    if columns < 1 or scale < 1:
        raise DataError(f"sample_grid: columns ({columns}) and scale ({scale}) must be at least 1.")

    sizes = [im.size for im in images]
    width, height = grid_image_size(sizes, columns, scale)
    tile_w = max(w for w, _ in sizes) * scale + 2 * FRAME
    tile_h = max(h for _, h in sizes) * scale + 2 * FRAME
    cols = min(columns, len(images))
    sheet = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(sheet)
    font = _font(13)
    for i, (im, caption, ok) in enumerate(zip(images, captions, correct, strict=True)):
        row, col = divmod(i, cols)
        x0 = GRID_PAD + col * (tile_w + GRID_PAD)
        y0 = GRID_PAD + row * (tile_h + CAPTION_H + GRID_PAD)
        colour = UNKNOWN_COLOUR if ok is None else CORRECT_COLOUR if ok else WRONG_COLOUR
        big = im.convert("RGB").resize((im.width * scale, im.height * scale), Image.Resampling.NEAREST)
        bx, by = x0 + (tile_w - big.width) // 2, y0 + (tile_h - big.height) // 2
        # a frame of FRAME pixels around the image: green, red, or a light grey one when unjudged
        box = [(bx - FRAME, by - FRAME), (bx + big.width + FRAME - 1, by + big.height + FRAME - 1)]
        draw.rectangle(box, outline=UNJUDGED_FRAME if ok is None else colour, width=FRAME)
        sheet.paste(big, (bx, by))
        text = _truncate(caption, font, tile_w)
        draw.text((x0, y0 + tile_h + 3), text, fill=colour, font=font)

    return save_image(sheet, out_path)


def save_image(image: Image.Image, out_path: str | Path) -> Path:
    """Save ``image`` (format from the suffix) whole or not at all: written beside ``out_path`` under a
    hidden name and renamed over it, so a failed write (a full disk) keeps the picture that was there.
    Raises OSError when the folder cannot be written."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.stem}.partial{out.suffix}")
    try:
        image.save(partial)
        os.replace(partial, out)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return out


def answer_grid(table: dict[str, dict[str, int]], out_path: str | Path, title: str = "answers given") -> Path:
    """The answer table of an evaluation (``mmgrpo.rollout.answers.answer_table``) as a picture: a row
    per true answer, a column per answer given, each cell shaded by its share of the row and labelled with
    its count; cells where the answer is right are framed green. A collapse shows as a few dark columns
    and empty green cells (answers never given)."""
    from mmgrpo.rollout.answers import answer_order, same_answer  # here: the rollout package loads torch

    if not table:
        raise DataError("answer_grid: an empty answer table; evaluate a task with a few short answers.")
    given: list[str] = list(table)  # every true answer has its column, given or not
    for row in table.values():
        given += [g for g in row if g not in given]
    given.sort(key=answer_order)
    cell, left, top, pad = 40, 90, 58, 10
    font, small = _font(14), _font(12)
    heading = f"{title} (rows: the true answer; columns: the model's)"
    width = max(left + cell * len(given), round(_text_width(font, heading))) + pad
    height = top + cell * len(table) + pad
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    draw.text((pad, 6), heading, fill=TEXT, font=font)
    for j, g in enumerate(given):
        label = _truncate(g, small, cell - 2)
        draw.text(
            (left + j * cell + (cell - _text_width(small, label)) / 2, top - 18),
            label,
            fill=MUTED,
            font=small,
        )
    for i, (true, row) in enumerate(table.items()):
        y = top + i * cell
        total = sum(row.values())
        draw.text(
            (pad, y + cell / 2 - 8),
            _truncate(f"{true} (n={total})", small, left - pad),
            fill=TEXT,
            font=small,
        )
        for j, g in enumerate(given):
            x, n = left + j * cell, row.get(g, 0)
            box = [(x, y), (x + cell - 2, y + cell - 2)]
            right = same_answer(true, g)
            fill = _blend(PALETTE[0], n / total)
            draw.rectangle(box, fill=fill, outline=CORRECT_COLOUR if right else GRID, width=2 if right else 1)
            if n:
                text = str(n)
                colour = WHITE if n / total > 0.5 else TEXT
                tx = x + (cell - 2 - _text_width(small, text)) / 2
                draw.text((tx, y + cell / 2 - 8), text, fill=colour, font=small)
    return save_image(image, out_path)

