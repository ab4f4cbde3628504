"""``verifiers_rubric``: the score of a Prime Intellect ``verifiers`` environment's rubric, as mmgrpo's reward.

The ``verifiers`` env (:mod:`mmgrpo.envs.pi_verifiers`) scores each finished episode with the PI task's own
``@vf.reward`` functions (and the rewards its ``Env`` records) and returns their weighted sum (PI's
``trace.reward``) as the episode's env reward. This verifier passes that sum through, named, weighted and
logged as ``reward/verifiers_rubric``::

    env: {name: verifiers, kwargs: {env: my_taskset}}
    verifiers:
      - {name: verifiers_rubric}

Each function's own score is logged by the env as ``env/<function name>`` (and the sum as
``env/verifiers_reward``). While this verifier is listed, ``Rewards`` does not add the env reward a second
time. Other verifiers (``format``, ``tool_call_cost``, ...) may be listed beside it and add to the total.
"""

from __future__ import annotations

from collections.abc import Callable

from mmgrpo.verifier import Episode

__all__ = ["verifiers_rubric"]


def verifiers_rubric() -> Callable[[Episode], float]:
    """The PI rubric's weighted reward sum of the episode (its env reward, summed over the steps)."""

    def verifiers_rubric_score(episode: Episode) -> float:
        return episode.env_reward

    verifiers_rubric_score.passes_env_reward = True  # type: ignore[attr-defined]  # Rewards: do not add it again
    return verifiers_rubric_score
