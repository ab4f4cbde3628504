"""Format verifiers: does the completion have the expected shape (``<answer>...</answer>``, a regex)?"""

from __future__ import annotations

import re
from collections.abc import Callable

from mmgrpo.errors import ConfigError
from mmgrpo.verifier import Episode

__all__ = ["format_reward"]


def format_reward(
    tag: str = "answer", strict: bool = True, pattern: str | None = None
) -> Callable[[Episode], float]:
    """1.0 when the completion has the answer format, else 0.0.

    - ``strict=True``: the completion is exactly one ``<tag>...</tag>`` pair, with only whitespace around it.
    - ``strict=False``: a ``<tag>...</tag>`` pair appears somewhere (reasoning before it is fine).
    - ``pattern``: a regular expression the whole completion must match (``re.fullmatch`` with DOTALL);
      when given, ``tag`` and ``strict`` are ignored.

    Only the shape is checked: ``<answer></answer>`` passes; whether the answer is right is the job of
    ``number_match`` / ``exact_match``.
    """
    if pattern is not None:
        try:
            regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError(
                f"format_reward: pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from exc
        description = f"fullmatch {pattern!r}"
    else:
        if not isinstance(tag, str) or not tag or "<" in tag or ">" in tag:
            raise ConfigError(f"format_reward: tag must be a bare tag name such as 'answer', got {tag!r}.")
        t = re.escape(tag)
        inner = rf"<{t}>(?:(?!</?{t}>).)*</{t}>"  # one pair, no nested or repeated tag inside
        regex = re.compile(rf"\s*{inner}\s*" if strict else rf".*{inner}.*", re.DOTALL)
        description = f"{'exactly' if strict else 'contains'} <{tag}>...</{tag}>"

    def format_score(episode: Episode) -> float:
        return 1.0 if regex.fullmatch(episode.completion) else 0.0

    format_score.__doc__ = f"1.0 if the completion is {description}, else 0.0."
    return format_score
