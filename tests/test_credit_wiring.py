"""grpo.credit in the trainer (mmgrpo.train.credit): the trajectories' per-turn rewards and state keys reach the
turn-level advantage math (mmgrpo.grpo.turn_credit, tested against plain loops in tests/test_turn_credit.py),
and a training run on the bare FrozenLake trains on per-token advantages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmgrpo.config import load_config
from mmgrpo.grpo import turn_credit
from mmgrpo.rollout.episodes import Trajectory
from mmgrpo.train import credit


def _traj(group: int, rewards: list[float], states: list, turns: int) -> Trajectory:
    return Trajectory(
        group=group, task={}, messages=[], completion="", response_ids=[], loss_mask=[],
        turn_rewards=rewards, turns=turns, turn_states=states,
    )  # fmt: skip


def _batch(trajs, loss_mask):
    return SimpleNamespace(
        trajectories=trajs,
        group_size=2,
        group_ids=[t.group for t in trajs],
        tokens=SimpleNamespace(loss_mask=torch.tensor(loss_mask)),
    )


G = SimpleNamespace(
    credit="episode", credit_gamma=0.9, credit_omega=1.0, credit_norm="position", scale="std_unbiased"
)
MASK = [[1, 1, 0, 1, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 0], [1, 0, 1, 0, 1]]  # 2, 2, 1, 3 policy turns


def _trajs():
    return [
        _traj(0, [0.0, 1.0], ["a", "b"], 2),
        _traj(0, [0.0, 0.0], ["a", "c"], 2),
        _traj(1, [], ["x"], 1),  # cut at max_new_tokens: the env never answered its turn
        _traj(1, [0.5, 0.0], ["x", "y"], 3),  # its last turn cut too: two rewards for three turns
    ]


def test_episode_credit_leaves_the_advantages_as_they_are():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = credit.assign(G, _batch(_trajs(), MASK), adv, torch.zeros(4), torch.ones(4, dtype=torch.bool))
    assert out is adv


def test_discounted_credit_pads_unanswered_turns_with_zero_and_spreads_per_token():
    g = SimpleNamespace(**{**vars(G), "credit": "discounted"})
    rewards, valid = torch.tensor([1.0, 0.0, 0.0, 0.5]), torch.ones(4, dtype=torch.bool)
    out = credit.assign(g, _batch(_trajs(), MASK), torch.zeros(4), rewards, valid)
    per_turn, turn_valid = turn_credit.pad_turns([[0.0, 1.0], [0.0, 0.0], [0.0], [0.5, 0.0, 0.0]])
    want_turns = turn_credit.discounted_turn_advantages(
        per_turn, turn_valid, 2, group_ids=[0, 0, 1, 1], gamma=0.9, episode_rewards=rewards, valid=valid
    )
    want = turn_credit.spread_turn_advantages(want_turns, torch.tensor(MASK))
    assert out.shape == (4, 5) and torch.equal(out, want)
    assert (out[torch.tensor(MASK) == 0] == 0).all()
    # both turns of the episode that reached the reward carry its (discounted) return, the other's do not
    assert out[0, 0] > 0 > out[1, 0] and out[0, 3] > 0 > out[1, 2]


def test_gigpo_credit_groups_turns_by_the_envs_state_and_a_missing_state_groups_alone():
    g = SimpleNamespace(**{**vars(G), "credit": "gigpo"})
    episode_adv = torch.tensor([0.7, -0.7, 0.0, 0.0])
    rewards, valid = torch.tensor([1.0, 0.0, 0.0, 0.5]), torch.ones(4, dtype=torch.bool)
    out = credit.assign(g, _batch(_trajs(), MASK), episode_adv, rewards, valid)
    keys = [["a", "b"], ["a", "c"], ["x"], ["x", "y", ("no state", 3, 2)]]
    per_turn, turn_valid = turn_credit.pad_turns([[0.0, 1.0], [0.0, 0.0], [0.0], [0.5, 0.0, 0.0]])
    want_turns = turn_credit.gigpo_turn_advantages(
        episode_adv,
        per_turn,
        turn_valid,
        keys,
        2,
        group_ids=[0, 0, 1, 1],
        gamma=0.9,
        episode_rewards=rewards,
        valid=valid,
    )
    assert torch.equal(out, turn_credit.spread_turn_advantages(want_turns, torch.tensor(MASK)))
    assert credit.state_keys(3, ["x", ["unhashable"]], 3) == ["x", "['unhashable']", ("no state", 3, 2)]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("credit") / "model")


@pytest.mark.parametrize("scheme", ["gigpo", "discounted"])
def test_a_run_on_the_bare_frozenlake_trains_on_per_turn_advantages(
    text_model, tmp_path, monkeypatch, scheme
):
    from mmgrpo.train.trainer import Trainer

    cfg = load_config(
        "examples/frozenlake_bare_tiny.yaml",
        overrides=[
            f"model.path={text_model}", f"output_dir={tmp_path / 'run'}", "warm_start.steps=0",
            "grpo.steps=2", "grpo.tasks_per_step=2", "grpo.group_size=4", f"grpo.credit={scheme}",
            "env.max_turns=3", "env.kwargs.max_steps=3",
        ],
    )  # fmt: skip
    seen = []
    assign = credit.assign

    def spy(g, batch, adv, rewards, valid):
        out = assign(g, batch, adv, rewards, valid)
        seen.append((batch, out))
        return out

    monkeypatch.setattr(credit, "assign", spy)
    trainer = Trainer(cfg, progress=False)
    try:
        for _ in range(2):
            record = trainer.train_step()
            assert torch.isfinite(torch.tensor(record["loss"]))
    finally:
        trainer.close()
    for batch, out in seen:
        assert out.shape == batch.tokens.loss_mask.shape  # (N, T): per token
        assert (out[batch.tokens.loss_mask == 0] == 0).all()
        for t in batch.trajectories:  # the grid each turn answered, from reset and each step
            assert len(t.turn_states) >= t.turns and all("P" in s for s in t.turn_states)
