"""What a newcomer meets on the command line (issue 17, items 2, 4, 5, 10): one writer per run, Ctrl-C,
CPU threads, full or read-only disks, wrong paths, a seed out of range, ``--version``, readable weights.

The hostile cases run ``python -m mmgrpo`` as a user does; faults that cannot be made for real (a full
disk, a read-only filesystem, as root) are injected in-process through ``mmgrpo.cli.app.main``.
"""

from __future__ import annotations

import errno
import importlib.util
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
COUNTING = str(ROOT / "examples" / "counting_tiny.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def mmgrpo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmgrpo", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def popen(*args: str) -> subprocess.Popen:
    """``mmgrpo ARGS`` as a user starts it from a terminal: with Ctrl-C's default disposition (a test run
    started in the background by a shell inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt)."""
    cmd = [sys.executable, "-m", "mmgrpo", *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def error_lines(stderr: str) -> list[str]:
    """mmgrpo's own lines (transformers' progress bars also write to stderr)."""
    return [line for line in stderr.splitlines() if line.startswith("mmgrpo")]


# ------------------------------------------------------------------------------ item 2: one writer per run
def test_two_trains_started_at_once_into_one_folder_one_stops_naming_the_other(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train", COUNTING, "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}"]
    args += ["--set", "warm_start.steps=0", "--set", "grpo.steps=1000", "--no-progress"]
    a, b = popen(*args), popen(*args)
    try:
        deadline = time.monotonic() + 90
        while a.poll() is None and b.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        done = [p for p in (a, b) if p.poll() is not None]
        assert done, "both runs are training into one folder"
        loser = done[0]
        winner = b if loser is a else a
        err = loser.stderr.read()
        assert loser.returncode == 2 and "Traceback" not in err, err[-2000:]
        (line,) = error_lines(err)
        assert f"output_dir '{out}' is in use by `mmgrpo train` (pid {winner.pid} on " in line
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()  # SIGKILL: the winner leaves its lock file behind, held by no one
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()
    # the next command takes the dead run's lock over, says so, and goes on to its own checks
    res = mmgrpo(*args, "--resume")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert f"took over the lock of '{out}' left by pid {winner.pid}" in lines[0]
    assert "holds no complete checkpoint-N" in lines[1] and len(lines) == 2
    assert not (out / ".mmgrpo.lock").exists()


def test_the_lock_belongs_to_the_launch_main_process_and_is_released(tmp_path, monkeypatch):
    from mmgrpo.cli.run_lock import LOCK_NAME, RunLock, RunLockedError

    out = tmp_path / "run"
    monkeypatch.setenv("RANK", "1")  # a non-main process of `accelerate launch`: its rank 0 holds the lock
    with RunLock(out, "mmgrpo train"):
        assert not (out / LOCK_NAME).exists()
    monkeypatch.setenv("RANK", "0")
    with RunLock(out, "mmgrpo train"):
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "mmgrpo train"
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):  # a second holder, even here
            RunLock(out, "mmgrpo sft").acquire()
    assert not out.exists()  # created by the lock, left without a file: removed


def test_a_holder_that_writes_its_details_a_moment_late_is_still_named(tmp_path, monkeypatch):
    """The holder writes pid and command just after taking the lock; on a loaded machine a second command can
    find the lock held and the file still empty (CI once did): it waits a moment for them."""
    import fcntl
    import threading

    from mmgrpo.train import run_lock

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / run_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing written yet
    record = {"pid": 4242, "host": "box", "command": "mmgrpo train", "since": 0}
    late = threading.Timer(0.4, lambda: os.pwrite(fd, json.dumps(record).encode(), 0))
    late.start()
    try:
        with pytest.raises(run_lock.RunLockedError, match=r"in use by `mmgrpo train` \(pid 4242 on box"):
            run_lock.RunLock(out, "mmgrpo sft").acquire()
        os.ftruncate(fd, 0)  # a holder that never writes: named as one that is starting, after the wait
        monkeypatch.setattr(run_lock, "HOLDER_WAIT_S", 0.1)
        with pytest.raises(run_lock.RunLockedError, match="another process \\(it is starting"):
            run_lock.RunLock(out, "mmgrpo sft").acquire()
    finally:
        late.join()
        os.close(fd)


def test_sft_refuses_a_folder_that_holds_a_run_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "config.json").write_text('{"earlier": true}')
    config = str(ROOT / "examples" / "sft_counting_tiny.yaml")
    res = mmgrpo("sft", config, "--set", f"output_dir={out}", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    (line,) = error_lines(res.stderr)
    assert f"output_dir '{out}' already holds a run (final)" in line and "--overwrite" in line
    assert "--resume" not in line  # sft has no --resume
    assert (out / "final" / "config.json").read_text() == '{"earlier": true}'


def test_sft_overwrite_replaces_the_run_and_its_weights_are_readable_by_all(tiny_model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_counting_sft", ROOT / "examples" / "make_counting_sft.py"
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    (data,) = maker.make_counting_sft(tmp_path / "data", n=4)
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "config.json").write_text('{"earlier": true}')
    sets = [f"model.path={tiny_model_dir}", f"sft.data={data}", "sft.eval_data=''", f"output_dir={out}"]
    sets += ["sft.steps=1", "sft.batch_size=2"]
    argv = ["sft", str(ROOT / "examples" / "sft_counting_tiny.yaml"), "--overwrite", "--no-progress"]
    assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 0
    final = out / "final"
    assert "earlier" not in (final / "config.json").read_text()
    # safetensors >= 0.8 writes 0600 through a temporary file; the weights get the mode config.json got
    assert (final / "model.safetensors").stat().st_mode & 0o777 == (
        final / "config.json"
    ).stat().st_mode & 0o777


# -------------------------------------------------------------------- item 5: threads and Ctrl-C
def test_the_default_cpu_threads_leave_half_the_cores():
    from mmgrpo.cli.threads import default_cpu_threads

    # a busy 2-core machine: one thread (two made a GRPO step 2-13x slower than one)
    assert [default_cpu_threads(c) for c in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4, 4]
    assert default_cpu_threads(16, processes=4) == 2 and default_cpu_threads(2, processes=2) == 1


def test_cpu_threads_come_from_the_flag_then_omp_num_threads_then_the_default(monkeypatch, capsys):
    import torch

    import mmgrpo.train.threads as threads
    from mmgrpo.cli.app import build_parser

    before = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(threads, "cpu_cores", lambda: 8)
    monkeypatch.setattr(threads, "_THREADS_SAID", False)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        threads.set_cpu_threads(None)  # the user's OMP_NUM_THREADS: torch has read it; nothing to do or say
        assert torch.get_num_threads() == before and capsys.readouterr().err == ""
        monkeypatch.delenv("OMP_NUM_THREADS")
        threads.set_cpu_threads(None)
        assert torch.get_num_threads() == 4
        assert capsys.readouterr().err == (
            "mmgrpo: 4 CPU threads (8 cores; --threads N or OMP_NUM_THREADS=N to change)\n"
        )
        threads.set_cpu_threads(None)  # said once
        assert capsys.readouterr().err == ""
        threads.set_cpu_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    args = build_parser().parse_args(["train", COUNTING, "--threads", "2"])
    assert args.threads == 2


def test_ctrl_c_in_the_demo_is_one_line_exit_130_and_keeps_the_built_model(tmp_path):
    out = tmp_path / "demo"
    demo = popen("demo", "--out", str(out), "--no-progress", "--processes", "1")
    try:
        first = demo.stdout.readline()  # "demo: built the tiny Qwen2.5-VL in ...": now it loads and evaluates
        assert first.startswith("demo: built the tiny"), first + demo.stderr.read()[-2000:]
        time.sleep(1.0)
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 130 and "Traceback" not in err, err[-3000:]
    (line,) = error_lines(err)
    assert line == (
        f"mmgrpo: demo interrupted; the run is not saved; kept the tiny model that sees in {out / 'tiny-model-sees'} "
        "(a new demo reuses it)"
    )
    assert (out / "tiny-model-sees" / "model.safetensors").is_file() and not (out / ".mmgrpo.lock").exists()


def test_ctrl_c_while_the_model_loads_is_one_line_exit_130(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import mmgrpo.train.trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmgrpo.train.trainer, "load_policy", interrupted)
    out = tmp_path / "new" / "run"
    sets = ["--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}"]

    def run(*argv: str) -> int:
        try:
            return main(list(argv))
        except KeyboardInterrupt:  # caught here, or pytest would stop the whole session
            pytest.fail("Ctrl-C escaped mmgrpo.cli.app.main as a traceback")

    assert run("train", COUNTING, *sets, "--no-progress") == 130
    assert capsys.readouterr().err == "\nmmgrpo: interrupted; nothing saved\n"
    assert not (tmp_path / "new").exists()  # the folders the run created for itself are gone
    assert run("eval", COUNTING, "--model", str(tiny_model_dir), *sets, "--no-progress") == 130
    assert capsys.readouterr().err == "\nmmgrpo: interrupted; nothing saved\n"


# ------------------------------------------------------------- item 4: tiny-model on a full disk
def test_tiny_model_on_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch, capsys):
    import transformers.modeling_utils

    def full(tensors, filename, metadata=None):  # config.json is written by then, as on a real disk
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    new = tmp_path / "new"
    assert main(["tiny-model", str(new)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (
        f"mmgrpo: error: cannot write the tiny model to '{new}': No space left on device; free some space or "
        "choose a folder on another disk. Nothing was left half-written."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no new/, no new.partial/
    earlier = tmp_path / "earlier"  # a folder that already holds a model keeps it
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    assert main(["tiny-model", str(earlier), "--text-only"]) == 2
    assert [p.name for p in earlier.iterdir()] == ["config.json"] and (
        earlier / "config.json"
    ).read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]


# ------------------------------------------------------------------------- item 10: still tracebacks
def test_tiny_model_into_a_file_is_one_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    res = mmgrpo("tiny-model", str(path))
    assert res.returncode == 2 and res.stderr == (
        f"mmgrpo: error: '{path}' is a file, not a folder: give a new folder path for the tiny model\n"
    )
    assert path.read_text() == "mine"


def test_tiny_model_into_a_read_only_folder_is_one_line(tmp_path, monkeypatch, capsys):
    read_only = tmp_path / "ro"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # root ignores permissions: a read-only filesystem is simulated
        if read_only in (self, *self.parents):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(["tiny-model", str(read_only / "model")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"mmgrpo: error: cannot write the tiny model to '{read_only / 'model'}': Read-only file system; choose "
        "a folder you can write to. Nothing was left half-written."
    )


def _a_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward": 0.1 * s, "loss": 1.0 / s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_out_where_nothing_can_be_written_is_one_line(tmp_path):
    res = mmgrpo("plot", str(_a_run(tmp_path)), "--out", "/sys/curves.png")  # refused even to root
    assert res.returncode == 2 and res.stderr == (
        "mmgrpo: error: cannot write the learning curves to '/sys/curves.png': Permission denied; choose a "
        "folder you can write to. Nothing was left half-written.\n"
    )


def test_plot_on_a_full_disk_keeps_the_earlier_picture(tmp_path, monkeypatch, capsys):
    from PIL import Image

    run = _a_run(tmp_path)
    (run / "curves.png").write_bytes(b"earlier")

    def full(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full)
    assert main(["plot", str(run)]) == 2
    assert "cannot write the learning curves" in capsys.readouterr().err
    assert (run / "curves.png").read_bytes() == b"earlier"
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_a_run_that_fails_before_writing_leaves_no_output_dir(tmp_path):
    out = tmp_path / "runs" / "first"
    res = mmgrpo(
        "train", COUNTING, "--set", f"model.path={tmp_path / 'no-model'}", "--set", f"output_dir={out}"
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_a_seed_out_of_range_is_one_line_naming_the_key(tmp_path):
    res = mmgrpo(
        "train", COUNTING, "--set", "seed=100000000000000000000", "--set", f"output_dir={tmp_path / 'r'}"
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    (line,) = error_lines(res.stderr)
    assert line.startswith("mmgrpo: error: --set seed=100000000000000000000: 'seed' must be ")
    assert not (tmp_path / "r").exists()


def test_version():
    from importlib.metadata import version

    res = mmgrpo("--version")
    assert res.returncode == 0 and res.stdout == f"mmgrpo {version('mmgrpo')}\n"


def test_tiny_model_weights_are_readable_like_its_other_files(tiny_model_dir):
    mode = (tiny_model_dir / "config.json").stat().st_mode & 0o777
    assert (tiny_model_dir / "model.safetensors").stat().st_mode & 0o777 == mode


def test_several_values_after_one_set_get_a_hint(capsys, tmp_path):
    """``--set a=1 b=2`` (as a shell user might write it) names the strays and says how to write them."""
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--out", str(tmp_path), "--set", "grpo.steps=5", "grpo.lr=1e-4", "seed=2"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and not any(tmp_path.iterdir())
    assert "unrecognized arguments: grpo.lr=1e-4 seed=2; --set takes one KEY=VALUE each" in err
    assert "write --set grpo.lr=1e-4 --set seed=2" in err
    with pytest.raises(SystemExit):  # another stray argument: argparse's own line, no hint
        main(["demo", "--out", str(tmp_path), "--bogus"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "--set takes" not in err


def test_a_demo_of_only_its_warm_start_ends_without_curves(tmp_path, capsys):
    """``--set grpo.steps=0`` (the warm start alone, e.g. to see what it teaches) ends with its accuracy
    lines; there are no GRPO steps to draw, so no curves.png (it used to fail on the empty metrics)."""
    sets = ["grpo.steps=0", "warm_start.steps=2", "warm_start.check_tasks=0", "eval.episodes=4"]
    sets.append("eval.batch_size=4")
    argv = ["demo", "--task", "text_math", "--out", str(tmp_path), "--processes", "1", "--no-progress"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "demo: accuracy before=" in out and "0 GRPO steps" in out
    assert (tmp_path / "run" / "demo.json").is_file() and not (tmp_path / "run" / "curves.png").exists()
