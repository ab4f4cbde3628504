"""``mmgrpo.GRPO``: TRL's ``GRPOTrainer(model, reward_funcs, train_dataset)`` shape, over ``mmgrpo.run``.

    import mmgrpo

    def brevity(prompts, completions, **kwargs):          # TRL's reward function signature
        return [-len(c) / 100 for c in completions]

    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "What is 4 + 1?"}]
    result = mmgrpo.GRPO(model="runs/tiny-text-model", reward_funcs=[brevity], train_dataset=rows,
                         max_steps=10, num_generations=4).train()

What it builds, so that the run is an ordinary mmgrpo run (config.yaml, ``mmgrpo eval``, resume):

- the dataset (a ``datasets.Dataset`` or a list of dicts in TRL's prompt formats: ``prompt`` text
  (standard) or chat messages (conversational), ``image``/``images`` columns for a VLM, any other columns)
  is written under ``output_dir/data/`` (JSONL; a save_to_disk folder when it holds images) and read by the
  ``text_qa`` env (``vqa`` with images), every row for training (``eval_dataset``: the eval split), no system
  prompt, every column passed through as it is;
- each reward function is registered as a verifier under its ``__name__`` (in this process) and called as
  TRL calls it: ``prompts`` (the rows' prompts: text, or messages), ``completions`` (text for a standard
  dataset, ``[{"role": "assistant", "content": ...}]`` for a conversational one), every other column as a
  keyword list; a None in the returned list skips that sample, as in TRL (``mmgrpo.verifier.from_trl``);
- keyword arguments are config keys: a ``grpo`` key by its name (``steps``, ``lr``, ``group_size``,
  ``max_new_tokens``, ...) or its TRL name (``max_steps``, ``learning_rate``, ``num_generations``,
  ``max_completion_length``, ``num_train_epochs``, ``push_to_hub``, ``hub_model_id``, ...), a top-level key
  (``seed``, ``output_dir``) or a section as a dict (``warm_start={"steps": 20}``); ``config`` is a base
  config (a YAML path or dict) they apply over, ``overrides`` more ``"key=value"`` strings.

Unlike TRL, the defaults are mmgrpo's (docs/config.md): e.g. grpo.max_new_tokens is 16 (TRL's
max_completion_length is 256) and grpo.steps 200; ``grpo.epochs`` (num_train_epochs) counts steps from the
dataset's rows.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mmgrpo.config.core import Config, GRPOConfig, config_to_dict, load_config
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.train.recipe import RunResult, run

TRL_NAMES = {
    **GRPOConfig._aliases,
    "num_train_epochs": "epochs",
    "push_to_hub": "hub.push",
    "hub_model_id": "hub.repo_id",
    "hub_private_repo": "hub.private",
}
"""TRL's GRPOConfig names of the keys GRPO() takes (a bare name is a grpo key)."""
IMAGE_COLUMNS = ("image", "images")

_REGISTERED: dict[str, Callable[..., Any]] = {}  # verifiers this module registered, by name


