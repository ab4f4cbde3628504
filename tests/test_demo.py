"""The full embedded demo, end to end (about 3 minutes on 2 CPU cores): run with `pytest -m slow`."""

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
