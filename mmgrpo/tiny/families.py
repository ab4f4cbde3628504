"""Tiny, random, real checkpoints of eight model families, built offline.

``mmgrpo.tiny.vlm`` builds one tiny Qwen2.5-VL; this module builds the same kind of stand-in for every family
that mmgrpo supports, so that each family's code path (processor outputs, forward keywords, positions,
caches, stop ids, chat template) can be tested without a download:

| family       | model class                              | processor / tokenizer                      |
|--------------|------------------------------------------|--------------------------------------------|
| qwen2-vl     | Qwen2VLForConditionalGeneration          | Qwen2VLProcessor (14 px patches)           |
| qwen2.5-vl   | Qwen2_5_VLForConditionalGeneration       | Qwen2_5_VLProcessor (``mmgrpo.tiny.vlm``)      |
| qwen3-vl     | Qwen3VLForConditionalGeneration          | Qwen3VLProcessor (16 px patches)           |
| llava        | LlavaForConditionalGeneration (CLIP)     | LlavaProcessor + CLIPImageProcessor        |
| idefics3     | Idefics3ForConditionalGeneration         | Idefics3Processor, no image splitting      |
| gemma3       | Gemma3ForConditionalGeneration (SigLIP)  | Gemma3Processor + Gemma3ImageProcessor     |
| qwen3        | Qwen3ForCausalLM                         | tokenizer only                             |
| llama        | LlamaForCausalLM                         | tokenizer only                             |

Every model is the transformers architecture with a language model of hidden size 64 x 2 layers (4 heads,
2 key/value heads, head_dim 16, tied embeddings) and, for the vision families, a vision tower of hidden
size 32 x 2 layers. An image becomes 4 to 16 tokens with the Qwen processors (dynamic resolution, any input
size) and exactly 16 with the others (resized to 32 x 32 px; Idefics3 without image splitting). Each model
has 130k-250k parameters and builds in well under a second once transformers is imported. Everything is
saved with ``save_pretrained``, so ``AutoProcessor`` / ``AutoTokenizer`` and
``AutoModelForImageTextToText`` / ``AutoModelForCausalLM`` load them like hub checkpoints.

Tokenizers: every family starts from ``mmgrpo.tiny.vlm.build_tokenizer`` (the same small byte-level BPE, its
single-token answer/think/tool tags, and the Qwen special tokens, which stay in every vocabulary) and adds
the family's own special tokens on top, with the family's bos/eos/pad roles. No tokenizer adds special
tokens by itself: the chat templates write the bos token where the family's template does.

Chat templates follow each family's real layout (Qwen ``<|im_start|>``, Llama 3 headers, Gemma turns,
SmolVLM ``User:``/``Assistant:``, LLaVA-1.5 ``USER:``/``ASSISTANT:``), take content as a string or a list of
``{"type": "text"|"image"}`` parts, and never rewrite past turns (no dates, no default system prompt, no
trimming), so a longer conversation renders (and tokenizes) as an extension of a shorter one; the one
exception is Qwen's, which puts consecutive tool results in one user turn closed after the last. ``tool``
messages render as the family's user-like turn (Llama 3: ``ipython``); only the Qwen templates render
``tools=`` (for the others ``Policy.render`` writes mmgrpo's tools block itself: ``mmgrpo.model.tool_prompt``).

``generation_config.json`` lists the family's stop ids, e.g. Qwen ``[<|im_end|>, <|endoftext|>]``, Llama 3
``[<|eot_id|>, <|end_of_text|>]``, Gemma 3 ``[<eos>, <end_of_turn>]``, Idefics3
``[<end_of_utterance>, <|endoftext|>]``, LLaVA ``[</s>]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmgrpo.tiny.vlm import CHAT_TEMPLATE as QWEN_CHAT_TEMPLATE
from mmgrpo.tiny.vlm import SPECIAL_TOKENS as QWEN_SPECIAL_TOKENS
from mmgrpo.tiny.vlm import TinyModelSpec, build_config, build_processor, build_tokenizer, save_whole

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava", "idefics3", "gemma3", "qwen3", "llama")
VISION_FAMILIES = FAMILIES[:6]
TEXT_FAMILIES = FAMILIES[6:]

# Sizes shared by all families.
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
INTERMEDIATE = 128
MAX_POSITIONS = 4096
VISION_HIDDEN = 32
VISION_LAYERS = 2
VISION_HEADS = 2
VISION_INTERMEDIATE = 64
# M-RoPE splits head_dim/2 rotary frequencies into (temporal, height, width): 8 -> [2, 3, 3]
MROPE_SECTION = [HEAD_DIM // 2 - 2 * (HEAD_DIM // 2 * 3 // 8), HEAD_DIM // 2 * 3 // 8, HEAD_DIM // 2 * 3 // 8]

# Qwen-style dynamic resolution: an image becomes 4 to 16 merged tokens (2x2 to 4x4 merged patches).
QWEN2_PATCH = 14  # Qwen2-VL, Qwen2.5-VL
QWEN3_PATCH = 16  # Qwen3-VL
# Fixed-resolution towers: 32 px images, 16 image tokens each.
FIXED_IMAGE_SIZE = 32
FIXED_IMAGE_TOKENS = 16


# ------------------------------------------------------------------------------------------ chat templates


def _jinja_str(text: str) -> str:
    """A jinja expression printing ``text`` (literal newlines after block tags would be trimmed)."""
    return (
        "{{ '" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "' }}" if text else ""
    )


def _parts(image: str) -> str:
    """Jinja rendering ``message['content']``: a string, or text/image parts, an image printing ``image``."""
    return (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}"
        + _jinja_str(image)
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}"
    )


# Llama 3 / 3.1 instruct without the date lines; tool results use Llama 3.1's ``ipython`` role.
LLAMA3_CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}" + _parts("") + "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Gemma 3: the system message opens the first user turn, the assistant is ``model``, an image is
# ``<start_of_image>`` (the processor expands it). Unlike Gemma's own template nothing is trimmed.
GEMMA3_CHAT_TEMPLATE = (
    "{{ '<bos>' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set message = messages[0] %}{% set first_prefix %}" + _parts("<start_of_image>") + "{{ '\\n\\n' }}"
    "{% endset %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' }}{% if loop.first %}{{ first_prefix }}{% endif %}"
    + _parts("<start_of_image>")
    + "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# SmolVLM / Idefics3: ``User:<image>text<end_of_utterance>\nAssistant: text<end_of_utterance>\n``.
IDEFICS3_CHAT_TEMPLATE = (
    "{{ '<|im_start|>' }}"
    "{% for message in messages %}"
    "{% set role = 'User' if message['role'] == 'tool' else message['role'] | capitalize %}"
    "{% if message['content'] is not string and message['content'] and message['content'][0]['type'] == 'image' %}"
    "{{ role + ':' }}{% else %}{{ role + ': ' }}{% endif %}"
    + _parts("<image>")
    + "{{ '<end_of_utterance>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# LLaVA-1.5 (Vicuna v1): ``sys USER: <image>\ntext ASSISTANT: text</s>USER: ...``. The space between turns
# opens the next turn (not closes the previous one), so that a rendered prefix also tokenizes as a prefix.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first and (message['role'] == 'assistant' or messages[loop.index0 - 1]['role'] != 'assistant') %}"
    "{{ ' ' }}{% endif %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' }}"
    "{% else %}{{ 'USER: ' }}{% endif %}"
    + _parts("<image>\n")
    + "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ ' ' }}{% endif %}{{ 'ASSISTANT:' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------- tokenizers


def family_tokenizer(
    specials: list[str],
    *,
    eos: str,
    pad: str,
    bos: str | None = None,
    chat_template: str,
    named: dict[str, str] | None = None,
):
    """``mmgrpo.tiny.vlm.build_tokenizer`` plus the family's special tokens and bos/eos/pad roles.

    ``named`` are model-specific tokens the family's processor reads as tokenizer attributes (e.g. Gemma 3's
    ``boi_token``/``image_token``); they are saved in tokenizer_config.json like the hub's.
    """
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer()
    vocab = base.get_vocab()
    new = [t for t in specials if t not in vocab]
    base.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        extra_special_tokens=list(specials),
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        chat_template=chat_template,
        **(named or {}),
    )


def qwen_tokenizer():
    """The Qwen tokenizer of ``mmgrpo.tiny.vlm``: eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos."""
    return family_tokenizer(
        QWEN_SPECIAL_TOKENS[1:], eos="<|im_end|>", pad="<|endoftext|>", chat_template=QWEN_CHAT_TEMPLATE
    )


def _ids(tokenizer, *tokens: str) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"token missing from the vocabulary: {tokens}")
    return ids


def _text_kwargs(tokenizer, *, bos: str | None, eos: str, pad: str) -> dict:
    """Language-model sizes and token ids common to all families."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.convert_tokens_to_ids(bos) if bos else None,
        eos_token_id=tokenizer.convert_tokens_to_ids(eos),
        pad_token_id=tokenizer.convert_tokens_to_ids(pad),
        tie_word_embeddings=True,
    )


