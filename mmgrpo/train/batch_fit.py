"""Does a step's batch fit in memory? Checked once, before the first rollout, so that a batch far too large
(``grpo.tasks_per_step=100000``) is one line naming the keys, not a process the kernel kills in silence.

The estimate is a lower bound of what generation alone holds: every episode of a step is sampled at once,
each with its key/value cache over its prompt and turns and the decode step's logits. The training pass
runs in micro-batches (``grpo.micro_batch_size``) and is not counted."""

from __future__ import annotations

from pathlib import Path

import torch

from mmgrpo.errors import ConfigError

GIB = 2**30


def free_bytes(device: torch.device | str) -> int | None:
    """Memory free for this process on ``device``: MemAvailable on the CPU, the GPU's free memory on CUDA;
    None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def generation_bytes(text_config, *, rows: int, tokens: int, dtype_bytes: int) -> int:
    """Lower bound of the memory a batch of ``rows`` episodes of ``tokens`` tokens holds while it is sampled:
    the key/value cache (2 x layers x kv heads x head dim per token) and two float32 rows of logits."""
    c = text_config
    heads = getattr(c, "num_attention_heads", 1) or 1
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    return rows * (tokens * per_token + 2 * c.vocab_size * 4)


def check(cfg, policy, make_env, device, processes: int = 1) -> None:
    """Raise ConfigError (one line) when a step's episodes cannot be sampled in the memory free on ``device``
    (``processes`` share the machine's memory on the CPU); the prompt's length is the env's first one."""
    free = free_bytes(device)
    if free is None:
        return
    model, prompt_tokens = policy.model, first_prompt_tokens(policy, make_env)
    g, env = cfg.grpo, cfg.env
    turns = g.max_new_tokens * max(env.max_turns, 1)
    tokens = prompt_tokens + min(turns, env.max_episode_tokens or turns)
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    rows = g.tasks_per_step * g.group_size
    need = generation_bytes(model.config.get_text_config(), rows=rows, tokens=tokens, dtype_bytes=dtype_bytes)
    if torch.device(device).type == "cpu":
        need *= processes
    if need > free:
        raise ConfigError(
            f"grpo.tasks_per_step={g.tasks_per_step} x grpo.group_size={g.group_size} = {rows} episodes per step "
            f"are sampled at once and need at least {need / GIB:.1f} GiB (key/value cache over ~{tokens} tokens "
            f"each, and logits), more than the {free / GIB:.1f} GiB free on {device}: lower grpo.tasks_per_step "
            "(default 16) or grpo.group_size"
        )


def first_prompt_tokens(policy, make_env) -> int:
    """Tokens of the env's first training prompt (0 when it cannot be posed: the rollout says why later)."""
    env = make_env()
    try:
        obs, info = env.reset(seed=0, options={"split": "train"})
        ids, _, _ = policy.encode_prompts([obs], [info.get("tools") or None])
        return int(ids.shape[1])
    except Exception:  # noqa: BLE001 - an estimate only
        return 0
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()
