"""mmgrpo: GRPO for vision-language and text models, with environments and verifiers.

The public API, in one place: what plugin authors and users import (environments, tools, verifiers, the
registry, config, training and evaluation). Importing mmgrpo is cheap and has no side effects: the names
below are loaded on first use. docs/architecture.md shows where each lives.

    import mmgrpo
    result = mmgrpo.run("examples/counting_tiny.yaml", ["model.path=runs/tiny-model-sees"])  # = mmgrpo train
    result = mmgrpo.GRPO(model="runs/tiny-text-model", reward_funcs=[f], train_dataset=rows).train()  # TRL-style

docs/python_api.md shows both, with callbacks.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # config
    "Config": "mmgrpo.config.core",
    "load_config": "mmgrpo.config.core",
    "save_config": "mmgrpo.config.core",
    # environments
    "ChatEnv": "mmgrpo.env",
    "SingleTurnEnv": "mmgrpo.env",
    "Task": "mmgrpo.env",
    "check_env": "mmgrpo.env",
    "Shown": "mmgrpo.env",
    "system": "mmgrpo.env",
    "user": "mmgrpo.env",
    "assistant": "mmgrpo.env",
    "text_part": "mmgrpo.env",
    "image_part": "mmgrpo.env",
    "ToolEnv": "mmgrpo.envs.tool_env",
    "GymChatEnv": "mmgrpo.envs.gym_adapter",
    # tools
    "Tool": "mmgrpo.tools",
    "ToolRunner": "mmgrpo.tools",
    "ToolResult": "mmgrpo.tools",
    "make_tool": "mmgrpo.toolbox",
    # verifiers
    "Episode": "mmgrpo.verifier",
    "Verifier": "mmgrpo.verifier",
    "Rewards": "mmgrpo.verifier",
    "from_trl": "mmgrpo.verifier",
    "check_verifier": "mmgrpo.verifier",
    "extract_tag": "mmgrpo.verifier",
    # registry
    "register_env": "mmgrpo.registry",
    "make_env": "mmgrpo.registry",
    "list_envs": "mmgrpo.registry",
    "register_verifier": "mmgrpo.registry",
    "make_verifier": "mmgrpo.registry",
    "list_verifiers": "mmgrpo.registry",
    # math
    "group_advantages": "mmgrpo.grpo.advantages",
    "grpo_loss": "mmgrpo.grpo.losses",
    # model, rollout, training
    "Policy": "mmgrpo.model.policy",
    "rollout": "mmgrpo.rollout.episodes",
    "Trajectory": "mmgrpo.rollout.episodes",
    "Trainer": "mmgrpo.train.trainer",
    "run": "mmgrpo.train.recipe",
    "RunResult": "mmgrpo.train.recipe",
    "GRPO": "mmgrpo.train.trl_style",
    "TrainerCallback": "mmgrpo.train.callbacks",
    "TrainingStopped": "mmgrpo.train.callbacks",
    "evaluate": "mmgrpo.rollout.evaluation",
    "build_tiny_model": "mmgrpo.tiny.vlm",
    # errors
    "MmgrpoError": "mmgrpo.errors",
    "ConfigError": "mmgrpo.errors",
    "RegistryError": "mmgrpo.errors",
    "DataError": "mmgrpo.errors",
    "EnvError": "mmgrpo.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmgrpo' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