class GRPO:
    """A GRPO run from a model, TRL-style reward functions and a dataset; :meth:`train` runs it with
    ``mmgrpo.run`` (the recipe of ``mmgrpo train``). The config is built and checked here (``self.config``):
    a wrong key or value is a ConfigError before any model loads."""

    def __init__(
        self,
        model: str,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]],
        train_dataset: Any,
        *,
        eval_dataset: Any = None,
        reward_weights: Sequence[float] | None = None,
        output_dir: str = "runs/grpo",
        callbacks: Iterable[Any] = (),
        config: str | Path | dict[str, Any] | Config | None = None,
        overrides: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not funcs or not all(callable(f) for f in funcs):
            raise ConfigError(
                "GRPO(reward_funcs=...): give a reward function f(prompts, completions, **kwargs)"
            )
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ConfigError(
                f"GRPO: {len(weights)} reward_weights for {len(funcs)} reward_funcs: give one each"
            )
        self.train_rows, self.eval_rows = _rows(train_dataset, "train_dataset"), None
        if eval_dataset is not None:
            self.eval_rows = _rows(eval_dataset, "eval_dataset")
        self.callbacks = list(callbacks)
        conversational = isinstance(self.train_rows.first.get("prompt"), list)
        self.names = [_register(f, i, conversational) for i, f in enumerate(funcs)]
        data = Path(output_dir) / "data"
        env_kwargs: dict[str, Any] = {
            "path": str(self.train_rows.target(data, "train")),
            "answer_field": None,  # every column reaches the reward functions as it is
            "system_prompt": None,  # the prompt as written, as TRL poses it
        }
        if self.eval_rows is not None:
            env_kwargs["eval_path"] = str(self.eval_rows.target(data, "eval"))
        else:
            env_kwargs["eval_fraction"] = 0.0  # every row trains, as in TRL
        base = config_to_dict(load_config(config)) if config is not None else {}
        base.update(
            output_dir=output_dir,
            model={**base.get("model", {}), "path": str(model)},
            env={"name": "vqa" if self.train_rows.images else "text_qa", "kwargs": env_kwargs},
            verifiers=[
                {"name": n, "weight": w, "kwargs": {} if conversational else {"conversational": False}}
                for n, w in zip(self.names, weights, strict=True)
            ],
        )
        if self.eval_rows is None:
            base.setdefault("grpo", {})["eval_every"] = 0  # nothing held out to evaluate on
        for key, value in kwargs.items():
            _set(base, key, value)
        self.config = load_config(base, overrides)

    def train(
        self, *, resume: bool | str | Path | None = None, overwrite: bool = False, **run_kwargs
    ) -> RunResult:
        """Write the dataset files, then ``mmgrpo.run(self.config, callbacks=..., resume=, overwrite=)``."""
        data = Path(self.config.output_dir) / "data"
        self.train_rows.write(data, "train")
        if self.eval_rows is not None:
            self.eval_rows.write(data, "eval")
        return run(self.config, callbacks=self.callbacks, resume=resume, overwrite=overwrite, **run_kwargs)


def _set(base: dict[str, Any], key: str, value: Any) -> None:
    """Put keyword argument ``key`` (a config key, a grpo key or a TRL name) into the config dict."""
    top = {f for f in Config.__dataclass_fields__}
    path = TRL_NAMES.get(key, key)
    if "." not in path and path not in top:
        path = f"grpo.{path}"
    section, _, name = path.rpartition(".")
    if not section:
        if isinstance(value, dict) and isinstance(base.get(name), dict):
            base[name] = {**base[name], **value}
        else:
            base[name] = value
        return
    if name not in {f for f in _section_fields(section)}:
        from mmgrpo.errors import did_you_mean

        known = sorted([*GRPOConfig.__dataclass_fields__, *TRL_NAMES, *top])
        raise ConfigError(
            f"GRPO({key}=...): not a config key.{did_you_mean(key, known)} Keyword arguments are grpo keys "
            "(steps, lr, group_size, max_new_tokens, ...), their TRL names (max_steps, learning_rate, "
            "num_generations, max_completion_length, num_train_epochs, ...), top-level keys (seed) or "
            "sections as dicts (warm_start={'steps': 20}); docs/config.md lists them."
        )
    base.setdefault(section, {})[name] = value


def _section_fields(section: str) -> Iterable[str]:
    field = Config.__dataclass_fields__[section]
    return getattr(field.default_factory(), "__dataclass_fields__", {})


def _register(fn: Callable[..., Any], index: int, conversational: bool) -> str:
    """Register ``fn`` as a verifier, called the TRL way (module docstring); returns its name."""
    from mmgrpo.registry import list_verifiers, register_verifier

    name = getattr(fn, "__name__", "") or type(fn).__name__
    if not name.isidentifier():  # a lambda
        name = f"reward_{index}"
    if name in list_verifiers() and name not in _REGISTERED:
        raise ConfigError(
            f"GRPO: your reward function '{name}' has the name of a registered verifier (`mmgrpo list`); "
            "rename the function (verifier metrics are keyed by name)"
        )
    _REGISTERED[name] = fn
    register_verifier(name, _trl_call(fn), overwrite=True)
    return name


