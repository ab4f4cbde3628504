"""Rows with distinct prompts that open alike (a warm start's batch) encode each opening once
(mmgrpo.model.openings): the same log-probs and gradients as one full forward per row."""

from __future__ import annotations

import random

import pytest
import torch

from mmgrpo.envs.tool_math import ToolMathEnv
from mmgrpo.envs.zoom_count import ZoomCountEnv
from mmgrpo.model import engine, openings
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
