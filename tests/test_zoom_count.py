"""ZoomCountEnv: the dots are readable after zoom and crowded before, tool turns through step, demonstrations,
kwargs errors, the registry, and one episode with a zoom turn rendered by the tiny model."""

from __future__ import annotations

import hashlib
import json
import random
import re

import numpy as np
import pytest
from PIL import Image
from test_counting import components
from test_multiturn import ScriptedPolicy
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmgrpo.env import Shown, check_env, message_images, message_text
from mmgrpo.envs.counting import PALETTE, scene_seed
from mmgrpo.envs.zoom_count import ZoomCountEnv, tool_call_text
from mmgrpo.errors import ConfigError
from mmgrpo.registry import ENVS, list_envs, make_env, register_env
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.vlm import TinyModelSpec

SEEDS = range(40)


def red(pixels: np.ndarray) -> np.ndarray:
    """Pixels that are clearly red (the dots are PALETTE red (220, 40, 40); anti-aliased pink is not)."""
    p = pixels.astype(int)
    return (p[..., 0] > 150) & (p[..., 1] < 100) & (p[..., 2] < 100)


def red_tokens(pixels: np.ndarray) -> int:
    """How many merged vision tokens (28 x 28 px squares) hold a red pixel."""
    n = pixels.shape[0] // 28
    return int(red(pixels).reshape(n, 28, n, 28).any(axis=(1, 3)).sum())


def overview(image: Image.Image) -> np.ndarray:
    """The image as the tiny model sees it: resized by the processor's rule (smart_resize) with its bicubic."""
    spec = TinyModelSpec()
    h, w = smart_resize(image.height, image.width, 28, spec.min_pixels, spec.max_pixels)
    return np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))


def episode(env: ZoomCountEnv, seed: int, split: str = "train"):
    messages, info = env.reset(seed=seed, options={"split": split})
    (image,) = message_images(messages)
    return image, message_text(messages[1]), info


def zoom_turn(env: ZoomCountEnv, cell: int) -> np.ndarray:
    """The image of the tool message answering a zoom call on ``cell`` (made through ``env.step``)."""
    messages, reward, terminated, truncated, info = env.step(tool_call_text("zoom", {"cell": cell}))
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_calls"] == 1 and info["tool_failures"] == {} and info["tool_names"] == ["zoom"]
    ((message),) = messages
    assert message["role"] == "tool" and message["name"] == "zoom" and message["error"] is None
    (part,) = message["content"]
    assert part["type"] == "image" and part["image"].size == (112, 112)
    return np.asarray(part["image"])


def test_check_env_passes():
    check_env(ZoomCountEnv())
    check_env(ZoomCountEnv(distractors=3, empty_frames=True, tools=["zoom", "crop"]), seeds=(0, 5))
    check_env(ZoomCountEnv(image_size=672, dot_radius=5), action=tool_call_text("zoom", {"cell": 1}))


def test_prompt_info_and_tools():
    env = ZoomCountEnv()
    image, question, info = episode(env, 3)
    assert image.size == (336, 336) and image.getpixel((0, 0)) == (255, 255, 255)
    assert question == f"How many red dots are in cell {info['cell']}? Use zoom to look closer."
    assert info["answer"] == str(info["count"]) and 1 <= info["count"] <= 4 and 1 <= info["cell"] <= 9
    assert (info["seed"], info["split"], info["distractor_cells"]) == (3, "train", [])
    assert [t["function"]["name"] for t in info["tools"]] == ["zoom"]
    assert "3x3 grid" in info["tools"][0]["function"]["description"]
    both = ZoomCountEnv(tools=["zoom", "crop"]).reset(seed=3)[1]["tools"]
    assert [t["function"]["name"] for t in both] == ["zoom", "crop"]
    counts = {episode(env, s)[2]["count"] for s in SEEDS}
    cells = {episode(env, s)[2]["cell"] for s in SEEDS}
    assert counts == {1, 2, 3, 4} and cells == set(range(1, 10))


def test_same_seed_same_task_and_splits_disjoint():
    env = ZoomCountEnv(distractors=2)

    def fingerprint(seed, split):
        image, question, info = episode(env, seed, split)
        return hashlib.sha256(image.tobytes()).hexdigest(), question, info["cell"], info["answer"]

    for seed in (0, 7):
        assert fingerprint(seed, "train") == fingerprint(seed, "train")
        assert fingerprint(seed, "eval") == fingerprint(seed, "eval")
    # eval scenes come from odd generator seeds, train scenes from even ones: never the same generator
    assert {scene_seed(s, "train") for s in range(100)}.isdisjoint(scene_seed(s, "eval") for s in range(100))
    train = {fingerprint(s, "train") for s in SEEDS}
    assert len(train) == len(SEEDS)  # distinct scenes
    assert sum(fingerprint(s, "eval") in train for s in SEEDS) <= 1  # only a chance coincidence of pixels


