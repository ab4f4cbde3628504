"""Names to factories: ``register_env/make_env``, ``register_verifier/make_verifier``, plugin discovery.

Two registries built from one small class. Each knows three kinds of entries:

- *builtin*: an entry point of the ``mmgrpo`` distribution itself (pyproject.toml);
- *plugin*: an entry point of another installed distribution, in the group ``mmgrpo.envs`` or
  ``mmgrpo.verifiers``::

      [project.entry-points."mmgrpo.verifiers"]
      my_reward = "my_package.rewards:my_reward_factory"

- *registered in code*: ``register_env(name, factory)`` / ``register_verifier(name, factory)``.

The entry-point groups are read on first use, and an entry point's object is imported only when it is first
made (or described), so listing names is cheap. A plugin that fails to import becomes a warning naming the
entry point, its distribution and the exception, and that one name is dropped; everything else keeps working.

An env factory is ``(**kwargs) -> ChatEnv``; a verifier factory is ``(**kwargs) -> fn(episode) -> float``
or a ``Verifier``. A verifier entry may instead be a TRL-style reward function
``f(completions, **kwargs) -> list[float]``, recognised by its ``completions`` parameter: it is not called
as a factory but wrapped with :func:`mmgrpo.verifier.from_trl`, the config's keyword arguments bound to it
with ``functools.partial``. This module knows nothing about what the entries do.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from mmgrpo.errors import ConfigError, EnvError, RegistryError, did_you_mean
from mmgrpo.verifier import Verifier, from_trl

__all__ = [
    "Registry",
    "describe",
    "import_optional",
    "is_trl_reward",
    "list_envs",
    "list_verifiers",
    "make_env",
    "make_verifier",
    "register_env",
    "register_verifier",
]

BUILTIN_DIST = "mmgrpo"
CODE_SOURCE = "registered in code"


@dataclass
class _Entry:
    name: str
    source: str  # "builtin", "plugin <dist>" or "registered in code"
    entry_point: metadata.EntryPoint | None = None
    factory: Callable[..., Any] | None = None  # set once loaded


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


def _keyword_names(signature: inspect.Signature) -> list[str]:
    return [
        p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _suggest(kwargs: dict[str, Any], signature: inspect.Signature) -> str:
    accepted = _keyword_names(signature)
    return "".join(did_you_mean(k, accepted) for k in kwargs if k not in accepted)


def _shown(obj: Any, signature: inspect.Signature) -> str:
    shown = signature.replace(return_annotation=inspect.Signature.empty)
    return f"{getattr(obj, '__qualname__', obj)}{shown}"


def _first_doc_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    """The factory's signature, with string annotations resolved where possible (for readable errors)."""
    try:
        return inspect.signature(factory, eval_str=True)
    except Exception:  # an annotation naming a TYPE_CHECKING-only import
        pass
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None


