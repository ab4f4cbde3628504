"""Precision, gradient checkpointing, dropout, stop ids, LoRA and the vision learning rate on the tiny VLM."""

from __future__ import annotations

import json

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.envs.counting import CountingEnv
from mmgrpo.errors import ConfigError
from mmgrpo.grpo.losses import grpo_loss
from mmgrpo.model.io import LoraSpec
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.train.trainer import Trainer

BASE = [
    "grpo.tasks_per_step=2",
    "grpo.group_size=4",
    "grpo.max_new_tokens=6",
    "grpo.beta=0.04",
    "warm_start.steps=0",
    "env.kwargs.max_count=3",
    "verifiers=[{name: test_length}, {name: format}]",
]


@pytest.fixture(autouse=True)
def _register_length_verifier():
    from mmgrpo.registry import register_verifier

    # varies within groups even for a fresh model, so every step has a gradient
    register_verifier("test_length", lambda **_: lambda ep: len(ep.completion) / 10, overwrite=True)


def _trainer(model_dir, out, *sets: str) -> Trainer:
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={out}", *BASE, *sets])
    return Trainer(cfg, progress=False)


def _trainable(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def counting_tokens(tiny_policy):
    torch.manual_seed(0)
    envs = [CountingEnv(distractors=2) for _ in range(8)]
    return rollout(tiny_policy, envs, [0, 1], group_size=4, max_new_tokens=6, temperature=1.0).tokens


def test_bf16_keeps_fp32_master_weights_so_tiny_updates_land(tiny_model_dir, tmp_path):
    """bf16 compute at lr 1e-6 for 20 steps: every trainable tensor moves (its master copy is fp32), and the
    rewards match an fp32 run's. Stored as bf16 (the old behaviour) most such updates round away."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        tr = _trainer(
            tiny_model_dir,
            tmp_path / dtype,
            f"model.dtype={dtype}",
            "grpo.lr=1e-6",
            "grpo.steps=20",
            "model.freeze_vision=true",
        )
        assert all(p.dtype == torch.float32 for p in tr.policy.model.parameters())
        before = _trainable(tr.policy)
        rewards = [tr.train_step()["reward"] for _ in range(20)]
        after = _trainable(tr.policy)
        moved = {n: bool((after[n] != before[n]).any()) for n in before}
        runs[dtype] = (rewards, moved, before, after)
    rewards32, _, _, _ = runs["float32"]
    rewards16, moved, before, after = runs["bfloat16"]
    assert all(moved.values()), [n for n, m in moved.items() if not m]
    assert abs(sum(rewards16) / 20 - sum(rewards32) / 20) < 0.1
    # the same updates applied to bf16-stored weights: most elements would not change at all
    n_total = sum(b.numel() for b in before.values())
    lost = sum(
        int(((a - b).bfloat16() + b.bfloat16() == b.bfloat16()).sum())
        for a, b in ((after[n], before[n]) for n in before)
    )
    assert lost / n_total > 0.5


def test_float16_on_cpu_is_refused_at_config_time(tmp_path):
    with pytest.raises(ConfigError, match="float16 needs a GPU.*bfloat16"):
        load_config(None, ["model.dtype=float16", "model.device=cpu"])


def test_bf16_autocast_runs_the_forward_in_bf16(tiny_model_dir, counting_tokens):
    policy = Policy.from_pretrained(tiny_model_dir, dtype="bfloat16")
    fp32 = Policy.from_pretrained(tiny_model_dir)
    assert policy.precision == "bf16" and next(policy.model.parameters()).dtype == torch.float32
    lp16 = policy.logprobs(counting_tokens).detach()
    lp32 = fp32.logprobs(counting_tokens).detach()
    m = counting_tokens.loss_mask.bool()
    diff = (lp16 - lp32)[m].abs().max().item()
    assert 0 < diff < 0.1  # bf16 rounding, not a different model


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir, counting_tokens):
    """Checkpointing turns the KV cache off in training passes, so log-probs take the full forward; the
    loss and gradients equal those of the shared path without checkpointing."""
    results = []
    for gc in (False, True):
        policy = Policy.from_pretrained(tiny_model_dir, gradient_checkpointing=gc)
        policy.model.train()
        tok = counting_tokens
        adv = torch.linspace(-1, 1, len(tok))
        lp = policy.logprobs(tok)  # (N, T)
        out = grpo_loss(
            lp,
            None,
            None,
            adv,
            tok.loss_mask,
            beta=0.0,
            num_sequences=len(tok),
            num_tokens=int(tok.loss_mask.sum()),
            max_new_tokens=6,
        )
        out.loss.backward()
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
        results.append((out.loss.detach(), grad))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-5, rtol=1e-4)


def test_dropout_is_off_after_loading(tiny_model_dir, tmp_path, counting_tokens):
    """A checkpoint with dropout 0.3 everywhere: train-mode and eval-mode log-probs are identical."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.text_config.attention_dropout = 0.3
    cfg.vision_config.attention_dropout = 0.3  # some towers read it, some ignore it
    src = tmp_path / "dropout"
    import shutil

    shutil.copytree(tiny_model_dir, src)
    cfg.save_pretrained(src)
    policy = Policy.from_pretrained(src)
    policy.model.train()
    a = policy.logprobs(counting_tokens).detach()
    b = policy.logprobs(counting_tokens).detach()
    policy.model.eval()
    c = policy.logprobs(counting_tokens).detach()
    m = counting_tokens.loss_mask.bool()
    assert torch.equal(a[m], b[m]) and torch.equal(a[m], c[m])


def test_stop_ids_come_from_generation_config(tiny_model_dir, tmp_path):
    """Qwen's checkpoints stop on <|im_end|> and <|endoftext|>: an episode ending at either is finished."""
    import shutil

    src = tmp_path / "stops"
    shutil.copytree(tiny_model_dir, src)
    gen = json.loads((src / "generation_config.json").read_text())
    policy = Policy.from_pretrained(src)
    endoftext = policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    gen["eos_token_id"] = [policy.end_of_turn_id, endoftext]
    (src / "generation_config.json").write_text(json.dumps(gen))
    policy = Policy.from_pretrained(src)
    assert policy.end_of_turn_id == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert set(policy.stop_ids) == {policy.end_of_turn_id, endoftext}
    completions, finished = policy._cut_at_stop([[5, 6, endoftext, 7], [5, policy.end_of_turn_id], [5, 6]])
    assert completions == [[5, 6, endoftext], [5, policy.end_of_turn_id], [5, 6]]
    assert finished == [True, True, False]


def test_eval_and_training_sample_through_one_loop(tiny_policy):
    """Greedy at G = 1 (eval) and G = 4 (training) give the same ids: one sampler serves both."""
    env = CountingEnv()
    obs = [env.reset(seed=s)[0] for s in range(3)]
    ids, mask, vision = tiny_policy.encode_prompts(obs)
    one, _ = tiny_policy.generate(ids, mask, vision, max_new_tokens=6, temperature=0.0)
    four, _ = tiny_policy.generate(ids, mask, vision, max_new_tokens=6, temperature=0.0, num_samples=4)
    assert one == four[::4]


def test_sampling_logprobs_equal_training_logprobs(tiny_policy):
    torch.manual_seed(1)
    envs = [CountingEnv() for _ in range(6)]
    obs = [envs[s].reset(seed=s)[0] for s in range(3)]
    ids, mask, vision = tiny_policy.encode_prompts(obs)
    comps, _, lps = tiny_policy.generate(
        ids, mask, vision, max_new_tokens=6, temperature=1.0, num_samples=2, return_logprobs=True
    )
    batch = rollout(tiny_policy, envs, [0, 1, 2], group_size=2, max_new_tokens=6, temperature=1.0)
    # recompute the sampled rows of `generate` through the training forward
    from mmgrpo.model.batch import TokenBatch, pad_right

    rid, rmask = pad_right(comps, tiny_policy.pad_token_id)
    rows = [b for b in range(3) for _ in range(2)]
    tok = TokenBatch(ids[rows], mask[rows], rid, rmask, rmask, vision, prompt_index=rows)
    with torch.no_grad():
        train_lp = tiny_policy.logprobs(tok)
    for i, row in enumerate(lps):
        torch.testing.assert_close(train_lp[i, : len(row)], torch.tensor(row), atol=1e-5, rtol=0)
    assert len(batch.trajectories) == 6


def test_lora_reference_is_the_base_model_exactly(tiny_model_dir, tmp_path, counting_tokens):
    """LoRA: only adapters train; the reference (adapter disabled, no copy) equals the base model's
    log-probs exactly, after the adapter has moved."""
    tr = _trainer(
        tiny_model_dir, tmp_path / "lora", "grpo.steps=3", "grpo.lr=1e-2", "model.lora={r: 4, alpha: 8}"
    )
    policy = tr.policy
    assert policy.lora
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    for _ in range(3):
        tr.train_step()
    assert policy.reference is None and policy.reference_is_base  # no second copy of the weights
    base = Policy.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = policy.logprobs(counting_tokens, reference=True)
        want = base.logprobs(counting_tokens)
        now = policy.logprobs(counting_tokens)
    m = counting_tokens.loss_mask.bool()
    assert torch.equal(ref[m], want[m])
    assert (now[m] - want[m]).abs().max() > 1e-4  # the adapter did move the policy


@pytest.mark.parametrize("save", ["adapter", "merged"])
def test_lora_saves_and_reloads(tiny_model_dir, tmp_path, counting_tokens, save):
    policy = Policy.from_pretrained(tiny_model_dir, lora=LoraSpec(r=4, alpha=8))
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a trained-looking adapter
        want = policy.logprobs(counting_tokens)
    out = tmp_path / save
    policy.save(out, merged=save == "merged")
    assert (out / "adapter_config.json").is_file() == (save == "adapter")
    again = Policy.from_pretrained(out)
    assert again.lora == (save == "adapter")
    with torch.no_grad():
        got = again.logprobs(counting_tokens)
    m = counting_tokens.loss_mask.bool()
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0)
    ids, mask, vision = (
        counting_tokens.prompt_ids[:1],
        counting_tokens.prompt_mask[:1],
        counting_tokens.vision.select([0]),
    )
    comps, _ = again.generate(ids, mask, vision, max_new_tokens=4, temperature=0.0)
    assert len(comps) == 1 and comps[0]


