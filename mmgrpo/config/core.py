"""Typed run configuration: dataclasses with a docstring per field, YAML loading, dotted overrides, validation.

    cfg = load_config("examples/counting.yaml", ["grpo.lr=1e-4", "env.kwargs.max_count=3"])

Every section is a frozen dataclass that checks its own types and ranges in ``__post_init__`` (so
``dataclasses.replace`` re-validates); the loader adds the file and line, or the ``--set`` override, to every
error. Derived values are properties, never fields patched after parsing. ``model.path`` may be empty at
parse time (so ``--help-config``, ``list`` and configs completed by ``--set model.path=...`` work); code that
loads a model calls ``cfg.require_model()``, which raises a ConfigError saying how to get one.
Field docs are the string literal under each field; ``describe_fields`` / ``config_reference`` read them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from mmgrpo.config.rollout import RolloutConfig
from mmgrpo.config.sections import (  # noqa: F401  (re-exported: the sections are public here)
    EnvConfig,
    EvalConfig,
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    SFTConfig,
    VerifierConfig,
    WarmStartConfig,
)
from mmgrpo.config.services import FaultsConfig, HubConfig, LoggingConfig
from mmgrpo.config.source import Sources, apply_override, read_yaml
from mmgrpo.config.types import FieldError, Section, build, describe_fields, reference_table
from mmgrpo.errors import ConfigError

__all__ = [
    "Config",
    "ModelConfig",
    "EnvConfig",
    "VerifierConfig",
    "GRPOConfig",
    "WarmStartConfig",
    "SFTConfig",
    "EvalConfig",
    "LoraConfig",
    "LoggingConfig",
    "FaultsConfig",
    "RolloutConfig",
    "HubConfig",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "save_config",
    "describe_fields",
    "config_reference",
]


@dataclass(frozen=True)
class Config(Section):
    seed: int = 0
    """Seed of everything random: same config and seed on the CPU give the same run."""
    output_dir: str = "runs/run"
    """Run directory: metrics.jsonl, checkpoints, the final model and the resolved config."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment that poses tasks and answers the policy's turns."""
    verifiers: list[VerifierConfig] = field(default_factory=lambda: [VerifierConfig("number_match", 1.0)])
    """Reward verifiers; the reward is their weighted sum. Names must be unique (metrics are keyed by name)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO training."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Optional supervised format-only cold start before GRPO."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning on (messages -> response) rows, run by `mmgrpo sft` (not by `mmgrpo train`)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Trackers and saved samples."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """What a failing env, verifier or a non-finite number does to the run."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Which engine samples the episodes (mmgrpo's own, or vLLM in its own process)."""
    hub: HubConfig = field(default_factory=HubConfig)
    """Pushing the final model (and its model card) to the Hugging Face hub."""

    _aliases: ClassVar[dict[str, str]] = {
        "environment": "env",
        "reward_funcs": "verifiers",
        "training": "grpo",
    }

    def _validate(self) -> None:
        self._require(
            0 <= self.seed < 2**31,
            "seed",
            "must be between 0 and 2**31 - 1 (numpy takes seeds below 2**32; each process adds its rank)",
        )
        self._require(bool(self.output_dir), "output_dir", "must be a directory path")
        names = [v.name for v in self.verifiers]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise FieldError(
                "verifiers",
                f"lists the name '{dup}' twice; per-verifier metrics are keyed by "
                "name, so list each verifier once",
            )

    def require_model(self) -> str:
        """The model path, or a ConfigError saying how to set one. Call before loading a model."""
        if not self.model.path:
            raise ConfigError(
                "model.path is empty: set it in the config (model: {path: DIR_OR_HUB_ID}) or with "
                "--set model.path=DIR. For an offline tiny model run `mmgrpo tiny-model runs/tiny-model` and "
                "use --set model.path=runs/tiny-model."
            )
        return self.model.path


def config_reference(markdown: bool = False) -> str:
    """Every config key with its type, default and docstring, as text or a markdown table (README, --help-config)."""
    return reference_table(Config, markdown)


# ---------------------------------------------------------------- loading and saving


def config_from_dict(d: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from a plain dict (missing keys take their defaults)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: a config must be a mapping of keys, got {type(d).__name__}")
    return build(Config, copy.deepcopy(d), (), Sources(source))


def load_config(path: str | Path | dict[str, Any] | Config | None, overrides: Sequence[str] = ()) -> Config:
    """Load a config and apply ``key.sub=value`` overrides, values parsed as YAML. ``path``: a YAML file,
    a dict of the same keys (checked as a file is: an unknown key, a wrong type or value is a ConfigError
    naming it, "<dict>" in place of the file and line), a Config, or None for the defaults."""
    if isinstance(overrides, str):
        overrides = [overrides]
    if isinstance(path, Config):
        path = config_to_dict(path)
    if isinstance(path, dict):
        data, sources = copy.deepcopy(path), Sources("<dict>")
    else:
        data, sources = read_yaml(path) if path is not None else ({}, Sources("<defaults>"))
    defaults = config_to_dict(Config())
    for override in overrides:
        apply_override(data, sources, override, defaults)
    return build(Config, data, (), sources)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-safe dict of a config (or of one section)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML; ``load_config(path)`` gives back an equal Config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True), encoding="utf-8"
    )
