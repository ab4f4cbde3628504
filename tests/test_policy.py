"""The tiny model, the Policy's log-probs and the rollout's token bookkeeping."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.vlm import TinyModelSpec, build_tiny_model, count_parameters


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_loads_with_auto_classes_and_is_small(tiny_model_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert count_parameters(model) < 10_000_000
    tok = processor.tokenizer
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(model.config, name) < len(tok)
    assert model.config.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(tok("<answer>42</answer>")["input_ids"]) == "<answer>42</answer>"


def test_tiny_model_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(again / name) == _digest(tiny_model_dir / name)
    assert _digest(other / "model.safetensors") != _digest(tiny_model_dir / "model.safetensors")
    assert json.loads((again / "mmgrpo_tiny.json").read_text())["seed"] == 0


def test_image_of_112_pixels_gives_16_tokens(tiny_policy):
    env = CountingEnv()
    obs, _ = env.reset(seed=0)
    ids, mask, vision = tiny_policy.encode_prompts([obs])
    assert int((ids == tiny_policy.image_token_id).sum()) == 16
    assert vision.image_grid_thw.tolist() == [[1, 8, 8]]


@pytest.fixture
def counting_batch(tiny_policy):
    torch.manual_seed(0)
    envs = [CountingEnv(distractors=2) for _ in range(12)]
    return rollout(tiny_policy, envs, [0, 1, 2], group_size=4, max_new_tokens=6, temperature=1.0)


def test_rollout_masks_only_sampled_tokens(counting_batch, tiny_policy):
    tok = counting_batch.tokens
    assert len(tok) == 12 and tok.shared_prompt_runs() == 4
    for i, t in enumerate(counting_batch.trajectories):
        n = len(t.response_ids)
        assert tok.response_ids[i, :n].tolist() == t.response_ids  # the sampled ids, not a re-encoding
        assert tok.loss_mask[i].tolist() == [1] * n + [0] * (tok.loss_mask.shape[1] - n)
        assert t.group == i // 4
        assert t.truncated == (tiny_policy.eos_token_id not in t.response_ids)
        assert tiny_policy.image_token_id not in t.response_ids  # placeholders are never sampled


def test_group_pixels_are_held_once(counting_batch):
    tok = counting_batch.tokens
    assert tok.prompt_index == [b for b in range(3) for _ in range(4)]
    assert tok.vision.images_per_seq == [1, 1, 1]  # three prompts' images, not twelve copies
    assert tok.row_vision().pixel_values.shape[0] == 4 * tok.vision.pixel_values.shape[0]
    mb = tok.select([4, 5, 6, 7, 8])  # rows of groups 1 and 2
    assert mb.prompt_index == [0, 0, 0, 0, 1] and mb.vision.images_per_seq == [1, 1]
    torch.testing.assert_close(mb.vision.pixel_values, tok.vision.select([1, 2]).pixel_values)


def test_shared_prompt_logprobs_equal_full_forward(counting_batch, tiny_policy):
    """Encoding each prompt once and repeating its KV cache gives the same numbers and gradients."""
    tok, model = counting_batch.tokens, tiny_policy.model
    mask = tok.loss_mask.bool()
    results = []
    for share in (False, True):
        model.zero_grad()
        lp = tiny_policy.logprobs(tok, share_prompt=share)  # (N, T)
        torch.where(mask, lp, 0.0).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((torch.where(mask, lp, 0.0).detach(), grad))
    model.zero_grad()
    (lp_full, g_full), (lp_shared, g_shared) = results
    torch.testing.assert_close(lp_shared, lp_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_shared, g_full, atol=1e-4, rtol=1e-3)


def test_greedy_tokens_are_the_argmax_of_the_training_forward(tiny_policy):
    """Positions line up: with prompts of different lengths (left padding) the ids generated greedily are
    the argmax of the logits the loss reads, at every response position."""
    long_q = "Please look closely and count every {color} {shape} you can see in this image."
    envs = [CountingEnv(question=long_q) if i % 2 else CountingEnv() for i in range(6)]
    batch = rollout(tiny_policy, envs, list(range(6)), group_size=1, max_new_tokens=5, temperature=0.0)
    tok = batch.tokens
    assert len(set(tok.prompt_mask.sum(1).tolist())) > 1, "want prompts of different lengths"
    with torch.no_grad():
        ids = torch.cat([tok.prompt_ids, tok.response_ids], 1)
        mask = torch.cat([tok.prompt_mask, tok.response_mask], 1)
        kw = tiny_policy._model_inputs(ids, mask, tok.row_vision(), tiny_policy.model)
        T = tok.response_ids.shape[1]
        logits = tiny_policy.model(**kw, logits_to_keep=T + 1).logits[:, :-1]  # (N, T, V)
        lp = tiny_policy.logprobs(tok)
    top = logits.argmax(-1)
    m = tok.loss_mask.bool()
    assert torch.equal(top[m], tok.response_ids[m])
    assert torch.all(lp[m] <= 0)


def test_text_only_prompt_runs_on_vision_model(tiny_policy):
    prompts = [[{"role": "user", "content": [{"type": "text", "text": "What is two plus two?"}]}]] * 2
    ids, mask, vision = tiny_policy.encode_prompts(prompts)
    assert vision.empty
    comps, done = tiny_policy.generate(ids, mask, vision, max_new_tokens=3, temperature=1.0)
    assert len(comps) == 2 and all(1 <= len(c) <= 3 for c in comps)


def test_missing_model_folder_is_a_clear_error(tmp_path, monkeypatch):
    from mmgrpo.errors import ConfigError

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="mmgrpo tiny-model"):
        Policy.from_pretrained(tmp_path / "empty")  # a folder, but no saved model in it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for missing in (tmp_path / "nope", "runs/nope", "./nope", "a/b/c"):  # typos, not hub ids
        with pytest.raises(ConfigError, match="does not exist"):
            Policy.from_pretrained(missing)


def test_shared_prefill_generation_matches_hf_generate_greedy(tiny_policy):
    """Encoding each prompt once and decoding on the repeated cache gives Hugging Face generate's ids."""
    envs = [CountingEnv(distractors=1) for _ in range(3)]
    prompts = [env.reset(seed=s)[0] for s, env in enumerate(envs)]
    ids, mask, vision = tiny_policy.encode_prompts(prompts)
    rows = [b for b in range(3) for _ in range(4)]
    hf = tiny_policy.generate(ids[rows], mask[rows], vision.select(rows), max_new_tokens=6, temperature=0.0)
    shared = tiny_policy.generate(ids, mask, vision, max_new_tokens=6, temperature=0.0, num_samples=4)
    assert shared == hf