def test_zoom_shows_countable_dots_the_overview_does_not():
    """Numbers at the defaults (336 px image, dot radius 4): in the zoomed cell each dot is an 8 px disc of 52
    red pixels centred in its own 28-px token; in the 112 x 112 overview the processor makes of the image a dot
    keeps ~3.5 red pixels (a speck ~3 px wide) and dots share tokens (a token covers 3 x 3 dot squares)."""
    env = ZoomCountEnv()
    zoom_area = overview_area = dots = overview_tok = 0
    crowded = 0
    for seed in SEEDS:
        image, _, info = episode(env, seed)
        count = info["count"]
        zoomed = zoom_turn(env, info["cell"])
        blobs = components(red(zoomed))
        assert len(blobs) == count  # countable: one blob per dot ...
        assert all(len(b) == 52 for b in blobs)  # ... each the whole 8 px disc (pi * 4**2 ~ 50)
        assert red_tokens(zoomed) == count  # ... and one vision token per dot
        small = overview(image)
        assert small.shape == (112, 112, 3)  # the tiny model's processor shrinks the image 3x
        dots += count
        zoom_area += red(zoomed).sum()
        overview_area += red(small).sum()
        overview_tok += red_tokens(small)
        crowded += red_tokens(small) < count
    assert zoom_area == 52 * dots
    assert overview_area < zoom_area / 10  # ~3.5 red pixels left per dot, down from 52
    assert overview_tok < 0.85 * dots  # dots share tokens in the overview (exactly one each when zoomed)
    assert crowded >= len(SEEDS) // 4  # in many scenes fewer red tokens than dots


def test_wrong_cell_zooms_elsewhere():
    env = ZoomCountEnv()
    for seed in range(10):
        _, _, info = episode(env, seed)
        other = info["cell"] % 9 + 1
        assert not red(zoom_turn(env, other)).any()
        assert red(zoom_turn(env, info["cell"])).any()  # the episode goes on; the named cell has the dots


def test_distractors_are_other_colours_in_other_cells():
    env = ZoomCountEnv(distractors=8, distractor_color="blue", empty_frames=True)
    blue = np.array(PALETTE["blue"])
    for seed in range(10):
        _, _, info = episode(env, seed)
        assert info["cell"] not in info["distractor_cells"]
        assert len(components(red(zoom_turn(env, info["cell"])))) == info["count"]
        for cell in info["distractor_cells"]:
            zoomed = zoom_turn(env, cell)
            assert not red(zoomed).any() and (zoomed == blue).all(axis=-1).any()


@pytest.mark.parametrize(
    "turn, kind",
    [
        (tool_call_text("zoom", {"cell": 0}), "tool_error"),
        (tool_call_text("zoom", {"cell": 10}), "tool_error"),
        (tool_call_text("zoom", {"cell": "5"}), "bad_arguments"),
        (tool_call_text("zoom", {}), "bad_arguments"),
        (tool_call_text("crop", {"x0": 0, "y0": 0, "x1": 9, "y1": 9}), "unknown_tool"),  # not offered
        ('<tool_call>\n{"name": "zoom", "arguments": {"cell": 5}\n</tool_call>', "invalid_json"),
    ],
)
def test_a_bad_call_is_an_error_message(turn, kind):
    env = ZoomCountEnv()
    env.reset(seed=0)
    messages, _, terminated, _, info = env.step(turn)
    assert not terminated and info["tool_failures"] == {kind: 1}
    ((message),) = messages
    assert message["role"] == "tool" and message["error"] == kind
    assert message_text(message).startswith("error: ")
    _, _, terminated, _, _ = env.step("<answer>1</answer>")
    assert terminated


