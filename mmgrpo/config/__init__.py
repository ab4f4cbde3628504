"""Typed run configuration (see ``core``): ``load_config``, ``Config`` and its sections, ``save_config``.

``sections`` holds the section dataclasses, ``core`` the whole ``Config`` with YAML loading and saving,
``types`` the typed building and checking of a dataclass from plain data, ``source`` where each value came
from (file and line, or ``--set``) for error messages.
"""

from mmgrpo.config.core import (
    Config,
    EnvConfig,
    EvalConfig,
    FaultsConfig,
    GRPOConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    VerifierConfig,
    WarmStartConfig,
    config_from_dict,
    config_reference,
    config_to_dict,
    describe_fields,
    load_config,
    save_config,
)

__all__ = [
    "Config",
    "EnvConfig",
    "EvalConfig",
    "FaultsConfig",
    "GRPOConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "VerifierConfig",
    "WarmStartConfig",
    "config_from_dict",
    "config_reference",
    "config_to_dict",
    "describe_fields",
    "load_config",
    "save_config",
]
