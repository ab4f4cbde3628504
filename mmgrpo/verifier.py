"""The reward protocol: named, weighted functions of a finished episode, and their composition.

A verifier looks at a finished :class:`Episode` (final assistant text, the whole conversation, the task
fields from ``env.reset`` such as ``answer``) and returns a float. :class:`Rewards` combines several of them
into one reward per episode::

    total[i] = sum_v weight_v * value_v[i]  (+ episode.env_reward, see below)

The environment's own reward (``episode.env_reward``, summed over steps) is added once, unweighted, when
``include_env_reward=True`` (the default) -- unless an env-reward verifier is present: one named
``"env_reward"`` (``verifiers: [{name: env_reward}]``, :func:`mmgrpo.verifiers.env_reward`) or whose
function carries ``passes_env_reward = True``. That verifier already puts the env reward into the total,
weighted and logged as ``reward/env_reward``, so it is not added a second time.

A bad episode is data, not a crash: a verifier that raises, returns something that is not a finite number,
or (batched) returns a list of the wrong length scores 0.0 for the episodes concerned, and the failure is
counted in ``RewardBreakdown.failures[name]`` with the first few messages kept in ``RewardBreakdown.errors``.
:func:`check_verifier` is the strict counterpart, for tests: it raises :class:`VerifierError` instead.

A verifier with ``skips_none=True`` (every TRL reward function wrapped by :func:`from_trl`) may return
None for an episode: it does not score that one (TRL's "skip this sample"). Its value there is 0.0, which
leaves the total as TRL's ``nansum`` over the functions leaves it, and ``RewardBreakdown.skipped`` marks it,
so that its mean leaves the episode out; an episode no verifier scored (``RewardBreakdown.unscored``) is left
out of its group's baseline and gets advantage 0, as in TRL. None is neither a failure nor a non-finite
value: the fault policy does not see it.

:func:`from_trl` adapts a TRL-style reward function ``f(completions, **kwargs) -> list[float]`` unchanged.

This module knows nothing about models or training; torch is imported only when rewards are scored.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmgrpo.errors import ConfigError, VerifierError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENV_REWARD",
    "Episode",
    "RewardBreakdown",
    "Rewards",
    "Verifier",
    "check_verifier",
    "extract_tag",
    "from_trl",
    "passes_env_reward",
]

ENV_REWARD = "env_reward"
"""The verifier name that takes over the environment's reward in :class:`Rewards` (see the module docstring)."""

MAX_ERRORS = 8
"""How many failure messages one :meth:`Rewards.score` call keeps (the counts are always complete)."""


@dataclass
class Episode:
    """A finished episode, as verifiers see it."""

    completion: str
    """The final assistant text."""
    messages: list = field(default_factory=list)
    """The full conversation (prompt, assistant turns, tool/env turns), in the chat-message format."""
    task: dict = field(default_factory=dict)
    """The task fields: the ``info`` dict returned by ``env.reset`` (``answer`` and the like)."""
    env_reward: float = 0.0
    """The environment's own reward, summed over the episode's steps."""
    truncated: bool = False
    """True when the episode was cut (max turns, token budget) rather than ended by the environment."""


@dataclass
class Verifier:
    """A named, weighted reward function.

    ``fn(episode) -> float``, or with ``batched=True`` ``fn(episodes) -> list[float]`` (one value per
    episode, in order). ``name`` labels the value in logs and must be unique within a :class:`Rewards`.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False
    skips_none: bool = False
    """None from ``fn`` means: this episode is not scored by this verifier (TRL's semantics; see the module
    docstring). False: None is a failure, scored 0.0 and counted."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"A verifier needs a non-empty string name, got {self.name!r}.")
        if not callable(self.fn):
            raise ConfigError(
                f"Verifier '{self.name}': fn must be callable (fn(episode) -> float), got {type(self.fn).__name__}."
            )
        if (
            isinstance(self.weight, bool)
            or not isinstance(self.weight, numbers.Real)
            or not math.isfinite(self.weight)
        ):
            raise ConfigError(f"Verifier '{self.name}': weight must be a finite number, got {self.weight!r}.")
        self.weight = float(self.weight)

    def score(self, episodes: Sequence[Episode]) -> list[float | None]:
        """One float per episode (None where a ``skips_none`` verifier skipped it). Strict: exceptions from
        ``fn`` propagate, a bad value raises VerifierError.

        :class:`Rewards` is the forgiving caller that turns such failures into counted zeros.
        """
        raw = self._call(episodes)
        return [
            None if v is None and self.skips_none else _as_float(v, self.name, i) for i, v in enumerate(raw)
        ]

    def _call(self, episodes: Sequence[Episode]) -> list[Any]:
        """The raw values, length-checked, not yet converted."""
        if not self.batched:
            return [self.fn(ep) for ep in episodes]
        raw = self.fn(list(episodes))
        try:
            raw = list(raw)
        except TypeError:
            raise VerifierError(
                f"Batched verifier '{self.name}' returned {type(raw).__name__}; expected a list with one "
                f"float per episode."
            ) from None
        if len(raw) != len(episodes):
            raise VerifierError(
                f"Batched verifier '{self.name}' returned {len(raw)} values for {len(episodes)} episodes; "
                f"it must return exactly one value per episode, in order."
            )
        return raw


