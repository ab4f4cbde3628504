"""Dataset envs (vqa, text_qa) and mmgrpo.data.records: formats, image references, splits, and errors that list every
bad row with its file and line."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from mmgrpo.data import records as data_module
from mmgrpo.data.records import Record, check_records, model_image_size, open_image, read_records
from mmgrpo.env import check_env, message_images, message_text
from mmgrpo.envs import vqa as vqa_module
from mmgrpo.envs.text_qa import TextQAEnv
from mmgrpo.envs.vqa import VQAEnv, answer_value, clear_cache, split_rows
from mmgrpo.errors import ConfigError, DataError, EnvError


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def picture(path, size=(100, 50), color=(200, 30, 30), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


def png_bytes(size=(40, 30), color=(0, 0, 255)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def vqa_rows(n, image="imgs/a.png"):
    return [
        {"image": image, "question": f"What is shown in picture {i}?", "answer": str(i)} for i in range(n)
    ]


# ------------------------------------------------------------------------------------------- formats
def test_jsonl_with_relative_image_paths_gives_image_parts_and_grounding_info(tmp_path):
    picture(tmp_path / "data" / "imgs" / "a.png", size=(100, 50))
    rows = vqa_rows(6)
    rows[0]["boxes"] = [[1, 2, 30, 40]]
    path = write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    env = VQAEnv(path=path, eval_fraction=0.0)
    messages, info = env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<answer></answer>" in message_text(messages[0])
    user_parts = messages[1]["content"]
    assert [p["type"] for p in user_parts] == ["image", "text"]
    assert user_parts[0]["image"].size == (100, 50) and user_parts[0]["image"].mode == "RGB"
    assert user_parts[1]["text"] == "What is shown in picture 0?"
    assert info["answer"] == "0"
    assert info["source"] == f"{path}:1"
    assert info["boxes"] == [[1, 2, 30, 40]]  # extra fields pass through
    assert info["question"] == "What is shown in picture 0?"
    assert info["image_size"] == [100, 50]
    # smart_resize(50, 100, factor=28) with the processor's default budget: 56 x 112
    assert info["model_image_size"] == [112, 56]
    assert "image" not in info
    assert env.reset(seed=7)[1]["source"] == f"{path}:2"  # row seed % n


def test_check_env_passes(tmp_path):
    picture(tmp_path / "imgs" / "a.png")
    env = VQAEnv(path=write_jsonl(tmp_path / "train.jsonl", vqa_rows(8)))
    check_env(env)


def test_parquet_with_embedded_image_bytes_and_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    picture(tmp_path / "b.png", size=(60, 40))
    rows = [
        {"image": {"bytes": png_bytes((40, 30)), "path": "x.png"}, "question": "q0", "answer": "a0"},
        {"image": {"bytes": None, "path": "b.png"}, "question": "q1", "answer": "a1"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    path = str(tmp_path / "train.parquet")
    records = read_records(path)
    assert [r.source for r in records] == [f"{path}:row 0", f"{path}:row 1"]
    env = VQAEnv(path=path, eval_fraction=0.0)
    sizes = [env.reset(seed=s)[1]["image_size"] for s in (0, 1)]
    assert sizes == [[40, 30], [60, 40]]


def test_datasets_folder_with_image_feature(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"image": datasets.Image(), "question": datasets.Value("string"), "answer": datasets.Value("string")}
    )
    images = [Image.new("RGB", (32 + 8 * i, 24), (10 * i, 0, 0)) for i in range(3)]
    ds = datasets.Dataset.from_dict(
        {"image": images, "question": ["q0", "q1", "q2"], "answer": ["0", "1", "2"]}, features=features
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    env = VQAEnv(path=str(tmp_path / "ds"), eval_fraction=0.0)
    messages, info = env.reset(seed=2)
    assert message_images(messages)[0].size == (48, 24)
    assert info["source"] == f"{tmp_path / 'ds'}:row 2" and info["answer"] == "2"
    # a DatasetDict folder: "folder:split" picks the split
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(read_records(f"{tmp_path / 'dd'}:test")) == 1
    with pytest.raises(DataError, match="no split 'tset'.*Did you mean 'test'"):
        read_records(f"{tmp_path / 'dd'}:tset")


def test_base64_data_uri_image(tmp_path):
    uri = "data:image/png;base64," + base64.b64encode(png_bytes((20, 10))).decode()
    path = write_jsonl(tmp_path / "t.jsonl", [{"image": uri, "question": "q", "answer": 1}])
    messages, info = VQAEnv(path=path, eval_fraction=0.0).reset(seed=0)
    assert message_images(messages)[0].size == (20, 10)
    assert info["answer"] == "1"


def test_several_images_per_row_and_placeholders(tmp_path):
    picture(tmp_path / "l.png", size=(30, 30), color=(255, 0, 0))
    picture(tmp_path / "r.png", size=(40, 30), color=(0, 255, 0))
    rows = [
        {"images": ["l.png", "r.png"], "question": "Which is bigger?", "answer": "right"},
        {
            "images": ["l.png", "r.png"],
            "question": "Left: <image> right: <image> Same colour?",
            "answer": "no",
        },
    ]
    env = VQAEnv(path=write_jsonl(tmp_path / "t.jsonl", rows), eval_fraction=0.0)
    messages, info = env.reset(seed=0)
    assert [p["type"] for p in messages[1]["content"]] == ["image", "image", "text"]
    assert info["image_size"] == [[30, 30], [40, 30]]  # a list field: one [w, h] per image
    assert info["model_image_size"] == [[56, 56], [84, 56]]  # small images are scaled up to 4 tokens
    messages, _ = env.reset(seed=1)
    parts = messages[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text", "image", "text"]
    assert parts[1]["image"].getpixel((0, 0)) == (255, 0, 0)
    assert parts[2]["text"] == " right: "


def test_video_as_frames_and_video_file_without_reader(tmp_path, monkeypatch):
    for i in range(3):
        picture(tmp_path / f"f{i}.png", size=(28, 28))
    rows = [{"video": ["f0.png", "f1.png", "f2.png"], "question": "What moves?", "answer": "ball"}]
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    messages, info = VQAEnv(path=path, eval_fraction=0.0, video_as="frames").reset(seed=0)
    assert len(message_images(messages)) == 3 and info["image_size"] == [[28, 28]] * 3
    messages, _ = VQAEnv(path=path, eval_fraction=0.0).reset(seed=0)
    video = messages[-1]["content"][0]
    assert video["type"] == "video" and len(video["video"]) == 3
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 16)
    monkeypatch.setattr(data_module, "video_reader", lambda: None)
    rows = [{"video": "clip.mp4", "question": "What moves?", "answer": "ball"}]
    with pytest.raises(DataError, match=r"v2\.jsonl:1: video 'clip\.mp4': .*torchcodec"):
        VQAEnv(path=write_jsonl(tmp_path / "v2.jsonl", rows), eval_fraction=0.0)


def test_resize_qwen_gives_the_model_size(tmp_path):
    picture(tmp_path / "imgs" / "a.png", size=(100, 50))
    env = VQAEnv(path=write_jsonl(tmp_path / "t.jsonl", vqa_rows(1)), eval_fraction=0.0, resize="qwen")
    messages, info = env.reset(seed=0)
    assert info["image_size"] == [100, 50]
    assert list(message_images(messages)[0].size) == info["model_image_size"] == [112, 56]
    small = VQAEnv(path=str(tmp_path / "t.jsonl"), eval_fraction=0.0, max_pixels=28 * 28 * 4)
    assert small.reset(seed=0)[1]["model_image_size"] == [56, 28]  # scaled down into 4 tokens


# ------------------------------------------------------------------------------------------- splits
def test_split_by_fraction_is_deterministic_disjoint_and_order_free(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(60)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    env = TextQAEnv(path=path, eval_fraction=0.25)
    train = {r.fields["question"] for r in env.rows["train"]}
    held_out = {r.fields["question"] for r in env.rows["eval"]}
    assert train.isdisjoint(held_out) and len(train | held_out) == 60
    assert 5 <= len(held_out) <= 25
    # every reset of a split poses one of that split's rows, whatever the seed
    seen = {env.reset(seed=s, options={"split": "eval"})[1]["question"] for s in range(100)}
    assert seen == held_out
    # the same rows in another order (another file) split the same way: the split hashes the content
    clear_cache()
    shuffled = TextQAEnv(path=write_jsonl(tmp_path / "r.jsonl", rows[::-1]), eval_fraction=0.25)
    assert {r.fields["question"] for r in shuffled.rows["eval"]} == held_out
    assert env.reset(seed=3)[1] == TextQAEnv(path=path, eval_fraction=0.25).reset(seed=3)[1]


def test_split_never_leaves_eval_empty_with_two_rows():
    records = [Record(f"f:{i}", {"question": str(i), "answer": "x"}) for i in range(2)]
    train, held_out = split_rows(records, 0.01)
    assert len(train) == 1 and len(held_out) == 1


def test_eval_path(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "a?", "answer": "1"}] * 3)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"question": "b?", "answer": "2"}])
    env = TextQAEnv(path=train, eval_path=held_out)
    assert len(env.rows["train"]) == 3 and len(env.rows["eval"]) == 1
    _, info = env.reset(seed=5, options={"split": "eval"})
    assert info["source"] == f"{held_out}:1" and info["answer"] == "2"
    with pytest.raises(ConfigError, match="not both"):
        TextQAEnv(path=train, eval_path=held_out, eval_fraction=0.2)


def test_no_eval_rows_is_a_clear_error(tmp_path):
    env = TextQAEnv(
        path=write_jsonl(tmp_path / "t.jsonl", [{"question": "a?", "answer": "1"}]), eval_fraction=0
    )
    with pytest.raises(EnvError, match="eval split .* has no rows"):
        env.reset(seed=0, options={"split": "eval"})


# ------------------------------------------------------------------------------------------- errors
def test_one_error_lists_malformed_line_missing_image_and_corrupt_image(tmp_path):
    picture(tmp_path / "imgs" / "ok.png")
    (tmp_path / "imgs" / "corrupt.png").write_bytes(b"this is not a png at all")
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"image": "imgs/ok.png", "question": "q1", "answer": "1"},
            '{"image": "imgs/ok.png", "question": "q2", "answer": ',
            {"image": "imgs/missing.png", "question": "q3", "answer": "3"},
            {"image": "imgs/corrupt.png", "question": "q4", "answer": "4"},
        ],
    )
    with pytest.raises(DataError) as caught:
        VQAEnv(path=path)
    message = str(caught.value)
    assert message.startswith("3 of 4 rows cannot be used:")
    assert f"{path}:2: malformed JSON" in message
    assert (
        f"{path}:3: image file 'imgs/missing.png' not found (looked for {tmp_path}/imgs/missing.png)"
        in message
    )
    assert f"{path}:4: image 'imgs/corrupt.png' cannot be decoded" in message
    assert f"{path}:1" not in message


def test_missing_field_and_wrong_types_are_named(tmp_path):
    picture(tmp_path / "imgs" / "a.png")
    rows = [
        {"image": "imgs/a.png", "question": "q", "anwser": "1"},
        {"image": "imgs/a.png", "question": 7, "answer": "1"},
        {"image": "imgs/a.png", "question": "q", "answer": True},
        {"image": "imgs/a.png", "question": "q", "answer": {"text": "1"}},
        {"image": 5, "question": "q", "answer": "1"},
    ]
    with pytest.raises(DataError) as caught:
        VQAEnv(path=write_jsonl(tmp_path / "t.jsonl", rows))
    message = str(caught.value)
    assert "t.jsonl:1: missing field 'answer'. Did you mean 'anwser'?" in message
    assert "t.jsonl:2: 'question' is int, expected text" in message
    assert "t.jsonl:3: answer is the boolean True" in message
    assert "t.jsonl:4: answer is dict" in message
    assert "t.jsonl:5: an image reference must be a path" in message


def test_prompt_template_fields_and_placeholder_count_are_checked(tmp_path):
    picture(tmp_path / "a.png")
    rows = [
        {"image": "a.png", "question": "q", "answer": "1", "choices": "A, B"},
        {"image": "a.png", "question": "q", "answer": "1"},
        {"image": "a.png", "question": "<image> vs <image>?", "choices": "A, B", "answer": "1"},
    ]
    with pytest.raises(DataError) as caught:
        VQAEnv(path=write_jsonl(tmp_path / "t.jsonl", rows), prompt_template="{question} Options: {choices}")
    message = str(caught.value)
    assert "t.jsonl:2: prompt_template uses {choices} but the row has no field 'choices'" in message
    assert "t.jsonl:3: the prompt has 2 <image> placeholder(s) but the row has 1 image(s)" in message
    assert "t.jsonl:1" not in message
    with pytest.raises(ConfigError, match="named fields"):
        VQAEnv(path=str(tmp_path / "t.jsonl"), prompt_template="{}")


def test_errors_are_capped_at_max_listed(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q"}] * 30)
    with pytest.raises(DataError, match=r"30 of 30 rows cannot be used(.|\n)*\.\.\. and 10 more"):
        TextQAEnv(path=path)


def test_data_source_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        VQAEnv(path=str(tmp_path / "nope.jsonl"))
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data format '.csv'"):
        read_records(tmp_path / "t.csv")
    (tmp_path / "bad.json").write_text('[{"question": "q",\n "answer": }]')
    with pytest.raises(DataError, match=r"bad\.json:2: malformed JSON"):
        read_records(tmp_path / "bad.json")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"question": "q", "answer": "a"}]}, indent=1))
    with pytest.raises(DataError, match="got an object \\(its key 'data' holds a list"):
        read_records(tmp_path / "wrapped.json")
    picture(tmp_path / "thin.png", size=(2010, 10))
    thin = write_jsonl(tmp_path / "thin.jsonl", [{"image": "thin.png", "question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="thin.jsonl:1: image of 2010x10 pixels cannot be given to a Qwen-VL"):
        VQAEnv(path=thin)
    path = write_jsonl(tmp_path / "text.jsonl", [{"question": "q", "answer": "a"}] * 2)
    with pytest.raises(DataError, match="no row has an image field.*text_qa"):
        VQAEnv(path=path)
    with pytest.raises(ConfigError, match="resize='qwn'.*Did you mean 'qwen'"):
        VQAEnv(path=path, resize="qwn")


# ------------------------------------------------------------------------------------------- pieces
def test_json_list_and_text_answers(tmp_path):
    rows = [
        {"question": "Capital of France?", "answer": ["Paris", "paris"]},
        {"question": "2.5 * 2?", "answer": 5.0},
        {"question": "half?", "answer": 0.5, "source": "quiz", "split": "dev"},
    ]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    env = TextQAEnv(path=str(tmp_path / "t.json"), eval_fraction=0.0)
    infos = [env.reset(seed=s)[1] for s in range(3)]
    assert [i["answer"] for i in infos] == [["Paris", "paris"], "5", "0.5"]
    assert infos[2]["row_source"] == "quiz" and infos[2]["row_split"] == "dev"
    assert infos[2]["source"] == f"{tmp_path / 't.json'}:row 2" and infos[2]["split"] == "train"
    messages, _ = env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert message_images(messages) == [] and message_text(messages[1]) == "Capital of France?"
    assert TextQAEnv.reference_completion(infos[0]) == "<answer>Paris</answer>"
    assert answer_value(3) == "3"


def test_open_image_references(tmp_path):
    picture(tmp_path / "p.png", size=(5, 4), mode="RGBA", color=(0, 0, 0, 0))
    image = open_image("p.png", tmp_path)
    assert image.mode == "RGB" and image.size == (5, 4) and image.getpixel((0, 0)) == (255, 255, 255)
    assert open_image(f"file://{tmp_path}/p.png").size == (5, 4)
    assert open_image({"bytes": png_bytes((3, 2)), "path": "ignored.png"}).size == (3, 2)
    assert open_image(png_bytes((3, 2))).size == (3, 2)
    assert open_image(Image.new("L", (2, 2))).mode == "RGB"
    with pytest.raises(DataError, match="not valid base64"):
        open_image("data:image/png;base64,@@@")
    with pytest.raises(DataError, match="neither 'bytes' nor 'path'"):
        open_image({"bytes": None, "path": None})


def test_urls_are_checked_for_syntax_only():
    good = Record("f:1", {"image": "https://example.com/cat.png", "question": "q", "answer": "a"})
    check_records([good], required=("question", "answer"), image_fields=("image",))  # not fetched
    bad = Record("f:2", {"image": "https://", "question": "q", "answer": "a"})
    with pytest.raises(DataError, match="f:2: image URL 'https://' is malformed"):
        check_records([bad], image_fields=("image",))


def test_a_dataset_is_read_once_per_process(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answer": "a"}] * 3)
    calls = []
    real = vqa_module.read_records
    monkeypatch.setattr(vqa_module, "read_records", lambda *a, **k: calls.append(a) or real(*a, **k))
    envs = [TextQAEnv(path=path) for _ in range(4)]
    assert len(calls) == 1 and envs[0].rows is envs[3].rows
    write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answer": "a"}] * 5)  # a changed file is read again
    assert len(TextQAEnv(path=path).rows["train"]) + len(TextQAEnv(path=path).rows["eval"]) == 5
    assert len(calls) == 2


def test_model_image_size_follows_the_processor():
    # expected values are those of transformers' Qwen2-VL image processor (smart_resize) for the same inputs
    assert model_image_size((100, 50)) == (112, 56)
    assert model_image_size((1000, 10)) == (560, 28)  # qwen_vl_utils 0.0.14 says (1008, 28)
    assert model_image_size((1000, 37), max_pixels=28 * 28 * 16) == (560, 28)  # qwen_vl_utils says height 0
    assert model_image_size((5000, 3000)) == (4620, 2772)
    assert model_image_size((13, 13)) == (56, 56)
    with pytest.raises(ValueError, match="aspect ratio"):
        model_image_size((2010, 10))


def test_rows_without_answer_for_grounding(tmp_path):
    picture(tmp_path / "a.png", size=(200, 100))
    rows = [{"image": "a.png", "question": "Where is the cat?", "box": [20, 10, 100, 50], "answer": "x"}]
    path = write_jsonl(tmp_path / "g.jsonl", [{k: v for k, v in rows[0].items() if k != "answer"}])
    with pytest.raises(DataError, match="missing field 'answer'"):
        VQAEnv(path=path)
    _, info = VQAEnv(path=path, answer_field=None, eval_fraction=0.0).reset(seed=0)
    assert "answer" not in info
    assert info["box"] == [20, 10, 100, 50] and info["image_size"] == [200, 100]
    assert info["model_image_size"] == [196, 112]


def test_truncated_image_is_caught_by_decoding_not_by_the_header(tmp_path):
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    (tmp_path / "cut.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    records = [Record("t.jsonl:1", {"image": "cut.png"}, tmp_path)]
    with pytest.raises(
        DataError, match="t.jsonl:1: image 'cut.png' cannot be decoded \\(corrupt or truncated\\)"
    ):
        check_records(records, image_fields=("image",))
    check_records(records, image_fields=("image",), decode=False)  # the header alone looks fine


def test_a_video_row_trains_through_the_tiny_qwen(tmp_path, tiny_policy):
    """Frames sent as one video part reach Qwen-VL's video input; the shared prompt path equals the full
    forward on them."""
    import torch

    from mmgrpo.rollout.episodes import rollout

    for i in range(4):
        picture(tmp_path / f"f{i}.png", size=(56, 56))
    rows = [{"video": [f"f{i}.png" for i in range(4)], "question": "What moves?", "answer": "ball"}]
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    envs = [VQAEnv(path=path, eval_fraction=0.0) for _ in range(2)]
    tok = rollout(tiny_policy, envs, [0], group_size=2, max_new_tokens=4, temperature=1.0).tokens
    assert tok.vision.keys() == ["pixel_values_videos", "video_grid_thw"]
    assert int((tok.prompt_ids == tiny_policy.video_token_id).sum()) > 0
    with torch.no_grad():
        shared = tiny_policy.logprobs(tok, share_prompt=True)
        full = tiny_policy.logprobs(tok, share_prompt=False)
    m = tok.loss_mask.bool()
    torch.testing.assert_close(shared[m], full[m], atol=1e-5, rtol=0)


def test_mmgrpo_train_reports_every_bad_row_before_loading_any_model(tmp_path, capsys):
    """The trainer builds the env before the model: bad rows fail at once, all of them in one message,
    even though the model path does not exist either."""
    from mmgrpo.cli.app import main

    picture(tmp_path / "imgs" / "ok.png")
    (tmp_path / "imgs" / "corrupt.png").write_bytes(b"\x89PNG garbage")
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"image": "imgs/ok.png", "question": "q1", "answer": "1"},
            '{"image": "imgs/ok.png", "question": "q2"',
            {"image": "imgs/missing.png", "question": "q3", "answer": "3"},
            {"image": "imgs/corrupt.png", "question": "q4", "answer": "4"},
        ],
    )
    config = tmp_path / "vqa.yaml"
    config.write_text(
        f"model: {{path: {tmp_path / 'no-model'}}}\n"
        f"output_dir: {tmp_path / 'run'}\n"
        f"env: {{name: vqa, kwargs: {{path: {data}}}}}\n"
        "verifiers: [{name: exact_match}]\n"
    )
    code = main(["train", str(config), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    for line in (2, 3, 4):
        assert f"train.jsonl:{line}:" in err
    assert "no-model" not in err  # the model was never looked for