class Registry:
    """Name -> factory for one kind of thing (``kind`` = "env" or "verifier"), fed by entry-point ``group``."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, _Entry] = {}
        self._broken: dict[str, str] = {}  # name -> why its plugin could not be loaded
        self._discovered = False

    # -- discovery -------------------------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        found: list[_Entry] = []
        for ep in metadata.entry_points(group=self.group):
            dist = _dist_name(ep)
            source = "builtin" if dist == BUILTIN_DIST else f"plugin {dist or '(unknown distribution)'}"
            found.append(_Entry(ep.name, source, entry_point=ep))
        found.sort(key=lambda e: e.source != "builtin")  # builtins win a name clash
        for entry in found:
            if entry.name in self._entries:
                other = self._entries[entry.name]
                if other.entry_point is not None and other.entry_point.value == entry.entry_point.value:
                    continue  # the same distribution seen twice on sys.path
                warnings.warn(
                    f"mmgrpo {self.kind} '{entry.name}' is declared by {other.source} "
                    f"({other.entry_point.value if other.entry_point else '?'}) and again by {entry.source} "
                    f"({entry.entry_point.value}); keeping the first. Rename one of them.",
                    stacklevel=3,
                )
                continue
            self._entries[entry.name] = entry

    def _load(self, entry: _Entry) -> Callable[..., Any] | None:
        """The entry's factory, importing its entry point on first use; None (and a warning) if it fails."""
        if entry.factory is not None:
            return entry.factory
        ep = entry.entry_point
        assert ep is not None
        try:
            obj = ep.load()
            if not callable(obj):
                raise TypeError(f"{ep.value} is a {type(obj).__name__}, not a callable factory")
        except Exception as exc:
            why = (
                f"mmgrpo {self.kind} plugin '{ep.name}' ({ep.value}, group {self.group}, distribution "
                f"{_dist_name(ep) or '(unknown)'}) failed to load: {type(exc).__name__}: {exc}. "
                f"It is skipped; fix or uninstall that package."
            )
            warnings.warn(why, stacklevel=4)
            self._broken[entry.name] = why
            del self._entries[entry.name]
            return None
        entry.factory = obj
        return obj

    # -- public ----------------------------------------------------------------------------------------
    def register(self, name: str, factory: Callable[..., Any], overwrite: bool = False) -> None:
        """Register ``factory`` under ``name``; an existing name is an error unless ``overwrite=True``."""
        if not isinstance(name, str) or not name or name != name.strip() or any(c.isspace() for c in name):
            raise RegistryError(
                f"A {self.kind} name must be a non-empty string without spaces, got {name!r}."
            )
        if not callable(factory):
            raise RegistryError(
                f"register_{self.kind}('{name}', ...): the factory must be callable, got {type(factory).__name__}."
            )
        self._discover()
        if name in self._entries and not overwrite:
            raise RegistryError(
                f"{self.kind} '{name}' is already registered ({self._entries[name].source}); pick another name "
                f"or pass overwrite=True to replace it."
            )
        self._broken.pop(name, None)
        self._entries[name] = _Entry(name, CODE_SOURCE, factory=factory)

    def names(self) -> list[str]:
        """The registered names, sorted. Imports nothing."""
        self._discover()
        return sorted(self._entries)

    def get(self, name: str) -> Callable[..., Any]:
        """The factory registered under ``name`` (importing its plugin if needed)."""
        self._discover()
        entry = self._entries.get(name)
        if entry is None:
            if name in self._broken:
                raise RegistryError(self._broken[name])
            names = sorted(self._entries)
            raise RegistryError(
                f"Unknown {self.kind} '{name}'.{did_you_mean(name, names)} Registered {self.kind}s: "
                f"{', '.join(names) or '(none)'}. Register one with register_{self.kind}(name, factory) or "
                f"an entry point in the group '{self.group}'."
            )
        factory = self._load(entry)
        if factory is None:
            raise RegistryError(self._broken[name])
        return factory

    def call(self, name: str, kwargs: dict[str, Any], hint: str = "") -> Any:
        """``factory(**kwargs)``; kwargs the factory does not accept are a ConfigError showing its signature."""
        factory = self.get(name)
        signature = _signature(factory)
        if signature is not None:
            try:
                signature.bind(**kwargs)
            except TypeError as exc:
                raise ConfigError(
                    f"{self.kind} '{name}': {exc}.{_suggest(kwargs, signature)} Its factory is "
                    f"{_shown(factory, signature)}.{hint}"
                ) from None
        try:
            return factory(**kwargs)
        except ImportError as exc:  # an optional package the factory imports is missing or broken
            package = (exc.name or "").split(".")[0] or "a package it imports"
            raise ConfigError(
                f"{self.kind} '{name}' ({self._entries[name].source}) could not import {package}: "
                f"{type(exc).__name__}: {exc}. Install or reinstall {package} (the extra of the package that "
                f"provides '{name}', or pip install {package})"
            ) from None

    def source(self, name: str) -> str:
        """Where ``name`` comes from: 'builtin', 'plugin <dist>' or 'registered in code'."""
        self.get(name)
        return self._entries[name].source

    def describe_rows(self) -> list[tuple[str, str, str]]:
        """(name, source, first docstring line) for every entry, importing plugins (broken ones warn)."""
        rows = []
        for name in self.names():
            entry = self._entries[name]
            factory = self._load(entry)
            if factory is not None:
                rows.append((name, entry.source, _first_doc_line(factory)))
        return rows

    def _reset(self) -> None:
        self._entries.clear()
        self._broken.clear()
        self._discovered = False


ENVS = Registry("env", "mmgrpo.envs")
VERIFIERS = Registry("verifier", "mmgrpo.verifiers")


def import_optional(module: str, who: str, package: str, install: str) -> Any:
    """``import module`` for ``who`` (e.g. "env 'textarena'"), which needs the optional ``package``, or one
    ConfigError line: not installed (install with ``install``), or installed but broken (any exception while
    importing it: a raw traceback before), naming the package, where it is, the original error and the
    reinstall command."""
    import importlib
    import importlib.util

    try:
        return importlib.import_module(module)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        try:
            spec = importlib.util.find_spec(module)
        except Exception:  # a broken parent package
            spec = None
        if spec is None:
            raise ConfigError(
                f"{who} needs the {package} package ({error}); install it with: {install}"
            ) from None
        where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        raise ConfigError(
            f"{who}: the installed {package} package ({where}) fails to import: {error}. Reinstall it, or the "
            f"package it names, with: {install}"
        ) from None


def register_env(name: str, factory: Callable[..., Any], overwrite: bool = False) -> None:
    """Register an environment factory ``(**kwargs) -> ChatEnv`` (a ChatEnv subclass works) under ``name``."""
    ENVS.register(name, factory, overwrite=overwrite)


def make_env(name: str, /, **kwargs: Any) -> Any:
    """Build the environment registered as ``name`` with ``kwargs``.

    Unknown names raise RegistryError (listing what exists); kwargs the factory does not take raise
    ConfigError showing its signature. ``name`` is positional-only, so a factory may take a ``name`` setting.
    """
    env = ENVS.call(name, kwargs)
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise EnvError(
            f"env '{name}': its factory returned {type(env).__name__}, which has no reset()/step(); an env "
            f"factory must return a ChatEnv (a gymnasium.Env with chat-message observations)."
        )
    return env


