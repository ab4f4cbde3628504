"""benchmarks/zoom_step.py runs end to end (one round, two steps, the same checkout on both sides); slow tier,
beside the other benchmarks' short forms (~20 s)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_zoom_step_benchmark_prints_its_ratios(tiny_model_dir, tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "zoom_step.py"), "--work", str(tmp_path)]
    cmd += ["--baseline", str(ROOT), "--model", str(tiny_model_dir), "--rounds", "1", "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("round 0") == 2, out
    for name in ("rollout_time", "train_time"):
        assert re.search(rf"^zoom_step: {name} ratio=\d+\.\d+$", out, re.M), out
    ratio = float(re.search(r"^zoom_step: ratio=(\d+\.\d+)$", out, re.M).group(1))
    assert 0.2 < ratio < 5.0, out  # the same code on both sides
    assert f"baseline: {ROOT / 'mmgrpo' / '__init__.py'}" in out  # each side names the mmgrpo it ran
