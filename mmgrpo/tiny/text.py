"""Build a tiny, offline text-only causal LM: a real ``Qwen2ForCausalLM`` with a small config.

The text-only twin of ``mmgrpo.tiny.vlm``: the same byte-level BPE tokenizer (``mmgrpo.tiny.vlm.build_tokenizer``,
with its Qwen special tokens, single-token answer tags and chat template) and the same sizes as the tiny
Qwen2.5-VL's language model (hidden 128 x 4 layers, 4 heads, 2 key/value heads, tied embeddings), with
plain 1-D rotary positions and no vision encoder. Saved with ``save_pretrained`` (model and tokenizer), so
``AutoTokenizer`` / ``AutoModelForCausalLM`` load it like a hub checkpoint and ``AutoProcessor`` returns
the tokenizer, which is how ``mmgrpo.model.policy.Policy`` tells a text-only model from a vision-language one.

Used by the tests and ``examples/text_math_tiny.yaml`` to exercise the text-only code paths.
"""

from __future__ import annotations

from pathlib import Path

from mmgrpo.tiny.vlm import TinyModelSpec, build_tokenizer, language_config_kwargs, save_whole


def build_text_config(tokenizer, spec: TinyModelSpec):
    """A Qwen2Config with the tiny VL model's language sizes whose token ids point into ``tokenizer``."""
    from transformers import Qwen2Config

    return Qwen2Config(**language_config_kwargs(tokenizer, spec))


def build_tiny_text_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build and save the tiny text-only model and its tokenizer to ``out_dir``; returns the path.

    Deterministic: the same seed gives byte-identical weights and tokenizer files.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    spec = TinyModelSpec(seed=seed)
    tokenizer = build_tokenizer(spec.vocab_size)
    config = build_text_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's random state
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, getattr(config, name))

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return save_whole(out_dir, write)  # in OUT.partial, renamed when complete
