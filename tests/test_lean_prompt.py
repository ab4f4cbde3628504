"""The lean prompt encoding (``mmgrpo.model.lean_prompt``) gives the model's own forward: the same next-token
logits, the same KV cache and the same gradients through both, on every family whose layers it reproduces,
images in the block included where the family's forward only scatters their features; and it steps aside
where it would not be exact (Qwen3-VL's image blocks, features not cached, another layout)."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.envs.text_math import TextMathEnv
from mmgrpo.model import engine, lean_pass, lean_prompt, system_prefix
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.families import VISION_FAMILIES, build_tiny_family

LEAN_FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava", "qwen3", "llama"]


def _prompts(policy: Policy, family: str):
    """Three prompts (left-padded ids, mask) that share their opening, and their images' cached features."""
    torch.manual_seed(0)
    env = (lambda: CountingEnv(max_count=3)) if family in VISION_FAMILIES else TextMathEnv
    tok = rollout(policy, [env() for _ in range(6)], [0, 1, 2], group_size=2, max_new_tokens=2).tokens
    heads = [0, 2, 4]
    owners = tok.row_prompts()
    vision = policy.encode_images(tok.vision.select([owners[h] for h in heads]), force=True)
    return tok.prompt_ids[heads], tok.prompt_mask[heads], vision


def _encode(policy: Policy, ids, mask, vision, lean_on: bool, monkeypatch) -> tuple:
    """encode_heads with the lean passes on or off: logits, cache, positions, layout, every gradient of a
    random weighting of the logits and the cache, and how many blocks the lean encoder took."""
    monkeypatch.setattr(lean_pass, "LEAN_PASSES", lean_on)
    calls = []
    real = lean_prompt.PromptEncoder.__call__
    monkeypatch.setattr(
        lean_prompt.PromptEncoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a)
    )
    policy.model.zero_grad()
    first, cache, start, layout = engine.encode_heads(
        policy.model, policy.adapter, ids, mask, vision, policy.device
    )
    kv = torch.cat([t.flatten() for x in cache.layers for t in (x.keys, x.values)])  # every cached number
    g = torch.Generator().manual_seed(1)
    loss = (first * torch.randn(first.shape, generator=g)).sum() + (
        kv * torch.randn(kv.shape, generator=g)
    ).sum()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    monkeypatch.setattr(lean_prompt.PromptEncoder, "__call__", real)
    return first.detach(), kv.detach(), start, layout, grad, len(calls)


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_prompt_encoding_equals_the_model_forward(tmp_path, monkeypatch, family):
    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    ids, mask, vision = _prompts(policy, family)
    stop = set(policy.adapter.suppress_ids) | ({policy.adapter.image_token_id} - {None})
    assert system_prefix.common_prefix(ids, mask, stop) >= system_prefix.MIN_SHARED  # opening, then block
    images = not vision.empty
    assert images == (family in VISION_FAMILIES) and (not images or vision.has_encoded)
    first_p, kv_p, start_p, layout_p, grad_p, plain_calls = _encode(
        policy, ids, mask, vision, False, monkeypatch
    )
    first_l, kv_l, start_l, layout_l, grad_l, lean_calls = _encode(
        policy, ids, mask, vision, True, monkeypatch
    )
    assert plain_calls == 0
    # the opening and the block; Qwen3-VL's image block goes through its forward (deepstack features)
    assert lean_calls == (1 if family == "qwen3-vl" else 2)
    assert torch.equal(start_l, start_p) and torch.equal(layout_l, layout_p)
    assert kv_l.shape == kv_p.shape
    torch.testing.assert_close(first_l, first_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_l, kv_p, atol=1e-5, rtol=1e-5)
    assert (grad_l - grad_p).norm() / grad_p.norm() < 1e-5


def test_lean_prompt_encoding_steps_aside_where_it_would_not_be_exact(tmp_path):
    from mmgrpo.model.batch import VisionInputs

    gemma = Policy.from_pretrained(build_tiny_family("gemma3", tmp_path / "g"))
    assert lean_prompt.for_model(gemma.model, gemma.adapter) is None  # a layout the lean step does not know
    policy = Policy.from_pretrained(build_tiny_family("qwen2.5-vl", tmp_path / "q"))
    encoder = lean_prompt.for_model(policy.model, policy.adapter)
    assert encoder is not None and encoder.takes(VisionInputs.none(2))
    _, _, vision = _prompts(policy, "qwen2.5-vl")
    assert encoder.takes(vision)  # cached features: scattered over the placeholders here
    assert not encoder.takes(vision.without_encoded())  # pixels: the forward runs the vision tower
    q3 = Policy.from_pretrained(build_tiny_family("qwen3-vl", tmp_path / "q3"))
    _, _, v3 = _prompts(q3, "qwen3-vl")
    assert not lean_prompt.for_model(q3.model, q3.adapter).takes(v3)  # deepstack: features inside the layers


@pytest.mark.parametrize("family", ["qwen2.5-vl", "llava"])
@pytest.mark.parametrize("opening", [True, False])
def test_prompts_given_as_pixels_are_encoded_once_then_lean_with_the_forwards_gradients(
    tmp_path, monkeypatch, family, opening
):
    """The rollout's and the training pass's prompts come as pixels: the lean encoder encodes their images
    (one call, with a graph) and takes the block -- after the shared opening, or the whole prompts where
    they share too little (``opening=False``: the zoom demo's bare questions beside full prompts); logits,
    cache, positions and every gradient, the vision tower's included, equal the model's forward."""
    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    ids, mask, vision = _prompts(policy, family)
    if not opening:
        monkeypatch.setattr(system_prefix, "MIN_SHARED", 10**6)
    pixels = vision.without_encoded()
    plain = _encode(policy, ids, mask, pixels, False, monkeypatch)
    lean = _encode(policy, ids, mask, pixels, True, monkeypatch)
    assert plain[5] == 0 and lean[5] == (2 if opening else 1)  # every block lean, the images' included
    assert torch.equal(lean[2], plain[2]) and torch.equal(lean[3], plain[3])  # next positions, layout
    torch.testing.assert_close(lean[0], plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lean[1], plain[1], atol=1e-5, rtol=1e-5)
    grad_l, grad_p = lean[4], plain[4]
    assert grad_l.shape == grad_p.shape  # the same parameters got a gradient: the vision tower's too
    assert (grad_l - grad_p).norm() / grad_p.norm() < 1e-5
    tower = [p for n, p in policy.model.named_parameters() if policy.adapter.is_vision_param(n)]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower)
