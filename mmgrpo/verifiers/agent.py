"""Agent verifiers: score how a tool-using episode used its tools, and pass the env's own reward through.

A tool-using episode is multi-turn. ``episode.messages`` holds the assistant turns (whose text may contain
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and one ``tool`` message per call the model
made, failed calls included::

    {"role": "tool", "name": <tool name>, "content": [parts], "error": <failure kind or None>}

These verifiers count calls from those tool messages (they never re-parse the assistant text, so they agree
with what the environment actually ran). A tool message without an ``error`` key counts as a success. Every
tool message in ``episode.messages`` counts, so few-shot examples belong in the system text, not as tool
messages in the prompt.

Correctness of the final answer is not scored here: ``number_match`` / ``exact_match`` read
``episode.completion``, the final assistant text, so a number that only appears in a tool result earns
nothing. Compose them, e.g. ``number_match`` (weight 1) + ``tool_call_cost`` (weight 1) +
``tool_use_valid`` (weight 0.2).

``env_reward`` passes the environment's summed step rewards through as a named, weighted, logged verifier;
:class:`mmgrpo.verifier.Rewards` then does not add ``episode.env_reward`` a second time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError
from mmgrpo.verifier import Episode
from mmgrpo.verifiers.answers import number_match

__all__ = ["env_reward", "tool_call_cost", "tool_messages", "tool_use_valid", "used_tool"]


def tool_messages(episode: Episode) -> list[dict[str, Any]]:
    """The episode's tool-result messages, in order: one per tool call the model made (failed ones too)."""
    return [m for m in episode.messages if isinstance(m, dict) and m.get("role") == "tool"]


def _failed(message: dict[str, Any]) -> bool:
    return message.get("error") is not None


def _check_number(owner: str, key: str, value: Any, minimum: float = 0.0) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ConfigError(f"{owner}: {key} must be a finite number >= {minimum:g}, got {value!r}.")
    return float(value)


def tool_use_valid(require_call: bool = True) -> Callable[[Episode], float]:
    """The fraction of the episode's tool calls that succeeded: 1.0 when every call did.

    - calls made: ``successful calls / calls`` (a tool message whose ``error`` is None is a success; any
      failure kind counts against it, ``oversized`` and ``too_many_calls`` included);
    - no call made: 0.0 with ``require_call=True`` (the task needs a tool), 1.0 with ``require_call=False``
      (nothing was called wrongly).

    It rewards well-formed calls, not right answers; pair it with an answer verifier.
    """
    if not isinstance(require_call, bool):
        raise ConfigError(f"tool_use_valid: require_call must be true or false, got {require_call!r}.")

    def tool_valid_score(episode: Episode) -> float:
        calls = tool_messages(episode)
        if not calls:
            return 0.0 if require_call else 1.0
        return sum(not _failed(m) for m in calls) / len(calls)

    return tool_valid_score


def tool_call_cost(
    cost: float = 0.1,
    free_calls: int = 0,
    max_penalty: float | None = None,
    only_when_right: bool = False,
    tag: str | None = "answer",
    field: str = "answer",
) -> Callable[[Episode], float]:
    """A penalty per tool call: ``-cost * max(0, calls - free_calls)``, at least ``-max_penalty``.

    ``calls`` counts every tool message, failed calls included (a failed call costs as much as a good one).
    The value is <= 0. Added to a correctness verifier it makes the same success with fewer calls score
    higher, so GRPO's group-relative advantage favours the cheapest correct trajectory: with
    ``number_match`` + ``tool_call_cost(cost=0.1)``, a right answer after 1 call scores 0.9 and after
    3 calls 0.7. Keep ``cost * typical calls`` below the correctness weight, or not calling (and guessing)
    beats calling and being right. ``max_penalty=None`` leaves the penalty unbounded.

    ``only_when_right=True`` charges only episodes whose answer is right (``number_match(tag, field)``):
    wrong answers score the same however many calls they made. Charged always, a policy that is still
    mostly wrong learns above all that its wrong episodes with fewer calls score higher, and can give up
    the tools before it finds the answers they lead to; charged on right answers only, the cost still
    ranks the right episodes by their calls, which is what it is for.
    """
    cost = _check_number("tool_call_cost", "cost", cost)
    if isinstance(free_calls, bool) or not isinstance(free_calls, numbers.Integral) or free_calls < 0:
        raise ConfigError(f"tool_call_cost: free_calls must be an int >= 0, got {free_calls!r}.")
    free_calls = int(free_calls)
    if max_penalty is not None:
        max_penalty = _check_number("tool_call_cost", "max_penalty", max_penalty)
    if not isinstance(only_when_right, bool):
        raise ConfigError(f"tool_call_cost: only_when_right must be true or false, got {only_when_right!r}.")
    right = number_match(tag=tag, field=field) if only_when_right else None

    def tool_cost_score(episode: Episode) -> float:
        if right is not None and right(episode) < 1.0:
            return 0.0
        penalty = cost * max(0, len(tool_messages(episode)) - free_calls)
        if max_penalty is not None:
            penalty = min(penalty, max_penalty)
        return -penalty

    return tool_cost_score


def used_tool(tool: str | None = None) -> Callable[[Episode], float]:
    """1.0 when a tool call succeeded (any tool, or the tool named ``tool``), else 0.0.

    A call that failed (unknown tool, bad arguments, the tool raised, ...) does not count as use.
    """
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise ConfigError(f"used_tool: tool must be a tool name or omitted (any tool), got {tool!r}.")

    def used_tool_score(episode: Episode) -> float:
        return float(
            any(not _failed(m) and (tool is None or m.get("name") == tool) for m in tool_messages(episode))
        )

    return used_tool_score


def env_reward() -> Callable[[Episode], float]:
    """The environment's own reward, summed over the episode's steps (``episode.env_reward``).

    Lets an env's reward train with no verifier written (``verifiers: [{name: env_reward}]``), logged as
    ``reward/env_reward`` and weighted like any verifier. While it is present, ``Rewards`` does not add
    ``episode.env_reward`` to the total a second time.
    """

    def env_reward_score(episode: Episode) -> float:
        return episode.env_reward

    env_reward_score.passes_env_reward = True  # type: ignore[attr-defined]  # Rewards: do not add it again
    return env_reward_score
