"""Paths a newcomer takes (issue 17): evaluation that reports no more episodes than the eval split has
distinct tasks, trackers that are asked for but not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mmgrpo.registry import make_env, make_verifier
from mmgrpo.rollout.evaluation import evaluate
from mmgrpo.verifier import Rewards


def _dataset(tmp_path, rows: int = 20) -> str:
    path = tmp_path / "qa.jsonl"
    lines = [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_eval_reports_no_more_episodes_than_distinct_held_out_tasks(tiny_policy, tmp_path, capsys):
    """20 rows, a quarter held out: `-n 200` ran 200 episodes on those few rows repeated and reported
    n=200 (48bbbf8); it now runs each held-out row once, reports that n and says why."""
    path = _dataset(tmp_path)
    env = make_env("text_qa", path=path, eval_fraction=0.25)
    held_out = env.num_tasks("eval")
    assert 1 <= held_out < 20 and env.num_tasks("train") == 20 - held_out
    rewards = Rewards([make_verifier("exact_match")])
    result = evaluate(
        tiny_policy,
        lambda: make_env("text_qa", path=path, eval_fraction=0.25),
        rewards,
        episodes=200,
        metric="exact_match",
        max_new_tokens=2,
    )
    assert result.n == held_out
    err = capsys.readouterr().err
    assert f"the eval split holds {held_out} distinct tasks; evaluating {held_out} episodes, not 200" in err


def test_procedural_envs_are_not_capped(tiny_policy):
    env = make_env("counting")
    assert env.num_tasks("eval") is None


ROOT = Path(__file__).resolve().parent.parent


def test_a_tracker_asked_for_but_not_installed_stops_before_training(tiny_model_dir, tmp_path):
    """`report_to: [tensorboard]` without the package trained with no tracker and only accelerate's
    warning (48bbbf8); now one line names the package, before any model loads."""
    hide = "import sys; sys.modules['tensorboard'] = sys.modules['tensorboardX'] = None; "
    run = "from mmgrpo.cli.app import main; sys.exit(main(sys.argv[1:]))"
    args = [str(ROOT / "examples" / "counting_tiny.yaml"), "--no-progress"]
    for s in (
        f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "logging.report_to=[tensorboard]",
    ):
        args += ["--set", s]
    res = subprocess.run(
        [sys.executable, "-c", hide + run, "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode != 0
    assert (
        "logging.report_to lists tensorboard, which is not installed: pip install tensorboard" in res.stderr
    )
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_on_a_read_only_model_folder_prints_the_accuracy_then_one_line(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """A read-only model folder: eval ran to the end, then died writing eval.json before printing the
    accuracy (48bbbf8). Now the accuracy comes first, then one line saying eval.json could not be written."""
    import errno

    from mmgrpo.cli.app import main
    from mmgrpo.rollout import evaluation as evaluate_module

    def read_only(result, where):
        raise OSError(errno.EROFS, "Read-only file system", str(where))

    monkeypatch.setattr(evaluate_module, "write_eval", read_only)
    code = main(
        [
            "eval",
            str(ROOT / "examples" / "counting_tiny.yaml"),
            "--model",
            str(tiny_model_dir),
            "-n",
            "4",
            "--no-progress",
            "--set",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1
    assert "accuracy: " in out and "(n=4)" in out
    lines = [x for x in err.splitlines() if x.startswith("mmgrpo: error")]
    assert lines == [
        f"mmgrpo: error: could not write eval.json into {tiny_model_dir} (Read-only file system); the accuracy "
        "above is the result. To keep it in a file, copy the model to a folder you can write to and evaluate "
        "that one."
    ]