def _trl_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as TRL calls it: ``prompts`` are the rows' own prompt column (text or messages), the other
    columns keyword lists; only the keywords ``fn`` names, unless it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params}
    except (TypeError, ValueError):
        takes_any, named = True, set()

    def reward(prompts, completions, **kwargs):
        rows = kwargs.pop("prompt", None)  # the dataset's prompt column, as the user wrote it
        if rows is not None and all(r is not None for r in rows):
            prompts = rows
        kwargs = {"prompts": prompts, "completions": completions, **kwargs}
        return fn(**(kwargs if takes_any else {k: v for k, v in kwargs.items() if k in named}))

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.__doc__ = getattr(fn, "__doc__", None)
    return reward


class _Rows:
    """A dataset given to GRPO(): its rows as a list of dicts or a ``datasets.Dataset``, the file or folder
    it is written to (named by a hash of its content, so a run's files never change under it)."""

    def __init__(self, rows: Any, what: str) -> None:
        self.rows, self.what = rows, what
        self.first = rows[0]
        columns = set(self.first)
        self.images = bool(columns & set(IMAGE_COLUMNS))
        if "prompt" not in columns and "question" not in columns:
            raise DataError(
                f"GRPO({what}=...): rows need a 'prompt' column (TRL's format: text, or chat messages); the "
                f"first row has {sorted(columns)}"
            )
        self.text = None if self.is_dataset else _jsonl(rows)
        digest = (
            hashlib.sha1(self.text.encode()).hexdigest()
            if self.text is not None
            else str(getattr(rows, "_fingerprint", "") or id(rows))
        )
        self.digest = digest[:12]

    @property
    def is_dataset(self) -> bool:
        return not isinstance(self.rows, list)

    def target(self, folder: Path, split: str) -> Path:
        name = f"{split}-{self.digest}"
        return folder / (f"{name}.jsonl" if self.text is not None else name)

    def write(self, folder: Path, split: str) -> Path:
        path = self.target(folder, split)
        if path.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        if self.text is not None:
            tmp = path.with_name(path.name + ".partial")
            tmp.write_text(self.text, encoding="utf-8")
            tmp.replace(path)
        else:
            rows = self.rows
            if isinstance(rows, list):  # rows JSON cannot hold (images): through datasets
                try:
                    import datasets
                except ImportError:
                    raise ConfigError(
                        f"GRPO({self.what}=...): rows with images are written with the datasets package: "
                        "pip install 'mmgrpo[data]'"
                    ) from None
                rows = datasets.Dataset.from_list(rows)
            rows.save_to_disk(str(path))
        return path


def _rows(data: Any, what: str) -> _Rows:
    if isinstance(data, dict) or isinstance(data, (str, bytes)):
        raise ConfigError(
            f"GRPO({what}=...): give a datasets.Dataset or a list of dicts (rows), got {type(data).__name__}; "
            "for a file or a hub id use mmgrpo.run with env.kwargs.path (docs/data.md)"
        )
    if not isinstance(data, list):
        if not hasattr(data, "save_to_disk"):  # an iterable of rows
            data = list(data)
    if len(data) == 0:
        raise DataError(f"GRPO({what}=...): the dataset has no rows")
    if isinstance(data, list) and not all(isinstance(r, dict) for r in data):
        bad = next(i for i, r in enumerate(data) if not isinstance(r, dict))
        raise DataError(f"GRPO({what}=...): row {bad} is a {type(data[bad]).__name__}, not a dict")
    return _Rows(data, what)


def _jsonl(rows: list[dict]) -> str | None:
    """The rows as JSONL text, or None when a value is not JSON (an image): then datasets writes them."""
    try:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    except (TypeError, ValueError):
        return None
