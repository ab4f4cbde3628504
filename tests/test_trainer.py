"""Trainer behaviour on the tiny model: micro-batches change memory, not the update; bad episodes are data."""

from __future__ import annotations

import math

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.envs.counting import CountingEnv
from mmgrpo.registry import register_env, register_verifier
from mmgrpo.train.trainer import Trainer

BASE = [
    "grpo.steps=1",
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.max_new_tokens=6",
    "warm_start.steps=0",
    "env.kwargs.max_count=3",
]


def _length_reward(**_):
    return lambda episode: len(episode.completion) / 10  # varies within groups even for a fresh model


@pytest.fixture(autouse=True)
def _register_length_verifier():
    register_verifier("test_length", _length_reward, overwrite=True)  # other tests reset the registry


VARIED = "verifiers=[{name: test_length}]"


def _trainer(tiny_model_dir, tmp_path, *sets: str) -> Trainer:
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", *BASE, *sets])
    return Trainer(cfg, progress=False)


def _step_gradient(trainer: Trainer) -> tuple[torch.Tensor, dict]:
    """Run one train step and return the (clipped) gradient the optimizer applied, and the metrics."""
    grads, step = [], trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.append(
            torch.cat(
                [p.grad.flatten().clone() for p in trainer.policy.model.parameters() if p.grad is not None]
            )
        )
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    record = trainer.train_step()
    return grads[0], record


def test_micro_batch_size_does_not_change_the_update(tiny_model_dir, tmp_path):
    """Whole-batch normalisation: 8 rows in one pass or in micro-batches of 4 (shared prompts) or 3
    (rows that split groups: the full forward) give the same gradient and the same metrics."""
    runs = [
        _step_gradient(
            _trainer(
                tiny_model_dir, tmp_path / f"mb{mb}", f"grpo.micro_batch_size={mb}", "grpo.beta=0.04", VARIED
            )
        )
        for mb in (8, 4, 3)
    ]
    (g8, r8), (g4, r4), (g3, r3) = runs
    assert g8.norm() > 0, "the step must have a gradient"
    torch.testing.assert_close(g4, g8, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(g3, g8, atol=1e-6, rtol=1e-4)
    for key in ("loss", "kl", "reward", "grad_norm"):
        assert abs(r4[key] - r8[key]) < 1e-5 and abs(r3[key] - r8[key]) < 1e-5, key


def test_num_iterations_reuses_rollouts_with_an_importance_ratio(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "grpo.num_iterations=3", "grpo.beta=0.0", "grpo.lr=5e-3", VARIED)
    record = tr.train_step()
    # pass 1 has ratio 1; passes 2 and 3 see the updated policy against the stored old log-probs
    assert record["ratio_mean"] != 1.0
    assert tr.scheduler.get_last_lr()[0] == 5e-3 and tr.optimizer.state  # three optimizer steps ran
    assert tr.policy.reference is None  # beta 0: no reference model at all


class _BrokenStepEnv(CountingEnv):
    def step(self, action):
        if action.count("<") % 2 == 0:
            raise RuntimeError("tool crashed")
        return super().step(action)


def _boom(**_):
    def fn(episode):
        raise ValueError("verifier bug")

    return fn


def test_bad_episodes_are_counted_not_fatal(tiny_model_dir, tmp_path):
    register_env("test_broken_step", _BrokenStepEnv, overwrite=True)
    register_verifier("test_boom", _boom, overwrite=True)
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        "env.name=test_broken_step",
        "verifiers=[{name: number_match}, {name: test_boom}]",
    )
    record = tr.train_step()
    assert record["verifier_failures"] == 8  # every episode, for the broken verifier only
    assert 0 <= record["env_errors"] <= 8
    assert record["reward/test_boom"] == 0.0


def test_output_dir_that_is_a_file_fails_before_the_model_loads(tmp_path):
    from mmgrpo.errors import ConfigError

    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    cfg = load_config(None, [f"model.path={tmp_path / 'no-model'}", f"output_dir={blocker}", *BASE])
    with pytest.raises(ConfigError, match="output_dir '.*taken' is a file, not a directory"):
        Trainer(cfg, progress=False)