# ---------------------------------------------------------------------------------------------- families
# Each builder returns (config, processor or tokenizer, generation stop ids); build_tiny_family does the rest.


def _qwen_image_processor(patch: int, mean_std: float | None = None):
    from transformers import Qwen2VLImageProcessor

    unit = patch * 2  # one merged token covers 2x2 patches
    size = {"shortest_edge": unit * unit * 4, "longest_edge": unit * unit * 16}
    kw = {} if mean_std is None else {"image_mean": [mean_std] * 3, "image_std": [mean_std] * 3}
    return Qwen2VLImageProcessor(size=size, patch_size=patch, merge_size=2, temporal_patch_size=2, **kw)


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = qwen_tokenizer()
    image_processor = _qwen_image_processor(QWEN2_PATCH)
    video_processor = Qwen2VLVideoProcessor(
        size=dict(image_processor.size), patch_size=QWEN2_PATCH, merge_size=2, temporal_patch_size=2
    )
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    text = _text_kwargs(tok, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    text.pop("head_dim")  # Qwen2 derives it from hidden_size / heads
    text["bos_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": MROPE_SECTION,
    }
    image, video, start, end = _ids(
        tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=VISION_LAYERS,
            embed_dim=VISION_HIDDEN,
            hidden_size=HIDDEN,  # the merger's output width = the language model's
            mlp_ratio=VISION_INTERMEDIATE // VISION_HIDDEN,
            num_heads=VISION_HEADS,
            patch_size=QWEN2_PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    return config, processor, _ids(tok, "<|im_end|>", "<|endoftext|>")


def _qwen2_5_vl():
    """``mmgrpo.tiny.vlm``'s config and processor at this module's sizes."""
    tok = qwen_tokenizer()
    spec = TinyModelSpec(
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        vision_hidden_size=VISION_HIDDEN,
        vision_depth=VISION_LAYERS,
        vision_heads=VISION_HEADS,
        vision_intermediate_size=VISION_INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
    )
    return build_config(tok, spec), build_processor(tok, spec), _ids(tok, "<|im_end|>", "<|endoftext|>")


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = qwen_tokenizer()
    image_processor = _qwen_image_processor(QWEN3_PATCH, mean_std=0.5)
    video_processor = Qwen3VLVideoProcessor(
        size=dict(image_processor.size), patch_size=QWEN3_PATCH, merge_size=2, temporal_patch_size=2
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    text = _text_kwargs(tok, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        text.pop(key)  # Qwen3VLTextConfig has no bos/eos fields; tying is the top-level config's
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": MROPE_SECTION,
        "mrope_interleaved": True,
    }
    image, video, start, end = _ids(
        tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=dict(
            depth=VISION_LAYERS,
            hidden_size=VISION_HIDDEN,
            intermediate_size=VISION_INTERMEDIATE,
            num_heads=VISION_HEADS,
            patch_size=QWEN3_PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=HIDDEN,
            num_position_embeddings=64,  # an 8x8 grid of learned positions, interpolated per image
            deepstack_visual_indexes=[0],
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    return config, processor, _ids(tok, "<|im_end|>", "<|endoftext|>")


def _llava():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor

    tok = family_tokenizer(
        ["<s>", "</s>", "<pad>", "<image>"],
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        chat_template=LLAVA_CHAT_TEMPLATE,
        named={"image_token": "<image>"},
    )
    patch = FIXED_IMAGE_SIZE // 4  # 4x4 patches = 16 image tokens (the CLS position is dropped)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": FIXED_IMAGE_SIZE},
        crop_size={"height": FIXED_IMAGE_SIZE, "width": FIXED_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token="<image>",
    )
    vision = CLIPVisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=FIXED_IMAGE_SIZE,
        patch_size=patch,
        projection_dim=VISION_HIDDEN,
    )
    text = LlamaConfig(**_text_kwargs(tok, bos="<s>", eos="</s>", pad="<pad>"))
    (image,) = _ids(tok, "<image>")
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image,
        image_seq_length=FIXED_IMAGE_TOKENS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,  # LLaVA-1.5: the penultimate CLIP layer (the last one is unused)
        tie_word_embeddings=True,
    )
    return config, processor, _ids(tok, "</s>")


def _idefics3():
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor, LlamaConfig

    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = family_tokenizer(
        ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid],
        bos="<|im_start|>",
        eos="<end_of_utterance>",
        pad="<|endoftext|>",
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": FIXED_IMAGE_SIZE},
        max_image_size={"longest_edge": FIXED_IMAGE_SIZE},
        do_image_splitting=False,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=FIXED_IMAGE_TOKENS,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )
    scale = 2  # pixel shuffle: 2x2 patches -> one token
    patch = FIXED_IMAGE_SIZE // (scale * 4)  # 8x8 patches -> 4x4 = 16 tokens
    text = LlamaConfig(**_text_kwargs(tok, bos="<|im_start|>", eos="<end_of_utterance>", pad="<|endoftext|>"))
    (image,) = _ids(tok, "<image>")
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=VISION_HIDDEN,
            intermediate_size=VISION_INTERMEDIATE,
            num_hidden_layers=VISION_LAYERS,
            num_attention_heads=VISION_HEADS,
            image_size=FIXED_IMAGE_SIZE,
            patch_size=patch,
        ),
        text_config=text,
        scale_factor=scale,
        image_token_id=image,
        pad_token_id=text.pad_token_id,  # deprecated top-level copy; its default (128002) is out of vocabulary
        tie_word_embeddings=True,
    )
    return config, processor, _ids(tok, "<end_of_utterance>", "<|endoftext|>")


