"""The AdamW of every training stage: fused where torch's kernel applies, the same updates as the loop."""

from __future__ import annotations

import torch

from mmgrpo.train.optim import adamw, fusable


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))


def test_fused_steps_equal_the_per_tensor_loop():
    fused_model, loop_model = _model(0), _model(0)
    groups = lambda m: [{"params": [m[0].weight, m[0].bias], "lr": 3e-3}, {"params": list(m[2].parameters())}]  # noqa: E731
    fused = adamw(groups(fused_model), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    loop = torch.optim.AdamW(groups(loop_model), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    moved = (fused_model[0].weight - _model(0)[0].weight).abs().max()
    assert moved > 1e-3  # the updates did something
    for a, b in zip(fused_model.parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_what_takes_the_fused_kernel():
    w = torch.nn.Parameter(torch.zeros(3))
    assert fusable([w]) and fusable([w.detach()])
    assert not fusable([])
    assert not fusable([torch.zeros(3, dtype=torch.int64)])

    class Sharded(torch.Tensor):  # a tensor subclass, as FSDP2's DTensor parameters are
        pass

    sharded = torch.zeros(3).as_subclass(Sharded).requires_grad_()
    assert not fusable([sharded]) and not fusable([w, sharded])
    assert adamw([sharded], lr=1e-3).defaults["fused"] is None  # torch's own default (the loop)


def test_the_trainer_steps_with_it(tiny_model_dir, tmp_path):
    from pathlib import Path

    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    sets = [
        f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "grpo.steps=1",
        "warm_start.steps=0",
    ]
    trainer = Trainer(load_config(root / "examples" / "counting_tiny.yaml", sets), progress=False)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper, or torch's
    assert inner.defaults["fused"] is True