def _as_float(value: Any, name: str, index: int) -> float:
    """``value`` as a finite float, or VerifierError naming the verifier and episode."""
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, numbers.Real):  # bool counts: a predicate scores 1.0 / 0.0
        result = float(value)
        if math.isfinite(result):
            return result
        raise VerifierError(
            f"Verifier '{name}' returned {result} for episode {index}; rewards must be finite."
        )
    raise VerifierError(
        f"Verifier '{name}' returned {type(value).__name__} ({value!r:.80}) for episode {index}; "
        f"a verifier must return a float."
    )


def check_verifier(verifier: Verifier, episodes: Sequence[Episode]) -> list[float | None]:
    """Run ``verifier`` on ``episodes`` strictly and return its values.

    Raises VerifierError when the protocol is broken: not a Verifier, ``fn`` raises, a value that is not a
    finite number, or (batched) a list of the wrong length. Use it in tests of your own verifiers.
    """
    if not isinstance(verifier, Verifier):
        raise VerifierError(
            f"check_verifier expects a mmgrpo Verifier, got {type(verifier).__name__}; wrap a function with "
            f"Verifier(name, fn) or make one with mmgrpo.registry.make_verifier(name)."
        )
    episodes = list(episodes)
    if not all(isinstance(ep, Episode) for ep in episodes):
        raise VerifierError("check_verifier expects a list of mmgrpo.verifier.Episode objects.")
    try:
        values = verifier.score(episodes)
    except VerifierError:
        raise
    except Exception as exc:
        raise VerifierError(f"Verifier '{verifier.name}' raised {type(exc).__name__}: {exc}") from exc
    if len(values) != len(episodes):  # defensive: score() already checks batched functions
        raise VerifierError(
            f"Verifier '{verifier.name}' gave {len(values)} values for {len(episodes)} episodes."
        )
    return values


@dataclass
class RewardBreakdown:
    """What :meth:`Rewards.score` returns. Tensors are float32 on the CPU, one entry per episode."""

    total: torch.Tensor
    """(N,) the weighted sum of the verifier values, plus the env reward when included."""
    per_verifier: dict[str, torch.Tensor]
    """name -> (N,) the unweighted values (0.0 where the verifier failed)."""
    failures: dict[str, int]
    """name -> how many episodes that verifier failed on (every verifier is listed, 0 when none)."""
    errors: list[str]
    """The first few failure messages, for logs."""
    skipped: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> (N,) bool, True where the verifier returned None (``skips_none``: it did not score the
    episode; its value there is 0.0). Verifiers that cannot skip may be absent."""

    @property
    def unscored(self) -> torch.Tensor:
        """(N,) bool: the episodes every verifier skipped (none when there are no verifiers): TRL's
        unscorable completions, left out of their group's baseline and given advantage 0."""
        import torch

        n = self.total.shape[0]
        if not self.per_verifier or len(self.skipped) < len(self.per_verifier):
            return torch.zeros(n, dtype=torch.bool)
        return torch.stack([self.skipped[k] for k in self.per_verifier]).all(dim=0)  # (N,)

    def none_counts(self) -> dict[str, int]:
        """name -> how many episodes the verifier skipped (returned None for)."""
        return {k: int(v.sum()) for k, v in self.skipped.items()}

    def mean_scored(self, name: str) -> float:
        """The verifier's mean over the episodes it scored (NaN when it skipped them all, as TRL's nanmean)."""
        values, skipped = self.per_verifier[name], self.skipped.get(name)
        kept = values if skipped is None else values[~skipped]
        return float(kept.mean()) if kept.numel() else float("nan")


