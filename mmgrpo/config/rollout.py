"""The ``rollout`` section: which engine samples the episodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmgrpo.config.types import Section


@dataclass(frozen=True)
class RolloutConfig(Section):
    engine: Literal["mmgrpo", "vllm"] = "mmgrpo"
    """Who samples: mmgrpo's own decode loop in this process, or vLLM in its own process and Python
    environment (`mmgrpo vllm-env` makes it), the policy's weights pushed to it after every optimizer step.
    vllm: Qwen2-VL / Qwen2.5-VL images go in as the policy's own image features; LoRA as merged weights;
    one process (docs/vllm.md)."""
    vllm_python: str = ""
    """The python of the environment with vLLM; empty = the one `mmgrpo vllm-env` made ($MMGRPO_VLLM_VENV,
    else ~/.cache/mmgrpo/vllm)."""
    vllm_max_model_len: int = 4096
    """The longest sequence (prompt and every turn) the vLLM engine holds."""
    vllm_kv_mb: int = 256
    """The vLLM engine's KV-cache budget in MiB (its default would reserve most of the memory)."""
    vllm_streams: bool = True
    """Multi-turn episodes through vLLM each as their own stream of requests: an episode's next turn is
    sampled as soon as its env answered, its env step runs while others sample (false: every live episode
    advances one turn at a time, as with engine mmgrpo)."""

    def _validate(self) -> None:
        for name in ("vllm_max_model_len", "vllm_kv_mb"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
