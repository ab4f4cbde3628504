"""Text-only arithmetic: "What is 3 + 4?" (registered env name ``text_math``).

A single-turn task with no image, for text-only causal LMs (and for checking that a vision-language model
still works without images). Each task draws ``a`` and ``b`` uniformly in ``[low, high]`` and an operator
from ``ops``; the answer is the exact integer result as a string (negative for some subtractions).

Determinism: a task is a pure function of ``(seed, split)`` through ``random.Random(2 * seed + (split ==
"eval"))``, the counting env's rule (``mmgrpo.envs.counting.scene_seed``): train seeds map to even generator
seeds and eval seeds to odd ones, so no train seed reuses an eval generator (with a small range of numbers
the same question can still appear in both splits; the question space is only ``len(ops) * n**2``).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import Any

from mmgrpo.env import SingleTurnEnv, Task, system, user
from mmgrpo.envs.counting import scene_seed
from mmgrpo.errors import ConfigError, did_you_mean

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
DEFAULT_SYSTEM_PROMPT = "Answer with the number only, inside <answer></answer>."
DEFAULT_QUESTION = "What is {a} {op} {b}?"


class TextMathEnv(SingleTurnEnv):
    """Answer one arithmetic question ``a op b``; the answer is the result as a string.

    Args (all keyword):
        ops: the operators to draw from, a non-empty subset of ``"+"``, ``"-"``, ``"*"`` (default + and -).
        low, high: ``a`` and ``b`` are uniform integers in ``[low, high]`` (default 0..9).
        system_prompt: the system message.
        question: the question template, formatted with ``a``, ``op`` and ``b``.

    ``reset`` info: ``answer`` (str), ``a``, ``b`` (int), ``op`` (str), plus ``seed`` and ``split``.
    """

    def __init__(
        self,
        *,
        ops: Sequence[str] = ("+", "-"),
        low: int = 0,
        high: int = 9,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question: str = DEFAULT_QUESTION,
    ) -> None:
        if isinstance(ops, str) or not isinstance(ops, Sequence) or not ops:
            raise ConfigError(
                f"TextMathEnv(ops={ops!r}): expected a non-empty list of operators, e.g. ['+', '-']"
            )
        for op in ops:
            if op not in OPS:
                raise ConfigError(
                    f"TextMathEnv(ops=...): unknown operator {op!r}; valid operators are {list(OPS)}."
                    f"{did_you_mean(str(op), tuple(OPS))}"
                )
        if len(set(ops)) != len(ops):
            raise ConfigError(f"TextMathEnv(ops={ops!r}): operators must be distinct")
        for kwarg, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"TextMathEnv({kwarg}={value!r}): expected an int")
        if low > high:
            raise ConfigError(f"TextMathEnv(low={low}, high={high}): expected low <= high")
        if not isinstance(system_prompt, str):
            raise ConfigError(
                f"TextMathEnv(system_prompt=...): expected a str, got {type(system_prompt).__name__}"
            )
        try:
            question.format(a=1, op="+", b=2)
        except (AttributeError, KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"TextMathEnv(question={question!r}): expected a str template using only {{a}}, {{op}} and "
                f"{{b}}, e.g. {DEFAULT_QUESTION!r} ({type(e).__name__}: {e})"
            ) from None
        self.ops, self.low, self.high = tuple(ops), low, high
        self.system_prompt, self.question = system_prompt, question

    def make_task(self, seed: int, split: str) -> Task:
        return arithmetic_task(self, seed, split)

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A completion that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"


def arithmetic_task(env: Any, seed: int, split: str) -> Task:
    """The task ``a op b`` of (seed, split) for an env with ``ops``, ``low``, ``high``, ``system_prompt`` and
    ``question`` (text_math and tool_math): info holds ``answer`` (str), ``a``, ``b`` and ``op``."""
    rng = random.Random(scene_seed(seed, split))
    op = rng.choice(env.ops)
    a, b = rng.randint(env.low, env.high), rng.randint(env.low, env.high)
    messages = [system(env.system_prompt), user(env.question.format(a=a, op=op, b=b))]
    return Task(messages, {"answer": str(OPS[op](a, b)), "a": a, "b": b, "op": op})
