"""Cluttered counting: CountingEnv's per-scene targets with min_distractors / near_misses, and
examples/counting_hard.yaml."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from test_counting import objects, scene

from mmgrpo.config.core import load_config
from mmgrpo.env import check_env
from mmgrpo.envs.counting import CountingEnv
from mmgrpo.errors import ConfigError
from mmgrpo.registry import make_env

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "counting_hard.yaml"
SHAPES = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "yellow")
HARD = dict(max_count=5, shapes=SHAPES, colors=COLORS, min_distractors=2, distractors=4, near_misses=True)


def hard_env(**overrides) -> CountingEnv:
    return CountingEnv(**{**HARD, **overrides})


def near_miss_sorts(target: tuple[str, str], distractors: list[dict]) -> set[str]:
    """Which near misses a scene's distractors hold: "shape" (target shape, other colour), "color"."""
    shape, color = target
    sorts = set()
    for o in distractors:
        if o["shape"] == shape and o["color"] != color:
            sorts.add("shape")
        if o["color"] == color and o["shape"] != shape:
            sorts.add("color")
    return sorts


# ---------------------------------------------------------------- the example config


def test_example_config_loads_and_validates():
    cfg = load_config(CONFIG)
    from mmgrpo.train.trainer import build_env_factory, build_rewards, eval_metric

    env = build_env_factory(cfg)()  # the kwargs are accepted by the env
    build_rewards(cfg)
    assert eval_metric(cfg) == "number_match"
    assert [v.name for v in cfg.verifiers] == ["number_match", "format"]
    assert cfg.env.name == "counting" and isinstance(env, CountingEnv)
    assert (env.target_shape, env.target_color) == (None, None)  # a per-scene target
    assert env.shapes == SHAPES and env.colors == COLORS
    assert (env.min_distractors, env.distractors, env.near_misses) == (4, 6, True)
    assert cfg.grpo.freeze_embeddings  # docs/results.md: the answers collapse onto 1, 3, 5 without it
    assert cfg.model.freeze_vision and cfg.warm_start.enabled and cfg.warm_start.source == "format"
    # the warm start's random answers cover exactly the env's counts
    assert (cfg.warm_start.random_low, cfg.warm_start.random_high) == (env.min_count, env.max_count)
    assert 4 <= env.max_count <= 5
    check_env(env)


def test_example_config_bad_override_is_a_config_error():
    from mmgrpo.train.trainer import build_env_factory

    cfg = load_config(CONFIG, ["env.kwargs.min_distractors=7"])
    with pytest.raises(ConfigError, match=r"min_distractors=7, distractors=6"):
        build_env_factory(cfg)
    cfg = load_config(CONFIG, ["env.kwargs.near_miss=true"])
    with pytest.raises(ConfigError, match="Did you mean 'near_misses'"):
        build_env_factory(cfg)


# ---------------------------------------------------------------- the env options


def test_question_names_the_per_scene_target_and_every_kind_is_drawn():
    env = hard_env()
    targets = Counter()
    for seed in range(90):
        _, question, info = scene(env, seed)
        (shape, color), _, _ = env.layout(seed, "train")
        assert info["target"] == f"{color} {shape}"
        assert question == f"How many {color} {shape}s are in the image?"
        targets[(shape, color)] += 1
    assert set(targets) == {(s, c) for s in SHAPES for c in COLORS}


def test_layout_and_pixels_hold_answer_objects_of_the_target_kind():
    env = hard_env()
    for split in ("train", "eval"):
        for seed in range(30):
            pixels, _, info = scene(env, seed, split)
            target, count, layout = env.layout(seed, split)
            kinds = Counter((o["shape"], o["color"]) for o in layout)
            assert kinds[target] == count == info["count"] and info["answer"] == str(count)
            assert len(layout) == count + info["num_distractors"]
            assert info["boxes"] == [o["box"] for o in layout[:count]]
            assert len({o["cell"] for o in layout}) == len(layout)  # one object per cell
            # what is drawn agrees: count objects of the target kind, num_distractors of other kinds
            found = objects(pixels)
            assert found == Counter({(c, s): n for (s, c), n in kinds.items()}), (split, seed)
            assert found[target[::-1]] == count


def test_distractors_are_never_the_target_kind_and_include_near_misses():
    env = hard_env()
    numbers = Counter()
    for split in ("train", "eval"):
        for seed in range(60):
            target, count, layout = env.layout(seed, split)
            distractors = layout[count:]
            assert all((o["shape"], o["color"]) != target for o in distractors)
            assert 2 <= len(distractors) <= 4
            assert near_miss_sorts(target, distractors) == {"shape", "color"}, (split, seed, target, layout)
            numbers[len(distractors)] += 1
    assert set(numbers) == {2, 3, 4}


def test_a_single_distractor_is_a_near_miss_of_either_sort():
    env = hard_env(min_distractors=1, distractors=1)
    sorts = Counter()
    for seed in range(60):
        target, count, layout = env.layout(seed, "train")
        (distractor,) = layout[count:]
        (sort,) = near_miss_sorts(target, [distractor])
        sorts[sort] += 1
    assert set(sorts) == {"shape", "color"}


def test_without_near_misses_distractor_kinds_are_drawn_from_all_other_kinds():
    env = hard_env(near_misses=False)
    far = 0
    for seed in range(60):
        target, count, layout = env.layout(seed, "eval")
        assert 2 <= len(layout) - count <= 4
        assert all((o["shape"], o["color"]) != target for o in layout[count:])
        far += sum(o["shape"] != target[0] and o["color"] != target[1] for o in layout[count:])
    assert far > 0  # kinds sharing neither shape nor colour occur too