def test_vision_lr_gives_the_tower_its_own_group(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path / "vlr", "grpo.steps=1", "grpo.lr=1e-3", "model.vision_lr=1e-5")
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["language"]["lr"] == 1e-3 and groups["vision"]["lr"] == 1e-5
    vision_ids = {id(p) for p in groups["vision"]["params"]}
    names = [n for n, p in tr.policy.model.named_parameters() if id(p) in vision_ids]
    assert names and all("visual" in n for n in names)
    frozen = _trainer(
        tiny_model_dir, tmp_path / "vf", "grpo.steps=1", "model.freeze_vision=true", "model.vision_lr=1e-5"
    )
    assert [g["name"] for g in frozen.optimizer.param_groups] == ["language"]


def test_samples_and_tensorboard_logging(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    tr = _trainer(
        tiny_model_dir,
        tmp_path / "logs",
        "grpo.steps=2",
        "logging.samples_every=1",
        "logging.samples_per_step=3",
        "logging.report_to=[tensorboard]",
    )
    tr.train()
    rows = [json.loads(line) for line in (tmp_path / "logs/samples/step-2.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {"prompt", "completion", "reward", "reward/format"} <= set(rows[0])
    assert "How many" in rows[0]["prompt"]
    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert events, "tensorboard wrote no event file"


def test_a_cache_without_batch_repetition_falls_back_to_encoding_each_row(
    tiny_policy, counting_tokens, monkeypatch
):
    """The shared-prompt paths take a prompt cache's rows by index or repeat them; a cache that can do
    neither (a custom class) has each prompt encoded G times, with the same numbers."""
    from mmgrpo.model import engine

    with torch.no_grad():
        want = tiny_policy.logprobs(counting_tokens)
    ids, mask = counting_tokens.prompt_ids[::4], counting_tokens.prompt_mask[::4]
    vision = counting_tokens.vision
    greedy, _ = tiny_policy.generate(ids, mask, vision, max_new_tokens=5, temperature=0.0, num_samples=4)
    calls = []
    monkeypatch.setattr(engine, "repeat_cache", lambda cache, G: calls.append(G) or False)
    monkeypatch.setattr(engine, "selects_rows", lambda cache: False)
    with torch.no_grad():
        got = tiny_policy.logprobs(counting_tokens)
    again, _ = tiny_policy.generate(ids, mask, vision, max_new_tokens=5, temperature=0.0, num_samples=4)
    assert calls, "the fallback was not exercised"
    m = counting_tokens.loss_mask.bool()
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0)
    assert again == greedy


def test_lora_dropout_is_the_users_choice(tiny_model_dir):
    """Dropout is switched off in the model, but model.lora.dropout stays as configured."""
    policy = Policy.from_pretrained(tiny_model_dir, lora=LoraSpec(r=4, alpha=8, dropout=0.1))
    lora_p = {
        m.p
        for n, m in policy.model.named_modules()
        if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)
    }
    other_p = {
        m.p
        for n, m in policy.model.named_modules()
        if "lora_dropout" not in n and isinstance(m, torch.nn.Dropout)
    }
    assert lora_p == {0.1} and other_p <= {0.0}
