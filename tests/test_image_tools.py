"""crop and zoom: the right region, the right size, errors that name the valid range."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw

from mmgrpo.toolbox import image_tools
from mmgrpo.toolbox.image import fit_square

RED, BLUE, BLACK, WHITE = (255, 0, 0), (0, 0, 255), (0, 0, 0), (255, 255, 255)


@pytest.fixture
def picture():
    """90 x 90 white, a red square filling grid cell 6 (x 60-89, y 30-59) and a blue one at x 0-9, y 80-89."""
    image = Image.new("RGB", (90, 90), WHITE)
    draw = ImageDraw.Draw(image)
    draw.rectangle((60, 30, 89, 59), fill=RED)
    draw.rectangle((0, 80, 9, 89), fill=BLUE)
    return image


def test_zoom_shows_the_cell(picture):
    crop, zoom = image_tools(picture, out_size=64)
    assert (crop.__name__, zoom.__name__) == ("crop", "zoom")
    cell = zoom(6)  # middle row, right column
    assert cell.size == (64, 64) and cell.mode == "RGB"
    assert {cell.getpixel((x, y)) for x in (2, 32, 61) for y in (2, 32, 61)} == {RED}
    assert zoom(5).getpixel((32, 32)) == WHITE
    assert zoom(7).getpixel((5, 60)) == BLUE  # bottom-left cell: the blue square at its bottom-left


def test_grid_numbering_is_row_major(picture):
    _, zoom = image_tools(picture, grid=2, out_size=32)
    # 2x2 grid of 45-px cells: the red square (x 60-89, y 30-59) overlaps cells 2 (top-right) and 4
    assert zoom(2).getpixel((31, 31)) == RED
    assert zoom(1).getpixel((16, 16)) == WHITE
    assert "1 2; 3 4" in zoom.__doc__


def test_crop_in_pixels(picture):
    crop, _ = image_tools(picture, out_size=50)
    region = crop(60, 30, 90, 60)
    assert region.size == (50, 50)
    assert region.getpixel((1, 1)) == RED and region.getpixel((48, 48)) == RED


def test_crop_keeps_the_aspect_ratio_and_pads(picture):
    crop, _ = image_tools(picture, out_size=60)
    region = crop(0, 30, 90, 60)  # 90 x 30: scaled to 60 x 20, centred on black
    assert region.size == (60, 60)
    assert region.getpixel((30, 5)) == BLACK and region.getpixel((30, 55)) == BLACK
    assert region.getpixel((10, 30)) == WHITE and region.getpixel((55, 30)) == RED


def test_crop_clamps_to_the_image(picture):
    crop, _ = image_tools(picture, out_size=30)
    region = crop(-50, 80, 10, 500)  # only x 0-9, y 80-89 is inside: the blue square
    assert region.size == (30, 30)
    assert region.getpixel((15, 15)) == BLUE


@pytest.mark.parametrize(
    "box", [(50, 50, 50, 60), (60, 10, 50, 20), (100, 0, 120, 10), (0, -20, 10, -1), (0, 0, 1.5, 10)]
)
def test_empty_or_invalid_boxes_are_errors(picture, box):
    crop, _ = image_tools(picture)
    with pytest.raises(ValueError, match="90x90 image|whole number"):
        crop(*box)


@pytest.mark.parametrize("cell", [0, 10, -1, 2.0, True, "5"])
def test_invalid_cells_are_errors(picture, cell):
    _, zoom = image_tools(picture)
    with pytest.raises(ValueError, match="from 1 to 9"):
        zoom(cell)


def test_other_modes_become_rgb():
    gray = Image.new("L", (30, 20), 128)
    crop, zoom = image_tools(gray, out_size=16)
    assert zoom(1).mode == "RGB" and crop(0, 0, 30, 20).mode == "RGB"


def test_tiny_image_and_bad_settings():
    _, zoom = image_tools(Image.new("RGB", (2, 2)), grid=3)
    with pytest.raises(ValueError, match="too small"):
        zoom(1)
    with pytest.raises(ValueError, match="out_size"):
        image_tools(Image.new("RGB", (8, 8)), out_size=0)
    with pytest.raises(TypeError, match="PIL image"):
        image_tools("picture.png")  # type: ignore[arg-type]


def test_fit_square_exact_size_is_a_plain_resize():
    assert fit_square(Image.new("RGB", (10, 10), RED), 40).getpixel((0, 0)) == RED
