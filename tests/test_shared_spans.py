"""Response openings a group's rows share run once in the training pass (mmgrpo.model.shared_spans): the
same log-probs, entropies and gradients as the model's own forward over each whole row."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mmgrpo.envs.tool_math import ToolMathEnv
from mmgrpo.envs.zoom_count import ZoomCountEnv
from mmgrpo.model import engine, shared_spans
from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.policy import Policy
from mmgrpo.tools.calls import tool_call_text
from mmgrpo.train.warmstart import demonstration_batch


def _grouped(batch, G: int):
    """The batch's rows as groups of G consecutive rows sharing a prompt (as a GRPO step lays them out)."""
    vision = VisionInputs.none(len(batch)) if batch.vision.empty else batch.vision
    return dataclasses.replace(batch, vision=vision, prompt_index=[r - r % G for r in range(len(batch))])


def _pass(policy: Policy, batch, how: str, scored: bool, entropy: bool):
    """Log-probs (and entropies) on the loss mask and every gradient of their sum: ``how`` = "spans" (the
    shared spans), "prompt" (each group's prompt once, whole responses) or "full" (the model's forward)."""
    shared_spans.SHARE_SPANS = how == "spans"
    try:
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        mask = batch.loss_mask.bool()
        out = policy.logprobs(
            batch,
            share_prompt=how != "full",
            scored=mask if scored else None,
            with_entropy=entropy,
            entropy_grad=entropy,
        )
        logp, ent = out if entropy else (out, torch.zeros_like(out))
        ((logp + 0.1 * ent) * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return torch.where(mask, logp.detach(), 0.0), torch.where(mask, ent.detach(), 0.0), grads
    finally:
        shared_spans.SHARE_SPANS = True


def _same(policy: Policy, batch, scored: bool = True, entropy: bool = False) -> None:
    lp, ent, grads = _pass(policy, batch, "spans", scored, entropy)
    for how in ("full", "prompt"):
        lp_ref, ent_ref, g_ref = _pass(policy, batch, how, scored, entropy)
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
        assert grads.keys() == g_ref.keys() and grads
        for name, g in g_ref.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{how}: {name}")


def _zoom_batch(policy: Policy, plays: list[list]) -> object:
    """One zoom task (seed 3) played as ``plays`` (one list of turns per row), then task 8 the same way."""
    env = ZoomCountEnv(tools=["zoom"], max_count=4)
    turns = iter(plays + plays)
    batch = demonstration_batch(
        policy, env, [3] * len(plays) + [8] * len(plays), random.Random(0), play=lambda info: next(turns)
    )
    return _grouped(batch, len(plays))


def _zoom(cell: int, count: int) -> list:
    return [tool_call_text("zoom", {"cell": cell}), f"<answer>{count}</answer>"]


@pytest.mark.parametrize("scored", [True, False])
def test_zoom_rows_that_make_the_same_call_share_it_and_its_image(tiny_model_dir, monkeypatch, scored):
    """Rows that zoom on the same cell share the call, the tool's message and the zoomed view (the images
    run once, inside the span); a row that answers at once stands alone, and so does one that zooms
    elsewhere (a row takes one span: the three rows save more on their own)."""
    policy = Policy.from_pretrained(tiny_model_dir)
    plays = [_zoom(1, 2), _zoom(1, 3), _zoom(1, 3), ["<answer>1</answer>"], _zoom(7, 2)]
    batch = _zoom_batch(policy, plays)
    assert batch.has_response_images
    plan = shared_spans.plan(batch, len(plays), policy.adapter)
    assert plan is not None
    lengths = plan.length[plan.owner].tolist()  # each row's shared tokens
    assert lengths[0] == lengths[1] == lengths[2] > 40  # call + tool message + view, up to the count
    assert lengths[3] == lengths[4] == 0  # alone (one span per row: the three above save more without it)
    calls = []
    real = engine.response_blocks_shared
    monkeypatch.setattr(engine, "response_blocks_shared", lambda *a, **k: calls.append(1) or real(*a, **k))
    _same(policy, batch, scored=scored)
    assert calls == [1]  # the "prompt" pass only: the spans' pass is not the engine's


def test_zooms_on_different_cells_share_the_call_opening(tiny_model_dir):
    """Rows that zoom on different cells share the call up to the cell; each view runs in its row's tail."""
    policy = Policy.from_pretrained(tiny_model_dir)
    batch = _zoom_batch(policy, [_zoom(1, 2), _zoom(7, 2), _zoom(4, 1), ["<answer>1</answer>"]])
    plan = shared_spans.plan(batch, 4, policy.adapter)
    assert plan is not None
    lengths = plan.length[plan.owner].tolist()
    assert lengths[0] == lengths[1] == lengths[2] and 8 <= lengths[0] < 20 and lengths[3] == 0
    _same(policy, batch, scored=True)


def test_entropy_bonus_through_shared_spans(tiny_model_dir):
    policy = Policy.from_pretrained(tiny_model_dir)
    batch = _zoom_batch(policy, [_zoom(2, 1), _zoom(2, 4), _zoom(2, 1), _zoom(5, 0)])
    assert shared_spans.plan(batch, 4, policy.adapter) is not None
    _same(policy, batch, scored=True, entropy=True)


def test_text_tool_rows_share_their_call(tmp_path):
    """Text rows (the lean pass runs the tails): calculator episodes of one task, same call, answers that
    differ (two rows answer alike, so their whole responses are one span but the last token)."""
    from mmgrpo.tiny.text import build_tiny_text_model

    policy = Policy.from_pretrained(build_tiny_text_model(tmp_path / "text"))
    env = ToolMathEnv()
    call = tool_call_text("calculator", {"expression": "3 * 4"})
    plays = [
        [call, "<answer>12</answer>"],
        [call, "<answer>7</answer>"],
        [call, "<answer>7</answer>"],
        ["no"],
    ]
    turns = iter(plays + plays)
    batch = demonstration_batch(policy, env, [4] * 4 + [5] * 4, random.Random(0), play=lambda i: next(turns))
    batch = _grouped(batch, 4)
    assert shared_spans.plan(batch, 4, policy.adapter) is not None
    _same(policy, batch, scored=True)
    _same(policy, batch, scored=False)


def test_groups_that_share_little_take_the_plain_pass(tiny_model_dir, monkeypatch):
    policy = Policy.from_pretrained(tiny_model_dir)
    batch = _zoom_batch(policy, [_zoom(1, 2), ["<answer>1</answer>"], ["<answer>3</answer>"], _zoom(4, 2)])
    assert shared_spans.plan(batch, 4, policy.adapter) is None  # below MIN_SAVED of the response tokens
    monkeypatch.setattr(shared_spans, "MIN_SAVED", 0.0)
    assert shared_spans.plan(batch, 4, policy.adapter) is not None
    _same(policy, batch, scored=True)


def test_rows_with_other_images_end_their_span_before_them(tiny_model_dir):
    """The same tokens, but a different zoomed view in one row: the span stops before the image."""
    policy = Policy.from_pretrained(tiny_model_dir)
    batch = _zoom_batch(policy, [_zoom(1, 2), _zoom(1, 3), _zoom(1, 3)])
    rv = batch.response_vision
    seqs = list(rv.seqs)
    seqs[1] = {k: (v + 0.5 if k == "pixel_values" else v) for k, v in seqs[1].items()}
    batch = dataclasses.replace(batch, response_vision=dataclasses.replace(rv, seqs=seqs, encoded=None))
    plan = shared_spans.plan(batch, 3, policy.adapter)
    assert plan is not None
    lengths = plan.length[plan.owner].tolist()
    assert lengths[0] == lengths[1] == lengths[2] < 40 and lengths[3] > 40  # group 1's span ends at the image
    _same(policy, batch, scored=True)


def test_reference_pass_through_shared_spans(tiny_model_dir):
    """The KL reference's pass (no graph) takes the spans too: the same log-probs as its full forward, and
    the reference is another model than the policy (the policy's weights moved after it was made)."""
    policy = Policy.from_pretrained(tiny_model_dir)
    policy.make_reference()
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = _zoom_batch(policy, [_zoom(1, 2), _zoom(1, 3), _zoom(1, 3), ["<answer>1</answer>"]])
    assert shared_spans.plan(batch, 4, policy.adapter) is not None
    on = batch.loss_mask.bool()
    with torch.no_grad():
        spans = policy.logprobs(batch, reference=True)
        full = policy.logprobs(batch, reference=True, share_prompt=False)
        own = policy.logprobs(batch)
    torch.testing.assert_close(spans[on], full[on], atol=1e-5, rtol=1e-5)
    assert (spans[on] - own[on]).abs().max() > 1e-3  # the reference's numbers, not the policy's