def _gemma3():
    from transformers import (
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tok = family_tokenizer(
        ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
        + ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        named={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = Gemma3ImageProcessor(
        size={"height": FIXED_IMAGE_SIZE, "width": FIXED_IMAGE_SIZE},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_pan_and_scan=False,
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=FIXED_IMAGE_TOKENS,
    )
    text = _text_kwargs(tok, bos="<bos>", eos="<eos>", pad="<pad>")
    text.update(
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],  # Gemma 3 alternates 5 local : 1 global
    )
    vision = SiglipVisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=FIXED_IMAGE_SIZE,
        patch_size=FIXED_IMAGE_SIZE // 8,  # 8x8 patches, average-pooled 2x2 to 16 tokens
        vision_use_head=False,
    )
    boi, eoi, image = _ids(tok, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    config = Gemma3Config(
        text_config=Gemma3TextConfig(**text),
        vision_config=vision,
        mm_tokens_per_image=FIXED_IMAGE_TOKENS,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        tie_word_embeddings=True,
    )
    return config, processor, _ids(tok, "<eos>", "<end_of_turn>")


def _qwen3():
    from transformers import Qwen3Config

    tok = qwen_tokenizer()
    text = _text_kwargs(tok, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    text["bos_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    return Qwen3Config(**text), tok, _ids(tok, "<|im_end|>", "<|endoftext|>")


def _llama():
    from transformers import LlamaConfig

    tok = family_tokenizer(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        + ["<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )
    text = _text_kwargs(tok, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    return LlamaConfig(**text), tok, _ids(tok, "<|eot_id|>", "<|end_of_text|>")


_BUILDERS = {
    "qwen2-vl": _qwen2_vl,
    "qwen2.5-vl": _qwen2_5_vl,
    "qwen3-vl": _qwen3_vl,
    "llava": _llava,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "qwen3": _qwen3,
    "llama": _llama,
}


def _model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return auto._model_mapping[type(config)]


def _write_generation_config(out: Path, eos_ids: list[int], pad_id: int, bos_id: int | None) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig(eos_token_id=list(eos_ids), pad_token_id=pad_id, bos_token_id=bos_id)
    gen.save_pretrained(out)


def build_tiny_family(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build and save a tiny random checkpoint of ``family`` (one of ``FAMILIES``) to ``out_dir``.

    Deterministic: the same family and seed give the same weights and tokenizer. Returns the path.
    """
    import torch

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    config, processor, eos_ids = _BUILDERS[family]()
    cls = _model_class(config)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's random state
        torch.manual_seed(seed)
        model = cls(config)
    text = config.get_text_config()

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        _write_generation_config(folder, eos_ids, text.pad_token_id, getattr(text, "bos_token_id", None))
        processor.save_pretrained(folder)
        spec = {"family": family, "seed": seed}
        (folder / "mmgrpo_tiny.json").write_text(json.dumps(spec, indent=2) + "\n")

    return save_whole(out_dir, write)  # in OUT.partial, renamed when complete