def test_cuda_without_a_gpu_is_a_config_error(tmp_path, monkeypatch):
    from mmgrpo.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(
        None, [f"model.path={tmp_path / 'no-model'}", f"output_dir={tmp_path}", "model.device=cuda", *BASE]
    )
    with pytest.raises(ConfigError, match="model.device=cuda, but torch .* sees no CUDA device"):
        Trainer(cfg, progress=False)


def test_a_verifier_failing_on_every_episode_is_reported_once(tiny_model_dir, tmp_path, capsys):
    def broken(**_):
        def fn(episode):
            raise KeyError("label")

        return fn

    register_verifier("test_broken", broken, overwrite=True)
    trainer = _trainer(
        tiny_model_dir, tmp_path, "grpo.steps=2", "verifiers=[{name: test_length}, {name: test_broken}]"
    )
    trainer.train_step()
    trainer.train_step()
    err = capsys.readouterr().err
    assert err.count("step 1: verifier 'test_broken' failed on all 8 episodes, so it scores 0") == 1
    assert err.count("first 'KeyError' failure of verifier 'test_broken'") == 1
    assert "step 2" not in err
    assert "test_broken" in (tmp_path / "warnings.log").read_text()


def test_a_failed_final_save_leaves_the_earlier_one_intact(tiny_model_dir, tmp_path, monkeypatch):
    """The save goes to final.partial and is renamed into place only when whole: a disk that fills up
    halfway leaves no half-written final/ and keeps the previous one."""
    import errno

    from mmgrpo.errors import ConfigError
    from mmgrpo.model import io as model_io

    trainer = _trainer(tiny_model_dir, tmp_path)
    trainer.save(tmp_path / "final")
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    real = model_io.save_model

    def fill_disk(model, processor, out, merged=False, state_dict=None):
        real(
            model, processor, out, merged=merged, state_dict=state_dict
        )  # the weights are written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_io, "save_model", fill_disk)
    with pytest.raises(ConfigError, match="No space left on device.*earlier save .* is intact"):
        trainer.save(tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "final.partial").exists()
    monkeypatch.setattr(model_io, "save_model", real)
    trainer.save(tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("final")) == ["final"]


class _BrokenSeedEnv(CountingEnv):
    """Counting scenes, except that task seeds in ``bad`` cannot be posed."""

    def __init__(self, bad=(1,), **kwargs):
        super().__init__(**kwargs)
        self.bad = set(bad)

    def make_task(self, seed, split):
        if seed in self.bad:
            raise FileNotFoundError(f"scene {seed} is missing")
        return super().make_task(seed, split)


def test_a_task_whose_reset_raises_is_left_out_and_logged(tiny_model_dir, tmp_path, capsys):
    from mmgrpo.registry import register_env

    register_env("test_broken_seed", _BrokenSeedEnv, overwrite=True)
    trainer = _trainer(tiny_model_dir, tmp_path, "env.name=test_broken_seed", VARIED)
    record = trainer.train_step()  # seeds 0 and 1: 1 fails, 0 trains
    assert record["env_reset_failures"] == 1 and 0 <= record["reward"]
    assert "failed to reset task seed 1: FileNotFoundError: scene 1 is missing" in capsys.readouterr().err
    assert "seed 1" in (tmp_path / "warnings.log").read_text()


def test_when_every_task_fails_to_reset_the_error_names_them(tiny_model_dir, tmp_path):
    from mmgrpo.errors import EnvError
    from mmgrpo.registry import register_env

    register_env("test_broken_seed", _BrokenSeedEnv, overwrite=True)
    trainer = _trainer(
        tiny_model_dir, tmp_path, "env.name=test_broken_seed", "env.kwargs={bad: [0, 1]}", VARIED
    )
    with pytest.raises(EnvError, match="raised in reset\\(\\) for every task .*seed 0: FileNotFoundError"):
        trainer.train_step()


class _StepFailsOnSeed(CountingEnv):
    """Counting scenes whose step() raises for the task seeds in ``bad`` (a crashing tool, say)."""

    def __init__(self, bad=(1,), **kwargs):
        super().__init__(**kwargs)
        self.bad, self.seed_now = set(bad), None

    def reset(self, *, seed=None, options=None):
        self.seed_now = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.seed_now in self.bad:
            raise RuntimeError(f"tool crashed on scene {self.seed_now}")
        return super().step(action)


