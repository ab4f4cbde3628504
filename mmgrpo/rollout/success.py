"""What counts as a success at evaluation, and who said so.

A verifier's score and a success are different things: a shaped reward (TextArena's 0.89 for a game lost
by invalid moves close to the target, reasoning-gym's partial credit) can be high while nothing was won.
``mmgrpo eval`` therefore reports the metric verifier's mean score and a success rate whose definition is
stated by, in this order:

1. the env: a class attribute ``success_rule`` (a short text, e.g. ``"game won"``) and, in its step infos,
   ``info["metrics"]["success"]`` (1.0 / 0.0; the last value of an episode counts, an episode that never
   reports it or whose step raised is a failure). An env that reports ``success`` without declaring a rule
   is taken at its word too (the rule then reads ``info['metrics']['success']``).
2. the metric verifier: attributes on its function, ``success_at`` (a score >= this counts) and optionally
   ``success_rule`` (the text shown; default ``score >= <success_at>``).
3. neither: a score >= 0.5, and the report says that this is the default.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmgrpo.errors import ConfigError

DEFAULT_THRESHOLD = 0.5
"""The success threshold on the metric's score when neither the env nor the verifier states a rule."""

SOURCES = ("env", "verifier", "default")


@dataclass(frozen=True)
class SuccessRule:
    """How successes were counted: ``source`` (one of ``SOURCES``), ``text`` (what a success is) and, for
    score rules, ``threshold`` (a score >= it counts)."""

    source: str
    text: str
    threshold: float | None = None

    def describe(self) -> str:
        """The rule as printed and written to eval.json, e.g. ``env: game won`` or ``score >= 0.5, the
        default``."""
        if self.source == "default":
            return f"{self.text}, the default"
        return f"{self.source}: {self.text}"


def env_rule(env: Any) -> str | None:
    """The success rule an env declares (its ``success_rule`` attribute, also through gymnasium
    wrappers), or None."""
    for candidate in (env, getattr(env, "unwrapped", None)):
        rule = getattr(candidate, "success_rule", None)
        if rule is not None:
            if not isinstance(rule, str) or not rule.strip():
                raise ConfigError(
                    f"{type(candidate).__name__}.success_rule = {rule!r}: set it to a short text saying what a "
                    "success is (e.g. 'game won'), or leave it out"
                )
            return rule.strip()
    return None


def verifier_rule(fn: Any, name: str) -> SuccessRule | None:
    """The success rule a verifier's function declares (``success_at``, ``success_rule``), or None."""
    threshold = getattr(fn, "success_at", None)
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
        raise ConfigError(
            f"verifier '{name}': success_at = {threshold!r}; set it to the score (a finite number) from which "
            "an episode counts as a success, or leave it out"
        )
    text = getattr(fn, "success_rule", None) or f"score >= {float(threshold):g}"
    return SuccessRule("verifier", f"{name} {text}", float(threshold))


def choose_rule(env_text: str | None, env_reported: bool, verifier: SuccessRule | None) -> SuccessRule:
    """The rule in force: the env's (declared, or reported without a declaration), else the verifier's,
    else the default threshold."""
    if env_text is not None:
        return SuccessRule("env", env_text)
    if env_reported:
        return SuccessRule("env", "info['metrics']['success']")
    if verifier is not None:
        return verifier
    return SuccessRule("default", f"score >= {DEFAULT_THRESHOLD:g}", DEFAULT_THRESHOLD)


def successes(rule: SuccessRule, scores: Sequence[float], env_success: Sequence[float | None]) -> list[bool]:
    """Per episode, whether it succeeded under ``rule``: ``scores`` are the metric verifier's, and
    ``env_success`` the env's last reported ``success`` (None where it reported none)."""
    if rule.source == "env":
        return [bool(s is not None and s >= 0.5) for s in env_success]
    assert rule.threshold is not None
    return [s >= rule.threshold for s in scores]
