"""A third-party plugin written against the import paths plugins use (tests/fixtures/plugin_api: it imports
``mmgrpo.env``, ``mmgrpo.verifier``, ``mmgrpo.registry``, ``mmgrpo.tools.runner``, ``mmgrpo.toolbox`` and
``mmgrpo.envs.tool_env``) is discovered, passes its own checks and trains: single-turn and with tools.
The fixture is never edited when mmgrpo moves its modules; this test runs it in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLUGIN_DIR = Path(__file__).parent / "fixtures" / "plugin_api"


def run_python(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_the_plugin_checks_itself_and_registers_in_code():
    code = (
        "import json, mmgrpo_shop_plugin as p; p.register_in_code(); "
        "from mmgrpo.registry import list_envs, list_verifiers; "
        "print(json.dumps({'check': p.self_check(), 'envs': list_envs(), 'verifiers': list_verifiers()}))"
    )
    done = run_python(["-c", code])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["check"] == {
        "tool_result": "25",
        "done_after_call": False,
        "runner_tools": ["lookup_price"],
        "short": 1.0,
        "answer": "180",  # seed 4: 3 pears at 60
    }
    for name in ("shop_add", "shop_price", "shop_add_code", "shop_price_code"):
        assert name in out["envs"]
    for name in ("shop_short", "shop_mentions", "shop_short_code", "shop_mentions_code"):
        assert name in out["verifiers"]


def test_the_plugin_trains_single_turn_and_with_tools(tiny_model_dir, tmp_path):
    for env_block, name in (
        ("{name: shop_add}", "add"),
        ("{name: shop_price, max_turns: 3, max_episode_tokens: 200, kwargs: {timeout_s: 3.0}}", "price"),
    ):
        out = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        config.write_text(
            f"seed: 0\noutput_dir: {out}\n"
            f"model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}\n"
            f"env: {env_block}\n"
            "verifiers:\n  - {name: shop_mentions, weight: 1.0}\n  - {name: shop_short, weight: 0.1}\n"
            "warm_start: {steps: 1, batch_size: 4, check_tasks: 4, min_skill: 0}\n"
            "grpo: {steps: 2, tasks_per_step: 2, group_size: 4, micro_batch_size: 8, max_new_tokens: 12}\n"
            "eval: {episodes: 4, batch_size: 4, max_new_tokens: 12}\n"
        )
        done = run_python(["-m", "mmgrpo", "train", str(config), "--no-progress"])
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "stage" not in r and "step" in r]
        assert [r["step"] for r in steps] == [1, 2]
        assert all(0.0 <= r["reward/shop_short"] <= 1.0 for r in steps)
        assert (out / "final" / "config.json").exists()