def test_env_step_failures_are_counted_and_logged_and_past_the_share_stop_the_run(
    warm_model_dir, tmp_path, capsys
):
    """The warm-started model ends its turns (a random one is cut at max_new_tokens and never reaches
    env.step), so the env's step runs and raises for seed 1's episodes; the others go on."""
    from mmgrpo.errors import FaultError

    register_env("test_step_fails", _StepFailsOnSeed, overwrite=True)
    sets = ("env.name=test_step_fails", VARIED, "grpo.max_new_tokens=8")
    trainer = _trainer(warm_model_dir, tmp_path, *sets)
    record = trainer.train_step()  # seeds 0 and 1: the stepped episodes of seed 1 end in the env's error
    assert record["env_errors"] >= 1 and record["faults/env_step"] == record["env_errors"]
    assert "raised in step() on task seed 1: RuntimeError: tool crashed on scene 1" in capsys.readouterr().err
    assert "task seed 1" in (tmp_path / "warnings.log").read_text()
    strict = _trainer(warm_model_dir, tmp_path / "strict", *sets, "faults.max_failure_frac=0.1")
    with pytest.raises(FaultError, match="faults.max_failure_frac"):
        strict.train_step()  # at least 1 of 8 episodes > 0.1


def _nan_for_long(**_):
    def fn(episode):
        return float("nan") if len(episode.completion) > 3 else 0.5

    return fn


def test_a_nan_reward_stops_the_run_naming_the_verifier_or_skips_the_batch(tiny_model_dir, tmp_path):
    from mmgrpo.errors import NonFiniteError

    register_verifier("test_nan", _nan_for_long, overwrite=True)
    trainer = _trainer(tiny_model_dir, tmp_path, "verifiers=[{name: test_length}, {name: test_nan}]")
    with pytest.raises(NonFiniteError, match="step 1: verifier 'test_nan' returned nan for"):
        trainer.train_step()
    skipping = _trainer(
        tiny_model_dir,
        tmp_path / "skip",
        "verifiers=[{name: test_length}, {name: test_nan}]",
        "faults.nonfinite=skip",
    )
    before = [p.detach().clone() for p in skipping.policy.model.parameters()]
    record = skipping.train_step()
    assert record["skipped"] == 1 and record["faults/skipped_batches"] == 1 and math.isnan(record["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, skipping.policy.model.parameters(), strict=True))
    assert "skipped" in (tmp_path / "skip" / "warnings.log").read_text()


def test_freeze_embeddings_leaves_them_to_the_warm_start_and_out_of_grpo(tiny_model_dir, tmp_path):
    from mmgrpo.model.adapters import embedding_parameters

    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        VARIED,
        "grpo.freeze_embeddings=true",
        "grpo.steps=2",
        "warm_start.steps=2",
        "warm_start.min_skill=0",
    )
    model = trainer.policy.model
    (emb,) = embedding_parameters(model)  # the tiny model ties its output head to the embedding
    assert model.get_output_embeddings().weight is emb
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(emb) not in in_optimizer and not emb.requires_grad
    layer = model.model.language_model.layers[0].mlp.down_proj.weight
    assert id(layer) in in_optimizer

    start = emb.detach().clone()
    trainer.warm_start()
    assert not torch.equal(emb, start), "the warm start should still train the embeddings"
    assert not emb.requires_grad  # frozen again for GRPO
    warm, warm_layer = emb.detach().clone(), layer.detach().clone()
    trainer.train()
    assert torch.equal(emb, warm)
    assert not torch.equal(layer, warm_layer)


def test_without_freeze_embeddings_grpo_trains_them(tiny_model_dir, tmp_path):
    from mmgrpo.model.adapters import embedding_parameters

    trainer = _trainer(tiny_model_dir, tmp_path, VARIED, "grpo.steps=2")
    (emb,) = embedding_parameters(trainer.policy.model)
    start = emb.detach().clone()
    trainer.train()
    assert emb.requires_grad and not torch.equal(emb, start)
