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