class Rewards:
    """A composition of verifiers: ``Rewards([v1, v2]).score(episodes) -> RewardBreakdown``.

    ``include_env_reward``: add each episode's ``env_reward`` (the environment's own reward) to the total,
    unweighted -- except when an env-reward verifier is present (a verifier named ``"env_reward"``, or whose
    ``fn`` has ``passes_env_reward = True``): it already counts the env reward, with its weight, so it is not
    added again (:attr:`adds_env_reward` is then False). With ``include_env_reward=False`` only such a
    verifier brings the env reward in. Never raises on a verifier's failure; see the module docstring.
    """

    def __init__(self, verifiers: Iterable[Verifier], include_env_reward: bool = True) -> None:
        self.verifiers: list[Verifier] = list(verifiers)
        self.include_env_reward = include_env_reward
        seen: set[str] = set()
        for v in self.verifiers:
            if not isinstance(v, Verifier):
                raise ConfigError(
                    f"Rewards takes Verifier objects, got {type(v).__name__} ({v!r:.60}); wrap a function with "
                    f"Verifier(name, fn, weight) or mmgrpo.verifier.from_trl(fn)."
                )
            if v.name in seen:
                raise ConfigError(
                    f"Two verifiers are named '{v.name}'; names label the logged rewards and must be unique. "
                    f"Give one of them another name."
                )
            seen.add(v.name)

    @property
    def adds_env_reward(self) -> bool:
        """Whether :meth:`score` adds ``episode.env_reward`` to the total itself (unweighted, not logged)."""
        return self.include_env_reward and not any(passes_env_reward(v) for v in self.verifiers)

    @property
    def names(self) -> list[str]:
        """The verifier names, in order."""
        return [v.name for v in self.verifiers]

    def __len__(self) -> int:
        return len(self.verifiers)

    def __repr__(self) -> str:
        parts = ", ".join(f"{v.name}*{v.weight:g}" for v in self.verifiers)
        return f"Rewards([{parts}], include_env_reward={self.include_env_reward})"

    def score(self, episodes: Sequence[Episode], *, keep_nonfinite: bool = False) -> RewardBreakdown:
        """Score every episode with every verifier; see the module docstring for the formula.

        A NaN or infinite value is a failure scored 0.0, unless ``keep_nonfinite``: then it is kept as it
        is, for the trainer to stop on (or skip the batch), naming the verifier (faults.nonfinite)."""
        import torch

        episodes = list(episodes)
        n = len(episodes)
        errors: list[str] = []
        failures: dict[str, int] = {}
        per_verifier: dict[str, torch.Tensor] = {}
        skipped: dict[str, torch.Tensor] = {}
        total = [0.0] * n
        for v in self.verifiers:
            values, failed, none = _score_forgiving(v, episodes, errors, keep_nonfinite)
            failures[v.name] = failed
            per_verifier[v.name] = torch.tensor(values, dtype=torch.float32)  # (N,)
            skipped[v.name] = torch.tensor(none, dtype=torch.bool)  # (N,)
            for i, value in enumerate(values):
                total[i] += v.weight * value
        if self.adds_env_reward:
            for i, ep in enumerate(episodes):
                try:
                    total[i] += _as_float(ep.env_reward, "env_reward", i)
                except VerifierError as exc:
                    failures["env_reward"] = failures.get("env_reward", 0) + 1
                    _keep(errors, str(exc))
        return RewardBreakdown(
            total=torch.tensor(total, dtype=torch.float32),  # (N,)
            per_verifier=per_verifier,
            failures=failures,
            errors=errors,
            skipped=skipped,
        )


def passes_env_reward(verifier: Verifier) -> bool:
    """True for a verifier that scores the environment's own reward (see :class:`Rewards`)."""
    return verifier.name == ENV_REWARD or bool(getattr(verifier.fn, "passes_env_reward", False))


def _keep(errors: list[str], message: str) -> None:
    if len(errors) < MAX_ERRORS:
        errors.append(message)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, VerifierError) else f"{type(exc).__name__}: {exc}"


def _score_forgiving(
    v: Verifier, episodes: list[Episode], errors: list[str], keep_nonfinite: bool = False
) -> tuple[list[float], int, list[bool]]:
    """(values, number failed, skipped): a failure scores 0.0 and leaves a message in ``errors``; with
    ``keep_nonfinite`` a NaN or infinite number is returned as it is, not counted as a failure; a None from
    a ``skips_none`` verifier scores 0.0 and is marked skipped."""
    n = len(episodes)
    skipped = [False] * n
    if v.batched:
        try:
            raw = v._call(episodes)
        except Exception as exc:  # the whole batch failed: every episode gets 0.0
            _keep(errors, f"verifier '{v.name}' failed on all {n} episodes: {_describe(exc)}")
            return [0.0] * n, n, skipped
    else:
        raw = []
        for i, ep in enumerate(episodes):
            try:
                raw.append(v.fn(ep))
            except Exception as exc:
                raw.append(_Failed(f"verifier '{v.name}' failed on episode {i}: {_describe(exc)}"))
    values: list[float] = []
    failed = 0
    for i, value in enumerate(raw):
        if isinstance(value, _Failed):
            message = value.message
        elif value is None and v.skips_none:
            values.append(0.0)
            skipped[i] = True
            continue
        elif keep_nonfinite and isinstance(value, numbers.Real) and not math.isfinite(float(value)):
            values.append(float(value))
            continue
        else:
            try:
                values.append(_as_float(value, v.name, i))
                continue
            except VerifierError as exc:
                message = str(exc)
        values.append(0.0)
        failed += 1
        _keep(errors, message)
    return values, failed, skipped


