"""A later turn's block with images through the lean step (mmgrpo.model.image_blocks): the episodes of the
model's forward on the rows' whole caches, token for token, and the sampled log-probs training reads."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.model import image_blocks, lean, prefix
from tests import test_kv_turns
from tests.test_kv_turns import _rollout, assert_sampled_is_trained, record_turns
from tests.test_multiturn import ZoomOnceEnv

ragged_stops = test_kv_turns.ragged_stops  # the fixture: stop ids a random model samples often


@pytest.fixture
def held_once(monkeypatch):
    """The prompts held once per group from the shortest prompt on (as the demos' long prompts are), and
    every lean block call counted: (whether it had image embeddings)."""
    monkeypatch.setattr(prefix, "MERGED", True)
    monkeypatch.setattr(prefix, "MERGED_MIN_PREFIX", 0)
    calls: list[bool] = []
    real = lean.LeanStep.block

    def counting(self, *a, **k):
        embeds = a[6] if len(a) > 6 else k.get("embeds")
        calls.append(embeds is not None)
        return real(self, *a, **k)

    monkeypatch.setattr(lean.LeanStep, "block", counting)
    return calls


def _episodes(policy, seeds, kv=True):
    envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(8)]  # 2 or 3 turns
    return _rollout(policy, envs, seeds, kv)


@pytest.mark.parametrize("seeds", [[3, 8], [4, 9]])
def test_image_blocks_through_the_lean_step_sample_what_the_forward_samples(
    ragged_stops, held_once, monkeypatch, seeds
):
    runs = []
    for on in (True, False):
        monkeypatch.setattr(image_blocks, "LEAN_IMAGE_BLOCKS", on)
        held_once.clear()
        runs.append(_episodes(ragged_stops, seeds))
        assert any(held_once) == on  # on: image blocks took the lean step; off: none did
    again = _episodes(ragged_stops, seeds, kv=False)  # every turn encoded whole by the model's forward
    for other in (runs[1], again):
        assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in other.trajectories]
        assert [t.loss_mask for t in runs[0].trajectories] == [t.loss_mask for t in other.trajectories]
    assert max(t.turns for t in runs[0].trajectories) >= 2


def test_sampled_logprobs_after_a_lean_image_block_are_what_training_reads(
    ragged_stops, held_once, monkeypatch
):
    policy = ragged_stops
    record = record_turns(monkeypatch)
    batch = _episodes(policy, [5, 6])
    assert any(held_once)
    assert_sampled_is_trained(policy, batch, record)


def test_the_embeddings_are_the_forwards_own(ragged_stops):
    """``block_embeds`` equals the model's own input embeddings with the features scattered (the forward's
    ``get_placeholder_mask`` route), read through a hook on the language model's first layer."""
    policy = ragged_stops
    adapter = policy.adapter
    _, message_ids, vision = _one_tool_block(policy)
    step = lean.stepper(policy.model, adapter.uses_mrope(policy.model))
    assert step is not None
    got = image_blocks.block_embeds(policy, step, message_ids, vision)  # (1, W, H)
    assert got is not None
    seen = {}
    layer0 = step.text.layers[0]

    def keep(module, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)  # (1, W, H) the layer's input

    hook = layer0.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            kw = adapter.forward_kwargs(
                message_ids, torch.ones_like(message_ids), vision, policy.device, torch.float32
            )
            policy.model(**kw)
    finally:
        hook.remove()
    assert torch.allclose(got, seen["h"], atol=1e-6)
    image = message_ids == adapter.image_token_id
    assert image.any() and not torch.allclose(got[image], step.text.embed_tokens(message_ids)[image])


def test_off_the_list_the_forward_takes_the_block(ragged_stops, monkeypatch):
    from mmgrpo.model import lean_prompt

    monkeypatch.setattr(lean_prompt, "SCATTERS_IMAGES", frozenset())  # as for Qwen3-VL (deepstack)
    _, ids, vision = _one_tool_block(ragged_stops)
    step = lean.stepper(ragged_stops.model, ragged_stops.adapter.uses_mrope(ragged_stops.model))
    assert image_blocks.block_embeds(ragged_stops, step, ids, vision) is None


def _one_tool_block(policy):
    """A tool message with an image as the processor gives it: (text, ids (1, W), its vision inputs)."""
    from PIL import Image

    image = Image.new("RGB", (56, 56), (200, 30, 30))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>the view<|im_end|>\n"
    enc = policy.processor(text=[text], images=[image], return_tensors="pt")
    ids = enc["input_ids"]
    seq = {k: enc[k] for k in ("pixel_values", "image_grid_thw")}
    from mmgrpo.model.batch import VisionInputs

    return text, ids, VisionInputs([seq], [1])
