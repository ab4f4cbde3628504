"""``mmgrpo demo`` trains GRPO on one process per core: the launch, the choice of the process count, and
the run it leaves (each step logged once, the final model evaluated by the parent)."""

from __future__ import annotations

import json

import pytest

from mmgrpo.cli.app import main
from mmgrpo.cli.processes import choose_processes
from mmgrpo.errors import ConfigError


def test_the_process_count(monkeypatch):
    monkeypatch.setattr("mmgrpo.cli.processes.available_cores", lambda: 2)
    assert choose_processes("auto", "cpu") == 2
    assert choose_processes("auto", "cuda") == 1
    assert choose_processes("3", "cpu") == 3
    monkeypatch.setattr("mmgrpo.cli.processes.available_cores", lambda: 1)
    assert choose_processes("auto", "cpu") == 1
    for bad in ("two", "0"):
        with pytest.raises(ConfigError, match="--processes takes 'auto' or a whole number"):
            choose_processes(bad, "cpu")


def test_the_demo_on_two_processes(tmp_path, capsys):
    sets = [
        "grpo.steps=3",
        "warm_start.steps=2",
        "warm_start.min_skill=0",
        "eval.episodes=8",
        "eval.batch_size=8",
    ]
    args = ["demo", "--out", str(tmp_path), "--no-progress", "--processes", "2"]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "demo: GRPO on 2 processes" in out
    assert out.strip().splitlines()[-1].startswith("demo: accuracy before=")
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "stage" not in r] == [1, 2, 3]  # rank 0 logs, once per step
    assert any(r.get("stage") == "warm_start" for r in records)  # the parent's warm start, same file
    assert json.loads((run / "demo.json").read_text())["processes"] == 2
    assert (run / "final" / "config.json").is_file() and (tmp_path / "warm-started" / "config.json").is_file()