@dataclass
class _Failed:
    message: str


def from_trl(
    fn: Callable[..., Any],
    name: str | None = None,
    weight: float = 1.0,
    conversational: bool = True,
) -> Verifier:
    """Wrap a TRL-style reward function ``fn(completions, **kwargs) -> list[float]``, used unchanged.

    ``fn`` is called once per batch with:

    - ``completions``: with ``conversational=True`` one ``[{"role": "assistant", "content": text}]`` per
      episode (what TRL passes for chat prompts), else one plain string per episode;
    - ``prompts``: each episode's messages before its final assistant message;
    - every task field as a list (``answer=[...]``; ``None`` where an episode's task lacks the field).

    ``completion_ids`` is not passed (write ``**kwargs`` as TRL's docs do). A function without ``**kwargs``
    gets only the arguments it names (TRL would fail on the others). A ``None`` in the returned list
    means "skip this sample" (TRL semantics): not a failure; the episode does not count for this function
    (``skips_none``, see the module docstring). ``name`` defaults to ``fn.__name__``.

    Settings bound with ``functools.partial(fn, key=value)`` win over a task field of the same name (that
    field is not passed); this is how the registry passes a config's keyword arguments to such a function.
    """
    if not callable(fn):
        raise ConfigError(
            f"from_trl expects a reward function f(completions, **kwargs), got {type(fn).__name__}."
        )
    inner = fn
    bound: set[str] = set()  # keywords fixed by functools.partial: task fields must not override them
    while isinstance(inner, functools.partial):
        bound.update(inner.keywords)
        inner = inner.func
    if name is None:
        name = getattr(inner, "__name__", None) or type(inner).__name__
    skip = {"completions", "prompts", *bound}
    accepted = _named_parameters(fn)  # None: it takes **kwargs (or cannot be inspected), pass everything

    def trl_batch(episodes: list[Episode]) -> list[Any]:
        if conversational:
            completions: list[Any] = [[{"role": "assistant", "content": ep.completion}] for ep in episodes]
        else:
            completions = [ep.completion for ep in episodes]
        keys: dict[str, None] = {}  # ordered union of the task fields
        for ep in episodes:
            keys.update(dict.fromkeys(ep.task))
        kwargs = {k: [ep.task.get(k) for ep in episodes] for k in keys if k not in skip}
        kwargs["prompts"] = [_prompt_of(ep.messages) for ep in episodes]
        if accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        values = fn(completions=completions, **kwargs)
        if values is None:
            raise VerifierError(
                f"TRL reward function '{name}' returned None; it must return a list of floats."
            )
        return list(values)

    trl_batch.__name__ = f"trl_{name}"
    trl_batch.__doc__ = getattr(inner, "__doc__", None)
    return Verifier(name=name, fn=trl_batch, weight=weight, batched=True, skips_none=True)


def _named_parameters(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword-passable parameter names of ``fn``, or None when it takes ``**kwargs`` or has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _prompt_of(messages: list) -> list:
    """The messages before the last assistant message (all of them if there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return list(messages[:i])
    return list(messages)


_TAG_CACHE: dict[str, re.Pattern[str]] = {}


def extract_tag(text: str, tag: str = "answer", strip: bool = True) -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text`` (stripped unless ``strip=False``), or None.

    >>> extract_tag("<think>...</think><answer> 3 </answer>")
    '3'
    """
    pattern = _TAG_CACHE.get(tag)
    if pattern is None:
        t = re.escape(tag)
        # content may not contain another opening tag, so "<a>x<a>y</a>" yields "y"
        pattern = _TAG_CACHE[tag] = re.compile(rf"<{t}>((?:(?!<{t}>).)*?)</{t}>", re.DOTALL)
    if not isinstance(text, str):
        return None
    matches = pattern.findall(text)
    if not matches:
        return None
    return matches[-1].strip() if strip else matches[-1]
