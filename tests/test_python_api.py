"""The Python API is the CLI (issue 54): ``mmgrpo.run`` is what ``mmgrpo train`` runs (warm start, run lock,
refusal to mix runs, resume), ``Trainer.train()`` on its own neither skips the configured warm start nor
mixes runs nor trains twice, and ``load_config`` takes a dict. On the tiny text model, a few steps each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mmgrpo
from mmgrpo.config.core import load_config
from mmgrpo.errors import ConfigError, MmgrpoError

ROOT = Path(__file__).resolve().parent.parent
TEXT_MATH = str(ROOT / "examples" / "text_math_tiny.yaml")
# two warm-start steps (checked, not required), two GRPO steps of 2 tasks x G=4, short answers
SMALL = [
    "grpo.steps=2",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.micro_batch_size=4",
    "grpo.max_new_tokens=8",
    "warm_start.steps=2",
    "warm_start.batch_size=4",
    "warm_start.check_tasks=4",
    "warm_start.min_skill=0",
    "eval.episodes=4",
    "eval.batch_size=4",
]


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model")


def sets(model_dir, out, *more: str) -> list[str]:
    return [f"model.path={model_dir}", f"output_dir={out}", *SMALL, *more]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_load_config_takes_a_dict_with_the_errors_of_a_file(tmp_path):
    cfg = load_config({"grpo": {"steps": 3}, "env": {"name": "text_math"}}, ["seed=2"])
    assert (cfg.grpo.steps, cfg.env.name, cfg.seed) == (3, "text_math", 2)
    assert load_config(cfg, ["grpo.lr=0.5"]).grpo.lr == 0.5  # a Config, overridden
    with pytest.raises(ConfigError, match=r"^<dict>: unknown key 'grpo.stepz'. Did you mean 'grpo.steps'\?"):
        load_config({"grpo": {"stepz": 3}})
    with pytest.raises(ConfigError, match=r"^<dict>: 'grpo.steps' must be int, got str 'x'"):
        load_config({"grpo": {"steps": "x"}})
    (tmp_path / "c.yaml").write_text("grpo:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown key 'grpo.stepz'. Did you mean 'grpo.steps'\?"):
        load_config(tmp_path / "c.yaml")


def test_mmgrpo_run_and_mmgrpo_train_are_the_same_run(text_model_dir, tmp_path, capsys):
    """Same config and seed on the CPU: the CLI and the Python call write the same metrics, warm start
    included (the CLI calls mmgrpo.run)."""
    from mmgrpo.cli.app import main

    cli, py = tmp_path / "cli", tmp_path / "py"
    assert (
        main(
            [
                "train",
                TEXT_MATH,
                *(x for s in sets(text_model_dir, cli) for x in ("--set", s)),
                "--no-progress",
            ]
        )
        == 0
    )
    result = mmgrpo.run(TEXT_MATH, sets(text_model_dir, py), progress=False)
    drop = ("rollout_time", "train_time", "step_time", "seconds")  # wall-clock times differ

    def same(r):
        return {k: v for k, v in r.items() if k not in drop}

    assert [same(r) for r in records(cli)] == [same(r) for r in records(py)]
    stages = [r.get("stage") for r in records(py)]
    assert stages.count("warm_start") == 2 and [r["step"] for r in records(py) if "stage" not in r] == [1, 2]
    assert result.step == 2 and result.final == py / "final" and (py / "final" / "README.md").is_file()
    assert result.metrics["reward"] == records(py)[-1]["reward"]
    assert result.trainer.warm_start_steps == 2 and (py / "curves.png").is_file()


def test_trainer_train_runs_the_configured_warm_start_and_trains_once(text_model_dir, tmp_path):
    from mmgrpo.train.trainer import Trainer

    trainer = Trainer(load_config(TEXT_MATH, sets(text_model_dir, tmp_path / "run")), progress=False)
    trainer.train()
    stages = [r.get("stage") for r in records(tmp_path / "run")]
    assert stages.count("warm_start") == 2 and trainer.warm_started and trainer.warm_start_steps == 2
    with pytest.raises(
        MmgrpoError, match=r"^this Trainer has trained already \(to step 2 of 2\): a Trainer trains once"
    ):
        trainer.train()


def test_a_new_run_into_a_folder_holding_one_is_refused_unless_resume_or_overwrite(text_model_dir, tmp_path):
    """A second run into the same output_dir mixed the runs (metrics steps 1, 2, 1, 2, final/ replaced)."""
    from mmgrpo.train.trainer import Trainer

    out = tmp_path / "run"
    first = sets(text_model_dir, out, "warm_start.steps=0", "grpo.save_every=1")
    mmgrpo.run(TEXT_MATH, first, progress=False)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run \(.*\): a new run there would mix"):
        Trainer(load_config(TEXT_MATH, first), progress=False).train()
    with pytest.raises(ConfigError, match=r"Pass resume=True to continue it .* overwrite=True to delete it"):
        mmgrpo.run(TEXT_MATH, first, progress=False)
    assert (out / "metrics.jsonl").read_text() == before  # nothing was written
    longer = mmgrpo.run(TEXT_MATH, [*first, "grpo.steps=3"], resume=True, progress=False)
    assert longer.step == 3 and [r["step"] for r in records(out)] == [1, 2, 3]
    again = mmgrpo.run(TEXT_MATH, first, overwrite=True, progress=False)
    assert again.step == 2 and [r["step"] for r in records(out)] == [1, 2]
    with pytest.raises(ConfigError, match="resume and overwrite"):
        mmgrpo.run(TEXT_MATH, first, resume=True, overwrite=True)


def test_a_second_run_into_a_locked_folder_stops_at_once(text_model_dir, tmp_path):
    from mmgrpo.train.run_lock import RunLock, RunLockedError

    out = tmp_path / "run"
    with RunLock(out, "mmgrpo train"), pytest.raises(RunLockedError, match="is in use by `mmgrpo train`"):
        mmgrpo.run(TEXT_MATH, sets(text_model_dir, out), progress=False)


def test_the_public_names_are_exported():
    for name in ("run", "RunResult", "GRPO", "TrainerCallback", "TrainingStopped"):
        assert name in mmgrpo.__all__ and getattr(mmgrpo, name) is not None
