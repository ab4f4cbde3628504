"""TRL's prompt-only dataset formats read by the dataset envs (vqa, text_qa): standard (``prompt`` text) and
conversational (``prompt`` as chat messages, ``{"type": "image"}`` placeholders filled from ``image`` /
``images``), from JSONL, parquet and ``datasets`` folders; the answer column named by ``answer_field``."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from mmgrpo.envs.text_qa import TextQAEnv
from mmgrpo.envs.vqa import VQAEnv, clear_cache
from mmgrpo.errors import DataError

RED, BLUE = (220, 20, 20), (20, 20, 220)


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def picture(path, color, size=(56, 56)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path.name


def png(color, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user_turn(*parts):
    return [{"role": "user", "content": list(parts)}]


IMAGE = {"type": "image"}


def text(t):
    return {"type": "text", "text": t}


def parts_of(message):
    return [
        (p["type"], p["image"].getpixel((0, 0)) if p["type"] == "image" else p["text"])
        for p in message["content"]
    ]


# ------------------------------------------------------------------------------------------- conversational
def test_conversational_vlm_row_fills_placeholders_in_order_and_keeps_the_answer_column(tmp_path):
    picture(tmp_path / "r.png", RED)
    picture(tmp_path / "b.png", BLUE)
    row = {
        "prompt": user_turn(text("Left:"), IMAGE, text("Right:"), IMAGE, text("Which is red?")),
        "images": ["r.png", "b.png"],  # relative to the data file
        "solution": "left",
    }
    path = write_jsonl(tmp_path / "trl.jsonl", [row, {**row, "solution": "the left one"}])
    env = VQAEnv(path=path, answer_field="solution", eval_fraction=0.0)
    messages, info = env.reset(seed=0)
    assert env.question_field == "prompt"  # no 'question' column: TRL's 'prompt'
    assert [m["role"] for m in messages] == ["system", "user"]  # the env's system prompt: the row has none
    assert parts_of(messages[1]) == [
        ("text", "Left:"),
        ("image", RED),
        ("text", "Right:"),
        ("image", BLUE),
        ("text", "Which is red?"),
    ]
    assert info["answer"] == "left" and info["solution"] == "left"  # TRL's accuracy_reward(solution=...)
    assert info["image_size"] == [[56, 56], [56, 56]]
    assert info["source"] == f"{path}:1"


def test_string_content_gets_the_images_first_and_a_row_system_message_wins(tmp_path):
    """TRL's prepare_multimodal_messages: a user message whose content is a string gets the images before
    its text; the row's own system message replaces the env's."""
    picture(tmp_path / "r.png", RED)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour?"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": prompt, "image": "r.png", "answer": "red"}])
    messages, info = VQAEnv(path=path, eval_fraction=0.0).reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert parts_of(messages[0]) == [("text", "Be brief.")]
    assert parts_of(messages[1]) == [("image", RED), ("text", "What colour?")]
    assert info["image_size"] == [56, 56]  # one image (not a list): one [w, h]


def test_mismatched_placeholder_counts_name_the_file_row_and_counts(tmp_path):
    picture(tmp_path / "r.png", RED)
    rows = [
        {"prompt": user_turn(IMAGE, text("Q?")), "image": "r.png", "answer": "a"},  # fine
        {"prompt": user_turn(IMAGE, IMAGE, text("Q?")), "image": "r.png", "answer": "b"},
        {"prompt": user_turn(text("Q?")), "images": [], "answer": "c"},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows[:2])
    with pytest.raises(DataError) as e:
        VQAEnv(path=path, eval_fraction=0.0)
    message = str(e.value)
    assert "1 of 2 rows cannot be used" in message
    assert (
        f"{path}:2: 'prompt' has 2 image placeholder(s) ({{'type': 'image'}}) but the row has 1 image(s)"
        in message
    )


def test_bad_messages_and_images_in_a_text_env_are_row_errors(tmp_path):
    rows = [
        {"prompt": [{"role": "robot", "content": "hi"}], "answer": "a"},
        {"prompt": user_turn({"type": "audio"}), "answer": "b"},
        {"prompt": user_turn(IMAGE, text("Q?")), "answer": "c"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError) as e:
        TextQAEnv(path=path, eval_fraction=0.0)
    message = str(e.value)
    assert f"{path}:1: 'prompt' message 0 has role 'robot'" in message
    assert f"{path}:2: 'prompt' message 0 part 0 is {{'type': 'audio'}}" in message
    assert (
        f"{path}:3: 'prompt' has 1 image placeholder(s) but this env takes no images: use the env vqa"
        in message
    )


def test_a_prompt_template_with_chat_messages_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": user_turn(text("Q?")), "answer": "a"}])
    with pytest.raises(DataError, match="holds chat messages, used as they are.*no prompt_template"):
        TextQAEnv(path=path, eval_fraction=0.0, prompt_template="{prompt}!")


# ------------------------------------------------------------------------------------------- standard
def test_standard_text_prompt_and_conversational_text_rows_in_text_qa(tmp_path):
    rows = [
        {"prompt": "What is 2 + 2?", "answer": 4},
        {"prompt": [{"role": "user", "content": "What is 3 + 3?"}], "answer": 6},
    ]
    env = TextQAEnv(path=write_jsonl(tmp_path / "t.jsonl", rows), eval_fraction=0.0, system_prompt=None)
    first, info0 = env.reset(seed=0)
    second, info1 = env.reset(seed=1)
    assert first == [{"role": "user", "content": [text("What is 2 + 2?")]}]
    assert second == [{"role": "user", "content": [text("What is 3 + 3?")]}]
    assert (info0["answer"], info1["answer"]) == ("4", "6")


def test_a_question_column_is_still_the_default_and_a_named_field_its_template(tmp_path):
    rows = [{"question": "Q1", "q": "Other", "prompt": "TRL", "answer": "a"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    assert TextQAEnv(path=path, eval_fraction=0.0, system_prompt=None).reset(seed=0)[0][0]["content"] == [
        text("Q1")
    ]
    clear_cache()
    env = TextQAEnv(path=path, eval_fraction=0.0, system_prompt=None, question_field="q")
    assert env.reset(seed=0)[0][0]["content"] == [text("Other")]  # the template follows question_field


# ------------------------------------------------------------------------------------------- files
def test_datasets_folder_with_image_feature_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {
        "prompt": [user_turn(IMAGE, text("Colour?")), user_turn(text("Colour?"), IMAGE)],
        "image": [Image.new("RGB", (56, 56), RED), Image.new("RGB", (56, 56), BLUE)],
        "solution": ["red", "blue"],
    }
    features = datasets.Features(
        {
            "prompt": [
                {
                    "role": datasets.Value("string"),
                    "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
                }
            ],
            "image": datasets.Image(),
            "solution": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.save_to_disk(str(tmp_path / "ds"))
    ds.to_parquet(str(tmp_path / "ds.parquet"))
    for path in (str(tmp_path / "ds"), str(tmp_path / "ds.parquet")):
        clear_cache()
        env = VQAEnv(path=path, answer_field="solution", eval_fraction=0.0, system_prompt=None)
        (m0,), info0 = env.reset(seed=0)
        (m1,), info1 = env.reset(seed=1)
        # Arrow fills a struct's missing key with null: {"type": "image", "text": None} is a placeholder
        assert parts_of(m0) == [("image", RED), ("text", "Colour?")]
        assert parts_of(m1) == [("text", "Colour?"), ("image", BLUE)]
        assert (info0["answer"], info1["solution"]) == ("red", "blue")


# ------------------------------------------------------------------------------------------- training
def test_a_trl_conversational_vlm_dataset_trains_through_vqa(tmp_path, tiny_model_dir):
    """The row TRL's GRPO docs show (prompt messages with an image placeholder, an image column, a
    solution column) trains two GRPO steps on the tiny VLM, scored by a verifier on the solution."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    colours = {"red": RED, "blue": BLUE}
    rows = [
        {
            "prompt": user_turn(IMAGE, text("What colour is this?")),
            "image": picture(tmp_path / f"{c}.png", rgb),
            "solution": c,
        }
        for c, rgb in colours.items()
    ]
    data = write_jsonl(tmp_path / "trl.jsonl", rows)
    (tmp_path / "run.yaml").write_text(
        f"""
seed: 0
output_dir: {tmp_path / "out"}
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
env: {{name: vqa, kwargs: {{path: {data}, answer_field: solution, eval_fraction: 0.0}}}}
verifiers: [{{name: exact_match}}, {{name: format, weight: 0.5}}]
warm_start: {{steps: 0}}
grpo: {{steps: 2, tasks_per_step: 2, group_size: 2, max_new_tokens: 4, micro_batch_size: 4}}
"""
    )
    trainer = Trainer(load_config(tmp_path / "run.yaml"), progress=False)
    last = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert last["num_episodes"] == 4 and last["verifier_failures"] == 0 and last["reward_none"] == 0
    assert all(r["loss"] == r["loss"] and "skipped" not in r for r in records)  # trained, not skipped
    for r in records:  # 4 episodes scored by exact_match on the solution column: a multiple of 1/4
        assert r["reward/exact_match"] * 4 == int(r["reward/exact_match"] * 4)