def list_envs() -> list[str]:
    """Registered environment names, sorted (imports no plugin)."""
    return ENVS.names()


def register_verifier(name: str, factory: Callable[..., Any], overwrite: bool = False) -> None:
    """Register a verifier factory ``(**kwargs) -> fn(episode) -> float | Verifier`` under ``name``.

    A TRL-style reward function ``f(completions, **kwargs) -> list[float]`` may be registered as it is (see
    :func:`make_verifier`).
    """
    VERIFIERS.register(name, factory, overwrite=overwrite)


def make_verifier(name: str, /, weight: float = 1.0, **kwargs: Any) -> Verifier:
    """Build the verifier registered as ``name``: ``factory(**kwargs)`` wrapped as ``Verifier(name, fn, weight)``.

    When the factory returns a Verifier, its ``fn`` and ``batched`` are kept and ``name``/``weight`` set
    from here. To use one verifier twice with different settings, rename one copy:
    ``dataclasses.replace(v, name="...")``. ``name`` is positional-only, so a factory may take a ``name``
    setting (``weight`` is always the verifier's weight).

    A TRL-style reward function ``f(completions, **kwargs) -> list[float]`` (any callable with a
    ``completions`` parameter) is wrapped with ``from_trl(functools.partial(f, **kwargs), name, weight)``:
    ``kwargs`` are its settings and must name its parameters (or it takes ``**kwargs``); the per-episode
    arguments (``completions``, ``prompts``, the task fields) come at scoring time. The extra setting
    ``conversational=False`` (unless ``f`` has such a parameter) passes plain-string completions.
    """
    factory = VERIFIERS.get(name)
    if is_trl_reward(factory):
        return _trl_verifier(name, factory, weight, kwargs)
    made = VERIFIERS.call(
        name,
        kwargs,
        hint=" (A verifier factory takes settings and returns fn(episode) -> float; a TRL-style reward "
        "function f(completions, **kwargs) is recognised by its `completions` parameter. If you registered "
        "fn(episode) itself, register `lambda: fn` instead.)",
    )
    if isinstance(made, Verifier):
        return dataclasses.replace(made, name=name, weight=weight)
    if not callable(made):
        raise ConfigError(
            f"verifier '{name}': its factory returned {type(made).__name__}; a verifier factory must return "
            f"fn(episode) -> float or a Verifier."
        )
    return Verifier(name=name, fn=made, weight=weight)


def is_trl_reward(obj: Any) -> bool:
    """True for a TRL-style reward function: a callable (not a class) with a parameter named ``completions``."""
    if inspect.isclass(obj) or not callable(obj):
        return False
    signature = _signature(obj)
    return signature is not None and "completions" in signature.parameters


_TRL_ARGUMENTS = ("completions", "prompts", "completion_ids")  # given per batch, never by a config


def _trl_verifier(name: str, fn: Callable[..., Any], weight: float, kwargs: dict[str, Any]) -> Verifier:
    """``from_trl(partial(fn, **settings))``, after checking the settings against ``fn``'s signature."""
    signature = _signature(fn)
    assert signature is not None  # is_trl_reward read it
    params = signature.parameters
    settings = dict(kwargs)
    conversational = True
    if "conversational" in settings and "conversational" not in params:
        conversational = settings.pop("conversational")
        if not isinstance(conversational, bool):
            raise ConfigError(
                f"verifier '{name}': conversational must be true (completions as chat messages, TRL's "
                f"format for chat prompts) or false (plain strings), got {conversational!r}."
            )
    shown = _shown(fn, signature)
    for key in settings:
        if key in _TRL_ARGUMENTS:
            raise ConfigError(
                f"verifier '{name}': '{key}' cannot be set in the config; it is the TRL-style reward "
                f"function's per-batch argument, passed when episodes are scored. The function is {shown}."
            )
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in settings if k not in _keyword_names(signature)]
    if unknown and not takes_any:
        raise ConfigError(
            f"verifier '{name}': unexpected setting(s) {unknown} for the TRL-style reward function "
            f"{shown}.{_suggest(settings, signature)} Settings must name its keyword parameters; the other "
            f"arguments (completions, prompts, task fields such as answer) are passed when scoring."
        )
    bound = functools.partial(fn, **settings) if settings else fn
    return from_trl(bound, name=name, weight=weight, conversational=conversational)


def list_verifiers() -> list[str]:
    """Registered verifier names, sorted (imports no plugin)."""
    return VERIFIERS.names()


def describe() -> str:
    """A table of every env and verifier: kind, name, source, first docstring line (for ``mmgrpo list``).

    Imports every plugin; one that fails to import is warned about and left out.
    """
    rows = [("kind", "name", "source", "description")]
    rows += [("env", *row) for row in ENVS.describe_rows()]
    rows += [("verifier", *row) for row in VERIFIERS.describe_rows()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def _reset_for_tests() -> None:
    """Forget every registration and re-read the entry points on next use (tests only)."""
    ENVS._reset()
    VERIFIERS._reset()