def test_demonstrations_teach_the_call_syntax_only():
    env = ZoomCountEnv()
    rng = random.Random(0)
    shapes, right_cell = [], 0
    for seed in range(200):
        _, info = env.reset(seed=seed)
        demo = env.demonstration(info, rng)
        *calls, answer = demo
        assert (
            answer.startswith("<answer>")
            and int(answer[8:-9]) in range(1, 5)
            and answer.endswith("</answer>")
        )
        for call in calls:
            cell = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"][
                "cell"
            ]
            assert (
                call
                == "<tool_call>\n"
                + json.dumps({"name": "zoom", "arguments": {"cell": cell}})
                + "\n</tool_call>"
            )
            assert re.fullmatch(
                r'<tool_call>\n\{"name": "zoom", "arguments": \{"cell": [1-9]\}\}\n</tool_call>', call
            )
            right_cell += cell == info["cell"]
            messages, _, terminated, _, step_info = env.step(call)  # the warm start plays it through step
            assert not terminated and step_info["tool_failures"] == {} and messages[0]["error"] is None
        assert env.step(answer)[2]  # terminated
        shapes.append(len(demo))
    assert set(shapes) == {1, 2} and 70 < shapes.count(2) < 130  # call_prob=0.5
    assert right_cell < 0.3 * shapes.count(2)  # a random cell, right about 1 time in 9
    _, info = env.reset(seed=0)
    assert all(len(ZoomCountEnv(call_prob=1.0).demonstration(info, rng)) == 2 for _ in range(20))
    assert all(len(ZoomCountEnv(call_prob=0.0).demonstration(info, rng)) == 1 for _ in range(20))


def test_right_cell_metric_says_whether_the_named_cell_was_zoomed():
    env = ZoomCountEnv(distractors=2)
    _, info = env.reset(seed=3)
    wrong = next(c for c in range(1, 10) if c != info["cell"])
    *_, step_info = env.step(tool_call_text("zoom", {"cell": wrong}))
    assert step_info["metrics"] == {"right_cell": 0.0}
    *_, step_info = env.step(tool_call_text("zoom", {"cell": info["cell"]}))
    assert step_info["metrics"] == {"right_cell": 1.0}
    *_, step_info = env.step("<answer>2</answer>")  # it stays: the episode did look at the right cell
    assert step_info["metrics"] == {"right_cell": 1.0}
    env.reset(seed=4)
    *_, step_info = env.step("<answer>2</answer>")  # answered without zooming
    assert step_info["metrics"] == {"right_cell": 0.0}
    env.reset(seed=4)
    *_, step_info = env.step(tool_call_text("zoom", {"cell": str(env._info["cell"])}))  # "5" is not 5
    assert step_info["metrics"] == {"right_cell": 0.0} and step_info["tool_failures"]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"image_size": 335}, "image_size=335"),
        ({"image_size": "336"}, "image_size='336'"),
        ({"max_count": 17}, "max_count=17"),
        ({"min_count": 5}, "min_count=5"),
        ({"dot_radius": 12}, "dot_radius=12"),
        ({"dot_radius": 1, "image_size": 84}, "dot_radius=1"),
        ({"distractors": 9}, "distractors=9"),
        ({"distractor_color": "red"}, "distractor_color='red'"),
        ({"distractor_color": "bleu"}, "Did you mean 'blue'"),
        ({"empty_frames": 1}, "empty_frames=1"),
        ({"tools": ["crop"]}, "including 'zoom'"),
        ({"tools": "zoom"}, "tools='zoom'"),
        ({"tools": ["zoom", "zom"]}, "Did you mean 'zoom'"),
        ({"call_prob": 1.5}, "call_prob=1.5"),
        ({"demo_cell": "name"}, "Did you mean 'named'"),
        ({"cell_reward": 2}, "cell_reward=2"),
        ({"question": "In cell {cel}?"}, "{cell}"),
        ({"system_prompt": None}, "system_prompt"),
        ({"timeout_s": 0}, "timeout_s=0"),
    ],
)
def test_bad_kwargs_raise_config_errors_naming_them(kwargs, named):
    with pytest.raises(ConfigError) as e:
        ZoomCountEnv(**kwargs)
    assert named in str(e.value)


@pytest.fixture
def zoom_count_registered():
    """Register the env in code when its entry point is not installed yet; forget it afterwards."""
    added = "zoom_count" not in list_envs()
    if added:
        register_env("zoom_count", ZoomCountEnv)
    yield
    if added:
        ENVS._entries.pop("zoom_count", None)


def test_registry_builds_it(zoom_count_registered):
    env = make_env("zoom_count", tools=["zoom", "crop"], max_count=3)
    assert isinstance(env, ZoomCountEnv) and env.tool_names == ("zoom", "crop") and env.max_count == 3
    check_env(env, seeds=(0,))


def test_tiny_model_renders_a_zoom_episode(tiny_policy):
    envs = [ZoomCountEnv() for _ in range(2)]
    script = [tool_call_text("zoom", {"cell": 5}), "<answer>2</answer>"]
    policy = ScriptedPolicy(tiny_policy, script)
    batch = rollout(policy, envs, [0], group_size=2, max_new_tokens=24, max_turns=2)
    assert batch.tokens.has_response_images  # the zoomed cell went back into the conversation as an image
    for t in batch.trajectories:
        assert (t.turns, t.tool_calls, t.truncated) == (2, 1, False)
        assert t.response_vision.images_per_seq == [1]
        assert tiny_policy.image_token_id in t.response_ids
    logp = policy.logprobs(batch.tokens)  # (N, T)
    assert logp.shape == batch.tokens.loss_mask.shape and bool(logp.isfinite().all())


