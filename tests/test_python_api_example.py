"""docs/python_api.md's examples run as written: examples/python_api.py (a TRL-style run with callbacks, then
a resume through mmgrpo.run) and the page's first snippet, on the tiny text model with 2 steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model")


def python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_example_script_trains_prints_its_callbacks_and_resumes(text_model_dir, tmp_path):
    out = tmp_path / "run"
    done = python(
        [
            str(ROOT / "examples" / "python_api.py"),
            "--model",
            str(text_model_dir),
            "--out",
            str(out),
            "--steps",
            "2",
        ],
        tmp_path,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # two steps, then one more after the resume
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert steps == [
        f"step {r['step']}: reward {r['reward']:.3f} (correct {r['reward/correct']:.2f})" for r in records
    ]
    assert f"saved {out / 'checkpoint-2'}" in lines and lines.count(f"saved {out / 'final'}") == 2
    assert (
        f"GRPO: 2 steps, last reward {records[1]['reward']:.3f}; model and card in {out / 'final'}" in lines
    )
    assert lines[-1] == f"resumed: 3 steps in {out}"
    assert "## Final metrics (step 3)" in (out / "final" / "README.md").read_text()


def test_the_snippet_on_the_page_runs_as_written(text_model_dir, tmp_path):
    page = (ROOT / "docs" / "python_api.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert len(snippet.strip().splitlines()) <= 10  # a TRL user's few lines
    assert 'model="runs/tiny-text-model"' in snippet and "max_steps=20" in snippet
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-text-model").symlink_to(text_model_dir)
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace("max_steps=20", "max_steps=2"))
    done = python([str(script)], tmp_path)
    reward, final = done.stdout.split()[-2:]
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2] and float(reward) == records[-1]["reward"]
    assert final == "runs/grpo/final" and (tmp_path / final / "model.safetensors").is_file()


def test_the_readme_snippet_runs_as_written(text_model_dir, tmp_path):
    """The README's Python API snippet (a shorter form of the page's) trains as written, 2 steps."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "mmgrpo.GRPO(" in snippet and "max_steps=20" in snippet
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-text-model").symlink_to(text_model_dir)
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace("max_steps=20", "max_steps=2") + "print(result.step, result.final)\n")
    done = python([str(script)], tmp_path)
    assert done.stdout.split()[-2:] == ["2", "runs/grpo/final"]
    assert (tmp_path / "runs" / "grpo" / "final" / "README.md").is_file()  # the model card
