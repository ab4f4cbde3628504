"""The model card written with a run's final model: ``final/README.md`` in the Hugging Face format (YAML
front matter, then markdown) saying what the model is: its base model, the task (env and verifiers), the
training recipe in a few lines and the final metrics. The full resolved config is next to it
(``mmgrpo_config.yaml``); ``hub.push`` uploads the folder with its card (``mmgrpo.train.hub``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mmgrpo.config.core import Config

CARD_METRICS = ("reward", "eval_accuracy", "kl", "completion_len", "frac_zero_std_groups", "truncated_frac")
"""The final step's metrics the card shows (with every ``reward/<verifier>``), in this order."""


def _value(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def card_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The metrics of the final step's ``record`` that the card lists."""
    keys = [k for k in CARD_METRICS if k in record]
    keys[1:1] = sorted(k for k in record if k.startswith("reward/"))
    return {k: record[k] for k in keys if isinstance(record[k], (int, float))}


def model_card(cfg: Config, record: dict[str, Any], *, warm_start_steps: int = 0) -> str:
    """The text of README.md for the final model of run ``cfg`` whose last step's metrics are ``record``."""
    g, base = cfg.grpo, cfg.model.path
    verifiers = ", ".join(f"`{v.name}` (weight {v.weight:g})" for v in cfg.verifiers)
    env_kwargs = json.dumps(cfg.env.kwargs, default=str) if cfg.env.kwargs else ""
    front = ["---", "library_name: transformers", "tags:", "- mmgrpo", "- grpo", "- reinforcement-learning"]
    if base and not Path(base).exists():  # a hub id: the hub links the base model
        front.append(f"base_model: {base}")
    front.append("---")
    warm = f"{warm_start_steps} supervised warm-start steps, then " if warm_start_steps else ""
    lines = [
        *front,
        "",
        f"# {Path(cfg.output_dir).name or 'mmgrpo model'}",
        "",
        f"Trained with GRPO by mmgrpo from `{base}` on the `{cfg.env.name}` environment.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| task | env `{cfg.env.name}`" + (f" with `{env_kwargs}`" if env_kwargs else "") + " |",
        f"| rewards | {verifiers} |",
        f"| recipe | {warm}{g.steps} GRPO steps of {g.tasks_per_step} tasks x {g.group_size} episodes |",
        f"| optimizer | AdamW, lr {g.lr:g} ({g.lr_schedule}), beta (KL) {g.beta:g} |",
        f"| sampling | temperature {g.temperature:g}, at most {g.max_new_tokens} new tokens per turn, "
        f"{cfg.env.max_turns} turn(s) |",
        f"| seed | {cfg.seed} |",
        "",
        f"## Final metrics (step {record.get('step', g.steps)})",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {k} | {_value(v)} |" for k, v in card_metrics(record).items()),
        "",
        "The whole resolved config is in `mmgrpo_config.yaml`; `mmgrpo eval CONFIG --model THIS_FOLDER` "
        "evaluates the model on held-out tasks.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(folder: Path, cfg: Config, record: dict[str, Any], *, warm_start_steps: int = 0) -> Path:
    """Write :func:`model_card` to ``folder/README.md`` (the model folder exists); returns its path."""
    path = Path(folder) / "README.md"
    path.write_text(model_card(cfg, record, warm_start_steps=warm_start_steps), encoding="utf-8")
    return path
