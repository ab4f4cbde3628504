"""Generation behind one interface (mmgrpo.model.turn_engines): the rollout sends turns and takes sampled turns
back, whichever engine samples them. A scripted engine stands in for one whose requests end on their own
(vLLM): episodes do not wait for each other's tools; a batching engine gets each turn of all live episodes at
once. The in-process engine gives the rollout's episodes unchanged (tests/test_kv_turns.py compares its two
ways of continuing a turn)."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
import torch

from mmgrpo.env import ChatEnv, system, user
from mmgrpo.model import turn_engines
from mmgrpo.model.turn_engines import InProcessTurns, Sampling, TurnResult, turn_engine
from mmgrpo.rollout.episodes import rollout

ROOT = Path(__file__).resolve().parents[1]


class SlowToolEnv(ChatEnv):
    """Three policy turns; the env of task seed 0's first episode takes ``delay`` seconds per step."""

    delay = 0.0
    log: list = []

    def __init__(self, slow: bool = False) -> None:
        self.slow = slow

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return [system("Answer."), user(f"task {seed}")], {"answer": "1"}

    def step(self, action):
        self.turn += 1
        if self.slow:
            time.sleep(self.delay)
        SlowToolEnv.log.append(("stepped", id(self), self.turn, time.perf_counter()))
        if self.turn >= 3:
            return [], 1.0, True, False, {}
        return [user(f"go on {self.turn}")], 0.0, False, False, {}


class ScriptedEngine:
    """An engine whose every request ends at once with the policy's end-of-turn id: records what it was sent."""

    def __init__(self, policy, batches: bool) -> None:
        self.policy, self.batches_turns = policy, batches
        self.sent: list[list[int]] = []  # rows of each submit call
        self.times: dict[tuple[int, int], float] = {}  # (row, its turn) -> when it was sampled
        self.queue: list = []
        self.lock = threading.Lock()

    def begin(self, prompt_ids, prompt_mask, vision, group_size):
        self.prompts = prompt_ids.shape[0]

    def submit(self, requests):
        self.sent.append([r.row for r in requests])
        self.queue += requests

    def poll(self):
        time.sleep(0.005)
        out, self.queue = self.queue, []
        for r in out:
            turn = sum(r.row in s for s in self.sent)
            self.times[(r.row, turn)] = time.perf_counter()
        eot = self.policy.end_of_turn_id
        return [TurnResult(r.row, [7, eot], True, [-1.0, -0.5]) for r in out]

    def end(self):
        pass


def _run(policy, monkeypatch, batches: bool, delay: float):
    engine = ScriptedEngine(policy, batches)
    monkeypatch.setattr("mmgrpo.rollout.episodes.turn_engine", lambda *a, **k: engine)
    SlowToolEnv.delay, SlowToolEnv.log = delay, []
    envs = [SlowToolEnv(slow=(i == 0)) for i in range(4)]
    batch = rollout(policy, envs, [0, 1], group_size=2, max_turns=3, max_new_tokens=4)
    return engine, batch


def test_requests_that_end_on_their_own_let_episodes_go_on_while_a_tool_runs(tiny_policy, monkeypatch):
    engine, batch = _run(tiny_policy, monkeypatch, batches=False, delay=0.3)
    assert [t.turns for t in batch.trajectories] == [3, 3, 3, 3]
    # every other episode had its three turns sampled before the slow episode's first tool answered
    slow_turn_2 = engine.times[(0, 2)]
    assert all(engine.times[(row, 3)] < slow_turn_2 for row in (1, 2, 3))
    # the trained ids are the sampled ids, the sampler's log-probs kept on them and NaN on the env's tokens
    t = batch.trajectories[1]
    policy_tokens = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
    assert policy_tokens == [7, tiny_policy.end_of_turn_id] * 3
    kept = [x for x, m in zip(t.sampled_logp, t.loss_mask, strict=True) if m]
    assert kept == [-1.0, -0.5] * 3
    assert all(x != x for x, m in zip(t.sampled_logp, t.loss_mask, strict=True) if not m)


def test_a_batching_engine_gets_each_turn_of_every_live_episode_at_once(tiny_policy, monkeypatch):
    engine, batch = _run(tiny_policy, monkeypatch, batches=True, delay=0.05)
    assert engine.sent == [[0, 1, 2, 3]] * 3  # turn by turn, rows in order, each turn after every env answered
    assert [t.turns for t in batch.trajectories] == [3, 3, 3, 3]


def test_the_in_process_engine_samples_turn_one_for_every_episode_together(tiny_policy):
    ids = torch.tensor([[1, 2, 3]])
    engine = InProcessTurns(tiny_policy, Sampling())
    engine.begin(ids, torch.ones_like(ids), turn_engines.VisionInputs.none(1), 2)
    engine.submit([turn_engines.TurnRequest(row=1, group=0, response_ids=[], max_tokens=2)])
    with pytest.raises(ValueError, match="turn 1 is sampled for all 2 episodes at once"):
        engine.poll()


def test_budgets_cut_each_row_of_a_batched_turn(tiny_policy):
    """Rows asking for fewer tokens than the batch's longest end at their own budget, unfinished."""
    torch.manual_seed(0)
    ids = torch.tensor([[5, 6, 7, 8]])
    engine = turn_engine(tiny_policy, Sampling(temperature=1.0), keep_cache=False)
    tiny_policy.stop_ids, old = [], list(tiny_policy.stop_ids)  # no stop: every row runs to its budget
    try:
        engine.begin(ids, torch.ones_like(ids), turn_engines.VisionInputs.none(1), 2)
        engine.submit(
            [turn_engines.TurnRequest(row=r, group=0, response_ids=[], max_tokens=n) for r, n in ((0, 5), (1, 5))]
        )
        first = engine.poll()
        engine.submit(
            [
                turn_engines.TurnRequest(row=0, group=0, response_ids=first[0].ids, max_tokens=2),
                turn_engines.TurnRequest(row=1, group=0, response_ids=first[1].ids, max_tokens=6),
            ]
        )
        second = engine.poll()
    finally:
        tiny_policy.stop_ids = old
    assert [len(r.ids) for r in first] == [5, 5]
    assert [(r.row, len(r.ids), r.finished) for r in second] == [(0, 2, False), (1, 6, False)]
    assert [len(r.logprobs) for r in second] == [2, 6]


def test_the_rollout_reaches_the_model_only_through_the_engine_interface():
    """mmgrpo.rollout imports from mmgrpo.model only the batch layout, the Policy and the turn engines: no
    decode loop, cache, adapter or vLLM part (the rollout does not reach into the engine)."""
    allowed = {"mmgrpo.model.batch", "mmgrpo.model.policy", "mmgrpo.model.turn_engines"}
    seen = set()
    for path in (ROOT / "mmgrpo" / "rollout").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmgrpo.model"):
                seen.add(node.module)
            elif isinstance(node, ast.Import):
                seen |= {a.name for a in node.names if a.name.startswith("mmgrpo.model")}
    assert seen <= allowed, sorted(seen - allowed)
