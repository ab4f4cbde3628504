"""Rows with distinct prompts that open alike (a warm start's batch) encode each opening once
(mmgrpo.model.openings): the same log-probs and gradients as one full forward per row."""

from __future__ import annotations

import random

import pytest
import torch

from mmgrpo.envs.tool_math import ToolMathEnv
from mmgrpo.envs.zoom_count import ZoomCountEnv
from mmgrpo.model import engine, openings, system_prefix
from mmgrpo.model.policy import Policy
from mmgrpo.train.warmstart import demonstration_batch


def _pass(policy: Policy, batch, share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs on the loss mask (summed: the loss's gradient) and every gradient, one way or the other."""
    openings.SHARE_OPENINGS = share
    try:
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        mask = batch.loss_mask.bool()
        logp = policy.logprobs(batch, scored=mask)  # (N, T)
        (logp * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return torch.where(mask, logp.detach(), 0.0), grads
    finally:
        openings.SHARE_OPENINGS = True


def _same_both_ways(policy: Policy, batch) -> None:
    full, g_full = _pass(policy, batch, False)
    shared, g_shared = _pass(policy, batch, True)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    assert g_shared.keys() == g_full.keys() and g_full
    for name, g in g_full.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_zoom_warm_start_batch_of_full_and_bare_prompts(tiny_model_dir, monkeypatch):
    policy = Policy.from_pretrained(tiny_model_dir)
    env = ZoomCountEnv(tools=["zoom"], demo_cell="named")
    bare = [False, True, False, False, True, False]
    batch = demonstration_batch(policy, env, list(range(6)), random.Random(0), bare=bare)
    assert len(set(batch.row_prompts())) == 6 and not batch.vision.empty  # distinct prompts with images
    parts = openings.opening_parts(batch, policy.adapter)
    assert parts is not None and ([0, 2, 3, 5], True) in parts  # the full prompts share their opening
    calls = []
    shared = engine.response_blocks_shared
    monkeypatch.setattr(engine, "response_blocks_shared", lambda *a, **k: calls.append(a[3]) or shared(*a, **k))
    _same_both_ways(policy, batch)
    assert calls == [1]  # one shared pass, one row per prompt


def test_text_tool_prompts_share_their_schema(tmp_path):
    from mmgrpo.tiny.text import build_tiny_text_model

    policy = Policy.from_pretrained(build_tiny_text_model(tmp_path / "text"))
    batch = demonstration_batch(policy, ToolMathEnv(), list(range(5)), random.Random(1), share_prefix=False)
    parts = openings.opening_parts(batch, policy.adapter)
    assert parts == [([0, 1, 2, 3, 4], True)]
    _same_both_ways(policy, batch)


@pytest.mark.parametrize("rows", [1, 2])
def test_nothing_shared_where_nothing_is_worth_it(tiny_model_dir, rows):
    policy = Policy.from_pretrained(tiny_model_dir)
    env = ZoomCountEnv(tools=["zoom"])
    batch = demonstration_batch(policy, env, list(range(rows)), random.Random(0), bare=True)
    assert openings.opening_parts(batch, policy.adapter) is None  # one row, or bare prompts' short opening


def _group_pass(policy: Policy, batch, split: bool, share_prompt: bool = True):
    """A GRPO training pass (groups of rows sharing a prompt): log-probs on the loss mask and gradients."""
    system_prefix.SPLIT_OPENINGS = split
    try:
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        mask = batch.loss_mask.bool()
        logp = policy.logprobs(batch, scored=mask, share_prompt=share_prompt)  # (N, T)
        (logp * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return torch.where(mask, logp.detach(), 0.0), grads
    finally:
        system_prefix.SPLIT_OPENINGS = True


@pytest.mark.parametrize("lean_encoder", [True, False])
def test_groups_of_bare_and_full_prompts_encode_each_opening_once(tiny_model_dir, monkeypatch, lean_encoder):
    """The zoom demo's first GRPO steps: groups on bare questions beside groups on full prompts share no
    opening as a batch; split by how they open, the full prompts' opening runs once, and the log-probs
    and gradients are those of one full forward per row; with the lean prompt encoder and with the model's
    own forward (a DDP training pass, where the lean encoder stands aside)."""
    import dataclasses

    from mmgrpo.model import lean_prompt

    if not lean_encoder:
        monkeypatch.setattr(lean_prompt, "for_model", lambda model, adapter: None)
    policy = Policy.from_pretrained(tiny_model_dir)
    env = ZoomCountEnv(tools=["zoom"], demo_cell="named")
    seeds = [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # five groups of two rows
    bare = [False, False, True, True, False, False, True, True, False, False]
    batch = demonstration_batch(policy, env, seeds, random.Random(0), bare=bare, play=env.skill_probe)
    batch = dataclasses.replace(batch, prompt_index=[0, 0, 2, 2, 4, 4, 6, 6, 8, 8])
    assert batch.shared_prompt_runs() == 2 and batch.has_response_images
    parts = []
    real = system_prefix.side_by_side
    monkeypatch.setattr(system_prefix, "side_by_side", lambda p, o: parts.append(o.tolist()) or real(p, o))
    split, g_split = _group_pass(policy, batch, True)
    assert parts == [[0, 2, 4, 1, 3]]  # the three full prompts' part, then the two bare ones
    whole, g_whole = _group_pass(policy, batch, False)
    full, g_full = _group_pass(policy, batch, True, share_prompt=False)  # one forward per row
    assert parts == [[0, 2, 4, 1, 3]]  # only the first pass split
    for got, grads in ((split, g_split), (whole, g_whole)):
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
        assert grads.keys() == g_full.keys() and g_full
        for name, g in g_full.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_rollout_of_bare_and_full_prompts_samples_what_training_reads(tiny_policy, monkeypatch):
    """The rollout of the same mix (the zoom env, half its tasks bare) starts on the parts laid side by
    side, and every episode's sampled ids and log-probs are those of one full forward per row; with the
    prompts encoded whole instead, the same episodes."""
    from mmgrpo.rollout.episodes import rollout
    from tests.test_kv_turns import assert_sampled_is_trained, record_turns

    parts = []
    real = system_prefix.side_by_side
    monkeypatch.setattr(system_prefix, "side_by_side", lambda p, o: parts.append(o.tolist()) or real(p, o))

    def run(split: bool):
        system_prefix.SPLIT_OPENINGS = split
        try:
            envs = [ZoomCountEnv(tools=["zoom"]) for _ in range(12)]
            torch.manual_seed(0)
            bare = [False, True, False, True, False, True]
            seeds = [3, 4, 5, 6, 7, 8]
            kw = {"max_new_tokens": 12, "temperature": 1.0, "max_turns": 2, "bare": bare}
            return rollout(tiny_policy, envs, seeds, group_size=2, **kw)
        finally:
            system_prefix.SPLIT_OPENINGS = True

    record = record_turns(monkeypatch)
    split = run(True)
    assert parts and parts[0] == [0, 2, 4, 1, 3, 5]  # the first turn's prompts: the full ones, then the bare
    assert_sampled_is_trained(tiny_policy, split, record)
    whole = run(False)
    assert [t.response_ids for t in split.trajectories] == [t.response_ids for t in whole.trajectories]


def test_only_caches_with_every_column_are_laid_side_by_side():
    """A part's cache is padded column for column against its mask, so a layer that holds fewer columns (a
    sliding window) or no key tensors (a custom cache) sends the prompts back to the whole encoding."""
    from types import SimpleNamespace

    def cache(*widths):
        kv = [torch.zeros(2, 1, w, 4) for w in widths]  # (B, Hk, columns, D) per layer
        return SimpleNamespace(layers=[SimpleNamespace(keys=k, values=k.clone()) for k in kv])

    assert system_prefix._lays_flat(cache(7, 7), 7)
    assert not system_prefix._lays_flat(cache(7, 5), 7)  # the second layer kept a window of 5
    assert not system_prefix._lays_flat(SimpleNamespace(layers=[SimpleNamespace(keys=None)]), 7)
