"""Build a tiny, offline vision-language model: a real Qwen2.5-VL with a small config.

The demo, the tests and the benchmarks cannot download anything, so mmgrpo builds its own model: the
transformers ``Qwen2_5_VLForConditionalGeneration`` architecture (the same code that runs
Qwen/Qwen2.5-VL-3B-Instruct) with a few hundred thousand parameters, a byte-level BPE tokenizer trained
here on a small built-in corpus, the stock Qwen2-VL image and video processors and a Qwen-style chat
template. Everything is saved with ``save_pretrained``, so ``AutoProcessor.from_pretrained(out)`` and
``AutoModelForImageTextToText.from_pretrained(out)`` load it exactly like a hub checkpoint, and every other
part of mmgrpo uses it through the same code path as a real model.

Departures from the real Qwen tokenizer, on purpose: the vocabulary is a few hundred tokens, digits are
split one per token (as Qwen does), and the tags ``<answer>``, ``</answer>``, ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>`` are single added tokens so that a tiny model's answers are short.

Run: ``mmgrpo tiny-model runs/tiny-model`` (deterministic for a given ``--seed``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mmgrpo.model.io import share_file_modes
from mmgrpo.model.tool_prompt import TOOLS_POSTAMBLE, TOOLS_PREAMBLE  # Qwen2.5's tools block

# Special tokens of the Qwen2.5-VL vocabulary, in the order Qwen assigns them after the BPE merges.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Tags that tasks use; single tokens, decoded as text (not "special", so they survive skip_special_tokens).
TAG_TOKENS = [
    "<answer>",
    "</answer>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# A Qwen2.5-style chat template. Content is a string or a list of parts {"type": "text"|"image", ...}.
# Like Qwen2.5's it renders ``tools=`` into the system message and ``tool`` messages as <tool_response>
# blocks inside one user turn (consecutive tool messages share it). Unlike the real Qwen template it adds
# no default system prompt, so that a run of later messages renders to exactly the tokens that follow the
# earlier ones (multi-turn episodes append without re-encoding). An assistant message with ``tool_calls``
# (OpenAI-style, as TRL and transformers' response parsing write them; mmgrpo itself never does) renders as
# Qwen2.5's does: ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` after its text, if any.
_PARTS = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
NL = "{{ '\\n' }}"  # a newline right after a block tag: HF renders templates with trim_blocks=True
# The assistant branch for ``tool_calls`` (Qwen2.5's): its text (when not empty), then one block per call.
_TOOL_CALLS = (
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% set body %}" + _PARTS + "{% endset %}"
    "<|im_start|>assistant{% if body %}" + NL + "{{ body }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    + NL
    + "<tool_call>"
    + NL
    + "{{ '{\"name\": \"' }}{{ call['name'] }}{{ '\", \"arguments\": ' }}{{ call['arguments'] | tojson }}{{ '}' }}"
    + NL
    + "</tool_call>{% endfor %}<|im_end|>\n"
)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{% set message = messages[0] %}"
    + _PARTS
    + NL
    + NL
    + "{% endif %}"
    + TOOLS_PREAMBLE
    + "{% for tool in tools %}"
    + NL
    + "{{ tool | tojson }}{% endfor %}"
    + NL
    + TOOLS_POSTAMBLE.removeprefix("\n")
    + "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    + NL
    + "<tool_response>\n"
    + _PARTS
    + NL
    + "</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    + _TOOL_CALLS
    + "{% else %}"
    "<|im_start|>{{ message['role'] }}\n" + _PARTS + "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "how many are there in the image picture scene count objects object question answer reply with "
    "number only inside e.g. you a an is of and or to what which where color colour shape shapes "
    "red green blue yellow orange purple black white gray grey brown pink cyan "
    "circle circles square squares triangle triangles star stars box boxes dot dots ball balls "
    "left right top bottom middle center above below next large small big tiny "
    "system user assistant tool call result error true false yes no none zero one two three four five "
    "six seven eight nine ten think step first then so total plus minus times equals "
    "Count the objects the question asks about. Reply with the number only, e.g. "
    "You are a helpful assistant. Solve the problem. What is"
)
# Words of tool schemas (transformers' get_json_schema) and of the built-in tools' descriptions.
_SCHEMA_WORDS = (
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
    'expression", "parameters": {"type": "object", "properties": {"expression": {"type": "string", '
    '"description": "an arithmetic expression, e.g."}}, "required": ["expression"]}, "return": {"type": '
    '"string"}}} integer number boolean array crop zoom cell python code http_get url image grid '
    "Use a tool when you need it, then answer with the number only, inside <answer></answer>. "
    "What is the product? error: unknown tool invalid arguments timeout Available tools"
)
# Prompts of the built-in tasks, so that their words are single tokens (shorter, faster sequences).
_PROMPTS = [
    "Count the objects the question asks about. Reply with the number only, inside <answer></answer>, "
    "e.g. <answer>3</answer>.",
    "How many {c} {s}s are in the image?",
]
_COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
_SHAPES = ["circle", "square", "triangle", "diamond"]


@dataclass
class TinyModelSpec:
    """Sizes of the tiny Qwen2.5-VL. Defaults give about 0.9M parameters."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vision_hidden_size: int = 64
    vision_depth: int = 2
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 16
    max_position_embeddings: int = 2048


