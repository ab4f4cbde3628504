"""Tiny offline models built from real transformers architectures with small configs and locally built
tokenizers: ``vlm`` (the embedded Qwen2.5-VL of the demos), ``text`` (a Qwen2 causal LM) and ``families``
(one tiny instance per supported model family, for tests).
"""

from mmgrpo.tiny.vlm import CHAT_TEMPLATE, TinyModelSpec, build_tiny_model, count_parameters, is_model_dir

__all__ = ["CHAT_TEMPLATE", "TinyModelSpec", "build_tiny_model", "count_parameters", "is_model_dir"]
