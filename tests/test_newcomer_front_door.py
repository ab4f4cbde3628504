"""What a newcomer met on the first day (issue 54's sixteen), each where the user meets it: a dataset too small to
hold rows out, a config with no verifier, a batch far too large for the machine, a folder holding an encoder,
and the warm start's check on a small eval split. Each is one line naming the key or file and the fix, or the
number the user expects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmgrpo.cli.app import main


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mmgrpo: error")]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("text") / "model")


def _config(tmp_path: Path, model: Path, rows: int, verifiers: str = "[{name: exact_match}]") -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(rows))
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {{path: {model}}}\noutput_dir: {tmp_path / 'run'}\n"
        f"env: {{name: text_qa, kwargs: {{path: {data}}}}}\nverifiers: {verifiers}\n"
    )
    return cfg


def test_eval_on_a_dataset_with_no_held_out_row_is_one_line(text_model, tmp_path, capsys):
    cfg = _config(tmp_path, text_model, rows=1)
    assert main(["eval", str(cfg), "--model", str(text_model), "--no-progress"]) != 0
    (line,) = _errors(capsys.readouterr().err)
    assert line == (
        "mmgrpo: error: the eval split of TextQAEnv holds no tasks (1 rows train, 0 eval): hold rows out for "
        "evaluation (the env's eval_fraction, or eval_path: a file of held-out rows)"
    )


def test_no_verifier_is_one_line_naming_the_key(text_model, tmp_path, capsys):
    cfg = _config(tmp_path, text_model, rows=8, verifiers="[]")
    assert main(["train", str(cfg)]) != 0
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith(
        "mmgrpo: error: verifiers: [] -- GRPO scores every episode with at least one verifier"
    )
    assert "exact_match" in line


def test_a_batch_far_too_large_is_one_line_before_any_step(text_model, tmp_path, capsys):
    cfg = _config(tmp_path, text_model, rows=8)
    code = main(["train", str(cfg), "--set", "grpo.tasks_per_step=10000000", "--set", "warm_start.steps=0"])
    assert code != 0
    (line,) = _errors(capsys.readouterr().err)
    assert "grpo.tasks_per_step=10000000 x grpo.group_size=8 = 80000000 episodes per step" in line
    assert "lower grpo.tasks_per_step" in line
    assert not (tmp_path / "run").exists()  # nothing was written


def test_the_estimate_counts_the_cache_and_logits():
    from types import SimpleNamespace

    from mmgrpo.train.batch_fit import generation_bytes

    c = SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=64, num_hidden_layers=3, vocab_size=100
    )
    # per token: 2 (k, v) x 3 layers x 2 kv heads x 16 dims x 4 bytes = 768; per row: 10 tokens + 2 x 100 x 4
    assert generation_bytes(c, rows=5, tokens=10, dtype_bytes=4) == 5 * (10 * 768 + 800)


def test_an_encoder_folder_is_one_line(tmp_path, capsys):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path / "bert"
    BertModel(
        BertConfig(
            vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).save_pretrained(folder)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijk"]) + "\n")
    BertTokenizerFast(str(vocab)).save_pretrained(folder)
    cfg = _config(tmp_path, folder, rows=8)
    assert main(["eval", str(cfg), "--model", str(folder), "--no-progress"]) != 0
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith("mmgrpo: error: model type 'bert' is not causal")


def test_the_warm_start_check_counts_the_held_out_tasks_there_are(text_model, tmp_path):
    """A 4-row eval split is 4 held-out tasks: the check says 'k/4', not 'k/64'."""
    from mmgrpo.envs.text_qa import TextQAEnv
    from mmgrpo.model.policy import Policy
    from mmgrpo.train.warm_check import check_skill

    data, held_out = tmp_path / "rows.jsonl", tmp_path / "eval.jsonl"
    for path, rows in ((data, range(20)), (held_out, range(20, 24))):
        path.write_text("".join(json.dumps({"question": f"{i}?", "answer": str(i)}) + "\n" for i in rows))
    policy = Policy.from_pretrained(text_model)
    make_env = lambda: TextQAEnv(path=str(data), eval_path=str(held_out))  # noqa: E731
    assert make_env().num_tasks("eval") == 4
    check = check_skill(policy, make_env, source="random", template="<answer>{answer}</answer>", tasks=64)
    assert check.n == 4 and check.line().endswith(f"{check.passed}/4 held-out tasks ({check.rate:.2f})")


@pytest.mark.parametrize(
    ("folder", "flags"), [("runs/tiny-model-sees", " --sees"), ("runs/tiny-text-model", " --text-only")]
)
def test_a_missing_tiny_model_hint_is_the_command_that_builds_it(
    tmp_path, monkeypatch, capsys, folder, flags
):
    """The tour's first probe before its model exists: the hint names the flags that folder wants (it said
    `mmgrpo tiny-model runs/tiny-model-sees`, which builds the blind model under the name of the one that sees)."""
    import socket

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", offline)
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "examples" / "counting_tiny.yaml"
    assert main(["probe", str(config), "--set", f"model.path={folder}"]) != 0
    (line,) = _errors(capsys.readouterr().err)
    assert line.endswith(f"or build the offline tiny model with `mmgrpo tiny-model {folder}{flags}`.")