def _corpus() -> list[str]:
    """A small, fixed training corpus for the BPE tokenizer (order matters for determinism)."""
    lines = [_WORDS, "system\nuser\nassistant\ntool\n", "\nsystem\n\nuser\n\nassistant\n"]
    for _ in range(20):  # repetition makes the prompt words win merges over rarer byte pairs
        lines.append(_PROMPTS[0])
        lines += [_PROMPTS[1].format(c=c, s=s) for c in _COLORS for s in _SHAPES]
    for n in range(0, 101):
        lines.append(f"{n} <answer>{n}</answer> How many? {n}")
    # tool use: the tools block, JSON schemas and Hermes-style calls, so that a call is a few tokens
    for i in range(10):
        lines += [TOOLS_PREAMBLE, TOOLS_POSTAMBLE, _SCHEMA_WORDS]
        lines.append(
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{i}{i + 3} * {i + 1}7"}}}}\n'
            f"</tool_call> <tool_response>\n{i * 37}\n</tool_response>"
        )
        lines.append(f'<tool_call>\n{{"name": "zoom", "arguments": {{"cell": {i}}}}}\n</tool_call>')
    lines.append(" ".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer with the Qwen special tokens, trained offline on ``_corpus()``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TAG_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.add_tokens(TAG_TOKENS)
    fast.padding_side = "left"
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_processor(tokenizer, spec: TinyModelSpec):
    """The stock Qwen2.5-VL processor (image + video processors) around our tokenizer."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def special_token_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def language_config_kwargs(tokenizer, spec: TinyModelSpec) -> dict:
    """Sizes and token ids of the tiny language model, shared by the VL model and the text-only one."""
    ids = special_token_ids(tokenizer)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )


def build_config(tokenizer, spec: TinyModelSpec):
    """A Qwen2_5_VLConfig with small sizes whose token ids point into ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.hidden_size // spec.num_heads  # 32
    half = head_dim // 2  # mrope splits head_dim/2 rotary frequencies into (temporal, height, width)
    mrope_section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16 -> [4, 6, 6]
    text = language_config_kwargs(tokenizer, spec)
    text["rope_parameters"]["mrope_section"] = mrope_section
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_heads=spec.vision_heads,
        out_hidden_size=spec.hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[spec.vision_depth - 1],
    )
    ids = special_token_ids(tokenizer)
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_tiny_model(
    out_dir: str | Path,
    spec: TinyModelSpec | None = None,
    sees: bool = False,
    perception=None,
    pretrain: bool = False,
    marks: bool = False,
) -> Path:
    """Build and save the tiny model, tokenizer and processor to ``out_dir``; returns the path.

    ``sees``: then give it the perception pretraining of ``mmgrpo.tiny.perception`` (settings ``perception``,
    a PerceptionSpec) before the folder is put in place: the shipped result of it for the default
    settings (a second), else (or with ``pretrain``) the pretraining itself (20-30 s); without ``sees`` the
    model is blind (a random vision encoder nothing has learnt to read), which most tests want.
    ``marks`` (with ``sees``): then the marking pretraining of ``mmgrpo.tiny.marks`` too (about a minute).
    Deterministic: the same spec (seed included) gives byte-identical weights and tokenizer files.
    """
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer(spec.vocab_size)
    processor = build_processor(tokenizer, spec)
    config = build_config(tokenizer, spec)
    devices = []  # fork the RNG so building a model does not disturb the caller's random state
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(spec.seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.bos_token_id = config.text_config.bos_token_id

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        (folder / "mmgrpo_tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
        if sees:
            from mmgrpo.tiny.perception import pretrain_perception, shipped_fits, take_shipped

            if not pretrain and shipped_fits(asdict(spec), perception):
                take_shipped(folder)
            else:
                pretrain_perception(folder, perception)
            if marks:
                from mmgrpo.tiny.marks import pretrain_marks

                pretrain_marks(folder)

    return save_whole(out_dir, write)


def save_whole(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(folder)`` on ``<out_dir>.partial`` and put the result in place only when it is complete:
    a failure (a full disk, a read-only folder, Ctrl-C) removes the partial folder and leaves ``out_dir`` as
    it was, so there is never a folder with a config and no weights. A missing or empty ``out_dir`` is
    replaced by the partial folder in one rename; into a folder that holds other files the new files are
    moved one by one (renames, which need no space). Weight files get the mode of the folder's other files.
    Raises OSError (FileExistsError when ``out_dir`` is a file).
    """
    import errno
    import shutil

    from mmgrpo.model.io import first_missing, remove_if_no_files

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(errno.EEXIST, "it is a file, not a folder", str(out))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a process that was killed
    created = first_missing(out.parent)
    try:
        partial.mkdir(parents=True)
        write(partial)
        share_file_modes(partial)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():
            for f in sorted(partial.iterdir()):
                os.replace(f, out / f.name)
            partial.rmdir()
        else:
            os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        remove_if_no_files(created)
        raise
    return out


def is_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a saved model (config and weights)."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
