"""Image tools bound to one episode's image: ``crop`` (a pixel box) and ``zoom`` (one cell of a grid).

``image_tools(image)`` returns both as plain functions; their docstrings (and so their schemas) state the
image's size and the grid, so that a model knows the coordinates it may use.

Every result is an RGB image of exactly ``out_size`` x ``out_size`` pixels, whatever was cut out: the region is
scaled (bicubic) so that its longer side is ``out_size``, keeping its aspect ratio, and centred on a black
square. A fixed size keeps the number of image tokens a tool result costs fixed. Coordinates are pixels of the
original image, with (0, 0) the top-left corner, x to the right and y downwards; boxes are clamped to the
image, and a box with nothing left inside it is an error (``ValueError``) naming the image's size.
"""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image

__all__ = ["fit_square", "image_tools"]


def image_tools(
    image: Image.Image, *, out_size: int = 112, grid: int = 3
) -> list[Callable[..., Image.Image]]:
    """``[crop, zoom]`` for ``image``; results are ``out_size`` x ``out_size`` RGB images.

    ``zoom(cell)`` divides the image into ``grid`` x ``grid`` cells numbered 1 to ``grid**2`` row by row (for
    3: 1 2 3 on top, 4 5 6 in the middle, 7 8 9 at the bottom).
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"image_tools: expected a PIL image, got {type(image).__name__}")
    if isinstance(out_size, bool) or not isinstance(out_size, int) or out_size < 1:
        raise ValueError(f"image_tools: out_size must be a positive int, got {out_size!r}")
    if isinstance(grid, bool) or not isinstance(grid, int) or not 1 <= grid <= 10:
        raise ValueError(f"image_tools: grid must be an int from 1 to 10, got {grid!r}")
    source = image.convert("RGB")
    width, height = source.size
    cells = grid * grid

    def crop(x0: int, y0: int, x1: int, y1: int) -> Image.Image:
        for key, value in (("x0", x0), ("y0", y0), ("x1", x1), ("y1", y1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} must be a whole number of pixels, got {value!r}")
        box = (max(0, x0), max(0, y0), min(width, x1), min(height, y1))
        if box[0] >= box[2] or box[1] >= box[3]:
            raise ValueError(
                f"the box ({x0}, {y0}, {x1}, {y1}) is empty inside the {width}x{height} image: "
                f"need 0 <= x0 < x1 <= {width} and 0 <= y0 < y1 <= {height}"
            )
        return fit_square(source.crop(box), out_size)

    def zoom(cell: int) -> Image.Image:
        if isinstance(cell, bool) or not isinstance(cell, int) or not 1 <= cell <= cells:
            raise ValueError(f"cell must be a whole number from 1 to {cells}, got {cell!r}")
        row, col = divmod(cell - 1, grid)
        box = (
            width * col // grid,
            height * row // grid,
            width * (col + 1) // grid,
            height * (row + 1) // grid,
        )
        if box[0] >= box[2] or box[1] >= box[3]:  # an image smaller than the grid
            raise ValueError(f"the {width}x{height} image is too small for a {grid}x{grid} grid; use crop")
        return fit_square(source.crop(box), out_size)

    crop.__doc__ = f"""Cut a rectangle out of the image and show it enlarged.

    The image is {width} pixels wide and {height} high; (0, 0) is its top-left corner.

    Args:
        x0: Left edge in pixels (0 to {width}).
        y0: Top edge in pixels (0 to {height}).
        x1: Right edge in pixels, larger than x0.
        y1: Bottom edge in pixels, larger than y0.
    """
    rows = "; ".join(
        " ".join(str(r * grid + c + 1) for c in range(grid)) for r in range(grid)
    )  # "1 2 3; 4 5 6; 7 8 9"
    zoom.__doc__ = f"""Show one part of the image enlarged.

    The image is divided into a {grid}x{grid} grid of cells numbered row by row from the top-left: {rows}.

    Args:
        cell: The cell to show, from 1 (top-left) to {cells} (bottom-right).
    """
    return [crop, zoom]


def fit_square(region: Image.Image, size: int) -> Image.Image:
    """``region`` scaled so that its longer side is ``size`` (aspect kept), centred on a black ``size`` square."""
    w, h = region.size
    scale = size / max(w, h)
    new = (max(1, round(w * scale)), max(1, round(h * scale)))
    resized = region.resize(new, Image.Resampling.BICUBIC)
    if new == (size, size):
        return resized
    canvas = Image.new("RGB", (size, size))
    canvas.paste(resized, ((size - new[0]) // 2, (size - new[1]) // 2))
    return canvas
