"""Typed config: defaults, YAML loading with line numbers in errors, overrides, validation, save/load."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmgrpo.config.core import (
    Config,
    GRPOConfig,
    VerifierConfig,
    config_from_dict,
    config_reference,
    config_to_dict,
    describe_fields,
    load_config,
    save_config,
)
from mmgrpo.errors import ConfigError

EXAMPLE = """\
seed: 3
output_dir: runs/test
model:
  path: runs/tiny-model
  dtype: bfloat16
  max_pixels: 50176
env:
  name: counting
  kwargs: {max_count: 5, image_size: 64}
verifiers:
  - {name: format, weight: 0.5}
  - name: number_match
grpo:
  steps: 10
  group_size: 4
  lr: 1.0e-3
  betas: [0.9, 0.99]
  dual_clip: 3
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_construct() -> None:
    cfg = Config()
    assert cfg == load_config(None)
    assert cfg.grpo.group_size == 8 and cfg.grpo.lr == 3e-4 and cfg.grpo.betas == [0.9, 0.999]
    assert cfg.verifiers == [VerifierConfig(name="number_match", weight=1.0)]
    assert cfg.grpo.episodes_per_step == 16 * 8
    assert cfg.grpo.uses_reference and not cfg.warm_start.enabled and cfg.eval.greedy


def test_yaml_loads_nested_values(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, EXAMPLE))
    assert cfg.seed == 3 and cfg.output_dir == "runs/test"
    assert (
        cfg.model.path == "runs/tiny-model"
        and cfg.model.dtype == "bfloat16"
        and cfg.model.max_pixels == 50176
    )
    assert cfg.env.kwargs == {"max_count": 5, "image_size": 64}
    assert [(v.name, v.weight) for v in cfg.verifiers] == [("format", 0.5), ("number_match", 1.0)]
    assert cfg.grpo.steps == 10 and cfg.grpo.episodes_per_step == 16 * 4
    assert cfg.grpo.lr == 1e-3 and cfg.grpo.betas == [0.9, 0.99]
    assert cfg.grpo.dual_clip == 3.0 and isinstance(cfg.grpo.dual_clip, float)  # int accepted for float
    assert cfg.grpo.temperature == 1.0  # untouched keys keep their defaults


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "# nothing yet\n")) == Config()


def test_overrides(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, EXAMPLE),
        [
            "grpo.lr=1e-4",  # YAML reads 1e-4 as a string: coerced for float fields
            "env.kwargs.max_count=3",  # merges into the free-form dict
            "verifiers=[{name: exact_match, kwargs: {strip: true}}]",
            "grpo.betas=[0.8, 0.9]",
            "model.path=other",
        ],
    )
    assert cfg.grpo.lr == 1e-4 and isinstance(cfg.grpo.lr, float)
    assert cfg.env.kwargs == {"max_count": 3, "image_size": 64}
    assert cfg.verifiers == [VerifierConfig("exact_match", 1.0, {"strip": True})]
    assert cfg.grpo.betas == [0.8, 0.9]
    assert cfg.model.path == "other"


def test_overrides_without_file_and_list_index() -> None:
    cfg = load_config(None, ["verifiers.0.weight=2", "warm_start.steps=5", "eval.temperature=0.5"])
    assert cfg.verifiers[0] == VerifierConfig("number_match", 2.0)
    assert cfg.warm_start.enabled and cfg.eval.temperature == 0.5


def test_unknown_key_names_file_line_key_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\ngrpo:\n  steps: 3\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:4:" in msg
    assert "unknown key 'grpo.lerning_rate'" in msg
    assert "Did you mean 'grpo.lr'?" in msg
    assert "Valid keys under 'grpo':" in msg and "group_size" in msg


def test_unknown_top_level_and_verifier_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: unknown key 'modle'. Did you mean 'model'\?"):
        load_config(write(tmp_path, "seed: 1\nmodle: {path: x}\n"))
    text = "verifiers:\n  - name: format\n  - name: number_match\n    wieght: 2\n"
    with pytest.raises(ConfigError, match=r"cfg.yaml:4: unknown key 'verifiers\[1\].wieght'"):
        load_config(write(tmp_path, text))


def test_trl_names_get_suggestions() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'grpo.group_size'\?"):
        load_config(None, ["grpo.num_generations=4"])


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "grpo:\n  lr: 0.1\n  steps: abc\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:3: 'grpo.steps' must be int, got str 'abc'"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "model.gradient_checkpointing='true'",
            "'model.gradient_checkpointing' must be bool, got str 'true'",
        ),
        ("grpo.group_size=2.5", "'grpo.group_size' must be int, got float 2.5"),
        ("grpo.steps=true", "'grpo.steps' must be int, got bool True"),
        ("grpo.lr=fast", "'grpo.lr' must be float, got str 'fast'"),
        ("grpo.betas=[0.9, x]", "'grpo.betas' must be list of float"),
        ("model.max_pixels=[1]", "'model.max_pixels' must be int or null"),
        ("env.kwargs=3", "'env.kwargs' must be dict, got int 3"),
        ("grpo=3", "'grpo' must be mapping, got int 3"),
        ("verifiers=[format]", "'verifiers' must be list of mapping"),
    ],
)
def test_type_errors(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)
    assert str(err.value).startswith(f"--set {override}: ")