def test_sample_tokens_filters_and_distribution():
    from mmgrpo.model.policy import sample_tokens

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)  # (N, V)
    assert torch.equal(sample_tokens(logits, 0.0), torch.zeros(20000, dtype=torch.long))
    assert torch.equal(sample_tokens(logits, 1.0, top_k=1), torch.zeros(20000, dtype=torch.long))
    assert torch.equal(sample_tokens(logits, 1.0, top_p=0.5), torch.zeros(20000, dtype=torch.long))
    assert int((sample_tokens(logits, 1.0, suppress=[0]) == 0).sum()) == 0
    freq = torch.bincount(sample_tokens(logits, 1.0), minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)
    # top_p = 0.9: softmax is (0.644, 0.237, 0.087, 0.032); the first three reach 0.968 >= 0.9, the last is cut
    kept = torch.bincount(sample_tokens(logits, 1.0, top_p=0.9), minlength=4)
    assert kept[3] == 0 and kept[2] > 0
    hot = torch.bincount(sample_tokens(logits, 0.5), minlength=4).float() / 20000
    torch.testing.assert_close(hot, (logits[0] / 0.5).softmax(-1), atol=0.015, rtol=0)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("weights_missing", "has a config but no weights"),
        ("weights_truncated", "the weights cannot be read .* truncated or corrupt"),
        ("config_corrupt", "config.json cannot be read"),
        ("tokenizer_missing", "has no tokenizer files"),
    ],
)
def test_a_broken_model_folder_says_what_is_wrong(tiny_model_dir, tmp_path, damage, message):
    import shutil

    from mmgrpo.errors import ConfigError

    folder = tmp_path / damage
    shutil.copytree(tiny_model_dir, folder)
    if damage == "weights_missing":
        (folder / "model.safetensors").unlink()
    elif damage == "weights_truncated":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "config_corrupt":
        (folder / "config.json").write_text("{not json")
    else:
        (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=message):
        Policy.from_pretrained(folder)


def test_an_unreachable_hub_id_fails_at_once(monkeypatch):
    import socket

    from mmgrpo.errors import ConfigError

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", offline)
    with pytest.raises(
        ConfigError, match="not in the Hugging Face cache, and huggingface.co cannot be reached"
    ):
        Policy.from_pretrained("some-org/not-cached-model")  # no retries: the client never starts


def test_on_the_cpu_mode_flips_do_not_rekernelize(tiny_model_dir, monkeypatch):
    """transformers loads a model with hub-kernel swapping on when the ``kernels`` package is installed, and
    every train() / eval() that changes the mode then walks the model to kernelize it (1.7 ms a flip on the
    tiny VLM, nothing swapped on the CPU). A CPU policy turns it off; a plain load still has it."""
    from transformers import AutoModelForImageTextToText
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils import is_kernels_available

    walks = []
    real = PreTrainedModel.set_use_kernels

    def counted(self, *args, **kwargs):
        walks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", counted)
    if is_kernels_available():  # the behaviour this guards against, on a plain load
        plain = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
        walks.clear()
        plain.train(), plain.eval()
        # on by default where kernels is a dependency of transformers (5.25.0); 5.20.0 loads with it off (nothing
        # to guard against there), so the walks follow the flag at both ends of pyproject's range
        assert len(walks) == (2 if plain.use_kernels else 0)
    policy = Policy.from_pretrained(tiny_model_dir)
    walks.clear()
    for _ in range(3):
        policy.model.train(), policy.model.eval()
    assert not policy.model.use_kernels and walks == []
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # the same model as before: nothing was swapped
        again = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
        assert torch.equal(policy.model(input_ids=x).logits, again(input_ids=x).logits)
