"""Answer verifiers: compare what the model put inside ``<answer>...</answer>`` with the task's answer.

No answer inside the tags means no credit: when the tag is absent the score is 0.0, even if the right
number appears elsewhere in the text (otherwise a model learns to spray numbers). Pass ``tag=None`` to
compare the whole completion instead.

The task field (``answer`` by default) may hold one value or a list/tuple of accepted values.
A missing task field raises VerifierError naming the field and the keys present; :class:`Rewards` counts
it as a failure of that verifier.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode, extract_tag

__all__ = ["exact_match", "number_distance", "number_match", "parse_number"]

# digits with optional thousands commas ("1,000"), optional fraction and exponent, optional sign
_NUMBER = re.compile(
    r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?|[+-]?\.\d+(?:[eE][+-]?\d+)?"
)


def parse_number(text: str) -> float | None:
    """The number ``text`` is (after stripping whitespace), or None.

    Accepts ``3``, ``-2``, ``+4.5``, ``3.0``, ``.5``, ``1,000``, ``1e3``; rejects words, ``nan``, ``inf``,
    fractions and anything with extra text ("3 apples").
    """
    if not isinstance(text, str):
        return None
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text.replace(",", ""))
    return value if math.isfinite(value) else None


def _answer_text(episode: Episode, tag: str | None, strip: bool = True) -> str | None:
    if tag is None:
        return episode.completion.strip() if strip else episode.completion
    return extract_tag(episode.completion, tag, strip=strip)


def _targets(episode: Episode, field: str) -> list[Any]:
    task = episode.task
    if field not in task:
        raise VerifierError(
            f"The task has no field '{field}' (task keys: {sorted(task)}); the env's reset() info must "
            f"contain it, or pass field=<one of those keys> to the verifier."
        )
    value = task[field]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _as_number(value: Any, field: str) -> float:
    number = parse_number(value) if isinstance(value, str) else value
    if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number):
        return float(number)
    raise VerifierError(
        f"Task field '{field}' = {value!r} is not a number; number_match needs a numeric answer."
    )


def _prediction(episode: Episode, tag: str | None, field: str) -> tuple[float | None, list[float]]:
    """The number the completion gives inside ``<tag>`` (None if none) and the accepted target numbers."""
    targets = [_as_number(t, field) for t in _targets(episode, field)]
    text = _answer_text(episode, tag)
    return (parse_number(text) if text is not None else None), targets


def number_match(
    tag: str | None = "answer", field: str = "answer", tolerance: float = 0.0, relative: bool = False
) -> Callable[[Episode], float]:
    """1.0 when the number inside ``<tag>`` equals ``task[field]`` within ``tolerance``, else 0.0.

    The tag's content must be a plain number (``3``, ``3.0``, ``-2``, ``1,000``; see ``parse_number``).
    ``tolerance`` is absolute, or relative to the target's magnitude with ``relative=True``.
    Tag absent or content not a number: 0.0. ``tag=None`` reads the whole completion.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ConfigError(f"number_match: tolerance must be a number >= 0, got {tolerance!r}.")

    def number_score(episode: Episode) -> float:
        predicted, targets = _prediction(episode, tag, field)
        if predicted is None:
            return 0.0
        for target in targets:
            allowed = tolerance * abs(target) if relative else tolerance
            if abs(predicted - target) <= allowed:
                return 1.0
        return 0.0

    return number_score


def number_distance(
    tag: str | None = "answer", field: str = "answer", scale: float = 1.0
) -> Callable[[Episode], float]:
    """Partial credit for numbers: ``max(0, 1 - |predicted - target| / (scale + 1))``, 1.0 when exact.

    A finer reward than ``number_match`` (a remedy for flat rewards): with ``scale = 1`` an
    answer off by one scores 0.5 and one off by two or more scores 0. Tag absent or not a number: 0.0.
    Against several accepted targets the closest counts.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ConfigError(f"number_distance: scale must be a number > 0, got {scale!r}.")

    def distance_score(episode: Episode) -> float:
        predicted, targets = _prediction(episode, tag, field)
        if predicted is None:
            return 0.0
        error = min(abs(predicted - t) for t in targets)
        return max(0.0, 1.0 - error / (scale + 1.0))

    return distance_score


def exact_match(
    tag: str | None = "answer", field: str = "answer", case_sensitive: bool = False, strip: bool = True
) -> Callable[[Episode], float]:
    """1.0 when the text inside ``<tag>`` equals ``str(task[field])``, else 0.0.

    Case-insensitive unless ``case_sensitive=True``; surrounding whitespace ignored unless ``strip=False``.
    Tag absent: 0.0. ``tag=None`` compares the whole completion.
    """

    def normalise(text: str) -> str:
        text = text.strip() if strip else text
        return text if case_sensitive else text.casefold()

    def exact_score(episode: Episode) -> float:
        targets = {normalise(str(t)) for t in _targets(episode, field)}
        text = _answer_text(episode, tag, strip=strip)
        return 1.0 if text is not None and normalise(text) in targets else 0.0

    return exact_score
