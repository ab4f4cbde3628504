"""plots: metric panels and the sample contact sheet, checked on synthetic data by their pixels."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from PIL import Image

from mmgrpo.errors import DataError
from mmgrpo.train.plots import (
    CORRECT_COLOUR,
    DEFAULT_KEYS,
    FRAME,
    GRID_PAD,
    PALETTE,
    UNJUDGED_FRAME,
    WRONG_COLOUR,
    grid_image_size,
    metrics_image_size,
    moving_average,
    plot_metrics,
    present_keys,
    read_metrics,
    sample_grid,
)


def write_metrics(path: Path, steps: int = 50, warm_steps: int = 20, seed: int = 0) -> Path:
    """A run's metrics.jsonl: warm start nll records, then GRPO steps; eval_accuracy every 10 steps, one NaN."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for k in range(1, warm_steps + 1):
            f.write(
                json.dumps({"stage": "warm_start", "step": k, "nll": 3.0 * math.exp(-k / 5) + 0.2}) + "\n"
            )
        for step in range(steps):
            progress = 1 / (1 + math.exp(-(step - steps / 2) / (steps / 10)))  # sigmoid learning curve
            accuracy = 0.2 + 0.7 * progress
            record = {
                "step": step,
                "reward": accuracy + 0.1 + rng.gauss(0, 0.05),
                "reward/number_match": accuracy + rng.gauss(0, 0.05),
                "kl": 0.002 * step + abs(rng.gauss(0, 0.005)),
                "frac_zero_std_groups": max(0.0, 0.6 - 0.5 * progress + rng.gauss(0, 0.05)),
                "completion_len": 7 + rng.randint(-1, 1),
            }
            if step == 13:
                record["kl"] = float("nan")  # json.dumps writes NaN, as the trainer's log does
            if step % 10 == 9:
                record["eval_accuracy"] = accuracy
            f.write(json.dumps(record) + "\n")
    return path


def count_near(image: Image.Image, colour: tuple[int, int, int], tol: int = 12) -> int:
    """How many pixels are within ``tol`` of ``colour`` in every channel."""
    counts = image.convert("RGB").getcolors(maxcolors=1 << 24) or []
    return sum(n for n, p in counts if all(abs(a - b) <= tol for a, b in zip(p, colour, strict=True)))


def test_plot_metrics_draws_one_panel_per_present_key(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    grpo, warm = read_metrics(metrics)
    assert len(grpo) == 50 and len(warm) == 20
    assert present_keys(grpo, DEFAULT_KEYS) == list(DEFAULT_KEYS)

    out = plot_metrics(metrics, tmp_path / "plots" / "metrics.png")
    assert out == tmp_path / "plots" / "metrics.png"
    image = Image.open(out)
    assert image.size == metrics_image_size(len(DEFAULT_KEYS) + 1)  # + the warm start panel
    assert image.size[0] == 900
    assert count_near(image, PALETTE[0]) > 50  # the first panel's moving-average line is drawn
    assert count_near(image, PALETTE[5]) > 5  # eval_accuracy's points (sixth panel)


def test_missing_keys_are_skipped(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", warm_steps=0)
    grpo, _ = read_metrics(metrics)
    keys = ["reward", "no_such_key", "kl", "clip_frac"]
    assert present_keys(grpo, keys) == ["reward", "kl"]

    with_missing = Image.open(plot_metrics(metrics, tmp_path / "a.png", keys=keys))
    only_present = Image.open(plot_metrics(metrics, tmp_path / "b.png", keys=["reward", "kl"]))
    assert with_missing.size == only_present.size == metrics_image_size(2)
    assert with_missing.tobytes() == only_present.tobytes()


def test_constant_and_single_point_series(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "\n".join(json.dumps({"step": s, "loss": 1.0, "kl": float("inf") if s else 0.5}) for s in range(5))
    )
    image = Image.open(plot_metrics(path, tmp_path / "out.png", keys=["loss", "kl"]))
    assert image.size == metrics_image_size(2)
    assert count_near(image, PALETTE[0]) > 20 and count_near(image, PALETTE[1]) > 5


def test_empty_or_stage_only_metrics_raise_data_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        plot_metrics(empty, tmp_path / "out.png")
    warm_only = tmp_path / "warm.jsonl"
    warm_only.write_text(json.dumps({"stage": "warm_start", "step": 1, "nll": 2.0}) + "\n")
    with pytest.raises(DataError, match="warm.jsonl"):
        plot_metrics(warm_only, tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_moving_average_matches_a_plain_loop():
    values = [1.0, 2.0, 6.0, 3.0, 0.0, 4.0]
    # window 3 = one neighbour each side, fewer at the ends: (1+2)/2, (1+2+6)/3, (2+6+3)/3, ...
    assert moving_average(values, 3) == pytest.approx([1.5, 3.0, 11 / 3, 3.0, 7 / 3, 2.0])
    assert moving_average(values, 1) == values


def test_sample_grid_layout_and_colours(tmp_path):
    images = [Image.new("RGB", (112, 112), (200, 200, 255)) for _ in range(10)]
    captions = [f"answer {i} | model <answer>{i}</answer> and a very long tail " * 3 for i in range(10)]
    correct: list[bool | None] = [True, False, None] * 3 + [True]
    out = sample_grid(images, captions, correct, tmp_path / "grid.png", columns=4, scale=2)
    sheet = Image.open(out).convert("RGB")
    assert sheet.size == grid_image_size([(112, 112)] * 10, columns=4, scale=2)
    tile = 112 * 2 + 2 * FRAME
    assert sheet.size[0] == 4 * (tile + GRID_PAD) + GRID_PAD  # 4 columns, 3 rows
    assert sheet.size == grid_image_size([(112, 112)] * 12, columns=4, scale=2)

    assert sheet.getpixel((GRID_PAD, GRID_PAD)) == CORRECT_COLOUR  # frame of tile 0
    assert sheet.getpixel((GRID_PAD + tile + GRID_PAD, GRID_PAD)) == WRONG_COLOUR  # frame of tile 1
    assert sheet.getpixel((GRID_PAD + 2 * (tile + GRID_PAD), GRID_PAD)) == UNJUDGED_FRAME  # None: grey
    assert sheet.getpixel((GRID_PAD + FRAME + 5, GRID_PAD + FRAME + 5)) == (200, 200, 255)  # the image
    caption_row = sheet.crop(
        (GRID_PAD, GRID_PAD + tile, GRID_PAD + 2 * tile + GRID_PAD, GRID_PAD + tile + 20)
    )
    assert (
        count_near(caption_row, CORRECT_COLOUR, tol=40) > 10
        and count_near(caption_row, WRONG_COLOUR, tol=40) > 10
    )


def test_sample_grid_rejects_mismatched_lengths(tmp_path):
    with pytest.raises(DataError, match="one caption"):
        sample_grid([Image.new("RGB", (8, 8))], ["a", "b"], [True], tmp_path / "g.png")
