"""The env lifecycle in training: every env the trainer makes is closed once, when the run ends normally,
on an error in the loop and on Ctrl-C, the warm start's and each evaluation's envs too; a single-turn env's
own metrics reach the metrics log; the format warm start renders the tool schemas GRPO's prompts show."""

from __future__ import annotations

import json

import pytest

from mmgrpo.env import SingleTurnEnv, Task, system, user
from mmgrpo.registry import register_env


class ClosingProbe(SingleTurnEnv):
    """A one-question env that counts its close() calls and reports the answer's length as a metric."""

    made: list[ClosingProbe] = []

    def __init__(self) -> None:
        self.closed = 0
        ClosingProbe.made.append(self)

    def make_task(self, seed: int, split: str) -> Task:
        return Task(
            [system("Answer inside <answer></answer>."), user(f"Say {seed % 3}.")], {"answer": str(seed % 3)}
        )

    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "metrics": {"chars": len(action)}}

    def close(self) -> None:
        self.closed += 1
        super().close()


@pytest.fixture
def probe_config(tmp_path, tiny_model_dir):
    from mmgrpo.config.core import load_config

    register_env("closing_probe", ClosingProbe, overwrite=True)
    ClosingProbe.made = []

    def config(*sets: str):
        (tmp_path / "run.yaml").write_text(
            f"""
seed: 0
output_dir: {tmp_path / "out"}
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
env: {{name: closing_probe}}
verifiers: [{{name: exact_match}}]
warm_start: {{steps: 0, batch_size: 2, check_tasks: 2, min_skill: 0}}
eval: {{episodes: 2, batch_size: 2, max_new_tokens: 4}}
grpo: {{steps: 2, tasks_per_step: 2, group_size: 2, max_new_tokens: 4, micro_batch_size: 4}}
"""
        )
        return load_config(tmp_path / "run.yaml", list(sets))

    return config


def closes() -> list[int]:
    return [env.closed for env in ClosingProbe.made]


def test_every_env_is_closed_once_after_warm_start_eval_and_training(probe_config, tmp_path):
    from mmgrpo.train.trainer import Trainer

    trainer = Trainer(probe_config("warm_start.steps=1", "grpo.eval_every=1"), progress=False)
    # the config check's env and the batch-size check's (each closed at once), and the rollout's 2 x 2
    assert closes() == [1, 1, 0, 0, 0, 0]
    trainer.warm_start()  # its env and its skill check's: closed when it ends
    assert len(ClosingProbe.made) == 8 and closes() == [1, 1, 0, 0, 0, 0, 1, 1]
    sample = trainer.policy.generate

    def finishing(*args, **kwargs):  # every turn ends (the tiny model seldom stops within 4 tokens), so
        ids, finished = sample(*args, **kwargs)  # that every episode reaches env.step
        return ids, [True] * len(finished)

    trainer.policy.generate = finishing
    trainer.train()  # an evaluation per step (2 envs each, closed by it); the rollout's at the end
    assert len(ClosingProbe.made) == 12 and closes() == [1] * 12
    trainer.close()  # again: nothing left to close
    assert closes() == [1] * 12
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if "stage" not in r]
    assert [r["step"] for r in grpo] == [1, 2]
    for r in grpo:  # the single-turn env's own metric: the mean length of the 4 answers, in characters
        assert r["env/chars"] > 0 and r["env/chars"] * 4 == int(r["env/chars"] * 4)
        assert "turns" not in r  # the multi-turn counters stay out of single-turn runs


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_envs_are_closed_on_an_error_and_on_ctrl_c_in_the_loop(probe_config, error):
    from mmgrpo.train.trainer import Trainer

    trainer = Trainer(probe_config(), progress=False)
    train_step, calls = trainer.train_step, []

    def failing_second_step():
        calls.append(1)
        if len(calls) == 2:
            raise error
        return train_step()

    trainer.train_step = failing_second_step
    with pytest.raises(type(error)):
        trainer.train()
    assert trainer.step == 1 and closes() == [1, 1, 1, 1, 1, 1]  # the two checks' and the rollout's four
    assert len(trainer.envs) == 4 and closes() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]  # used again: new ones
    trainer.close()
    assert closes() == [1] * 10


def test_ctrl_c_in_the_warm_start_closes_every_env(probe_config, monkeypatch):
    from mmgrpo.train import warm_check
    from mmgrpo.train.trainer import Trainer

    trainer = Trainer(probe_config("warm_start.steps=1"), progress=False)

    def interrupted(policy, make_env, *args, **kwargs):
        make_env()
        raise KeyboardInterrupt

    monkeypatch.setattr(warm_check, "warm_start_and_check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.warm_start()
    assert closes() == [1] * 7  # the two checks', the rollout's four and the warm start's


def test_the_format_warm_start_renders_the_tool_schemas(tiny_policy, monkeypatch):
    """The warm start's prompts carry the tools block GRPO's rollout renders (Policy.encode_prompts with the
    env's info["tools"]), token for token."""
    from mmgrpo.envs.tool_math import ToolMathEnv
    from mmgrpo.rollout.episodes import reset_group
    from mmgrpo.train import warmstart

    batches = []
    supervised_batch = warmstart.supervised_batch

    def spy(policy, prompts, targets, tools=None):
        batches.append((prompts, tools, supervised_batch(policy, prompts, targets, tools)))
        return batches[-1][2]

    monkeypatch.setattr(warmstart, "supervised_batch", spy)
    tiny_policy.model.float()
    warmstart.warm_start(
        tiny_policy,
        ToolMathEnv,
        steps=1,
        lr=0.0,
        batch_size=2,
        template="<answer>{random}</answer>",
        low=0,
        high=9,
        seed=0,
        progress=False,
    )
    prompts, tools, batch = batches[0]
    assert tools is not None and all(t and t[0]["function"]["name"] for t in tools)
    env = ToolMathEnv()
    obs, info = reset_group([env], 10_000_000, "train")  # the warm start's first task
    ids, mask, _ = tiny_policy.encode_prompts([obs], [info["tools"]])  # as the rollout renders it
    first = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
    assert first == ids[0][mask[0].bool()].tolist()
    assert info["tools"][0]["function"]["name"] in tiny_policy.tokenizer.decode(first)
