"""grpo.bare_steps: the first steps roll out bare prompts, then the warm start's drills run again on full
prompts (until their check passes), then GRPO goes on with full prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmgrpo.config.core import load_config
from mmgrpo.train import trainer as trainer_module
from mmgrpo.train.trainer import Trainer

DRILL_CHECK = ("warm_start.batch_size=2", "warm_start.check_tasks=2", "warm_start.check_every=1")


def _sets(model_dir: Path, tmp_path: Path, *more: str) -> list[str]:
    """A few-step run of the zoom example on the tiny model: 2 tasks x G=2, 8 new tokens, no evaluations,
    no warm start before GRPO (Trainer.train runs a configured one), no bare drills; ``more`` adds keys."""
    common = ["grpo.tasks_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=8", "grpo.eval_every=0"]
    common.append("warm_start.steps=0")
    return [
        f"model.path={model_dir}",
        f"output_dir={tmp_path / 'run'}",
        *common,
        "warm_start.drill_bare_steps=0",
        *more,
    ]


def test_bare_steps_then_full_prompt_drills_then_full_steps(tiny_model_dir, tmp_path, monkeypatch):
    sets = _sets(
        tiny_model_dir,
        tmp_path,
        "grpo.steps=3",
        "grpo.bare_steps=1",
        "grpo.bare_share=1",
        "warm_start.drill_steps=2",
        "warm_start.min_skill=0.0",
        *DRILL_CHECK,
    )
    cfg = load_config("examples/tools_zoom_tiny.yaml", sets)
    assert cfg.grpo.lr_schedule == "linear"
    trainer = Trainer(cfg, progress=False)
    bare_flags, drills = [], []
    real_rollout, real_warm_start = trainer_module.rollout, Trainer.warm_start

    def spy_rollout(*args, bare=False, **kw):
        batch = real_rollout(*args, bare=bare, **kw)
        prompts_have_images = not batch.tokens.vision.empty
        bare_flags.append((all(bare), prompts_have_images, trainer.step + 1))  # grpo.bare_share 1: every task
        return batch

    def spy_warm_start(self, w=None, stage=""):
        drills.append((self.step, w.steps, w.drill_bare_steps, w.drill_steps, stage))
        return real_warm_start(self, w, stage)

    monkeypatch.setattr(trainer_module, "rollout", spy_rollout)
    monkeypatch.setattr(Trainer, "warm_start", spy_warm_start)
    trainer.train()
    # step 1 bare (no image in the prompts), steps 2-3 full; the drills once, between steps 1 and 2
    assert bare_flags == [(True, False, 1), (False, True, 2), (False, True, 3)]
    assert drills == [(1, 0, 0, 2, "full_prompt_drills")]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stages = [r.get("stage") for r in records if str(r.get("stage", "")).startswith("full_prompt_drills")]
    assert "full_prompt_drills" in stages and "full_prompt_drills_check" in stages
    lrs = [r["lr"] for r in records if "lr" in r and "stage" not in r]
    # one linear schedule over all three steps (the rate each step leaves for the next); restarting it at
    # the switch was tried on the zoom agent and collapsed its answers (docs/agents.md)
    assert lrs == pytest.approx([cfg.grpo.lr * 2 / 3, cfg.grpo.lr / 3, 0.0])


def test_bare_share_poses_that_share_of_the_tasks_bare_during_the_bare_steps(
    tiny_model_dir, tmp_path, monkeypatch
):
    """grpo.bare_share 0.5: about half of each bare step's tasks bare (by seed), the others full; after
    bare_steps every task full."""
    sets = _sets(
        tiny_model_dir,
        tmp_path,
        "grpo.steps=3",
        "grpo.bare_steps=2",
        "grpo.bare_share=0.5",
        "grpo.tasks_per_step=4",
        "warm_start.drill_steps=0",
    )
    trainer = Trainer(load_config("examples/tools_zoom_tiny.yaml", sets), progress=False)
    seen = []
    real_rollout = trainer_module.rollout

    def spy_rollout(policy, envs, seeds, *args, bare=False, **kw):
        batch = real_rollout(policy, envs, seeds, *args, bare=bare, **kw)
        per_seq = batch.tokens.vision.images_per_seq  # the prompts' images, per row (or per task)
        per = len(per_seq) // len(seeds)
        images = [per_seq[b * per] > 0 for b in range(len(seeds))]
        seen.append((list(seeds), list(bare), images))
        return batch

    monkeypatch.setattr(trainer_module, "rollout", spy_rollout)
    trainer.train()
    # seeds 0-3, 4-7 bare by the golden-ratio rule (0, 2, 4, 5 and 7 of them), 8-11 all full
    assert [flags for _, flags, _ in seen] == [
        [True, False, True, False],
        [True, True, False, True],
        [False] * 4,
    ]
    assert all(
        has_image == (not flag)
        for _, flags, images in seen
        for flag, has_image in zip(flags, images, strict=True)
    )


@pytest.mark.parametrize("rate_at_switch", [0.5, 1.0])
def test_the_switch_checks_first_and_drills_only_when_the_skill_is_short(
    tiny_model_dir, tmp_path, monkeypatch, rate_at_switch
):
    """At the switch the check on full prompts runs first: at min_skill the drills are skipped (drilling a
    policy that already passes cost the zoom agent's seed 0 its answers), below it they run until it passes."""
    from mmgrpo.train import warm_check
    from mmgrpo.train.warm_check import SkillCheck

    sets = _sets(
        tiny_model_dir,
        tmp_path,
        "grpo.steps=2",
        "grpo.bare_steps=1",
        "warm_start.drill_steps=4",
        "warm_start.min_skill=0.9",
        *DRILL_CHECK,
    )
    trainer = Trainer(load_config("examples/tools_zoom_tiny.yaml", sets), progress=False)
    rates = iter([rate_at_switch, 0.5, 1.0])  # the check before drilling, then after drill steps 1 and 2
    checked = []

    def fake_check(policy, make_env, **kw):
        checked.append(kw["tasks"])
        return SkillCheck("the skill", int(2 * next(rates)), 2)

    monkeypatch.setattr(warm_check, "check_skill", fake_check)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    drill_steps = [r["step"] for r in records if r.get("stage") == "full_prompt_drills"]
    checks = [(r["step"], r["rate"]) for r in records if r.get("stage") == "full_prompt_drills_check"]
    if rate_at_switch >= 0.9:
        assert drill_steps == [] and checks == [(0, 1.0)] and checked == [2]
    else:
        assert drill_steps == [1, 2] and checks == [(0, 0.5), (1, 0.5), (2, 1.0)]
    assert all(r["grpo_step"] == 1 for r in records if str(r.get("stage", "")).startswith("full_prompt"))
    assert [r["step"] for r in records if "lr" in r and "stage" not in r] == [1, 2]


def test_a_micro_batch_without_images_gives_the_trained_vision_tower_zero_gradients(tiny_policy):
    """DDP's buckets need every trainable parameter's gradient on every process: a micro-batch without an
    image adds 0 x the vision parameters (microbatch.idle_vision); one with images adds nothing."""
    import random

    from mmgrpo.envs.zoom_count import ZoomCountEnv
    from mmgrpo.train.microbatch import idle_vision
    from mmgrpo.train.warmstart import demonstration_batch

    env = ZoomCountEnv(call_prob=0.0)  # answers at once: no zoomed image
    bare = demonstration_batch(tiny_policy, env, [0, 1], random.Random(0), bare=True)
    full = demonstration_batch(tiny_policy, env, [0, 1], random.Random(0))
    assert bare.vision.empty and not bare.has_response_images and not full.vision.empty
    assert idle_vision(tiny_policy, full) == 0.0
    touch = idle_vision(tiny_policy, bare)
    assert float(touch.detach()) == 0.0 and touch.requires_grad
    model = tiny_policy.model
    vision = [p for n, p in model.named_parameters() if tiny_policy.adapter.is_vision_param(n)]
    model.zero_grad(set_to_none=True)
    touch.backward()
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision if p.requires_grad)
    model.zero_grad(set_to_none=True)