def test_enum_error_lists_choices(tmp_path: Path) -> None:
    path = write(tmp_path, "grpo:\n  scale: std_unbaised\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:2: 'grpo.scale' must be one of std_unbiased, std_biased, none" in msg
    assert "Did you mean 'std_unbiased'?" in msg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("grpo.group_size=1", "at least 2 samples per group"),
        ("grpo.tasks_per_step=0", "'grpo.tasks_per_step' must be >= 1"),
        ("grpo.micro_batch_size=0", "'grpo.micro_batch_size' must be >= 1"),
        ("grpo.temperature=0", "zero reward variance"),
        ("grpo.clip_eps_low=1.0", "'grpo.clip_eps_low' must be in [0, 1)"),
        ("grpo.clip_eps_high=-0.1", "'grpo.clip_eps_high' must be in [0, 1)"),
        ("grpo.beta=-0.01", "'grpo.beta' must be >= 0"),
        ("grpo.dual_clip=0.5", "'grpo.dual_clip' must be > 1"),
        ("warm_start.random_low=9", "'warm_start.random_low' must be <= random_high (5)"),
        ("warm_start.target='<answer>{x}</answer>'", "placeholders {random} and {answer}"),
        ("verifiers=[{name: format}, {name: format}]", "'format' twice"),
        ("verifiers=[{weight: 2}]", "'verifiers[0]' needs the key 'name'"),
        ("model.min_pixels=100", None),  # fine alone
    ],
)
def test_value_rules(override: str, needle: str | None) -> None:
    if needle is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_sections_validate_on_direct_construction_and_replace() -> None:
    with pytest.raises(ConfigError, match="'group_size' must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ConfigError, match="'scale' must be one of"):
        dataclasses.replace(GRPOConfig(), scale="std")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().grpo.lr = 1.0  # type: ignore[misc]


def test_override_errors_name_the_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, EXAMPLE), ["grpo.stepz=3"])
    msg = str(err.value)
    assert msg.startswith("--set grpo.stepz=3: unknown key 'grpo.stepz'.")
    assert "Did you mean 'grpo.steps'?" in msg
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["grpo.lr"])
    with pytest.raises(ConfigError, match=r"--set verifiers.3.weight=1: 'verifiers' is a list of 1 items"):
        load_config(None, ["verifiers.3.weight=1"])


def test_override_replaces_file_location(tmp_path: Path) -> None:
    path = write(tmp_path, "grpo:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"^--set grpo.steps=-1: 'grpo.steps' must be >= 0"):
        load_config(path, ["grpo.steps=-1"])


def test_save_load_roundtrip(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, EXAMPLE), ["grpo.lr=1e-4", "grpo.adv_eps=1e-8", "warm_start.steps=4"])
    out = tmp_path / "sub" / "config.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert load_config(None) == config_from_dict(config_to_dict(Config()))


def test_bad_yaml_syntax_has_line(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\ngrpo:\n  steps: [1, 2\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: invalid YAML"):
        load_config(path)
    path = write(tmp_path, "grpo:\n  steps: 1\n  steps: 2\n", "dup.yaml")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: duplicate key 'grpo.steps' \(first set on line 2\)"):
        load_config(path)
    path = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(ConfigError, match="top level of a config must be a mapping"):
        load_config(path)


def test_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_import_is_light() -> None:
    code = "import sys, mmgrpo.config.core; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_from_dict_names_source() -> None:
    with pytest.raises(ConfigError, match=r"^<dict>: unknown key 'grpo.lrr'"):
        config_from_dict({"grpo": {"lrr": 1}})
    assert config_from_dict({"grpo": {"lr": "3e-4"}}).grpo.lr == 3e-4


def test_describe_fields_returns_docstrings() -> None:
    docs = describe_fields(GRPOConfig)
    assert list(docs) == [f.name for f in dataclasses.fields(GRPOConfig)]
    assert "KL coefficient" in docs["beta"]
    assert "_aliases" not in docs
    sections = [type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)]
    for cls in [Config, VerifierConfig, *filter(dataclasses.is_dataclass, sections)]:
        assert all(describe_fields(cls).values()), f"{cls.__name__} has a field without a docstring"


def test_config_reference_lists_every_key() -> None:
    text = config_reference()
    assert "grpo.lr: float = 0.0003" in text and "verifiers[].name: str = (required)" in text
    table = config_reference(markdown=True)
    assert table.startswith("| key | type | default | description |")
    assert "| `grpo.scale` | one of std_unbiased, std_biased, none |" in table


def test_model_path_required_only_when_a_model_is_loaded() -> None:
    cfg = load_config(None)  # parses fine: --help-config, list and `--set model.path=` completions work
    with pytest.raises(ConfigError, match="mmgrpo tiny-model runs/tiny-model"):
        cfg.require_model()
    assert load_config(None, ["model.path=runs/tiny-model"]).require_model() == "runs/tiny-model"


def test_bare_drills_need_the_full_drills_they_lead_into():
    with pytest.raises(ConfigError, match=r"warm_start.drill_bare_steps.*set drill_steps > 0 too"):
        load_config(None, ["warm_start.source=env", "warm_start.drill_bare_steps=100"])
    cfg = load_config(
        None, ["warm_start.source=env", "warm_start.drill_steps=50", "warm_start.drill_bare_steps=100"]
    )
    assert (cfg.warm_start.drill_bare_steps, cfg.warm_start.drill_steps) == (100, 50)


def test_bare_steps_must_leave_full_steps():
    with pytest.raises(ConfigError, match=r"grpo.bare_steps.*must be below steps \(100\)"):
        load_config(None, ["grpo.steps=100", "grpo.bare_steps=100"])
    assert load_config(None, ["grpo.steps=100", "grpo.bare_steps=60"]).grpo.bare_steps == 60
    for share in ("0", "1.5"):
        with pytest.raises(ConfigError, match=r"grpo.bare_share.*must be in \(0, 1\]"):
            load_config(None, [f"grpo.bare_share={share}"])
