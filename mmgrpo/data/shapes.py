"""Flat shapes on a board of cells: the drawing shared by the counting scenes (``envs/counting.py``) and the
tiny VLM's perception pretraining (``mmgrpo/tiny/perception.py``), so that both show the model the same
pixels for "a red circle"."""

from __future__ import annotations

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 60, 180),
    "orange": (245, 130, 20),
}
"""Object colours (fixed RGB, far apart, none close to a background)."""

SHAPES = ("circle", "square", "triangle", "diamond")
BOARD_WHITE = (255, 255, 255)


def cell_box(cell: int, image_size: int, grid: int, scale: float) -> list[int]:
    """The box [x0, y0, x1, y1] (pixel edges, x1 and y1 exclusive) of an object of ``scale`` times the cell's
    side, centred in ``cell`` (row-major) of a ``grid x grid`` board of ``image_size`` px."""
    side = image_size / grid
    row, col = divmod(cell, grid)
    cx, cy, r = (col + 0.5) * side, (row + 0.5) * side, scale * side / 2
    return [round(cx - r), round(cy - r), round(cx + r), round(cy + r)]


def draw_shape(draw, box: list[int], shape: str, fill: tuple[int, int, int]) -> None:
    """Fill ``shape`` (one of SHAPES) in ``box`` [x0, y0, x1, y1] (x1, y1 exclusive) on a PIL ImageDraw."""
    x0, y0, x1, y1 = box[0], box[1], box[2] - 1, box[3] - 1
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "diamond":
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        draw.polygon([(mx, y0), (x1, my), (mx, y1), (x0, my)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; shapes are {list(SHAPES)}")
