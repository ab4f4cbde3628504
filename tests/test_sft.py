"""`mmgrpo sft`: supervised fine-tuning on (messages -> response) rows, on the tiny VLM."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmgrpo.config.core import load_config
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.model.policy import Policy
from mmgrpo.train.sft import batch_rows, example_batch, read_examples, run_sft, supervised_batch

ROOT = Path(__file__).resolve().parent.parent


def _load_maker():
    spec = importlib.util.spec_from_file_location(
        "make_counting_sft", ROOT / "examples" / "make_counting_sft.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_counting_sft = _load_maker().make_counting_sft


def _config(model, out, data, *extra):
    return load_config(
        None, [f"model.path={model}", "model.device=cpu", f"output_dir={out}", f"sft.data={data}", *extra]
    )


def _accuracy(policy, examples) -> float:
    """Greedy answers equal to the targets, over ``examples``."""
    batch = example_batch(policy, examples)
    outs, _ = policy.generate(
        batch.prompt_ids, batch.prompt_mask, batch.vision, max_new_tokens=8, temperature=0
    )
    right = [policy.decode(o).strip() == e.target for o, e in zip(outs, examples, strict=True)]
    return sum(right) / len(right)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sft_learns_counting_rows(tiny_model_dir, tmp_path):
    # a one-word system prompt: half the tokens of the default one, so each step costs half
    train_path, eval_path = make_counting_sft(tmp_path / "data", n=32, eval_n=8, system_prompt="Count.")
    cfg = _config(
        tiny_model_dir,
        tmp_path / "run",
        train_path,
        f"sft.eval_data={eval_path}",
        "sft.epochs=25",  # 32 rows, batches of 8: 100 steps
        "sft.lr=1e-3",
        "sft.batch_size=8",
        "sft.log_every=5",
    )
    examples = read_examples([str(train_path)])[0]
    policy = Policy.from_pretrained(tiny_model_dir)
    before = _accuracy(policy, examples)
    summary = run_sft(cfg, policy=policy, progress=False)
    after = _accuracy(policy, examples)
    assert summary["steps"] == 100 and summary["examples"] == 32 and summary["dropped"] == 0
    assert before <= 0.1, before  # the fresh model never writes <answer>N</answer>
    assert after >= 0.75, (before, after)  # measured 0.97: it reads the count off the image
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(5, 101, 5))
    assert all(r["stage"] == "sft" and r["tokens"] == 8 * 4 and r["lr"] == 1e-3 for r in steps)
    assert summary["first_loss"] > 5.0 and summary["last_loss"] < 0.5  # measured 6.88 -> 0.13
    assert sum(r["loss"] for r in steps[-4:]) / 4 < 0.1 * summary["first_loss"]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 100]
    assert summary["eval_loss"] < 0.3 * summary["eval_loss_before"]  # held-out: at least the format
    final = tmp_path / "run" / "final"
    for name in ("config.json", "model.safetensors", "mmgrpo_config.yaml", "tokenizer_config.json"):
        assert (final / name).is_file(), name
    assert load_config(final / "mmgrpo_config.yaml") == cfg
    assert _accuracy(Policy.from_pretrained(final), examples) == after


def test_bad_rows_fail_together_before_the_model_loads(tmp_path):
    Image.new("RGB", (32, 32), "white").save(tmp_path / "ok.png")
    good = {"question": "How many?", "image": "ok.png", "response": "<answer>1</answer>"}
    data = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            good,
            '{"question": "How many?", "response": ',  # line 2: malformed
            {"question": "How many?", "image": "ok.png", "answer": "3"},  # line 3: no response
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"question": "How many?", "image": "nope.png", "response": "<answer>2</answer>"},  # line 5
            {"messages": [{"role": "user", "content": "hi"}]},  # line 6: no target
        ],
    )
    cfg = _config(tmp_path / "no-such-model", tmp_path / "out", data)
    with pytest.raises(DataError) as err:
        run_sft(cfg, progress=False)
    msg = str(err.value)
    assert msg.startswith("4 of 6 rows cannot be used")
    assert f"{data}:2: malformed JSON" in msg
    assert f"{data}:3: missing field 'response'" in msg and "'answer' is the verifiers' field" in msg
    assert f"{data}:5: image file 'nope.png' not found" in msg
    assert f"{data}:6: the last message is a user message" in msg
    assert ":1:" not in msg and ":4:" not in msg
    assert not (tmp_path / "out").exists()  # nothing written, no model loaded
    _write_jsonl(data, [good])  # with good rows the next problem is the model path
    with pytest.raises(ConfigError, match="does not exist"):
        run_sft(cfg, progress=False)
    with pytest.raises(ConfigError, match="sft.data is empty"):
        run_sft(_config(tmp_path / "no-such-model", tmp_path / "out", "''"), progress=False)


def test_row_forms_give_the_same_batch(tiny_policy, tmp_path):
    from mmgrpo.envs.counting import CountingEnv

    env = CountingEnv(max_count=5, shapes=["circle"], colors=["red"])
    task = env.make_task(3, "train")
    system, user = task.messages
    image = next(p["image"] for p in user["content"] if p["type"] == "image")
    image.save(tmp_path / "scene.png")
    sys_text, question = system["content"][0]["text"], user["content"][1]["text"]
    target = "<answer>4</answer>"
    prompt = [
        {"role": "system", "content": sys_text},
        {
            "role": "user",
            "content": [{"type": "image", "image": "scene.png"}, {"type": "text", "text": question}],
        },
    ]
    placeholder = [
        prompt[0],
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]
    rows = [
        {"messages": [*prompt, {"role": "assistant", "content": [{"type": "text", "text": target}]}]},
        {"messages": prompt, "response": target},
        {"system": sys_text, "question": question, "image": "scene.png", "response": target, "answer": "4"},
        {"messages": [*placeholder, {"role": "assistant", "content": target}], "images": ["scene.png"]},
    ]
    examples = read_examples([str(_write_jsonl(tmp_path / "rows.jsonl", rows))])[0]
    # the env's own prompt (GRPO's) is the reference
    ref = supervised_batch(tiny_policy, [task.messages], [target])
    assert ref.response_ids[0].tolist() == tiny_policy.encode_text(target) + [tiny_policy.end_of_turn_id]
    assert ref.loss_mask.tolist() == [[1] * ref.response_ids.shape[1]]
    for e in examples:
        b = example_batch(tiny_policy, [e])
        for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask"):
            assert torch.equal(getattr(b, key), getattr(ref, key)), (e.source, key)
        assert torch.equal(b.vision.pixel_values, ref.vision.pixel_values)
        assert torch.equal(b.vision.image_grid_thw, ref.vision.image_grid_thw)


def test_max_length_drops_long_rows_and_batches_cover_epochs(tiny_model_dir, tmp_path):
    rows = [{"question": "q" * k, "response": "<answer>1</answer>"} for k in (1, 2, 200)]
    data = _write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = _config(
        tiny_model_dir, tmp_path / "run", data, "sft.steps=1", "sft.max_length=60", "sft.batch_size=2"
    )
    summary = run_sft(cfg, progress=False)
    assert summary["examples"] == 2 and summary["dropped"] == 1
    with pytest.raises(DataError, match="every sft.data row is longer than sft.max_length=5"):
        run_sft(_config(tiny_model_dir, tmp_path / "run", data, "sft.max_length=5"), progress=False)
    batches = list(batch_rows(5, 2, 5, seed=0, shuffle=True))  # two epochs, the second in a new order
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == sorted(flat[5:]) == list(range(5)) and flat[:5] != flat[5:]
    assert batches == list(batch_rows(5, 2, 5, seed=0, shuffle=True))
    assert [i for b in batch_rows(3, 2, 3, seed=0, shuffle=False) for i in b] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ConfigError, match="'sft.batch_size' must be >= 1"):
        load_config(None, ["sft.batch_size=0"])


def test_micro_batches_take_the_same_step(tiny_model_dir, tmp_path):
    (train_path,) = make_counting_sft(tmp_path / "data", n=4, system_prompt="Count.")
    weights = []
    for micro in (0, 1):  # the whole batch of 4 at once, or 4 passes of one row
        out = tmp_path / f"micro{micro}"
        cfg = _config(tiny_model_dir, out, train_path, "sft.steps=1", "sft.batch_size=4", "sft.lr=1e-2")
        summary = run_sft(
            dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, micro_batch_size=micro)), progress=False
        )
        weights.append((summary["first_loss"], load_file(out / "final" / "model.safetensors")))
    (loss_a, a), (loss_b, b) = weights
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert max((a[k] - base[k]).abs().max().item() for k in a) > 5e-3  # Adam's first step moves by ~lr
    vision = [k for k in a if k.startswith("visual.")]
    assert vision and all(torch.equal(a[k], base[k]) for k in vision)  # sft.train_vision is off
    # the same update up to float summation order. Adam's first step is lr * g / (|g| + eps): on a weight
    # whose gradient is near eps (1e-8) the order's noise moves it by a visible part of lr (measured: <= 3e-5
    # with torch's default threads, 1.5e-4 with one thread), so the bound is 5% of lr = 1e-2
    assert all(torch.allclose(a[k], b[k], atol=5e-4) for k in a)


def test_lora_sft_trains_only_adapters_and_reloads(tiny_model_dir, tmp_path):
    from mmgrpo.train.trainer import load_policy

    (train_path,) = make_counting_sft(tmp_path / "data", n=8)
    cfg = _config(
        tiny_model_dir, tmp_path / "run", train_path, "model.lora={r: 4, alpha: 8}", "sft.steps=3", "sft.lr=1e-2",
        "sft.batch_size=4",
    )  # fmt: skip
    policy = load_policy(cfg)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    run_sft(cfg, policy=policy, progress=False)
    changed = [n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed), changed
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.model.named_parameters())
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    again = Policy.from_pretrained(final)
    assert again.lora
    batch = example_batch(policy, read_examples([str(train_path)])[0][:2])
    with torch.no_grad():
        assert torch.allclose(again.logprobs(batch), policy.logprobs(batch), atol=1e-5)


def test_cli_sft_prints_summary_and_next_command(tiny_model_dir, tmp_path, capsys):
    from mmgrpo.cli.app import main

    (train_path,) = make_counting_sft(tmp_path / "data", n=4)
    out = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"sft.data={train_path}", "sft.eval_data=''", f"output_dir={out}"]
    sets += ["sft.steps=2", "sft.batch_size=2"]
    config = str(ROOT / "examples" / "sft_counting_tiny.yaml")
    assert main(["sft", config, *[x for s in sets for x in ("--set", s)], "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("sft: 2 steps, loss ") and f"saved to {out / 'final'}" in printed
    assert (
        f"next: mmgrpo train {config} --set model.path={out / 'final'} --set output_dir={out / 'grpo'}"
        in printed
    )
    assert (out / "final" / "config.json").is_file()
