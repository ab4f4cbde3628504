"""The embedded demos, end to end, each asserting its done-when on held-out accuracy (n = 200).

Slow tier (`pytest -m slow tests/test_demo.py`; `.ci/run` runs the counting, counting_hard, text_math, tools
and tools_lookup demos after the fast tests; the zoom demo is run by hand until it is faster: .ci/run says why). On 2 CPU cores: counting about 1 minute, text_math about 1,
tools about 2, tools_lookup about 5, counting_hard about 4, zoom about 9-12.
`--demo-set KEY=VALUE` adds an override to every demo here, e.g. `--demo-set seed=1`, or
`--demo-set grpo.steps=5` to see a demo fall short and its test fail.
"""

from __future__ import annotations

import json

import pytest

from mmgrpo.cli.app import main


def run_demo(task: str, tmp_path, capsys, demo_sets: list[str]) -> dict:
    """``mmgrpo demo --task TASK``; returns its demo.json after checking the final line's form."""
    assert main(["demo", "--task", task, "--out", str(tmp_path), "--no-progress", *demo_sets]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    with capsys.disabled():  # the demo's own summary lines reach the CI log
        print(f"\n[{task}{' ' + ' '.join(demo_sets) if demo_sets else ''}]")
        print("\n".join(line for line in out.splitlines() if line.startswith(("demo:", "warm start:"))))
    assert last.startswith("demo: accuracy before=") and last.endswith("(n=200)")
    summary = json.loads((tmp_path / "run" / "demo.json").read_text())
    assert summary["n"] >= 200
    return summary


@pytest.mark.slow
def test_demo_learns_to_count(tmp_path, capsys, demo_sets):
    summary = run_demo("counting", tmp_path, capsys, demo_sets)
    assert summary["after"] >= 0.95, summary
    assert summary["after"] - summary["before"] >= 0.50, summary
    # the answer table agrees with the accuracy: its right cells hold the correct episodes
    table = summary["answers_after"]
    right = sum(n for true, row in table.items() for given, n in row.items() if given == true)
    assert sum(n for row in table.values() for n in row.values()) == summary["n"]
    assert right == round(summary["after"] * summary["n"]), table
    assert (tmp_path / "run" / "answers.png").is_file()


@pytest.mark.slow
def test_demo_learns_to_use_the_calculator(tmp_path, capsys, demo_sets):
    summary = run_demo("tools", tmp_path, capsys, demo_sets)
    assert summary["before"] <= 0.30 and summary["after"] >= 0.80, summary
    # what GRPO changed is the tool call: the question's expression instead of another one
    right_before = summary["tool_use_before"]["env/right_call"]
    assert summary["tool_use_after"]["env/right_call"] - right_before >= 0.5, summary
    assert any((tmp_path / "run" / "transcripts").glob("episode-*.md"))


@pytest.mark.slow
def test_demo_learns_to_look_up_then_multiply(tmp_path, capsys, demo_sets):
    """Two tools in sequence (a price over HTTP, then the calculator) and a per-call cost."""
    summary = run_demo("tools_lookup", tmp_path, capsys, demo_sets)
    assert summary["before"] <= 0.30 and summary["after"] >= 0.80, summary
    # what GRPO changed is the first call: a lookup when the question states no price
    before, after = summary["tool_use_before"], summary["tool_use_after"]
    assert after["env/lookup_unpriced"] - before["env/lookup_unpriced"] >= 0.5, summary


@pytest.mark.slow
def test_demo_learns_to_count_in_the_zoomed_view(tmp_path, capsys, demo_sets):
    """The zoom agent on the tiny model that sees: the warm start teaches the call on the named cell and the
    answer's form (counts at random, so before is chance), GRPO must read the count in the zoomed view (bare
    prompts first, then full ones) and keep zooming on the named cell. With grpo.freeze_embeddings (as in
    counting_hard) seeds 0, 1 and 2 each ended at 1.000; without it seed 1 collapsed onto "1" (0.245). Not in
    .ci/run for now (19.6 min there on a slow day with 700 steps, 12 min with 500; see its header): run it by
    hand after changing what it uses. After >= 0.90 is issue 56's bar (seeds 0 and 1 with 500 steps: 1.000)."""
    summary = run_demo("zoom", tmp_path, capsys, demo_sets)
    assert summary["before"] <= 0.30 and summary["after"] >= 0.90, summary
    after = summary["tool_use_after"]
    assert after["env/right_cell"] >= 0.9 and after["tools/used_frac"] >= 0.9, summary
    table = summary["answers_after"]
    assert all(row.get(true, 0) > 0 for true, row in table.items()), table  # every count read somewhere


@pytest.mark.slow
def test_demo_learns_addition_on_the_text_model(tmp_path, capsys, demo_sets):
    """GRPO must add at least +0.40 over what the cold start on a few true examples gives alone."""
    summary = run_demo("text_math", tmp_path, capsys, demo_sets)
    assert summary["after"] >= 0.90 and summary["after"] - summary["before"] >= 0.40, summary


@pytest.mark.slow
def test_demo_counts_one_named_kind_among_distractors(tmp_path, capsys, demo_sets):
    """The model that sees, then its marking pretraining (mmgrpo/tiny/marks.py), the question before the
    image: the format warm start leaves it at chance, GRPO must reach 0.90 with every count answered right
    somewhere. Without grpo.freeze_embeddings the answers collapsed onto 1, 3 and 5 (seed 1: 0.490);
    with it, seed 0 0.960 and seed 1 1.000 (docs/results.md: "What decided a run")."""
    summary = run_demo("counting_hard", tmp_path, capsys, demo_sets)
    assert summary["before"] <= 0.30 and summary["after"] >= 0.90, summary
    table = summary["answers_after"]
    assert all(row.get(true, 0) > 0 for true, row in table.items()), table  # no count left unanswered
