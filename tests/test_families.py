"""Every supported model family through mmgrpo's own code paths: train 2 GRPO steps (with images where the
family takes them), save, reload with from_pretrained and generate; sampling log-probs equal training
log-probs; the shared-prompt path equals the full forward, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.envs.counting import CountingEnv
from mmgrpo.envs.text_math import TextMathEnv
from mmgrpo.model.batch import TokenBatch, pad_right
from mmgrpo.model.head import plain_head
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.families import FAMILIES, VISION_FAMILIES, build_tiny_family
from mmgrpo.train.trainer import Trainer

ADAPTERS = {
    "qwen2-vl": "qwen-vl",
    "qwen2.5-vl": "qwen-vl",
    "qwen3-vl": "qwen-vl",
    "llava": "llava",
    "idefics3": "idefics3",
    "gemma3": "gemma3",
    "qwen3": "causal-lm",
    "llama": "causal-lm",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    path = build_tiny_family(name, tmp_path_factory.mktemp(name.replace(".", "")) / "model")
    return name, path


@pytest.fixture(autouse=True)
def _register_length_verifier():
    from mmgrpo.registry import register_verifier

    # varies within groups even for a fresh model, so every step has a gradient
    register_verifier("test_length", lambda **_: lambda ep: len(ep.completion) / 10, overwrite=True)


def _env(name: str):
    return CountingEnv(max_count=3) if name in VISION_FAMILIES else TextMathEnv()


def _prompts(policy: Policy, name: str, n: int = 3):
    env = _env(name)
    obs = [env.reset(seed=s)[0] for s in range(n)]
    return policy.encode_prompts(obs)


def test_adapter_stop_ids_and_template_turn_end(family):
    name, path = family
    policy = Policy.from_pretrained(path)
    assert policy.adapter.name == ADAPTERS[name]
    gen = policy.model.generation_config.eos_token_id
    assert set(gen if isinstance(gen, list) else [gen]) <= set(policy.stop_ids)
    assert policy.end_of_turn_id in policy.stop_ids
    if name in VISION_FAMILIES:
        assert policy.image_token_id in policy.suppress_ids
        ids, _, vision = _prompts(policy, name, 2)
        assert vision.images_per_seq == [1, 1] and not vision.empty
        assert int((ids == policy.image_token_id).sum()) > 0


def test_one_processor_call_equals_one_call_per_prompt(family, monkeypatch):
    """Prompts processed together (split per prompt by the adapter) give the ids, masks and vision tensors
    that processing each prompt on its own gives."""
    name, path = family
    policy = Policy.from_pretrained(path)
    env = _env(name)
    obs = [env.reset(seed=s)[0] for s in range(3)]
    together = policy.encode_prompts(obs)
    monkeypatch.setattr(policy.adapter, "split_vision", lambda enc, counts: None)
    alone = policy.encode_prompts(obs)
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])
    assert together[2].images_per_seq == alone[2].images_per_seq
    for a, b in zip(together[2].seqs, alone[2].seqs, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shared_prompt_path_equals_full_forward(family):
    """Each prompt (and its image) encoded once, its cache repeated G times: the same log-probs and
    gradients as one full forward per row."""
    name, path = family
    policy = Policy.from_pretrained(path)
    torch.manual_seed(0)
    envs = [_env(name) for _ in range(6)]
    tok = rollout(policy, envs, [0, 1, 2], group_size=2, max_new_tokens=5, temperature=1.0).tokens
    assert tok.shared_prompt_runs() == 2
    mask = tok.loss_mask.bool()
    results = []
    for share in (False, True):
        policy.model.zero_grad()
        lp = policy.logprobs(tok, share_prompt=share)  # (N, T)
        torch.where(mask, lp, 0.0).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
        results.append((torch.where(mask, lp, 0.0).detach(), grad))
    (lp_full, g_full), (lp_shared, g_shared) = results
    torch.testing.assert_close(lp_shared, lp_full, atol=1e-5, rtol=1e-5)
    # gradients: relative to their norm (the Gemma 3 projector's reach 2e4, where float32 summation order
    # alone moves single entries by 1e-2)
    assert (g_shared - g_full).norm() / g_full.norm() < 1e-5


def test_sampling_logprobs_equal_training_logprobs(family):
    name, path = family
    policy = Policy.from_pretrained(path)
    torch.manual_seed(1)
    ids, mask, vision = _prompts(policy, name, 3)
    comps, _, lps = policy.generate(
        ids, mask, vision, max_new_tokens=6, temperature=1.0, num_samples=2, return_logprobs=True
    )
    rows = [b for b in range(3) for _ in range(2)]
    rid, rmask = pad_right(comps, policy.pad_token_id)
    tok = TokenBatch(ids[rows], mask[rows], rid, rmask, rmask, vision, prompt_index=rows)
    with torch.no_grad():
        train_lp = policy.logprobs(tok)  # (N, T)
    for i, row in enumerate(lps):
        torch.testing.assert_close(train_lp[i, : len(row)], torch.tensor(row), atol=1e-5, rtol=0)


def test_greedy_sampler_matches_hf_generate(family):
    name, path = family
    policy = Policy.from_pretrained(path)
    ids, mask, vision = _prompts(policy, name, 2)
    ours, _ = policy.generate(ids, mask, vision, max_new_tokens=5, temperature=0.0)
    for b in range(2):  # one row at a time: HF's padding-aware positions differ per family
        row = [b]
        hf, _ = policy.generate(
            ids[row][:, mask[b].argmax() :],
            mask[row][:, mask[b].argmax() :],
            vision.select(row),
            max_new_tokens=5,
            temperature=0.0,
            use_hf_generate=True,
        )
        assert hf[0] == ours[b]


def test_trains_two_steps_saves_reloads_and_generates(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    name, path = family
    env = "counting" if name in VISION_FAMILIES else "text_math"
    sets = [
        f"model.path={path}",
        f"output_dir={tmp_path}",
        f"env.name={env}",
        "env.kwargs={}",
        "grpo.steps=2",
        "grpo.tasks_per_step=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=5",
        "grpo.beta=0.04",
        "grpo.lr=1e-2",
        "warm_start.steps=0",
        "verifiers=[{name: test_length}, {name: number_match}]",
    ]
    trainer = Trainer(load_config(None, sets), progress=False)
    before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
    record = trainer.train()
    assert trainer.step == 2 and torch.isfinite(torch.tensor(record["loss"]))
    moved = [n for n, p in trainer.policy.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved and any("embed" in n or "layers" in n for n in moved)
    final = tmp_path / "final"
    auto = AutoModelForImageTextToText if name in VISION_FAMILIES else AutoModelForCausalLM
    reloaded = auto.from_pretrained(final)
    for n, p in trainer.policy.model.named_parameters():
        torch.testing.assert_close(reloaded.state_dict()[n], p.detach(), atol=0, rtol=0)
    again = Policy.from_pretrained(final)
    ids, mask, vision = _prompts(again, name, 2)
    comps, _ = again.generate(ids, mask, vision, max_new_tokens=4, temperature=1.0, num_samples=2)
    assert len(comps) == 4 and all(comps)


def test_kept_cache_turns_equal_encoding_every_turn(family, monkeypatch):
    """Multi-turn episodes (images from the env mid-episode for vision families) come out the same on the
    KV cache kept across turns as when every turn encodes the whole sequence again, and the sampled
    log-probs equal the training forward's; families that cannot keep it fall back (mmgrpo.model.turns)."""
    from mmgrpo.model import turns
    from mmgrpo.rollout.episodes import rollout
    from tests.test_kv_turns import per_episode, record_turns
    from tests.test_multiturn import ZoomOnceEnv

    name, path = family
    policy = Policy.from_pretrained(path)
    vocab = policy.model.config.get_text_config().vocab_size
    policy.stop_ids = sorted(set(policy.stop_ids) | set(range(40, vocab, 3)))  # ragged turns
    runs, record = [], record_turns(monkeypatch)
    for kv in (True, False):
        envs = [ZoomOnceEnv(with_image=name in VISION_FAMILIES, turns_before_end=1 + i % 2) for i in range(8)]
        torch.manual_seed(0)
        runs.append(rollout(policy, envs, [3, 8], group_size=4, max_new_tokens=8, max_turns=3, kv_across_turns=kv))
    kept, again = runs
    assert [t.response_ids for t in kept.trajectories] == [t.response_ids for t in again.trajectories]
    assert max(t.turns for t in kept.trajectories) == 3
    if not turns.supported(policy):
        assert name == "gemma3" and not record
        return
    sampled = per_episode(record)
    with torch.no_grad():
        trained = policy.logprobs(kept.tokens, share_prompt=False)  # (N, T)
    for i, t in enumerate(kept.trajectories):
        where = [k for k, m in enumerate(t.loss_mask) if m]
        if policy.adapter.images_on_cache or name not in VISION_FAMILIES:
            assert len(where) == len(sampled[i])  # every turn sampled on the kept cache
        else:  # Idefics3 keeps it until an image arrives, then encodes again: turn 1 was on the cache
            where = where[: len(sampled[i])]
        assert torch.allclose(trained[i, where], torch.tensor(sampled[i]), atol=1e-5), (name, i)


