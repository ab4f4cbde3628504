"""Shared fixtures: the tiny Qwen2.5-VL is built once per test session (a few seconds, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption(
        "--demo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra --set override for the slow demo tests (repeatable), e.g. --demo-set seed=1, or "
        "--demo-set grpo.steps=5 to see a demo test fail when GRPO is cut short",
    )


@pytest.fixture
def demo_sets(request) -> list[str]:
    """The ``--set`` arguments given with ``--demo-set`` (the slow demo tests pass them to ``mmgrpo demo``)."""
    return [x for item in request.config.getoption("--demo-set") for x in ("--set", item)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from mmgrpo.tiny.vlm import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    from mmgrpo.model.policy import Policy

    return Policy.from_pretrained(tiny_model_dir)


# a two-step run small enough for a smoke test: (B=2 tasks x G=4), two warm-start steps, six eval episodes
SMALL_RUN = [
    "grpo.steps=2",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.micro_batch_size=4",
    "warm_start.steps=2",
    "warm_start.batch_size=4",
    "warm_start.check_tasks=4",  # two warm-start steps teach nothing: measure the skill, do not require it
    "warm_start.min_skill=0",
    "eval.episodes=6",
    "eval.batch_size=6",
]


@pytest.fixture
def small_run():
    """``small_run(*extra)``: the --set arguments of SMALL_RUN plus ``extra`` overrides."""

    def sets(*extra: str) -> list[str]:
        return [x for item in (*SMALL_RUN, *extra) for x in ("--set", item)]

    return sets


@pytest.fixture
def train_small(small_run):
    """``train_small(config, model_dir, out)``: ``mmgrpo train`` for two small steps; returns
    (GRPO step records, all records of metrics.jsonl)."""
    import json

    from mmgrpo.cli.app import main

    def run(config: str, model_dir, out) -> tuple[list[dict], list[dict]]:
        sets = small_run(f"model.path={model_dir}", f"output_dir={out}")
        assert main(["train", config, *sets, "--no-progress"]) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "stage" not in r], records

    return run


@pytest.fixture(scope="session")
def warm_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny VLM after 40 steps of the counting demo's format warm start: its samples get rewards that
    differ within a group (about a third are in the answer format), so GRPO steps have real gradients."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    out = tmp_path_factory.mktemp("warm")
    sets = [
        f"model.path={tiny_model_dir}",
        f"output_dir={out / 'run'}",
        "grpo.steps=0",
        "warm_start.steps=40",
        "warm_start.min_skill=0",  # a partial format is the point here: measure it, do not require it
    ]
    trainer = Trainer(load_config(ROOT / "examples" / "counting_tiny.yaml", sets), progress=False)
    trainer.warm_start()
    trainer.save(out / "model")
    return out / "model"