def test_near_misses_change_only_the_distractor_kinds():
    with_near, without = hard_env(), hard_env(near_misses=False)
    for seed in range(30):
        t1, c1, l1 = with_near.layout(seed, "train")
        t2, c2, l2 = without.layout(seed, "train")
        assert (t1, c1) == (t2, c2) and [o["cell"] for o in l1] == [o["cell"] for o in l2]


def test_same_seed_and_split_give_the_same_scene_and_splits_differ():
    a, b = hard_env(), hard_env()
    pixels = {}
    for split in ("train", "eval"):
        for seed in range(15):
            pa, qa, ia = scene(a, seed, split)
            pb, qb, ib = scene(b, seed, split)
            assert np.array_equal(pa, pb) and qa == qb and ia == ib
            assert a.layout(seed, split) == b.layout(seed, split)
            pixels[split, seed] = pa.tobytes()
    assert len(set(pixels.values())) == len(pixels)  # different seeds differ, and train never equals eval
    assert not any(a.layout(s, "train") == a.layout(s, "eval") for s in range(15))


def test_make_env_builds_the_hard_env_and_check_env_passes():
    env = make_env("counting", **HARD)
    assert isinstance(env, CountingEnv) and env.near_misses
    check_env(env)
    check_env(hard_env(min_distractors=0, distractors=0))  # near_misses is a no-op without distractors
    check_env(hard_env(image_size=56, grid=2, max_count=2, min_distractors=1, distractors=2))


# The scenes of the defaults and of plain distractors, pinned as they were before min_distractors and
# near_misses existed: the options left at their defaults change nothing.
PINNED = [
    ({}, "train", 0, "How many yellow squares are in the image?", 1, 0, [[88, 88, 108, 108]]),
    (
        {},
        "train",
        7,
        "How many green circles are in the image?",
        3,
        0,
        [[32, 60, 52, 80], [88, 60, 108, 80], [32, 4, 52, 24]],
    ),
    (
        {},
        "eval",
        0,
        "How many red circles are in the image?",
        3,
        0,
        [[88, 88, 108, 108], [4, 88, 24, 108], [88, 32, 108, 52]],
    ),
    (
        {"distractors": 4, "shapes": SHAPES, "colors": ("red", "green", "blue")},
        "train",
        0,
        "How many green squares are in the image?",
        1,
        2,
        [[88, 88, 108, 108]],
    ),
    (
        {"distractors": 4, "shapes": SHAPES, "colors": ("red", "green", "blue")},
        "eval",
        1,
        "How many blue circles are in the image?",
        5,
        1,
        [[88, 60, 108, 80], [60, 88, 80, 108], [32, 60, 52, 80], [88, 32, 108, 52], [60, 60, 80, 80]],
    ),
]


@pytest.mark.parametrize("kwargs, split, seed, question, count, num_distractors, boxes", PINNED)
def test_defaults_give_the_scenes_of_before(kwargs, split, seed, question, count, num_distractors, boxes):
    for env in (CountingEnv(**kwargs), CountingEnv(**kwargs, min_distractors=0, near_misses=False)):
        _, q, info = scene(env, seed, split)
        assert (q, info["count"], info["num_distractors"], info["boxes"]) == (
            question,
            count,
            num_distractors,
            boxes,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"min_distractors": 5},
            r"min_distractors=5, distractors=4\).*min_distractors must be <= distractors",
        ),
        ({"min_distractors": -1}, r"min_distractors=-1\): expected an int >= 0"),
        ({"min_distractors": "2"}, r"min_distractors='2'\): expected an int"),
        ({"min_distractors": True}, r"min_distractors=True\): expected an int"),
        ({"near_misses": "yes"}, r"near_misses='yes'\): expected true or false"),
        ({"near_misses": 1}, r"near_misses=1\): expected true or false"),
        ({"shapes": ("circle",)}, r"no near miss.*red object of another shape.*has no shape but 'circle'"),
        ({"colors": ("blue",)}, r"no near miss.*circle in another colour.*has no colour but 'blue'"),
        ({"target_shape": "diamond"}, r"target \w+ diamond has no near miss.*lacks 'diamond'"),
        (
            {"target_color": "purple"},
            r"target purple \w+ has no near miss.*lacks 'purple'.*near_misses=false",
        ),
        ({"shapes": ("circle",), "colors": ("red",)}, "no distractor kind differs"),
        ({"max_count": 13}, r"max_count \+ distractors <= grid \* grid = 16"),
    ],
)
def test_bad_values_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        hard_env(**kwargs)


def test_question_first_puts_the_question_before_the_image_and_changes_nothing_else():
    a, b = hard_env(), hard_env(question_first=True)
    ta, tb = a.make_task(3, "train"), b.make_task(3, "train")
    kinds = [[p["type"] for p in t.messages[1]["content"]] for t in (ta, tb)]
    assert kinds == [["image", "text"], ["text", "image"]]
    assert ta.info == tb.info and ta.messages[1]["content"][1] == tb.messages[1]["content"][0]
    assert np.array_equal(np.asarray(ta.messages[1]["content"][0]["image"]), np.asarray(tb.messages[1]["content"][1]["image"]))
    with pytest.raises(ConfigError, match="question_first"):
        hard_env(question_first="yes")
