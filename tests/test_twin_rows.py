"""Rows identical in everything a later turn's block reads run that block once (turns.FEED_TWINS_ONCE): the
same episodes as feeding every row, and the sampled log-probs are what training reads."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.model import turns
from mmgrpo.rollout.episodes import rollout
from tests.test_kv_turns import per_episode, record_turns
from tests.test_multiturn import ZoomOnceEnv


def _greedy(policy, seeds, with_image, temperature=0.0):
    """Greedy turns: the G rows of a group are twins through every turn (the late zoom run's case)."""
    envs = [ZoomOnceEnv(with_image=with_image, turns_before_end=1 + i % 2) for i in range(4 * len(seeds))]
    torch.manual_seed(0)
    return rollout(policy, envs, seeds, group_size=4, max_new_tokens=8, temperature=temperature, max_turns=3)


@pytest.fixture
def greedy_stops(tiny_policy):
    """The random model's greedy turn is one id repeated; with that id a stop id, greedy turns end."""
    old = list(tiny_policy.stop_ids)
    first = _greedy(tiny_policy, [3], False).trajectories[0].response_ids[0]
    tiny_policy.stop_ids = sorted(set(old) | {first})
    yield tiny_policy
    tiny_policy.stop_ids = old


@pytest.fixture
def fed(monkeypatch):
    """The number of rows each later turn's blocks ran, call by call."""
    rows: list[int] = []
    real = turns.TurnDecoder._feed

    def counting(self, st, pending, vision, room):
        rows.append(len(pending))
        return real(self, st, pending, vision, room)

    monkeypatch.setattr(turns.TurnDecoder, "_feed", counting)
    return rows


@pytest.mark.parametrize("with_image", [False, True])
def test_twins_run_the_block_once_with_the_same_episodes(greedy_stops, fed, monkeypatch, with_image):
    runs, counts = [], []
    for once in (True, False):
        monkeypatch.setattr(turns, "FEED_TWINS_ONCE", once)
        fed.clear()
        runs.append(_greedy(greedy_stops, [3, 8], with_image))
        counts.append(list(fed))
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]
    assert [t.loss_mask for t in runs[0].trajectories] == [t.loss_mask for t in runs[1].trajectories]
    assert max(t.turns for t in runs[0].trajectories) == 3
    # turn 2: 8 rows (2 groups of 4 twins) fed as 2; turn 3: the 4 rows still going (2 per group) as 2
    assert sum(counts[1]) == 12 and sum(counts[0]) == 4, counts


def test_sampled_logprobs_of_twins_are_what_training_reads(greedy_stops, monkeypatch):
    """Sampled rows after a block run once for their twins: ids and log-probs equal training's forward."""
    record = record_turns(monkeypatch)
    twins = []
    real = turns.TurnDecoder._twins
    monkeypatch.setattr(turns.TurnDecoder, "_twins", lambda self, *a: twins.append(r := real(self, *a)) or r)
    batch = _greedy(greedy_stops, [5, 6], True)
    assert any(t is not None for t in twins)
    sampled, sampled_ids = per_episode(record), per_episode(record, 2)
    with torch.no_grad():
        trained = greedy_stops.logprobs(batch.tokens, share_prompt=False)  # (N, T) one full forward per row
    for i, t in enumerate(batch.trajectories):
        where = [k for k, m in enumerate(t.loss_mask) if m]
        assert [t.response_ids[k] for k in where] == sampled_ids[i]
        assert torch.allclose(trained[i, where], torch.tensor(sampled[i]), atol=1e-5), i


def test_rows_that_differ_are_fed_each(greedy_stops, fed):
    """Sampled at temperature 1 the rows of a group differ after turn 1: no twins, every row fed."""
    batch = _greedy(greedy_stops, [3, 8], True, temperature=1.0)
    later = [len(t.response_ids) for t in batch.trajectories if t.turns >= 2]
    assert len(set(map(tuple, (t.response_ids for t in batch.trajectories)))) == len(batch.trajectories)
    assert fed and fed[0] == len(later)
