"""Smoke test of benchmarks/multiturn.py: its quick form runs end to end (the zoom shape and the TRL tool
comparison; the text shape's env is checked here directly: the zoom env is a subclass of it and runs the
same worker) and prints the result lines."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "multiturn.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("multiturn_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_text_env_answers_with_the_calculator_and_ends_after_the_last_turn():
    bench = load_bench()
    text_env, zoom_env = bench.make_envs()
    env = text_env(turns=3)
    messages, info = env.reset(seed=5)
    a, b = map(int, re.findall(r"\d+", messages[-1]["content"][0]["text"]))
    assert info["answer"] == a * b and info["tools"][0]["function"]["name"] == "calculator"
    for _ in range(2):
        obs, _, terminated, truncated, step_info = env.step("anything")
        assert obs[0]["role"] == "tool" and obs[0]["content"][0]["text"] == str(a * b)
        assert not terminated and not truncated and step_info["tool_calls"] == 1
    assert env.step("done")[2] is True
    zoom = zoom_env(turns=2)
    zoom.reset(seed=1)
    parts = zoom.step("x")[0][0]["content"]
    assert parts[0]["type"] == "image" and parts[0]["image"].size == (112, 112) and parts[1]["type"] == "text"


@pytest.mark.slow  # about 50 s: in CI's slow tier (.ci/run), so the default run keeps its 10-minute budget
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install -e '.[bench]')")
def test_quick_benchmark_prints_its_ratios(tmp_path, tiny_model_dir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny-model").symlink_to(tiny_model_dir)  # the session's tiny model: no build worker
    out = tmp_path / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--only",
        "zoom,trl",
        "--work",
        str(work),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^multiturn: zoom_vs_single ratio=\d+\.\d+$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^multiturn: vs_trl_tools ratio=\d+\.\d+$", proc.stdout, re.M), proc.stdout
    assert "prompt ids identical on both sides: yes" in proc.stdout
    res = json.loads(out.read_text())
    multi, single = res["zoom"]["multi"], res["zoom"]["single"]
    assert multi["turns"] == 3 and multi["truncation"] == ["None"]  # every episode ran its 3 turns
    assert multi["policy_tokens_per_step"] == 2 * 2 * 3 * 8  # B x G x turns x forced tokens per turn
    assert single["response_tokens"] == multi["response_tokens"] == res["zoom"]["single_tokens"]
