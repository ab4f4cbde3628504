"""Mathematical answers compared symbolically with math-verify: ``\\frac{1}{2}`` is ``0.5``, ``(x+1)^2`` is
``x^2+2x+1``.

math-verify (``pip install math-verify``) is an optional dependency, imported when the verifier is built:
without it, building ``math_equiv`` raises ConfigError at config time, not on the first episode.

math-verify bounds its parsing and comparison time with ``signal.alarm``, which only works in the main
thread. ``math_equiv`` uses that timeout (``timeout_seconds``) when scoring in the main thread and turns it off
in any other thread, where a pathological expression may then take long (math-verify logs a warning once).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode
from mmgrpo.verifiers.answers import _answer_text, _targets

__all__ = ["last_boxed", "math_equiv"]

_DELIMITERS = ("\\boxed", "$", "\\(", "\\[")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched; None if none.

    >>> last_boxed("so \\\\boxed{\\\\frac{1}{2}} done")
    '\\\\frac{1}{2}'
    """
    if not isinstance(text, str):
        return None
    for m in reversed(list(_BOXED.finditer(text))):
        depth = 0
        for k in range(m.end() - 1, len(text)):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end() : k].strip()
    return None


def _latex_input(text: str) -> str:
    """What to hand to ``math_verify.parse``: the text itself when it is delimited LaTeX, else ``$text$``.

    A bare ``x^2+2x+1`` is not found by math-verify's extraction unless it sits in math delimiters. An
    answer written as a sentence ("so it is 1/2") reads badly as math; the answer tag should hold the answer.
    """
    return text if any(d in text for d in _DELIMITERS) else f"${text}$"


def math_equiv(
    tag: str | None = "answer",
    field: str = "answer",
    boxed: bool = True,
    float_rounding: int = 6,
    numeric_precision: int = 15,
    strict: bool = True,
    timeout_seconds: int | None = 5,
) -> Callable[[Episode], float]:
    """1.0 when the final answer is mathematically equal to ``task[field]`` (math-verify), else 0.0.

    The final answer is the content of ``<tag>`` (``<answer>``); when the completion has no such tag and
    ``boxed=True``, the content of its last ``\\boxed{...}``. Neither: 0.0. ``tag=None`` hands the whole
    completion to math-verify, which finds the answer itself (``\\boxed``, "final answer is", the last
    expression). Both sides are parsed with ``math_verify.parse`` (as LaTeX, plain ``x^2+2x+1`` included)
    and compared with ``math_verify.verify(gold, prediction, ...)``, which takes ``float_rounding``,
    ``numeric_precision`` and ``strict`` (see its documentation). The task field may hold one answer or a
    list of accepted ones; a number is used as its text. One that math-verify cannot parse raises
    VerifierError.

    ``timeout_seconds`` (a whole number; 0 or null for none) bounds each parse and comparison in the main
    thread; in other threads no timeout is used (signals work only in the main thread).
    """
    try:
        math_verify = importlib.import_module("math_verify")
    except ImportError as exc:
        raise ConfigError(
            f"math_equiv needs the math-verify package, which is not installed ({exc}). Install it with "
            f"`pip install math-verify`, or use number_equiv / number_match for numeric answers."
        ) from exc
    for name, value in (("float_rounding", float_rounding), ("numeric_precision", numeric_precision)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"math_equiv: {name} must be a whole number >= 0, got {value!r}.")
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int) or timeout_seconds < 0
    ):
        raise ConfigError(
            f"math_equiv: timeout_seconds must be a whole number of seconds >= 0 (signal.alarm takes whole "
            f"seconds) or null, got {timeout_seconds!r}."
        )
    for name, value in (("boxed", boxed), ("strict", strict)):
        if not isinstance(value, bool):
            raise ConfigError(f"math_equiv: {name} must be true or false, got {value!r}.")
    parse, verify = math_verify.parse, math_verify.verify

    def timeout() -> int | None:
        in_main = threading.current_thread() is threading.main_thread()
        return timeout_seconds if in_main and timeout_seconds else None

    def parsed(text: str, seconds: int | None) -> list[Any]:
        return parse(text, parsing_timeout=seconds)

    def parsed_answer(text: str, seconds: int | None) -> list[Any]:
        """An extracted answer: as LaTeX math first, as plain text when that finds nothing ("sqrt(2)")."""
        wrapped = _latex_input(text)
        return parsed(wrapped, seconds) or (parsed(text, seconds) if wrapped != text else [])

    def math_score(episode: Episode) -> float:
        seconds = timeout()
        golds = []
        for raw in _targets(episode, field):
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                raise VerifierError(
                    f"Task field '{field}' = {raw!r:.80} is not an answer math_equiv can read (a string or number)."
                )
            gold = parsed_answer(str(raw).strip(), seconds)
            if not gold:
                raise VerifierError(f"Task field '{field}' = {raw!r:.80}: math-verify could not parse it.")
            golds.append(gold)
        if tag is None:
            text: str | None = episode.completion
            prediction = parsed(text, seconds)
        else:
            text = _answer_text(episode, tag)
            if text is None and boxed:
                text = last_boxed(episode.completion)
            if text is None or not text.strip():
                return 0.0
            prediction = parsed_answer(text, seconds)
        if not prediction:
            return 0.0
        kwargs = dict(
            float_rounding=float_rounding,
            numeric_precision=numeric_precision,
            strict=strict,
            timeout_seconds=seconds,
        )
        return 1.0 if any(verify(gold, prediction, **kwargs) for gold in golds) else 0.0

    return math_score
