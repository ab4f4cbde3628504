"""The lean training pass (``mmgrpo.model.lean_pass``) gives the model's own forward: the same log-probs and
gradients on every family whose layers it reproduces, with LoRA adapters and under bf16 autocast; and it is
left out where it would not be exact (another layout, attention dropout while training, a tool's image)."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.envs.text_math import TextMathEnv
from mmgrpo.model import lean_pass
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.families import VISION_FAMILIES, build_tiny_family


def _batch(policy: Policy, name: str, seed: int = 0):
    torch.manual_seed(seed)
    vocab = policy.model.config.get_text_config().vocab_size
    policy.stop_ids = sorted(set(policy.stop_ids) | set(range(40, vocab, 3)))  # rows end at different lengths
    env = (lambda: CountingEnv(max_count=3)) if name in VISION_FAMILIES else TextMathEnv
    # 3 prompts x G = 4, responses of different lengths (padding after a row's end)
    tok = rollout(policy, [env() for _ in range(12)], [0, 1, 2], group_size=4, max_new_tokens=7).tokens
    _SEEN.clear()  # the gate's probe of the lean pass (mmgrpo.model.lean_gate) ran in the rollout
    return tok


def _logprobs_and_grad(policy: Policy, tok, lean_on: bool, monkeypatch, calls: list) -> tuple:
    monkeypatch.setattr(lean_pass, "LEAN_PASSES", lean_on)
    policy.model.zero_grad()
    mask = tok.loss_mask.bool()
    lp = policy.logprobs(tok)  # (N, T)
    torch.where(mask, lp, 0.0).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    calls.append(sum(shape[0] for shape in _SEEN))  # rows through the lean pass
    _SEEN.clear()
    return torch.where(mask, lp, 0.0).detach(), grad


_SEEN: list[tuple] = []


@pytest.fixture
def spy(monkeypatch):
    """Counts the lean pass's calls (in ``_SEEN``)."""
    real = lean_pass.LeanPass.hidden

    def hidden(self, ids, *args):
        _SEEN.append(tuple(ids.shape))
        return real(self, ids, *args)

    monkeypatch.setattr(lean_pass.LeanPass, "hidden", hidden)
    _SEEN.clear()
    yield


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "qwen3", "llama", "llava"])
def test_lean_pass_equals_the_model_forward(tmp_path, monkeypatch, spy, family):
    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    tok = _batch(policy, family)
    assert len(set(tok.response_mask.sum(dim=1).tolist())) > 1  # rows of different lengths
    calls: list[int] = []
    lp_plain, g_plain = _logprobs_and_grad(policy, tok, False, monkeypatch, calls)
    lp_lean, g_lean = _logprobs_and_grad(policy, tok, True, monkeypatch, calls)
    assert calls[0] == 0 and calls[1] == len(tok.response_ids)  # every row through the lean pass, then none
    torch.testing.assert_close(lp_lean, lp_plain, atol=1e-5, rtol=1e-5)
    assert (g_lean - g_plain).norm() / g_plain.norm() < 1e-5
    with torch.no_grad():  # the reference's pass (no graph) too
        policy.make_reference()
        monkeypatch.setattr(lean_pass, "LEAN_PASSES", False)
        ref_plain = policy.logprobs(tok, reference=True)
        monkeypatch.setattr(lean_pass, "LEAN_PASSES", True)
        ref_lean = policy.logprobs(tok, reference=True)
    assert len(_SEEN) >= 1
    torch.testing.assert_close(ref_lean, ref_plain, atol=1e-5, rtol=1e-5)


def test_lean_pass_with_lora_and_under_bf16_autocast(tmp_path, monkeypatch, spy):
    from mmgrpo.model.io import LoraSpec, apply_lora

    policy = Policy.from_pretrained(build_tiny_family("qwen2.5-vl", tmp_path / "m"))
    policy.model = apply_lora(policy.model, LoraSpec(r=2, alpha=4, target_modules=["q_proj", "gate_proj"]))
    with torch.no_grad():  # an adapter update that changes the numbers
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tok = _batch(policy, "qwen2.5-vl", seed=1)
    calls: list[int] = []
    lp_plain, g_plain = _logprobs_and_grad(policy, tok, False, monkeypatch, calls)
    lp_lean, g_lean = _logprobs_and_grad(policy, tok, True, monkeypatch, calls)
    assert calls == [0, calls[1]] and calls[1] >= 1
    torch.testing.assert_close(lp_lean, lp_plain, atol=1e-5, rtol=1e-5)
    assert (g_lean - g_plain).norm() / g_plain.norm() < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp16_plain, _ = _logprobs_and_grad(policy, tok, False, monkeypatch, calls)
        lp16_lean, _ = _logprobs_and_grad(policy, tok, True, monkeypatch, calls)
    assert calls[3] >= 1
    # bf16 rounding: the two paths agree to bf16's resolution, and both stay near the fp32 numbers
    assert (lp16_lean - lp16_plain).abs().max() < 0.05
    assert (lp16_lean - lp_plain).abs().max() < 0.1


def test_lean_pass_left_out_where_it_would_not_be_exact(tmp_path):
    gemma = Policy.from_pretrained(build_tiny_family("gemma3", tmp_path / "g"))
    assert lean_pass.for_model(gemma.model, gemma.adapter) is None  # extra norms, sliding layers
    policy = Policy.from_pretrained(build_tiny_family("qwen3", tmp_path / "q"))
    model = policy.model
    assert lean_pass.for_model(model, policy.adapter) is not None
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    assert lean_pass.for_model(model, policy.adapter) is None  # the forward would drop attention weights
    model.eval()
    assert lean_pass.for_model(model, policy.adapter) is not None  # no dropout in eval mode
    model.to("meta")  # off the CPU: the model's forward keeps its memory-efficient attention kernel
    assert lean_pass.for_model(model, policy.adapter) is None


def test_a_pass_with_a_tool_image_goes_through_the_model(tmp_path, monkeypatch, spy):
    """Response chunks that hold an image run the model's forward (which embeds it); the others the lean
    pass; together the log-probs of the plain path."""
    from tests.test_multiturn import ZoomOnceEnv

    policy = Policy.from_pretrained(build_tiny_family("qwen2.5-vl", tmp_path / "m"))
    vocab = policy.model.config.get_text_config().vocab_size
    policy.stop_ids = sorted(set(policy.stop_ids) | set(range(40, vocab, 3)))  # turns end early
    torch.manual_seed(2)
    envs = [ZoomOnceEnv(with_image=True, turns_before_end=2) for _ in range(6)]
    tok = rollout(policy, envs, [0, 1, 2], group_size=2, max_new_tokens=6, max_turns=3).tokens
    _SEEN.clear()  # the gate's probe of the lean pass ran in the rollout
    assert tok.has_response_images
    calls: list[int] = []
    lp_plain, g_plain = _logprobs_and_grad(policy, tok, False, monkeypatch, calls)
    lp_lean, g_lean = _logprobs_and_grad(policy, tok, True, monkeypatch, calls)
    with_image = [i for i, s in enumerate(tok.response_vision.seqs) if s]
    assert with_image and calls[0] == 0
    assert calls[1] <= len(tok.response_ids) - len(with_image)  # rows with an image: the model's forward
    torch.testing.assert_close(lp_lean, lp_plain, atol=1e-5, rtol=1e-5)
    assert (g_lean - g_plain).norm() / g_plain.norm() < 1e-5
