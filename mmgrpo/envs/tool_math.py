"""Arithmetic with a calculator: "What is 47 * 38?" (registered env name ``tool_math``).

A text task the tiny model cannot solve without a tool (it cannot multiply two-digit numbers) and can with
one: call ``calculator`` with the question's expression, read the result from the tool's message, answer
``<answer>1786</answer>``. The episode is multi-turn: a turn with ``<tool_call>`` blocks runs the tools
(``mmgrpo.envs.tool_env.ToolEnv``), the first turn without one is the final answer.

Demonstrations for the warm start (``warm_start.source: env``) teach the call syntax, not the task: each is
a random choice between

- answering at once with a random number (probability ``demo_answer_prob``, default 0.1),
- calling the calculator on the question's numbers with a *different* operator and answering with what it
  returns (``demo_wrong_op_prob``, default 0.7),
- calling it on the question's expression and answering with what it returns (the rest, 0.2).

So after the warm start the policy knows how a call looks, copies the question's numbers into it and the
tool's result into its answer, but mostly calls with the wrong operation (greedy decoding picks a wrong
one: 0.35 each against 0.2); when to call, and with which expression, is what GRPO has to find (the
metrics show it: ``env/right_call``, the share of episodes that called the calculator on the question's
expression, next to ``tools/used_frac`` and the success rate).

Copy drills (``demo_copy_prob`` of the demonstrations, default 0.3, drawn before the mix above) are right
calls whose operator is shown, not taught (``Shown``: loss mask 0), followed by the answer that copies the
result: they teach copying the question's numbers into the call and a product into the answer without
teaching which operation to pick. The mix alone shows a product's result in 2 of 10 demonstrations and the
+/- results (2-3 digits) in 7; a tiny model trained on it for 600 steps copied 2-3 digit results but not
4-digit products (0 of 20), so a right call never earned a reward and GRPO abandoned the tool. After the
warm start the same drill on held-out tasks is the check (``skill_probe``): with the right operator shown,
greedy decoding must write the rest of the call and the answer token for token.

Determinism: a task is a pure function of ``(seed, split)`` through ``scene_seed`` (train seeds even, eval
seeds odd generator seeds), as in ``counting`` and ``text_math``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mmgrpo.env import DemoTurn, Shown, Task
from mmgrpo.envs.text_math import OPS, arithmetic_task
from mmgrpo.envs.tool_env import ToolEnv
from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox.calculator import value_of
from mmgrpo.tools.runner import tool_call_text

DEFAULT_SYSTEM_PROMPT = (
    "Use a tool when you need it, then answer with the number only, inside <answer></answer>."
)
DEFAULT_QUESTION = "What is {a} {op} {b}?"


class ToolMathEnv(ToolEnv):
    """Answer ``a op b`` with two-digit (by default) operands; the calculator tool is offered.

    Args (all keyword):
        ops: operators to draw from, a subset of ``"+"``, ``"-"``, ``"*"`` (default ``["*"]``).
        low, high: operands are uniform integers in ``[low, high]`` (default 10..99).
        tools: built-in tools offered to the model (default ``["calculator"]``; see mmgrpo.toolbox), each a
            name or a mapping of the name and the tool's settings, e.g. ``{name: python, cpu_seconds: 2}``.
        demo_answer_prob, demo_wrong_op_prob, demo_copy_prob: the warm-start mix (module docstring).
        system_prompt, question: the texts (question formatted with ``a``, ``op``, ``b``).
        timeout_s, max_result_chars, max_calls_per_turn: the tool runner's limits.
    """

    def __init__(
        self,
        *,
        ops: Sequence[str] = ("*",),
        low: int = 10,
        high: int = 99,
        tools: Sequence[str] = ("calculator",),
        demo_answer_prob: float = 0.1,
        demo_wrong_op_prob: float = 0.7,
        demo_copy_prob: float = 0.3,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question: str = DEFAULT_QUESTION,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        max_calls_per_turn: int = 4,
    ) -> None:
        from mmgrpo.toolbox import make_tools

        if isinstance(ops, str) or not ops or any(op not in OPS for op in ops):
            bad = next((op for op in ops if op not in OPS), ops) if not isinstance(ops, str) else ops
            raise ConfigError(
                f"ToolMathEnv(ops={ops!r}): expected a non-empty list of operators from {list(OPS)}."
                f"{did_you_mean(str(bad), tuple(OPS))}"
            )
        if (
            isinstance(low, bool)
            or isinstance(high, bool)
            or not isinstance(low, int)
            or not isinstance(high, int)
        ):
            raise ConfigError(f"ToolMathEnv(low={low!r}, high={high!r}): expected ints")
        if low > high:
            raise ConfigError(f"ToolMathEnv(low={low}, high={high}): expected low <= high")
        for kwarg, p in (
            ("demo_answer_prob", demo_answer_prob),
            ("demo_wrong_op_prob", demo_wrong_op_prob),
            ("demo_copy_prob", demo_copy_prob),
        ):
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"ToolMathEnv({kwarg}={p!r}): expected a probability in [0, 1]")
        if demo_answer_prob + demo_wrong_op_prob > 1.0:
            raise ConfigError(
                f"ToolMathEnv: demo_answer_prob + demo_wrong_op_prob = {demo_answer_prob + demo_wrong_op_prob} "
                "> 1; the rest is the share of demonstrations that call the calculator correctly"
            )
        if isinstance(tools, str):
            raise ConfigError(
                f"ToolMathEnv(tools={tools!r}): expected a list of tools, e.g. ['calculator'] or "
                "[{name: python, cpu_seconds: 2}]"
            )
        super().__init__(
            make_tools(tools, "ToolMathEnv: tools"),
            timeout_s=timeout_s,
            max_result_chars=max_result_chars,
            max_calls_per_turn=max_calls_per_turn,
        )
        self.ops, self.low, self.high = tuple(ops), low, high
        self.demo_answer_prob, self.demo_wrong_op_prob = demo_answer_prob, demo_wrong_op_prob
        self.demo_copy_prob = demo_copy_prob
        self.system_prompt, self.question = system_prompt, question

    def make_task(self, seed: int, split: str) -> Task:
        return arithmetic_task(self, seed, split)

    skill = "with the right operation shown, copy the question's numbers into the call and its result into the answer"

    def demonstration(self, info: dict[str, Any], rng: random.Random) -> list[DemoTurn]:
        a, b, op = info["a"], info["b"], info["op"]
        if rng.random() < self.demo_copy_prob:  # a copy drill: the right call shown, the answer taught
            return self.skill_probe(info)
        u = rng.random()
        if u < self.demo_answer_prob:  # answer at once, with a number that has nothing to do with the task
            return [
                f"<answer>{OPS[op](rng.randint(self.low, self.high), rng.randint(self.low, self.high))}</answer>"
            ]
        if u < self.demo_answer_prob + self.demo_wrong_op_prob:
            op = rng.choice([o for o in OPS if o != op])
        return [
            tool_call_text("calculator", {"expression": f"{a} {op} {b}"}),
            f"<answer>{OPS[op](a, b)}</answer>",
        ]

    def skill_probe(self, info: dict[str, Any]) -> list[DemoTurn]:
        """The right call with its operator shown (not taught) and the rest of it taught (the question's
        numbers copied into it), then the answer that copies the tool's result (taught)."""
        a, b, op = info["a"], info["b"], info["op"]
        head, tail = tool_call_text("calculator", {"expression": f"{a} {op} {b}"}).split(f" {op} ", 1)
        return [(head, Shown(f" {op}"), f" {tail}"), f"<answer>{OPS[op](a, b)}</answer>"]

    def call_flags(self, info: dict[str, Any], calls: list) -> dict[str, bool]:
        # "did the episode call the calculator on the question's expression": what GRPO has to learn
        asked = OPS[info["op"]](info["a"], info["b"])
        right = any(
            c.name == "calculator" and value_of(c.arguments.get("expression")) == asked for c in calls
        )
        return {"right_call": right}

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A final answer that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"
