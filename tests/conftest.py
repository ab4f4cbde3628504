"""Shared fixtures: the tiny Qwen2.5-VL is built once per test session (a few seconds, offline)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from mmgrpo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    from mmgrpo.policy import Policy

    return Policy.from_pretrained(tiny_model_dir)


# a two-step run small enough for a smoke test: (B=2 tasks x G=4), two warm-start steps, six eval episodes
SMALL_RUN = [
    "grpo.steps=2",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.micro_batch_size=4",
    "warm_start.steps=2",
    "warm_start.batch_size=4",
    "eval.episodes=6",
    "eval.batch_size=6",
]


@pytest.fixture
def small_run():
    """``small_run(*extra)``: the --set arguments of SMALL_RUN plus ``extra`` overrides."""

    def sets(*extra: str) -> list[str]:
        return [x for item in (*SMALL_RUN, *extra) for x in ("--set", item)]

    return sets
