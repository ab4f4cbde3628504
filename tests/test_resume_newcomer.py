"""Resuming and saving as a newcomer meets them (issue 17, items 1, 3 and 4's checkpoint half).

- ``--resume --set grpo.lr=...`` trains at the new learning rate (the restored optimizer and scheduler no
  longer override it), with one line saying what each change does; changes that cannot apply on resume are
  refused by name before anything is loaded.
- A damaged checkpoint (a cut or missing file) is named with what is wrong and the previous complete one.
- A full disk while a checkpoint or the final model is written is one line; what was there stays, and the
  trained model of a failed final save is kept in a rescue folder.

The hostile cases run ``mmgrpo train ... --resume`` as a user does: one through a subprocess, the others
through ``mmgrpo.cli.app.main`` in this process (to patch the writers: no disk is really filled).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.cli.app import main
from mmgrpo.train.checkpoint import complete_checkpoints, damaged_file, resume_changes

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "examples" / "counting_tiny.yaml")
RUN = [  # two small steps, a checkpoint after each (counting_tiny.yaml: lr 3e-4, vision_lr 3e-5)
    "warm_start.steps=0",
    "grpo.beta=0.02",  # a reference model, so that the checkpoint holds one (the recipe's beta is 0)
    "grpo.lr_schedule=constant",  # the lr as set, step after step (the recipe's decays linearly)
    "grpo.steps=2",
    "grpo.tasks_per_step=2",
    "grpo.group_size=2",
    "grpo.micro_batch_size=4",
    "grpo.save_every=1",
    "grpo.keep_checkpoints=2",
]


def _sets(model: Path, out: Path, *extra: str) -> list[str]:
    return [x for s in (f"model.path={model}", f"output_dir={out}", *RUN, *extra) for x in ("--set", s)]


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "stage" not in r]


def _error_line(err: str) -> str:
    """The one error line (no traceback, nothing else on stderr but warnings and progress)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("mmgrpo: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished two-step run: checkpoint-1, checkpoint-2 and final (each test resumes a copy)."""
    out = tmp_path_factory.mktemp("newcomer") / "run"
    assert main(["train", CONFIG, *_sets(tiny_model_dir, out), "--no-progress"]) == 0
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run to resume (and damage)."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


# ------------------------------------------------------------------------------ item 1: lr on resume
def test_resume_with_a_lower_lr_trains_at_the_new_lr(tiny_model_dir, run):
    """Through the CLI, as a user lowers the lr of a run: steps 3-4 run at the new lr (logged) and the
    optimizer's language and vision groups hold the new lrs (checkpoint-4's optimizer state); the warning
    says the change took effect and makes the continuation differ."""
    cmd = [sys.executable, "-m", "mmgrpo", "train", CONFIG, *_sets(tiny_model_dir, run)]
    cmd += ["--set", "grpo.steps=4", "--set", "grpo.lr=1e-5", "--set", "model.vision_lr=1e-6"]
    proc = subprocess.run(
        [*cmd, "--no-progress", "--resume"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = next(line for line in proc.stderr.splitlines() if "with a changed config" in line)
    assert "Applied from step 3" in warning and "grpo.lr 0.0003 -> 1e-05" in warning
    assert "model.vision_lr 3e-05 -> 1e-06" in warning
    assert "differ from an uninterrupted run" in warning and "grpo.lr, model.vision_lr" in warning
    assert [(r["step"], r["lr"]) for r in _steps(run)] == [(1, 3e-4), (2, 3e-4), (3, 1e-5), (4, 1e-5)]
    groups = torch.load(run / "checkpoint-4" / "optimizer.bin", weights_only=True)["param_groups"]
    assert {g["name"]: (g["lr"], g["initial_lr"]) for g in groups} == {
        "language": (1e-5, 1e-5),
        "vision": (1e-6, 1e-6),
    }


def test_resume_rebuilds_the_schedule_at_the_restored_step_and_keeps_adams_moments(tiny_model_dir, run):
    """Through the API: a constant-lr checkpoint at step 2 resumed with a linear schedule over 4 steps at
    lr 1e-4 and AdamW's betas and weight decay changed. The schedule's factor after 2 of 4 optimizer steps
    is (4 - 2) / 4 = 0.5, so the language group's lr is 5e-5 and the vision group's 3e-5 * 0.5; after
    steps 3 and 4 the logged lr is 1e-4 * 1/4 and 0. Adam's moments are the checkpoint's."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    extra = ["grpo.steps=4", "grpo.lr=1e-4", "grpo.lr_schedule=linear", "grpo.betas=[0.8, 0.99]"]
    cfg = load_config(CONFIG, [*_sets(tiny_model_dir, run)[1::2], *extra, "grpo.weight_decay=0.1"])
    trainer = Trainer(cfg, progress=False)
    trainer.resume(run / "checkpoint-2")
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert groups["language"]["lr"] == pytest.approx(5e-5) and groups["language"]["initial_lr"] == 1e-4
    assert groups["vision"]["lr"] == pytest.approx(1.5e-5) and groups["vision"]["initial_lr"] == 3e-5
    assert all(g["betas"] == (0.8, 0.99) and g["weight_decay"] == 0.1 for g in groups.values())
    saved = torch.load(run / "checkpoint-2" / "optimizer.bin", weights_only=True)["state"]
    live = trainer.optimizer.optimizer.state_dict()["state"]
    assert saved.keys() == live.keys() and all(
        torch.equal(saved[k]["exp_avg_sq"], live[k]["exp_avg_sq"]) for k in saved
    )
    trainer.train()
    assert [r["lr"] for r in _steps(run)][2:] == [pytest.approx(2.5e-5), 0.0]


def test_resume_changes_say_what_each_change_does():
    """The classification behind the warning line, on flat configs (no model)."""
    saved = {"grpo.lr": 3e-4, "grpo.temperature": 1.0, "grpo.save_every": 1, "warm_start.steps": 100}
    saved |= {"model.lora": "null", "model.freeze_vision": False, "model.path": "/no/such/old/model"}
    now = {**saved, "grpo.lr": 1e-5, "grpo.temperature": 0.7, "grpo.save_every": 0, "warm_start.steps": 5}
    changes = resume_changes(saved, {**now, "model.path": str(ROOT)})  # the model folder moved: allowed
    assert changes.rebuilt == ["grpo.lr 0.0003 -> 1e-05"] and changes.applied == [
        "grpo.temperature 1.0 -> 0.7"
    ]
    assert changes.no_effect == ["grpo.save_every 1 -> 0"] and changes.not_used == [
        "warm_start.steps 100 -> 5"
    ]
    assert not changes.refused
    line = changes.warning(Path("ckpt"), 2)
    assert (
        "because of grpo.lr, grpo.temperature." in line and "No effect on training: grpo.save_every" in line
    )
    refused = resume_changes(saved, {**now, "model.freeze_vision": True, "model.path": str(ROOT)}).refused
    assert len(refused) == 1 and refused[0].startswith("model.freeze_vision changed (false -> true)")
    lora = {k: v for k, v in now.items() if k != "model.lora"} | {"model.lora.r": 4}
    assert resume_changes(saved, lora).refused[0].startswith("model.lora was off in the checkpoint's run")
    assert resume_changes(saved, saved).warning(Path("ckpt"), 2) is None
    # with grpo.bare_steps the drills at the switch read warm_start: applied up to it, unused after it
    bare = {"grpo.bare_steps": 3}
    for step, applied in ((2, True), (3, True), (4, False)):
        c = resume_changes(saved | bare, now | bare | {"model.path": str(ROOT)}, step)
        assert ("warm_start.steps 100 -> 5 (at the drills after grpo.bare_steps)" in c.applied) == applied
        assert (c.not_used == ["warm_start.steps 100 -> 5"]) == (not applied)


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.freeze_vision=true"], "model.freeze_vision changed (false -> true)"),
        (["grpo.freeze_embeddings=false"], "grpo.freeze_embeddings changed (true -> false)"),
        (["model.lora={r: 4, alpha: 8}"], "model.lora was off in the checkpoint's run and is on now"),
        (["model.path=OTHER"], "model.path changed ("),
    ],
    ids=["freeze_vision", "freeze_embeddings", "lora-on", "another-model"],
)
def test_resume_refuses_a_change_that_cannot_apply_by_name(
    tiny_model_dir, run, tmp_path, capsys, change, named
):
    """Refused before anything is loaded or written: one line naming the key and the way out; the run's
    metrics and checkpoints are untouched."""
    other = Path(shutil.copytree(tiny_model_dir, tmp_path / "other-model"))  # another model folder
    change = [c.replace("OTHER", str(other)) for c in change]
    before = (run / "metrics.jsonl").read_text()
    sets = _sets(tiny_model_dir, run, *change)
    assert main(["train", CONFIG, *sets, "--no-progress", "--resume"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--resume {run / 'checkpoint-2'}: " in line and named in line and "start a new run" in line
    assert (run / "metrics.jsonl").read_text() == before and not (run / "final.partial").exists()


# ------------------------------------------------------------------- item 3: a damaged checkpoint
@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda c: os.truncate(c / "model.safetensors", 1000), "model.safetensors is truncated or corrupt"),
        (lambda c: (c / "optimizer.bin").unlink(), "optimizer.bin is missing"),
        (lambda c: os.truncate(c / "optimizer.bin", 4000), "optimizer.bin is truncated or corrupt"),
        (lambda c: (c / "reference.safetensors").unlink(), "reference.safetensors is missing"),
    ],
    ids=["cut-weights", "no-optimizer", "cut-optimizer", "no-reference"],
)
def test_a_damaged_checkpoint_is_named_with_the_previous_complete_one(
    tiny_model_dir, run, capsys, damage, named
):
    damage(run / "checkpoint-2")
    assert main(["train", CONFIG, *_sets(tiny_model_dir, run), "--no-progress", "--resume"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--resume {run / 'checkpoint-2'}: the checkpoint is damaged ({named}" in line
    assert f"The previous complete checkpoint is {run / 'checkpoint-1'} (step 1)" in line
    assert f"--resume {run / 'checkpoint-1'}" in line


def test_resuming_the_previous_checkpoint_as_told_replaces_the_damaged_one(tiny_model_dir, run, capsys):
    """The way out the error gives works: resume from checkpoint-1; step 2 is trained again and its
    checkpoint written over the damaged one."""
    os.truncate(run / "checkpoint-2" / "model.safetensors", 1000)
    sets = _sets(tiny_model_dir, run)
    assert main(["train", CONFIG, *sets, "--no-progress", "--resume", str(run / "checkpoint-1")]) == 0
    assert damaged_file(run / "checkpoint-2" / "model.safetensors") is None
    assert [r["step"] for r in _steps(run)] == [1, 2]
    assert main(["train", CONFIG, *sets, "--set", "grpo.steps=3", "--no-progress", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().err and [r["step"] for r in _steps(run)] == [1, 2, 3]


def test_a_lora_adapter_stores_its_base_as_an_absolute_path(tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA run from a relative model.path: the final adapter (and each checkpoint's) names its base by
    an absolute path, so it loads from any working directory."""
    from mmgrpo.model.io import load_model

    shutil.copytree(tiny_model_dir, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    sets = _sets(Path("base"), Path("run"), "grpo.steps=1", "model.lora={r: 4, alpha: 8}")
    assert main(["train", CONFIG, *sets, "--no-progress"]) == 0
    for folder in (tmp_path / "run" / "final", tmp_path / "run" / "checkpoint-1"):
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == str(tmp_path / "base")
    monkeypatch.chdir(ROOT)
    model, _ = load_model(tmp_path / "run" / "final")
    assert any("lora_" in n for n, _ in model.named_parameters())


# ------------------------------------------------------------------------ item 4: a full disk
def _full_disk(monkeypatch, *, under: Path, error: Exception) -> None:
    """Every weights file written under ``under`` fails with ``error`` (both writers: torch.save for
    accelerate's optimizer/scheduler/RNG files, safetensors for the model)."""
    import transformers.modeling_utils

    real_torch, real_st = torch.save, transformers.modeling_utils.safe_save_file

    def guard(real):
        def write(obj, f, *args, **kwargs):
            if str(f).startswith(str(under)):
                raise error
            return real(obj, f, *args, **kwargs)

        return write

    monkeypatch.setattr(torch, "save", guard(real_torch))
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", guard(real_st))


@pytest.mark.parametrize(
    "error, reason",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "(No space left on device; "),
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
            "unexpected pos",
        ),
    ],
    ids=["oserror", "torch-runtimeerror"],
)
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(
    tiny_model_dir, tmp_path, monkeypatch, capsys, error, reason
):
    """checkpoint-2 fails (OSError; or the RuntimeError torch.save really raises on a full disk, which
    never names the disk): one line, checkpoint-1 intact, no partial folder; resuming continues."""
    out = tmp_path / "run"
    _full_disk(monkeypatch, under=out / "checkpoint-2.partial", error=error)
    assert main(["train", CONFIG, *_sets(tiny_model_dir, out), "--no-progress"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"writing checkpoint {out / 'checkpoint-2'} failed (" in line and reason in line
    assert "left on that disk" in line and f"{out / 'checkpoint-1'} (step 1) is intact" in line
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1"]
    assert not (out / "checkpoint-2.partial").exists() and not (out / "checkpoint-2").exists()
    monkeypatch.undo()  # space freed
    assert main(["train", CONFIG, *_sets(tiny_model_dir, out), "--no-progress", "--resume"]) == 0
    assert [r["step"] for r in _steps(out)] == [1, 2] and (out / "final" / "model.safetensors").is_file()


def test_a_full_disk_at_the_final_save_keeps_the_model_in_a_rescue_folder(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The default save_every 0: no checkpoint, so a failed final save used to lose the run. The model
    goes to a rescue folder in $TMPDIR instead, named in the one line, and loads from there."""
    import tempfile

    from mmgrpo.model.io import load_model

    out, tmp = tmp_path / "run", tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _full_disk(monkeypatch, under=out, error=OSError(errno.ENOSPC, "No space left on device"))
    assert main(["train", CONFIG, *_sets(tiny_model_dir, out, "grpo.save_every=0"), "--no-progress"]) == 2
    line = _error_line(capsys.readouterr().err)
    (rescue,) = tmp.glob("mmgrpo-rescue-run-final-*")
    assert f"saving {out / 'final'} failed (No space left on device; " in line
    assert (
        f"The trained model was saved to {rescue} instead" in line and f"mv {rescue} {out / 'final'}" in line
    )
    assert not (out / "final").exists() and not (out / "final.partial").exists()
    assert (rescue / "model.safetensors").is_file() and (rescue / "mmgrpo_config.yaml").is_file()
    load_model(rescue)


def test_when_the_rescue_fails_too_the_earlier_final_stays_and_the_latest_checkpoint_is_named(
    tiny_model_dir, run, tmp_path, monkeypatch, capsys
):
    """Resuming a finished run for one more step on a disk that is full everywhere: the earlier final/
    is untouched, no partial folder is left, and the line names checkpoint-2 to resume from."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    final_bytes = (run / "final" / "model.safetensors").read_bytes()
    _full_disk(monkeypatch, under="/", error=OSError(errno.ENOSPC, "No space left on device"))
    sets = _sets(tiny_model_dir, run, "grpo.steps=3", "grpo.save_every=0")
    assert main(["train", CONFIG, *sets, "--no-progress", "--resume"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert (
        f"nothing there was replaced (the earlier save at {run / 'final'} is intact), and a copy to" in line
    )
    assert f"The latest checkpoint is {run / 'checkpoint-2'}: free some space" in line
    assert (run / "final" / "model.safetensors").read_bytes() == final_bytes
    assert not list(run.glob("*.partial")) and not list(tmp_path.glob("mmgrpo-rescue-*"))
