"""The tiny checkpoints of ``mmgrpo.tiny.families`` load and run like hub checkpoints of their families."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmgrpo.tiny.families import FAMILIES, VISION_FAMILIES, build_tiny_family

# class, generation stop tokens, tokenizer eos, processor outputs besides input_ids/attention_mask, and a
# piece of the family's chat layout
EXPECTED = {
    "qwen2-vl": (
        "Qwen2VLForConditionalGeneration",
        ["<|im_end|>", "<|endoftext|>"],
        "<|im_end|>",
        {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "qwen2.5-vl": (
        "Qwen2_5_VLForConditionalGeneration",
        ["<|im_end|>", "<|endoftext|>"],
        "<|im_end|>",
        {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "qwen3-vl": (
        "Qwen3VLForConditionalGeneration",
        ["<|im_end|>", "<|endoftext|>"],
        "<|im_end|>",
        {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "llava": ("LlavaForConditionalGeneration", ["</s>"], "</s>", {"pixel_values"}, "USER: <image>\n"),
    "idefics3": (
        "Idefics3ForConditionalGeneration",
        ["<end_of_utterance>", "<|endoftext|>"],
        "<end_of_utterance>",
        {"pixel_values", "pixel_attention_mask"},
        "<end_of_utterance>\nUser:<image>",
    ),
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        ["<eos>", "<end_of_turn>"],
        "<eos>",
        {"pixel_values", "token_type_ids"},
        "<start_of_turn>user\n",
    ),
    "qwen3": ("Qwen3ForCausalLM", ["<|im_end|>", "<|endoftext|>"], "<|im_end|>", set(), "<|im_start|>user\n"),
    "llama": (
        "LlamaForCausalLM",
        ["<|eot_id|>", "<|end_of_text|>"],
        "<|eot_id|>",
        set(),
        "<|start_header_id|>user<|end_header_id|>\n\n",
    ),
}
GEN_PROMPT = {
    "qwen2-vl": "<|im_start|>assistant\n",
    "qwen2.5-vl": "<|im_start|>assistant\n",
    "qwen3-vl": "<|im_start|>assistant\n",
    "llava": " ASSISTANT:",
    "idefics3": "Assistant:",
    "gemma3": "<start_of_turn>model\n",
    "qwen3": "<|im_start|>assistant\n",
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}

# the token the processor repeats once per image feature (Gemma 3's text placeholder is <start_of_image>)
IMAGE_TOKEN = {
    "qwen2-vl": "<|image_pad|>",
    "qwen2.5-vl": "<|image_pad|>",
    "qwen3-vl": "<|image_pad|>",
    "llava": "<image>",
    "idefics3": "<image>",
    "gemma3": "<image_soft_token>",
}


def _image(w: int, h: int, color=(220, 40, 40)) -> Image.Image:
    im = Image.new("RGB", (w, h), (255, 255, 255))
    im.paste(color, (w // 4, h // 4, w // 2, h // 2))
    return im


def _user(text: str, n_images: int, vision: bool) -> dict:
    parts = [{"type": "image"} for _ in range(n_images if vision else 0)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, tmp_path_factory):
    """(family, directory, processor or tokenizer, model) for each family, built once and reloaded."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    family = request.param
    out = build_tiny_family(family, tmp_path_factory.mktemp(family.replace(".", "_")) / "model")
    vision = family in VISION_FAMILIES
    proc = (AutoProcessor if vision else AutoTokenizer).from_pretrained(out)
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(out)
    return family, out, proc, model.eval()


def test_checkpoint_config(built):
    from transformers import GenerationConfig

    family, out, proc, model = built
    cls, stops, eos, _, _ = EXPECTED[family]
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    tok = getattr(proc, "tokenizer", proc)
    gen = GenerationConfig.from_pretrained(out)
    eos_ids = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert set(eos_ids) >= {tok.convert_tokens_to_ids(t) for t in stops}
    assert gen.pad_token_id is not None and gen.pad_token_id == tok.pad_token_id
    assert tok.eos_token == eos
    assert len(tok) <= model.config.get_text_config().vocab_size
    if family in VISION_FAMILIES:
        assert model.config.image_token_id == tok.convert_tokens_to_ids(IMAGE_TOKEN[family])