def test_skill_probe_teaches_the_named_cell_and_shows_the_count():
    env = ZoomCountEnv()
    for seed in range(5):
        _, info = env.reset(seed=seed)
        call, answer = env.skill_probe(info)
        assert call == tool_call_text("zoom", {"cell": info["cell"]})
        assert answer == ("<answer>", Shown(str(info["count"])), "</answer>")  # the tags taught, the count not
    assert "cell number" in ZoomCountEnv.skill and "<answer>" in ZoomCountEnv.skill


def test_the_probe_teaches_the_tags_and_not_the_count(tiny_policy):
    from mmgrpo.train.warmstart import encode_turn

    env = ZoomCountEnv()
    _, info = env.reset(seed=0)
    _, answer = env.skill_probe(info)
    text, ids, taught = encode_turn(tiny_policy, answer)
    tok = tiny_policy.tokenizer
    assert text == f"<answer>{info['count']}</answer>" and 0 < sum(taught) < len(ids)
    assert str(info["count"]) not in tok.decode([i for i, t in zip(ids, taught, strict=True) if t])
    assert "answer" in tok.decode([i for i, t in zip(ids, taught, strict=True) if t])


def test_cell_reward_is_paid_once_at_the_first_zoom_on_the_named_cell():
    env = ZoomCountEnv(cell_reward=0.3)
    _, info = env.reset(seed=3)
    wrong = next(c for c in range(1, 10) if c != info["cell"])
    right = tool_call_text("zoom", {"cell": info["cell"]})
    rewards = [env.step(turn)[1] for turn in (tool_call_text("zoom", {"cell": wrong}), right, right)]
    assert rewards == [0.0, 0.3, 0.0] and env.step("<answer>2</answer>")[1] == 0.0
    env.reset(seed=4)
    assert env.step("<answer>2</answer>")[1] == 0.0  # no zoom, no reward
    env = ZoomCountEnv()  # off by default
    _, info = env.reset(seed=3)
    assert env.step(tool_call_text("zoom", {"cell": info["cell"]}))[1] == 0.0


def test_named_demonstrations_zoom_on_the_named_cell():
    env, rng = ZoomCountEnv(demo_cell="named", call_prob=0.7), random.Random(0)
    calls = 0
    for seed in range(100):
        _, info = env.reset(seed=seed)
        *turns, answer = env.demonstration(info, rng)
        assert turns in ([], [tool_call_text("zoom", {"cell": info["cell"]})])
        assert re.fullmatch(r"<answer>[1-4]</answer>", answer)
        calls += len(turns)
    assert 55 < calls < 85  # call_prob 0.7
    # "random" (the default) draws exactly as before the option existed
    a, b = ZoomCountEnv(), ZoomCountEnv(demo_cell="random")
    _, info = a.reset(seed=0)
    assert [a.demonstration(info, random.Random(5)) for _ in range(3)] == [
        b.demonstration(info, random.Random(5)) for _ in range(3)
    ]


def test_bare_rollout_poses_the_question_alone_and_still_runs_the_tool(tiny_policy):
    """grpo.bare_steps' rollout: no system prompt, tool schemas or image in the prompt; the zoom call
    still returns the task's cell as an image."""
    envs = [ZoomCountEnv() for _ in range(2)]
    _, info = envs[0].reset(seed=0)
    script = [tool_call_text("zoom", {"cell": info["cell"]}), "<answer>2</answer>"]
    policy = ScriptedPolicy(tiny_policy, script)
    full = rollout(policy, envs, [0], group_size=2, max_new_tokens=24, max_turns=2)
    bare = rollout(
        ScriptedPolicy(tiny_policy, script),
        envs,
        [0],
        group_size=2,
        max_new_tokens=24,
        max_turns=2,
        bare=True,
    )
    assert not full.tokens.vision.empty and bare.tokens.vision.empty  # the overview is gone
    prompt = tiny_policy.tokenizer.decode(bare.tokens.prompt_ids[0][bare.tokens.prompt_mask[0].bool()])
    assert "<tools>" not in prompt and "system" not in prompt and f"in cell {info['cell']}?" in prompt
    assert bare.tokens.prompt_mask.sum() < full.tokens.prompt_mask.sum() / 4
    for t in bare.trajectories:
        assert t.task["tools"] is None and (t.turns, t.tool_calls) == (2, 1)
        assert t.response_vision.images_per_seq == [1] and t.env_metrics == {"right_cell": 1.0}
