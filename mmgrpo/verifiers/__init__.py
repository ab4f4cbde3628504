"""Built-in reward verifiers, installed as the package ``mmgrpo.verifiers``.

Each public name is a *factory* ``(**kwargs) -> fn(episode) -> float``, registered under the entry-point
group ``mmgrpo.verifiers`` (see pyproject.toml) and made by name with ``mmgrpo.registry.make_verifier``.
``answers`` and ``format`` score the final assistant text; ``agent`` scores tool use and passes the
environment's own reward through.
"""

from __future__ import annotations

from mmgrpo.verifiers.agent import env_reward, tool_call_cost, tool_messages, tool_use_valid, used_tool
from mmgrpo.verifiers.answers import exact_match, number_distance, number_match, parse_number
from mmgrpo.verifiers.format import format_reward

__all__ = [
    "env_reward",
    "exact_match",
    "format_reward",
    "number_distance",
    "number_match",
    "parse_number",
    "tool_call_cost",
    "tool_messages",
    "tool_use_valid",
    "used_tool",
]