def test_processor_forward_generate(built):
    family, _, proc, model = built
    _, _, _, keys, marker = EXPECTED[family]
    vision = family in VISION_FAMILIES
    convs = [
        [
            {"role": "system", "content": "You are a helpful assistant."},
            _user("How many red circles?", 1, vision),
        ],
        [_user("Count the objects.", 1, vision)],
    ]
    texts = [proc.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    assert marker in texts[0] and texts[1].endswith(GEN_PROMPT[family])
    if vision:
        enc = proc(text=texts, images=[[_image(40, 56)], [_image(64, 48)]], return_tensors="pt", padding=True)
    else:
        enc = proc(texts, return_tensors="pt", padding=True)
    assert set(enc) == {"input_ids", "attention_mask"} | keys
    assert (enc["attention_mask"][:, -1] == 1).all()  # left padding
    if vision:
        n_image_tokens = (enc["input_ids"] == model.config.image_token_id).sum(-1)
        assert ((n_image_tokens > 0) & (n_image_tokens <= 64)).all()
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    with torch.no_grad():
        out = model(**enc, labels=labels)
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
    assert out.logits.shape[:2] == enc["input_ids"].shape

    with torch.no_grad():
        generated = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert enc["input_ids"].shape[1] < generated.shape[1] <= enc["input_ids"].shape[1] + 3

    if vision:  # one conversation with two images
        text = proc.apply_chat_template(
            [_user("Which is bigger?", 2, True)], tokenize=False, add_generation_prompt=True
        )
        enc2 = proc(
            text=[text], images=[[_image(40, 40), _image(56, 32, (40, 40, 220))]], return_tensors="pt"
        )
        assert set(enc2) == {"input_ids", "attention_mask"} | keys
        assert (enc2["input_ids"] == model.config.image_token_id).sum() > n_image_tokens.min()
        with torch.no_grad():
            logits = model(**enc2).logits
        assert torch.isfinite(logits).all()


def test_chat_template_extends_prefixes(built):
    """A longer conversation renders (and tokenizes) as an extension of a shorter one."""
    family, _, proc, _ = built
    vision = family in VISION_FAMILIES
    tok = getattr(proc, "tokenizer", proc)
    image = {"type": "image", "image": _image(32, 32)}
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [image, {"type": "text", "text": "How many?"}] if vision else "How many?",
        },
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "zoom", "arguments": {"cell": 2}}\n</tool_call>',
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": [{"type": "text", "text": "4"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<answer>3</answer>"}]},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    tools = [{"type": "function", "function": {"name": "zoom", "description": "zoom", "parameters": {}}}]

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    for kw in ({}, {"tools": tools}):
        full = proc.apply_chat_template(messages, tokenize=False, **kw)
        full_ids = ids(full)
        for k in range(1, len(messages)):
            if messages[k - 1]["role"] == messages[k]["role"] == "tool" and family.startswith("qwen"):
                continue  # Qwen puts consecutive tool results in one user turn, closed after the last
            heads = [proc.apply_chat_template(messages[:k], tokenize=False, **kw)]
            if messages[k]["role"] == "assistant":
                heads.append(
                    proc.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True, **kw)
                )
            for head in heads:
                assert full.startswith(head), (k, head)
                assert full_ids[: len(ids(head))] == ids(head), (k, head)


def test_deterministic_for_a_seed(tmp_path):
    for family in ("qwen2-vl", "gemma3"):
        a = build_tiny_family(family, tmp_path / f"{family}-a", seed=1)
        b = build_tiny_family(family, tmp_path / f"{family}-b", seed=1)
        c = build_tiny_family(family, tmp_path / f"{family}-c", seed=2)
        for name in ("model.safetensors", "tokenizer.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny_family("gpt2", tmp_path)
