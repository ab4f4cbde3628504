"""The full embedded demos, end to end (counting 2-6 minutes, tools about 11, on 2 CPU cores): run with
`pytest -m slow`."""

from __future__ import annotations

import json

import pytest

from mmgrpo.cli import main


@pytest.mark.slow
def test_demo_learns_to_count(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: accuracy before=") and last.endswith("(n=200)")
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    assert summary["n"] >= 200
    assert summary["after"] >= 0.95
    assert summary["after"] - summary["before"] >= 0.50


@pytest.mark.slow
def test_demo_learns_to_use_the_calculator(tmp_path, capsys):
    assert main(["demo", "--task", "tools", "--out", str(tmp_path), "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: accuracy before=") and last.endswith("(n=200)")
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    assert summary["before"] <= 0.30 and summary["after"] >= 0.80
    # what GRPO changed is the tool call: the question's expression instead of another one
    assert summary["tool_use_after"]["env/right_call"] - summary["tool_use_before"]["env/right_call"] >= 0.5
    assert any((tmp_path / "run" / "transcripts").glob("episode-*.md"))


@pytest.mark.slow
def test_demo_learns_addition_on_the_text_model(tmp_path, capsys):
    """GRPO must add at least +0.40 over what the cold start on a few true examples gives alone."""
    assert main(["demo", "--task", "text_math", "--out", str(tmp_path), "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: accuracy before=") and last.endswith("(n=200)")
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    assert summary["after"] >= 0.90 and summary["after"] - summary["before"] >= 0.40


@pytest.mark.slow
def test_demo_counts_one_named_kind_among_distractors(tmp_path, capsys):
    assert main(["demo", "--task", "counting_hard", "--out", str(tmp_path), "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: accuracy before=") and last.endswith("(n=200)")
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    assert summary["after"] >= 0.90 and summary["after"] - summary["before"] >= 0.50
