"""mmgrpo's learning-rate schedules give transformers' factors at every step, and a run no longer imports
transformers.optimization (nor, through it, peft)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mmgrpo.train.lr_schedule import lr_factor, make_scheduler


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
