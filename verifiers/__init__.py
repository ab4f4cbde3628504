"""Built-in reward verifiers, installed as the package ``mmgrpo.verifiers``.

Each public name is a *factory* ``(**kwargs) -> fn(episode) -> float``, registered under the entry-point
group ``mmgrpo.verifiers`` (see pyproject.toml) and made by name with ``mmgrpo.registry.make_verifier``.
"""

from __future__ import annotations

from mmgrpo.verifiers.answers import exact_match, number_match, parse_number
from mmgrpo.verifiers.format import format_reward

__all__ = ["exact_match", "format_reward", "number_match", "parse_number"]
