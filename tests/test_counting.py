"""CountingEnv: determinism, split separation, that the pixels show what the answer says, and kwargs errors."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from mmgrpo.env import check_env, message_images, message_text
from mmgrpo.envs.counting import BACKGROUNDS, PALETTE, CountingEnv, scene_seed
from mmgrpo.errors import ConfigError


def scene(env: CountingEnv, seed: int, split: str = "train"):
    messages, info = env.reset(seed=seed, options={"split": split})
    (image,) = message_images(messages)
    return np.asarray(image), message_text(messages[1]), info


def components(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    """4-connected components of a boolean mask (plain flood fill)."""
    seen = np.zeros_like(mask)
    blobs = []
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        stack, blob = [(y, x)], []
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            blob.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        blobs.append(blob)
    return blobs


def classify(blob: list[tuple[int, int]]) -> str:
    """Tell a blob's shape from its fill ratio in its bounding box and the width of its bottom row."""
    ys, xs = np.array(blob).T
    h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = len(blob) / (h * w)
    if fill > 0.9:
        return "square"
    if fill > 0.65:
        return "circle"
    bottom = (ys == ys.max()).sum()
    return "triangle" if bottom > 0.8 * w else "diamond"


def objects(pixels: np.ndarray) -> Counter:
    """Counter of (color, shape) over every object in the image."""
    found = Counter()
    for color, rgb in PALETTE.items():
        for blob in components((pixels == rgb).all(axis=-1)):
            found[(color, classify(blob))] += 1
    return found


def test_same_seed_and_split_give_identical_scene_and_different_seeds_differ():
    env = CountingEnv()
    scenes = [scene(env, s) for s in range(20)]
    for s in (0, 7, 19):
        pixels, question, info = scene(CountingEnv(), s)
        assert np.array_equal(pixels, scenes[s][0]) and question == scenes[s][1] and info == scenes[s][2]
    assert len({p.tobytes() for p, _, _ in scenes}) == 20


def test_train_and_eval_differ_for_the_same_seed():
    env = CountingEnv()
    assert {scene_seed(s, "train") for s in range(100)}.isdisjoint(scene_seed(s, "eval") for s in range(100))
    same = [np.array_equal(scene(env, s, "train")[0], scene(env, s, "eval")[0]) for s in range(20)]
    assert not any(same)
    assert scene(env, 3, "eval")[2]["split"] == "eval"


def test_pixels_show_count_objects_of_the_target_kind_and_nothing_else():
    env = CountingEnv()
    for seed in range(25):
        pixels, question, info = scene(env, seed)
        color, shape = info["target"].split()
        assert question == f"How many {color} {shape}s are in the image?"
        assert objects(pixels) == Counter({(color, shape): info["count"]})
        assert info["answer"] == str(info["count"]) and len(info["boxes"]) == info["count"]
        not_background = (pixels != BACKGROUNDS["white"]).any(axis=-1)
        assert len(components(not_background)) == info["count"]


def test_distractors_are_never_the_target_kind():
    env = CountingEnv(
        shapes=("circle", "square", "triangle", "diamond"), colors=tuple(PALETTE), distractors=6
    )
    total = 0
    for seed in range(40):
        pixels, _, info = scene(env, seed, "eval")
        target = tuple(info["target"].split())
        found = objects(pixels)
        assert found[target] == info["count"], (seed, info, found)
        assert sum(found.values()) - found[target] == info["num_distractors"]
        total += info["num_distractors"]
    assert total > 0


def test_fixed_target_and_count_distribution_is_roughly_uniform():
    env = CountingEnv(target_shape="diamond", target_color="purple", max_count=5)
    infos = [env.reset(seed=s)[1] for s in range(200)]
    assert {i["target"] for i in infos} == {"purple diamond"}
    counts = Counter(i["count"] for i in infos)
    assert set(counts) == {1, 2, 3, 4, 5}
    assert all(20 <= n <= 60 for n in counts.values()), counts  # expected 40 each


def test_check_env_passes():
    check_env(CountingEnv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gymnasium_check_env(CountingEnv(), skip_render_check=True)  # gymnasium's own checker agrees
    check_env(CountingEnv(distractors=3, image_size=56, grid=2, max_count=1, background="black"))


def test_reference_completion():
    _, info = CountingEnv().reset(seed=4)
    assert CountingEnv.reference_completion(info) == f"<answer>{info['count']}</answer>"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_count": 17}, r"max_count \+ distractors <= grid \* grid = 16"),
        ({"max_count": 10, "distractors": 7}, "distractors=7"),
        ({"colors": ("red", "rde")}, r"unknown color 'rde'; valid colors are \['red'.*Did you mean 'red'\?"),
        ({"target_color": "bleu"}, "Did you mean 'blue'"),
        ({"shapes": "circle"}, "shapes='circle'"),
        ({"target_shape": "star"}, "valid shapes are"),
        ({"min_count": 3, "max_count": 2}, "min_count <= max_count"),
        ({"grid": 0}, "grid=0"),
        ({"object_scale": 1.5}, "object_scale=1.5"),
        ({"background": "pink"}, "background"),
        ({"question": "How many {colour}?"}, "question="),
        ({"shapes": ("circle",), "colors": ("red",), "distractors": 1}, "no distractor kind"),
    ],
)
def test_kwargs_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CountingEnv(**kwargs)


def test_kwargs_are_keyword_only():
    with pytest.raises(TypeError):
        CountingEnv(112)  # type: ignore[misc]
