"""mmgrpo's learning-rate schedules give transformers' factors at every step, and a run no longer imports
transformers.optimization (nor, through it, peft). A resumed run continues its schedule at the right
position when grpo.num_iterations or grpo.steps changed, and refuses a grpo.steps below the steps done."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.train.lr_schedule import lr_factor, make_scheduler

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "steps"), [(0, 10), (3, 10), (5, 5), (0, 1), (4, 37)])
def test_factors_equal_transformers_at_every_step(name, warmup, steps):
    from transformers import get_scheduler

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        sched = make(opt)
        out = []
        for _ in range(steps + 3):  # past the end too
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    theirs_name = "constant_with_warmup" if name == "constant" and warmup > 0 else name
    theirs = lrs(lambda o: get_scheduler(theirs_name, o, num_warmup_steps=warmup, num_training_steps=steps))
    ours = lrs(lambda o: make_scheduler(name, o, warmup_steps=warmup, steps=steps))
    assert ours == pytest.approx(theirs, abs=1e-12)


def test_factor_values_and_unknown_name():
    assert lr_factor("linear", 0, warmup_steps=2, steps=10) == 0.0
    assert lr_factor("linear", 1, warmup_steps=2, steps=10) == 0.5
    assert lr_factor("linear", 6, warmup_steps=2, steps=10) == pytest.approx(0.5)
    assert lr_factor("cosine", 6, warmup_steps=2, steps=10) == pytest.approx(0.5)
    assert lr_factor("constant", 9, warmup_steps=0, steps=10) == 1.0
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        make_scheduler(
            "step", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), warmup_steps=0, steps=3
        )


def test_building_a_trainer_imports_neither_transformers_optimization_nor_peft(tiny_model_dir, tmp_path):
    code = (
        "import sys\n"
        "from mmgrpo import Trainer, load_config\n"
        f"sets = ['model.path={tiny_model_dir}', 'output_dir={tmp_path / 'run'}', 'grpo.lr_schedule=cosine']\n"
        "Trainer(load_config('examples/counting_tiny.yaml', sets), progress=False)\n"
        "print(sorted(m for m in ('transformers.optimization', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------------- resume with another grpo.num_iterations
RESUME_RUN = [  # a linear decay of lr 1e-3 to 0 over 20 steps; no gradients are taken (see _walk)
    "warm_start.steps=0",
    "grpo.lr=1e-3",
    "grpo.lr_schedule=linear",
    "grpo.warmup_steps=0",
    "grpo.steps=20",
    "grpo.tasks_per_step=2",
    "grpo.group_size=2",
    "grpo.keep_checkpoints=3",
]


def _trainer(model, out, *extra):
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    sets = [f"model.path={model}", f"output_dir={out}", *RESUME_RUN, *extra]
    return Trainer(load_config(ROOT / "examples" / "counting_tiny.yaml", sets), progress=False)


def _walk(trainer, steps: int) -> list[float]:
    """The lr logged after each of ``steps`` GRPO steps (Trainer.train_step logs get_last_lr after the
    update), stepping the optimizer and the scheduler num_iterations times per step as the update does;
    without gradients the weights stay, the schedule moves exactly as in training."""
    lrs = []
    for _ in range(steps):
        for _ in range(trainer.cfg.grpo.num_iterations):
            trainer.optimizer.step()
            trainer.scheduler.step()
        trainer.step += 1
        lrs.append(trainer.scheduler.get_last_lr()[0])
    return lrs


@pytest.fixture(scope="module")
def halfway(tiny_model_dir, tmp_path_factory):
    """checkpoint-10 of the 20-step run at 1 and at 2 iterations per step (10 and 20 optimizer steps):
    lr 1e-3 x (20 - 10) / 20 = 5e-4 after step 10 in both. The 1-iteration run also keeps checkpoint-5."""
    found = {}
    for iters in (1, 2):
        trainer = _trainer(
            tiny_model_dir, tmp_path_factory.mktemp("lr") / "run", f"grpo.num_iterations={iters}"
        )
        _walk(trainer, 5)
        trainer.save_checkpoint()
        assert _walk(trainer, 5)[-1] == pytest.approx(5e-4)
        found[iters] = trainer.save_checkpoint()
    return found


@pytest.mark.parametrize(
    ("saved", "changes", "refit", "at_resume", "after_11"),
    [
        # 10 steps of 1 iteration are position 20 of 2 x 20 = 40: lr 1e-3 x 20/40; after step 11, 18/40
        (1, ["grpo.num_iterations=2"], "20 to 40", 20 / 40, 18 / 40),
        (1, ["grpo.num_iterations=2", "grpo.steps=30"], "20 to 60", 40 / 60, 38 / 60),  # position 20 of 60
        (1, ["grpo.num_iterations=2", "grpo.steps=15"], "20 to 30", 10 / 30, 8 / 30),  # 20 of 30
        # 10 steps of 2 iterations (20 optimizer steps) are position 10 of 20 at 1 iteration
        (2, ["grpo.num_iterations=1"], "40 to 20", 10 / 20, 9 / 20),
        (2, ["grpo.num_iterations=1", "grpo.steps=15"], "40 to 15", 5 / 15, 4 / 15),  # 10 of 15
        (2, ["grpo.num_iterations=3", "grpo.steps=30"], "40 to 90", 60 / 90, 57 / 90),  # 30 of 90
        (1, ["grpo.steps=30"], None, 20 / 30, 19 / 30),  # the same iterations: position 10 of 30, as before
    ],
    ids=["1to2", "1to2-steps30", "1to2-steps15", "2to1", "2to1-steps15", "2to3-steps30", "steps30"],
)
def test_resume_with_another_num_iterations_refits_the_schedule(
    tiny_model_dir, tmp_path, halfway, capsys, saved, changes, refit, at_resume, after_11
):
    """The schedule counts optimizer steps (grpo.steps x grpo.num_iterations); resumed with another
    num_iterations, the checkpoint's optimizer steps are converted to the new count, so step 11 trains at
    the new schedule's lr for step 10 and the last step ends the linear decay at 0, with one line saying
    so. Counting them as new ones, 1 -> 2 iterations trained step 11 at 7.5e-4 and ended at 2.5e-4, and
    2 -> 1 trained every remaining step at lr 0."""
    trainer = _trainer(tiny_model_dir, tmp_path / "run", *changes)
    trainer.resume(halfway[saved])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * at_resume)
    logged = _walk(trainer, trainer.cfg.grpo.steps - 10)
    assert logged[0] == pytest.approx(1e-3 * after_11)
    assert logged[-1] == pytest.approx(0.0, abs=1e-12) and min(logged) >= 0.0
    err = capsys.readouterr().err
    refits = [line for line in err.splitlines() if "learning-rate schedule was re-fitted" in line]
    if refit is None:
        assert refits == []
    else:
        assert len(refits) == 1 and f"re-fitted from {refit} optimizer steps" in refits[0], err


def test_resume_with_fewer_steps_than_done_is_refused_by_name(tiny_model_dir, halfway, capsys):
    """grpo.steps below the checkpoint's step: one error line naming the key, the step and the ways out,
    before anything is loaded or written (it trained no step, printed "last reward nan" and exited 0)."""
    from mmgrpo.cli.app import main

    ckpt = halfway[1]
    sets = [f"model.path={tiny_model_dir}", f"output_dir={ckpt.parent}", *RESUME_RUN, "grpo.steps=8"]
    config = str(ROOT / "examples" / "counting_tiny.yaml")
    rc = main(
        ["train", config, *(x for s in sets for x in ("--set", s)), "--no-progress", "--resume", str(ckpt)]
    )
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("mmgrpo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "the checkpoint has done 10 steps and grpo.steps is 8" in lines[0]
    assert "--set grpo.steps=10 or more" in lines[0]
    assert f"or resume from {ckpt.parent / 'checkpoint-5'} (step 5) to end at step 8" in lines[0]
    assert not (ckpt.parent / "final").exists()