def test_two_processes_train_bare_steps_with_the_vision_tower_trained(tiny_model_dir, tmp_path):
    """Bare prompts hold no image, and the tiny model's answers without a call hold none either: on 2
    processes (DDP) with model.freeze_vision false, steps without images must still sync (before
    microbatch.idle_vision: "Expected to have finished reduction" on the second step, or the processes'
    collectives out of step when only one of them had an image)."""
    from test_distributed import _launch

    sets = _sets(
        tiny_model_dir,
        tmp_path,
        "grpo.steps=3",
        "grpo.bare_steps=2",
        "warm_start.steps=0",
        "warm_start.drill_steps=0",
        "warm_start.bare_share=0",
    )
    config = Path(__file__).resolve().parents[1] / "examples" / "tools_zoom_tiny.yaml"
    args = [
        "-m",
        "mmgrpo.cli.processes",
        str(config),
        *(x for s in sets for x in ("--set", s)),
        "--no-progress",
    ]
    _launch(tmp_path, args)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "lr" in r] == [1, 2, 3]
    assert (tmp_path / "run" / "final").is_dir()


def test_a_switch_whose_drills_fail_keeps_the_bare_steps_in_a_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    """WarmStartError at the switch writes checkpoint-{bare_steps} first and names it (the bare steps are
    the run's longest phase); a resume from it runs the drills again."""
    from mmgrpo.errors import WarmStartError
    from mmgrpo.train import warm_check
    from mmgrpo.train.warm_check import SkillCheck

    sets = _sets(
        tiny_model_dir,
        tmp_path,
        "grpo.steps=2",
        "grpo.bare_steps=1",
        "warm_start.drill_steps=2",
        "warm_start.min_skill=0.9",
        *DRILL_CHECK,
    )
    cfg = load_config("examples/tools_zoom_tiny.yaml", sets)
    monkeypatch.setattr(warm_check, "check_skill", lambda *a, **kw: SkillCheck("the skill", 0, 2))
    with pytest.raises(WarmStartError, match=r"after grpo.bare_steps, on full prompts: .*checkpoint-1"):
        Trainer(cfg, progress=False).train()
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    again = Trainer(cfg, progress=False)
    again.resume(tmp_path / "run" / "checkpoint-1")
    monkeypatch.setattr(warm_check, "check_skill", lambda *a, **kw: SkillCheck("the skill", 2, 2))
    again.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "lr" in r and "stage" not in r] == [1, 2]
    # the failed run's checks (before drilling, after drill steps 1 and 2) stay on record; then the resume's
    checks = [r["rate"] for r in records if r.get("stage") == "full_prompt_drills_check"]
    assert checks == [0.0, 0.0, 0.0, 1.0]
