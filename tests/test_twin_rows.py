"""Rows identical in everything a later turn's block reads run that block once (turns.FEED_TWINS_ONCE): the
same episodes as feeding every row, and the sampled log-probs are what training reads."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.model import turns
from mmgrpo.rollout.episodes import rollout
from tests.test_kv_turns import assert_sampled_is_trained, record_turns
from tests.test_multiturn import ZoomOnceEnv


def _greedy(policy, seeds, with_image, temperature=0.0):
    """Greedy turns: the G rows of a group are twins through every turn (the late zoom run's case)."""
    envs = [ZoomOnceEnv(with_image=with_image, turns_before_end=1 + i % 2) for i in range(4 * len(seeds))]
    torch.manual_seed(0)
    return rollout(policy, envs, seeds, group_size=4, max_new_tokens=8, temperature=temperature, max_turns=3)


@pytest.fixture
def greedy_stops(tiny_policy):
    """Stop ids a random model samples often, and its greedy turn's id (one id repeated), so that greedy and
    sampled turns alike end within their budget and episodes go on to later turns."""
    old = list(tiny_policy.stop_ids)
    vocab = tiny_policy.model.config.get_text_config().vocab_size
    first = _greedy(tiny_policy, [3], False).trajectories[0].response_ids[0]
    tiny_policy.stop_ids = sorted(set(old) | set(range(40, vocab, 3)) | {first})
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


def _policy_turns(t) -> list[tuple[int, ...]]:
    """An episode's policy turns: the runs of its response ids that the loss mask marks."""
    out, run = [], []
    for i, m in zip(t.response_ids, t.loss_mask, strict=True):
        if m:
            run.append(i)
        elif run:
            out.append(tuple(run))
            run = []
    return out + [tuple(run)] if run else out


def _feeds(batch) -> tuple[int, int]:
    """Later-turn rows to feed: every row's (turns 2..T), and the distinct ones -- rows of a group whose
    earlier turns are the same ids (the env's messages are the same for a group's rows at a turn)."""
    every, distinct = 0, set()
    for t in batch.trajectories:
        done = _policy_turns(t)
        for k in range(2, t.turns + 1):
            every += 1
            distinct.add((t.group, k, tuple(done[: k - 1])))
    return every, len(distinct)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_image", [False, True])
def test_twins_run_the_block_once_with_the_same_episodes(
    greedy_stops, fed, monkeypatch, with_image, temperature
):
    runs, counts = [], []
    for once in (True, False):
        monkeypatch.setattr(turns, "FEED_TWINS_ONCE", once)
        fed.clear()
        runs.append(_greedy(greedy_stops, [3, 8], with_image, temperature))
        counts.append(sum(fed))
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]
    assert [t.loss_mask for t in runs[0].trajectories] == [t.loss_mask for t in runs[1].trajectories]
    every, distinct = _feeds(runs[0])
    assert every >= 6  # later turns really ran
    assert counts == [distinct, every], (counts, distinct, every)
    if temperature == 0:  # greedy: a group's rows are twins at every turn, so fewer rows were fed
        assert distinct < every


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_logprobs_of_twins_are_what_training_reads(greedy_stops, monkeypatch, temperature):
    """Sampled rows after a block run once for their twins: ids and log-probs equal training's forward."""
    record = record_turns(monkeypatch)
    twins = []
    real = turns.TurnDecoder._twins
    monkeypatch.setattr(turns.TurnDecoder, "_twins", lambda self, *a: twins.append(r := real(self, *a)) or r)
    batch = _greedy(greedy_stops, [5, 6], True, temperature)
    assert temperature > 0 or any(t is not None for t in twins)
    assert_sampled_is_trained(greedy_stops, batch, record)
