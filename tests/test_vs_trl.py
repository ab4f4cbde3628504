"""The short form of benchmarks/vs_trl.py: mmgrpo's GRPO step and TRL's GRPOTrainer both run, side by side.

Only that both systems ran and the report was printed is checked; the numbers themselves are machine
dependent (docs/speed.md has measured ones).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(
    r"vs_trl: G=4 step_ratio=\d+\.\d\d rss_ratio=\d+\.\d\d vision_calls_mmgrpo=\d+ vision_calls_trl=\d+"
)


@pytest.mark.slow  # about 30 s: in CI's slow tier (.ci/run), so the default run keeps its 10-minute budget
def test_vs_trl_quick(tmp_path):
    pytest.importorskip("trl", reason='TRL runs the other side: pip install -e ".[bench]"')
    report = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/vs_trl.py", "--quick", "--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    assert any(line.startswith("  G    N | step s mmgrpo") for line in lines), proc.stdout
    assert any(re.match(r"\s+4\s+16 \|", line) for line in lines), proc.stdout  # the G=4 row
    assert "threads pinned: 1 per run" in proc.stdout

    per_G = json.loads(report.read_text())["per_G"]["4"]
    for system in ("mmgrpo", "trl"):
        times = per_G[system]["step_times_s"]
        assert times and all(t > 0 for t in times), (system, times)
        assert per_G[system]["median_step_s"] > 0
        assert per_G[system]["peak_rss_mb"] > 0
