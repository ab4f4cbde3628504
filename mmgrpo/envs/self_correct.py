"""Self-correction: answer, get asked to check the answer, answer again (registered env name ``self_correct``).

``SelfCorrectEnv`` wraps any single-turn env (``counting``, ``text_math``, ``vqa``, a plugin's
``SingleTurnEnv``) and makes each episode two policy turns::

    env:
      name: self_correct
      max_turns: 2                # needed: with 1 the rollout cuts every episode after the first answer
      kwargs:
        env: counting             # the inner env's registered name
        env_kwargs: {max_count: 5}
        prompt: "Check your answer. If it is wrong, give the corrected answer inside <answer></answer>; otherwise repeat it."
        answer_field: answer      # the task field holding the true answer (for the statistics only)

- ``reset``: the inner env's ``reset``, the same prompt and info.
- first ``step(text)``: the episode goes on. The first answer (the text inside the last
  ``<answer>...</answer>``, read with ``mmgrpo.verifier.extract_tag`` as the answer verifiers read it) is
  kept, and the env returns one user message holding ``prompt`` (the model's own answer is already in the
  conversation as its assistant turn), reward 0.0, ``terminated=False``. The rollout appends that message as
  env tokens (loss mask 0).
- second ``step(text)``: the inner env is stepped with this final text, and the episode ends with the inner
  env's reward. The episode's completion is this last assistant turn, so the verifiers (``number_match``,
  ``format``, ...) score the corrected answer only.

Statistics: the final step's ``info["metrics"]`` (logged by the trainer and ``mmgrpo eval`` as
``env/<name>``, each the mean over the episodes that finished both turns) holds, per episode, 1 or 0:

- ``first_correct``: the first answer was right;
- ``final_correct``: the final answer was right (what ``number_match`` rewards, for numeric answers);
- ``corrected``: the first was wrong and the final right;
- ``broken``: the first was right and the final wrong.

and ``info["first_answer"]`` is the first answer's text (None when it had no answer tag). Reading them:
``final_correct - first_correct = corrected - broken`` is the net gain of the second look; the share of
first-wrong answers that got corrected is ``corrected / (1 - first_correct)``, and the share of first-right
answers the model talked itself out of is ``broken / first_correct``. A model that just repeats itself has
``corrected = broken = 0``.

Correctness for the statistics: the answer text is compared with ``str(task[answer_field])`` (each
element when the field holds a list or tuple of accepted answers); numerically when both parse as plain
numbers (``mmgrpo.verifiers.answers.parse_number``: ``3`` equals ``3.0`` and ``+3``), otherwise as text,
ignoring case and surrounding whitespace. No ``<answer>`` tag means wrong.

Episodes the rollout cuts before the second step (``max_turns: 1``, a turn that hits ``max_new_tokens``, the
token budget) report no statistics and are not counted in them. The inner env must be single-turn: a tool
env, the ``gym`` adapter or another ``self_correct`` is refused when built, and any other inner env that
does not end its episode on its first step raises EnvError at that step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmgrpo.env import ChatEnv, Message, check_step, user
from mmgrpo.errors import ConfigError, EnvError, RegistryError
from mmgrpo.verifier import extract_tag
from mmgrpo.verifiers.answers import parse_number

__all__ = ["DEFAULT_PROMPT", "SelfCorrectEnv", "is_correct"]

DEFAULT_PROMPT = (
    "Check your answer. If it is wrong, give the corrected answer inside <answer></answer>; "
    "otherwise repeat it."
)
TAG = "answer"
METRICS = ("first_correct", "final_correct", "corrected", "broken")


def is_correct(answer: str | None, target: Any) -> bool:
    """Whether the answer text (from inside the answer tag; None: no tag) matches ``target``.

    ``target`` is one accepted answer or a list/tuple of them, each compared as ``str(target)``: numerically
    when both parse as plain numbers, else as text ignoring case and surrounding whitespace.
    """
    if answer is None:
        return False
    targets = list(target) if isinstance(target, (list, tuple)) else [target]
    predicted = parse_number(answer)
    for t in targets:
        text = str(t)
        number = parse_number(text)
        if predicted is not None and number is not None:
            if predicted == number:
                return True
        elif answer.strip().casefold() == text.strip().casefold():
            return True
    return False


def _multi_turn_kind(env: Any) -> str | None:
    """Why ``env`` is known to be multi-turn (a short description), or None when it is not known to be."""
    from mmgrpo.envs.gym_adapter import GymChatEnv
    from mmgrpo.envs.tool_env import ToolEnv

    if isinstance(env, SelfCorrectEnv):
        return "a self_correct env (already two turns)"
    if isinstance(env, ToolEnv):
        return "a tool env (ToolEnv: its turns may call tools)"
    if isinstance(env, GymChatEnv):
        return "the gym adapter (one turn per game step)"
    return None


class SelfCorrectEnv(ChatEnv):
    """Two turns on a single-turn task: answer, then check the answer and answer again (the one scored).

    Args (all keyword):
        env: the registered name of the inner, single-turn env (``counting``, ``text_math``, ...).
        env_kwargs: the inner env's keyword arguments (default none).
        prompt: the text of the user message after the first answer (default ``DEFAULT_PROMPT``).
        answer_field: the task field (``reset`` info) holding the true answer, for the statistics only
            (default ``answer``).

    ``reset`` info: the inner env's, unchanged. Final ``step`` info: the inner env's final step info plus
    ``first_answer`` (str or None) and ``metrics`` = {first_correct, final_correct, corrected, broken}, each
    0 or 1 (see the module docstring for how to read them).
    """

    def __init__(
        self,
        *,
        env: str,
        env_kwargs: Mapping[str, Any] | None = None,
        prompt: str = DEFAULT_PROMPT,
        answer_field: str = "answer",
    ) -> None:
        from mmgrpo.registry import make_env

        if not isinstance(env, str) or not env:
            raise ConfigError(
                f"SelfCorrectEnv(env={env!r}): expected the inner env's registered name, e.g. env: counting"
            )
        if env_kwargs is None:
            env_kwargs = {}
        if not isinstance(env_kwargs, Mapping) or not all(isinstance(k, str) for k in env_kwargs):
            raise ConfigError(
                f"SelfCorrectEnv(env_kwargs={env_kwargs!r}): expected a mapping of the inner env's keyword "
                f"arguments, e.g. env_kwargs: {{max_count: 5}}"
            )
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(
                f"SelfCorrectEnv(prompt={prompt!r}): expected a non-empty str, the user message after the "
                f"first answer, e.g. {DEFAULT_PROMPT!r}"
            )
        if not isinstance(answer_field, str) or not answer_field:
            raise ConfigError(
                f"SelfCorrectEnv(answer_field={answer_field!r}): expected the name of the task field holding "
                "the true answer, e.g. answer_field: answer"
            )
        try:
            inner = make_env(env, **dict(env_kwargs))
        except (RegistryError, ConfigError) as exc:
            raise ConfigError(f"SelfCorrectEnv(env={env!r}): {exc}") from None
        kind = _multi_turn_kind(inner)
        if kind is not None:
            raise ConfigError(
                f"SelfCorrectEnv(env={env!r}): the inner env is {kind}; self_correct wraps single-turn envs "
                "only (a SingleTurnEnv such as counting, text_math, vqa or text_qa)."
            )
        self.inner = inner
        self.inner_name = env
        self.prompt = prompt
        self.answer_field = answer_field
        self._info: dict[str, Any] | None = None
        self._first: str | None = None
        self._turn = 0
        self._done = True

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        messages, info = self.inner.reset(seed=seed, options=options)
        if not isinstance(info, dict) or self.answer_field not in info:
            keys = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise EnvError(
                f"SelfCorrectEnv: the inner env '{self.inner_name}' gave a task without the field "
                f"'{self.answer_field}' (task keys: {keys}); set answer_field to the field that holds the "
                "true answer."
            )
        self._info, self._first, self._turn, self._done = dict(info), None, 0, False
        return messages, info

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        check_step(self, self._info is not None, self._done, action)
        assert self._info is not None
        self._turn += 1
        if self._turn == 1:
            self._first = extract_tag(action, TAG)
            return [user(self.prompt)], 0.0, False, False, dict(self._info)
        self._done = True
        obs, reward, terminated, truncated, inner_info = self.inner.step(action)
        if not (terminated or truncated) or obs:
            raise EnvError(
                f"SelfCorrectEnv: the inner env '{self.inner_name}' ({type(self.inner).__name__}) did not end "
                f"its episode on its first step (terminated={terminated}, truncated={truncated}, "
                f"{len(obs or [])} new message(s)); self_correct wraps single-turn envs only."
            )
        target = self._info[self.answer_field]
        first = is_correct(self._first, target)
        final = is_correct(extract_tag(action, TAG), target)
        info = dict(self._info, **(inner_info if isinstance(inner_info, dict) else {}))
        inner_metrics = info.get("metrics")
        info["first_answer"] = self._first
        info["metrics"] = {
            **(inner_metrics if isinstance(inner_metrics, dict) else {}),
            "first_correct": int(first),
            "final_correct": int(final),
            "corrected": int(final and not first),
            "broken": int(first and not final),
        }
        return [], float(reward), True, False, info

    def close(self) -> None:
        self.inner.close()
        super().close()
