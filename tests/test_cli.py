"""CLI smoke runs on the tiny model: train, eval, probe, list, errors; examples and docs stay valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmgrpo.cli.app import main
from mmgrpo.config.core import config_reference, load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))  # mmgrpo configs (accelerate/ holds launch configs)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_validates(path):
    cfg = load_config(path)
    from mmgrpo.train.trainer import build_env_factory, build_rewards, eval_metric

    build_env_factory(cfg)()  # env kwargs accepted by the env
    build_rewards(cfg)  # verifiers exist and accept their kwargs
    eval_metric(cfg)


def test_config_reference_page_is_up_to_date():
    page = (ROOT / "docs" / "config.md").read_text()
    assert config_reference(markdown=True) in page, "regenerate with: mmgrpo config-reference --markdown"


def test_train_two_steps_then_eval(tiny_model_dir, tmp_path, capsys, small_run, train_small):
    out = tmp_path / "run"
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    grpo, records = train_small(cfg, tiny_model_dir, out)
    sets = small_run(f"model.path={tiny_model_dir}", f"output_dir={out}")
    assert [r["step"] for r in grpo] == [1, 2]
    for key in (
        "reward",
        "reward/number_match",
        "reward/format",
        "reward_std_within_group",
        "frac_zero_std_groups",
        "kl",
        "clip_frac",
        "completion_len",
        "step_time",
        "loss",
    ):
        assert key in grpo[0], key
    assert 0.0 <= grpo[0]["frac_zero_std_groups"] <= 1.0
    assert len([r for r in records if r.get("stage") == "warm_start"]) == 2
    final = out / "final"
    assert (final / "config.json").is_file() and (final / "mmgrpo_config.yaml").is_file()
    assert (out / "config.yaml").is_file()
    assert (out / "curves.png").is_file()  # learning curves drawn at the end of training
    (out / "curves.png").unlink()
    assert main(["plot", str(out)]) == 0 and (out / "curves.png").is_file()
    from transformers import AutoModelForImageTextToText, AutoProcessor

    AutoProcessor.from_pretrained(final)
    AutoModelForImageTextToText.from_pretrained(final)

    capsys.readouterr()
    assert main(["eval", cfg, "--model", str(final), *sets, "--no-progress"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    last = printed[-1]
    assert last.startswith("accuracy: ") and last.endswith("(n=6)")
    result = json.loads((final / "eval.json").read_text())
    assert result["n"] == 6 and f"{result['accuracy']:.3f}" in last
    # counting's answers are a few small numbers: the table of answers given, per true answer
    assert sum(n for row in result["answers"].values() for n in row.values()) == 6
    assert all(1 <= int(true) <= 9 for true in result["answers"])
    assert "  answers given (the true answer: the model's answers, most given first):" in printed
    assert sum(line.startswith("    true ") for line in printed) == len(result["answers"])


def test_same_config_and_seed_give_the_same_run(tiny_model_dir, tmp_path, small_run):
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        sets = small_run(f"model.path={tiny_model_dir}", f"output_dir={out}", "warm_start.steps=0")
        assert main(["train", cfg, *sets, "--no-progress"]) == 0
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.endswith("_time")} for r in recs])
    assert runs[0] == runs[1]


def test_probe_and_list(tiny_model_dir, capsys, small_run):
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    assert main(["probe", cfg, "--steps", "1", *small_run(f"model.path={tiny_model_dir}")]) == 0
    out = capsys.readouterr().out
    assert "reward histogram" in out and "zero-variance groups" in out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("counting", "number_match", "exact_match", "format"):
        assert name in out


def test_bad_config_is_one_clear_error_before_any_model(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: nowhere\ngrpo:\n  lerning_rate: 0.1\n")
    assert main(["train", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:4" in err and "grpo.lerning_rate" in err and "grpo.lr" in err

    assert main(["train", str(ROOT / "examples" / "counting_tiny.yaml"), "--set", "env.name=countng"]) == 2
    err = capsys.readouterr().err
    assert "countng" in err and "counting" in err


def test_missing_model_path_names_the_fix(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_dir: " + str(tmp_path / "o") + "\n")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    assert "mmgrpo tiny-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "x.yaml", "--model", "m", "-n", "-5"],
        ["eval", "x.yaml", "--model", "m", "-n", "0"],
        ["probe", "x.yaml", "--steps", "0"],
    ],
)
def test_counts_below_one_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_plot_of_a_folder_without_a_run_says_so(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "metrics.jsonl" in err
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("grpo:\n  lr: 1e-4  # r\xe9glage\n".encode("latin-1"))
    assert main(["train", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "latin1.yaml: not UTF-8 text" in err and "b'\\xe9'" in err


def test_python_dash_m_mmgrpo_runs_the_cli():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "list"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "counting" in out.stdout


def test_a_second_train_into_a_run_refuses_unless_overwrite(tiny_model_dir, tmp_path, small_run, capsys):
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    out = tmp_path / "run"
    sets = small_run(f"model.path={tiny_model_dir}", f"output_dir={out}", "warm_start.steps=0")
    assert main(["train", cfg, *sets, "--no-progress"]) == 0
    model = (out / "final" / "model.safetensors").read_bytes()
    assert main(["train", cfg, *sets, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (metrics.jsonl, final" in err and "--overwrite" in err
    assert (out / "final" / "model.safetensors").read_bytes() == model  # nothing was touched
    assert main(["train", cfg, *sets, "--no-progress", "--overwrite"]) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the new run's steps only, not 1 2 1 2


def test_ctrl_c_finishes_the_step_saves_a_checkpoint_and_resume_completes_the_run(
    tiny_model_dir, tmp_path, small_run, capsys, monkeypatch
):
    """A real SIGINT during step 2: the step finishes, checkpoint-2 is written, one line says how to
    resume, exit 130; --resume then runs step 3 only and metrics.jsonl holds each step once."""
    import os
    import signal

    from mmgrpo.train.trainer import Trainer

    real = Trainer.train_step

    def signalled_in_step_2(self):
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", signalled_in_step_2)
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    out = tmp_path / "run"
    sets = small_run(
        f"model.path={tiny_model_dir}", f"output_dir={out}", "warm_start.steps=0", "grpo.steps=3"
    )
    assert main(["train", cfg, *sets, "--no-progress"]) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "SIGINT: finishing step 2, then saving a checkpoint" in err and "Traceback" not in err
    assert f"stopped after step 2 of 3; checkpoint in {out / 'checkpoint-2'}" in err and "--resume" in err
    assert (out / "checkpoint-2" / "model.safetensors").is_file() and (out / "curves.png").is_file()
    assert not (out / "final").exists()
    monkeypatch.setattr(Trainer, "train_step", real)
    assert main(["train", cfg, *sets, "--no-progress"]) == 2  # a run is there: --resume or --overwrite
    assert "Pass --resume to continue it" in capsys.readouterr().err
    assert main(["train", cfg, *sets, "--no-progress", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().err
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and (out / "final" / "model.safetensors").is_file()


def test_ctrl_c_in_the_warm_start_keeps_the_model_so_far(
    tiny_model_dir, tmp_path, small_run, capsys, monkeypatch
):
    import os
    import signal

    from mmgrpo.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "warm_start", lambda self: os.kill(os.getpid(), signal.SIGINT))
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    out = tmp_path / "run"
    assert (
        main(["train", cfg, *small_run(f"model.path={tiny_model_dir}", f"output_dir={out}"), "--no-progress"])
        == 130
    )
    assert "interrupted during the warm start" in capsys.readouterr().err
    assert (out / "interrupted" / "model.safetensors").is_file() and not (out / "final").exists()


def test_resume_without_a_checkpoint_says_so(tiny_model_dir, tmp_path, small_run, capsys):
    cfg = str(ROOT / "examples" / "counting_tiny.yaml")
    sets = small_run(f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'none'}")
    assert main(["train", cfg, *sets, "--resume"]) == 2
    assert "holds no complete checkpoint-N to resume from" in capsys.readouterr().err
    assert main(["train", cfg, *sets, "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    assert main(["train", cfg, *sets, "--resume", "--overwrite"]) == 2
    assert "give one" in capsys.readouterr().err


def test_no_progress_turns_off_the_libraries_bars_too(monkeypatch):
    """--no-progress: transformers' own bars ("Loading weights", "Writing model shards") are off as well."""
    from transformers.utils import logging as hf_logging

    import mmgrpo.cli.app as app

    seen = []
    monkeypatch.setattr(app, "cmd_train", lambda args: seen.append(hf_logging.is_progress_bar_enabled()) or 0)
    # as from a terminal (under pytest stderr is not one, and no bars are drawn: mmgrpo.train.progress)
    monkeypatch.setattr("mmgrpo.train.progress.bars_wanted", lambda progress, stream=None: progress)
    hf_logging.enable_progress_bar()  # an earlier test's --no-progress left them off in this process
    try:
        assert app.main(["train", "any.yaml"]) == 0
        assert app.main(["train", "any.yaml", "--no-progress"]) == 0
    finally:
        hf_logging.enable_progress_bar()
    assert seen == [True, False]