def test_shared_pass_with_tool_images_equals_full_forward(family):
    """Multi-turn episodes whose env turns bring images train in one batched pass on the group's shared
    prompt cache: the same log-probs (1e-5) and gradients as one full forward per row; so does the head
    run on the loss mask's positions only (``scored``), which leaves 0 on the env tokens."""
    from tests.test_multiturn import ZoomOnceEnv

    name, path = family
    policy = Policy.from_pretrained(path)
    vocab = policy.model.config.get_text_config().vocab_size
    policy.stop_ids = sorted(set(policy.stop_ids) | set(range(40, vocab, 3)))
    torch.manual_seed(2)
    envs = [ZoomOnceEnv(with_image=name in VISION_FAMILIES, turns_before_end=2) for _ in range(6)]
    tok = rollout(policy, envs, [0, 1, 2], group_size=2, max_new_tokens=6, max_turns=3).tokens
    assert tok.has_response_images == (name in VISION_FAMILIES)
    mask = tok.loss_mask.bool()
    assert len(set(tok.response_mask.sum(dim=1).tolist())) > 1  # rows of different lengths
    env_tokens = tok.response_mask.bool() & ~mask  # (N, T) the tools' results and the template
    assert env_tokens.any()
    assert plain_head(policy.model) is not None  # every family's head can run on the scored positions only
    results = []
    # full; shared in one pass; shared per length; then the head on the loss mask only, full and shared
    cases = ((False, 0, None), (True, 10**6, None), (True, 0, None), (False, 0, mask), (True, 0, mask))
    for share, overhead, scored in cases:
        policy.model.zero_grad()
        with _length_passes(overhead):
            lp = policy.logprobs(tok, share_prompt=share, scored=scored)  # (N, T)
        if scored is not None:  # the head never ran on the env tokens
            assert (lp[env_tokens] == 0).all()
        else:
            assert (lp[env_tokens] != 0).all()
        torch.where(mask, lp, 0.0).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
        results.append((torch.where(mask, lp, 0.0).detach(), grad))
    (lp_full, g_full), *others = results
    for lp_other, g_other in others:
        torch.testing.assert_close(lp_other, lp_full, atol=1e-5, rtol=1e-5)
        assert (g_other - g_full).norm() / g_full.norm() < 1e-5


def _length_passes(overhead: int):
    """engine.length_chunks with this per-pass overhead (0: a pass per distinct length, up to 4)."""
    from unittest import mock

    from mmgrpo.model import engine

    real = engine.length_chunks
    return mock.patch.object(engine, "length_chunks", lambda lengths: real(lengths, overhead=overhead))
