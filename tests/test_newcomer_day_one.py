"""More of what a newcomer met on the first day (issue 54's sixteen), each where the user meets it: an env whose
reset raises during the warm start, ``--resume`` of a run that has done all its steps, Ctrl-C during
``tiny-model --sees --pretrain`` and during ``mmgrpo sft``, progress bars in a redirected log, and an optional
package that is installed but broken. Each is one line that says what happened and what was kept, or the
behaviour a user expects.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgrpo.cli.app import main

ROOT = Path(__file__).resolve().parent.parent
TEXT_MATH = str(ROOT / "examples" / "text_math_tiny.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SMALL = ["grpo.tasks_per_step=2", "grpo.group_size=2", "eval.episodes=4", "warm_start.batch_size=4"]


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mmgrpo: error")]


def _sets(*items: str) -> list[str]:
    return [x for item in (*SMALL, *items) for x in ("--set", item)]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("text") / "model")


# ---------------------------------------------------------------- an env whose reset raises in the warm start
@pytest.fixture
def flaky_env():
    """env 'flaky_reset': text_math whose reset raises for every seed (fail=all) or every third (fail=some)."""
    from mmgrpo.registry import ENVS, make_env, register_env

    def factory(fail: str = "all", **kwargs):
        env = make_env("text_math", **kwargs)
        reset = env.reset

        def failing(seed=None, options=None):
            if fail == "all" or (seed or 0) % 3 == 0:
                raise RuntimeError("the task database is unreachable")
            return reset(seed=seed, options=options)

        env.reset = failing
        return env

    register_env("flaky_reset", factory, overwrite=True)
    yield "flaky_reset"
    ENVS._entries.pop("flaky_reset", None)


def test_a_warm_start_that_cannot_pose_any_task_is_one_line(text_model, tmp_path, flaky_env, capsys):
    args = ["train", TEXT_MATH, "--no-progress"]
    args += _sets(f"model.path={text_model}", f"output_dir={tmp_path / 'run'}", f"env.name={flaky_env}")
    assert main([*args, "--set", "warm_start.steps=2", "--set", "env.kwargs.fail=all"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = _errors(err)  # a 30-line traceback through example_pool before
    assert line.startswith("mmgrpo: error: warm start: env TextMathEnv raised in reset() for every task")
    assert "first: seed 10000000: RuntimeError: the task database is unreachable" in line


def test_a_warm_start_leaves_out_the_tasks_the_env_cannot_pose(text_model, tmp_path, flaky_env, capsys):
    out = tmp_path / "run"
    args = ["train", TEXT_MATH, "--no-progress"]
    args += _sets(
        f"model.path={text_model}", f"output_dir={out}", f"env.name={flaky_env}", "env.kwargs.fail=some"
    )
    args += _sets("warm_start.steps=2", "warm_start.check_tasks=6", "warm_start.min_skill=0", "grpo.steps=1")
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    assert not _errors(capsys.readouterr().err)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("stage") == "warm_start"] == [1, 2]


# ------------------------------------------------------------------- --resume of a run with all steps done
def test_resume_with_every_step_done_says_so_and_changes_nothing(text_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", TEXT_MATH, "--no-progress"]
    args += _sets(f"model.path={text_model}", f"output_dir={out}", "warm_start.steps=0", "grpo.save_every=1")
    assert main([*args, "--set", "grpo.steps=2"]) == 0
    capsys.readouterr()
    final = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "final").iterdir()}
    metrics = (out / "metrics.jsonl").read_text()
    last = [json.loads(x) for x in metrics.splitlines() if "stage" not in json.loads(x)][-1]

    assert main([*args, "--set", "grpo.steps=2", "--resume"]) == 0
    captured = capsys.readouterr()
    said = [x for x in captured.err.splitlines() if "nothing to do" in x]
    assert said == [
        f"mmgrpo: nothing to do: the run in {out} already has 2 steps (grpo.steps=2) and its model in "
        f"{out / 'final'}; nothing was changed. To train on, raise grpo.steps: --set grpo.steps=3 --resume"
    ]
    assert "nan" not in captured.out  # "last reward nan" before
    assert f"last reward {last['reward']:.3f}" in captured.out
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "final").iterdir()} == final
    assert (out / "metrics.jsonl").read_text() == metrics

    # fewer steps than done: refused in one line, nothing written
    assert main([*args, "--set", "grpo.steps=1", "--resume"]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert "the checkpoint has done 2 steps and grpo.steps is 1" in line
    assert (out / "metrics.jsonl").read_text() == metrics


# -------------------------------------------------------------------- Ctrl-C during tiny-model --pretrain
def test_ctrl_c_during_the_pretraining_keeps_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    import mmgrpo.tiny.perception as perception

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(perception, "pretrain_perception", interrupted)
    out = tmp_path / "sees"
    assert main(["tiny-model", str(out), "--sees", "--pretrain"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mmgrpo: interrupted while building the tiny model; nothing saved ({out} not created, the partial "
        f"folder {out}.partial removed)"
    )
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_ctrl_c_after_the_model_is_saved_says_where_it_is(tmp_path, monkeypatch, capsys):
    import mmgrpo.cli.commands as commands

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "tiny_model_summary", interrupted)  # Ctrl-C while the summary is drawn
    out = tmp_path / "text"
    assert main(["tiny-model", str(out), "--text-only"]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last == f"mmgrpo: interrupted; the tiny model is complete and saved in {out}"
    )  # "nothing saved" before
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))


# ---------------------------------------------------------------------------------- Ctrl-C in mmgrpo sft
def test_ctrl_c_in_sft_keeps_the_model_so_far_and_says_where(text_model, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"{i}+1?", "response": f"<answer>{i + 1}</answer>"}) + "\n"
            for i in range(32)
        )
    )
    out = tmp_path / "sft"
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        f"model: {{path: {text_model}}}\noutput_dir: {out}\nenv: {{name: text_math}}\n"
        f"verifiers: [{{name: number_match}}]\nsft: {{data: {data}, steps: 100000, batch_size: 4, log_every: 1}}\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo", "sft", str(cfg), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and p.poll() is None:
            if metrics.exists() and '"loss"' in metrics.read_text():
                break
            time.sleep(0.2)
        assert p.poll() is None, p.stderr.read()[-2000:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("mmgrpo: sft interrupted after step ") and " of 100000; " in last, last
    assert last.endswith(f"the model so far is in {out / 'interrupted'} (use it as model.path)")
    kept = out / "interrupted"
    assert (kept / "config.json").is_file() and any(kept.glob("*.safetensors"))  # "no model saved" before


# ------------------------------------------------------------------------------ progress in a redirected log
def test_a_redirected_log_has_no_carriage_returns_and_errors_start_their_line(text_model, tmp_path):
    log = tmp_path / "train.log"
    args = [sys.executable, "-m", "mmgrpo", "train", TEXT_MATH]  # no --no-progress: stderr is a file
    args += _sets(f"model.path={text_model}", f"output_dir={tmp_path / 'run'}", "warm_start.steps=2")
    with log.open("w") as f:  # the warm start's check fails (0.5 of skill after 2 steps is out of reach)
        res = subprocess.run(args, stdout=subprocess.PIPE, stderr=f, text=True, env=ENV, timeout=300)
    text = log.read_text()
    assert res.returncode == 2, text[-2000:]
    assert "\r" not in text  # the bars' frames, onto which the error line was glued before
    assert text.count("mmgrpo: error") == len(_errors(text)) == 1
    assert "Loading weights" not in text  # transformers' bars too


def test_grpo_writes_a_whole_line_every_tenth_of_the_run(capsys):
    from types import SimpleNamespace

    from mmgrpo.train.progress import ProgressLines, bars_wanted

    trainer = SimpleNamespace(cfg=SimpleNamespace(grpo=SimpleNamespace(steps=25)), step=0)
    lines = ProgressLines()
    for step in range(1, 26):
        lines.on_step_end(trainer, {"step": step, "reward": 0.5, "kl": 0.001})
    err = capsys.readouterr().err.splitlines()
    assert [x.split(":")[0] for x in err] == [
        f"grpo step {k}/25" for k in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25)
    ]
    assert err[-1] == "grpo step 25/25: reward 0.5, kl 0.001"
    assert not bars_wanted(True, open(os.devnull, "w")) and not bars_wanted(False)


# ---------------------------------------------------------------------- an optional package installed but broken
def test_a_broken_optional_package_is_one_line_naming_it_and_the_extra(
    text_model, tmp_path, monkeypatch, capsys
):
    broken = tmp_path / "site" / "reasoning_gym"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import json\njson.no_such_attribute\n")  # fails as it is imported
    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = str(ROOT / "examples" / "reasoning_gym_tiny.yaml")
    assert (
        main(
            ["train", config, "--set", f"model.path={text_model}", "--set", f"output_dir={tmp_path / 'run'}"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err  # an AttributeError's traceback before
    (line,) = _errors(err)
    assert line == (
        f"mmgrpo: error: env 'reasoning_gym': the installed reasoning-gym package ({broken / '__init__.py'}) "
        "fails to import: AttributeError: module 'json' has no attribute 'no_such_attribute'. Reinstall it, or "
        "the package it names, with: pip install 'mmgrpo[reasoning-gym]' (or pip install reasoning-gym)"
    )


def test_a_factory_whose_import_fails_is_one_line_naming_the_package(monkeypatch):
    from mmgrpo.errors import ConfigError
    from mmgrpo.registry import ENVS, make_env, register_env

    def factory():
        import mmgrpo_no_such_package  # noqa: F401

    register_env("needs_missing", factory)
    try:
        with pytest.raises(
            ConfigError,
            match=r"env 'needs_missing' \(registered in code\) could not import mmgrpo_no_such_package",
        ):
            make_env("needs_missing")
    finally:
        ENVS._entries.pop("needs_missing", None)


# --------------------------------------------------------------------- accelerate launch, 2 processes, warm start
def _launch_train(tmp_path: Path, model: Path, *sets: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``mmgrpo train`` (text_math) on 2 CPU processes (torchrun's launcher, gloo)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    cmd += ["-m", "mmgrpo", "train", TEXT_MATH, "--no-progress"]
    cmd += _sets(
        f"model.path={model}", f"output_dir={tmp_path / 'run'}", "warm_start.steps=2", "grpo.steps=1", *sets
    )
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_a_text_env_on_the_vlm_warm_starts_on_two_processes(tiny_model_dir, tmp_path):
    # the VLM's vision tower trains (freeze_vision: false) and sees no image: inside DDP the warm start's
    # second step stopped with "parameters that were not used in producing loss"
    res = _launch_train(tmp_path, tiny_model_dir, "warm_start.min_skill=0", "model.freeze_vision=false")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "not used in producing loss" not in res.stderr
    assert "train: 1 steps" in res.stdout


def test_a_failed_warm_start_check_on_two_processes_is_said_once(tiny_model_dir, tmp_path):
    res = _launch_train(tmp_path, tiny_model_dir)  # 2 steps teach nothing: the check (0.5) fails
    assert res.returncode != 0
    assert len(_errors(res.stderr)) == 1, res.stderr[-4000:]  # once per process before
    assert "the warm start did not teach the skill GRPO needs" in _errors(res.stderr)[0]
    # torchrun's summary names the line as the root cause ("To enable traceback see: ..." before)
    assert "traceback : mmgrpo: error: the warm start did not teach the skill" in res.stderr
