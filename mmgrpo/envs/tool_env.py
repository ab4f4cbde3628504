"""``ToolEnv``: the base class of multi-turn episodes in which the model may call tools before it answers.

An episode is ``reset`` (the prompt, and ``info["tools"]``: the tools' JSON schemas, which the rollout passes to
the chat template as ``tools=``), then one ``step`` per assistant turn:

- a turn with ``<tool_call>...</tool_call>`` blocks runs them (``mmgrpo.tools.runner.ToolRunner``: concurrently, each
  with its own timeout) and returns one ``tool`` message per call, ``terminated=False``;
- a turn without any is the final answer: ``([], 0.0, True, False, info)``.

A bad call (broken JSON, unknown tool, wrong arguments, a tool that raises or hangs) is an observation, a tool
message saying what was wrong and how to call the tool, never an exception. The rollout, not the env, enforces
``max_turns`` and the token budget; a tool's result reaches the model in its next turn, so a tool env needs
``env.max_turns >= 2`` (``MIN_TURNS``; the config refuses less for a registered ToolEnv class, and
``check_max_turns(env, max_turns)`` is the same check on a built env). Step infos carry ``tool_calls`` (int),
``tool_failures`` ({kind: count}) and ``tool_names`` (list) for metrics.

Subclasses implement ``make_task(seed, split) -> Task`` exactly as for ``SingleTurnEnv`` and may override
``episode_tools(task)`` to give each episode its own tools (e.g. crop and zoom bound to the episode's image).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from mmgrpo.env import ChatEnv, DemoTurn, Message, Task, check_step, start_task
from mmgrpo.errors import ConfigError
from mmgrpo.tools.runner import (
    Tool,
    ToolCall,
    ToolRunner,
    as_tool,
    count_failures,
    parse_tool_calls,
    tool_message,
)

MIN_TURNS = 2
"""The fewest turns in which a tool call can be answered: the call, then a turn that reads its result."""


def max_turns_problem(max_turns: int, env_name: str) -> str | None:
    """Why ``env.max_turns = max_turns`` cannot work for the tool env ``env_name``, or None when it can."""
    if max_turns >= MIN_TURNS:
        return None
    return (
        f"is {max_turns}, but the tool env {env_name} answers a tool call in the model's next turn, so no call "
        "could ever be answered: set env.max_turns >= 2 (the tool examples use 3)"
    )


def check_max_turns(env: Any, max_turns: int, env_name: str = "") -> None:
    """Raise ConfigError when ``env`` is a ToolEnv and ``max_turns`` leaves no turn to read a tool's result."""
    if isinstance(env, ToolEnv) and (problem := max_turns_problem(max_turns, env_name or type(env).__name__)):
        raise ConfigError(f"env.max_turns {problem}")


class ToolEnv(ChatEnv):
    """A task env whose assistant turns may call tools; the first turn without a call ends the episode.

    ``tools`` are Tools or plain functions (type hints and a Google-style docstring); ``timeout_s``,
    ``max_result_chars`` and ``max_calls_per_turn`` configure the ``ToolRunner`` of every episode.
    """

    _task: Task | None = None
    _info: dict[str, Any] | None = None
    _done: bool = True
    runner: ToolRunner | None = None
    """The current episode's runner (set by ``reset``)."""

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        *,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        max_calls_per_turn: int = 4,
    ) -> None:
        self.tools = [as_tool(t) for t in tools]
        self.runner_settings = {
            "timeout_s": timeout_s,
            "max_result_chars": max_result_chars,
            "max_calls_per_turn": max_calls_per_turn,
        }
        ToolRunner(
            self.tools, **self.runner_settings
        )  # fail now (ConfigError) on bad settings or duplicate names

    def make_task(self, seed: int, split: str) -> Task:
        raise NotImplementedError(f"{type(self).__name__} must implement make_task(seed, split) -> Task")

    skill: str = ""
    """What ``skill_probe`` measures, in a few words (e.g. "copy the calculator's result into the answer")."""

    def demonstration(self, info: dict[str, Any], rng: random.Random) -> list[DemoTurn] | None:
        """Assistant turns for the supervised warm start (``warm_start.source: env``), or None if the env has
        none. The warm start plays them through ``step`` (tools really run) and trains on the policy turns,
        except what is wrapped in ``Shown`` (a whole turn, or pieces of a turn given as a tuple of pieces):
        played and laid out, not trained on. Each env documents what its
        demonstrations teach; the built-in ones teach the call syntax and leave the choice of tool, timing or
        arguments to GRPO."""
        return None

    def skill_probe(self, info: dict[str, Any]) -> list[DemoTurn] | None:
        """The check of what the demonstrations must have taught, or None: turns as ``demonstration`` returns
        them, whose taught (not ``Shown``) turns the warm-started policy must reproduce token for token under
        greedy decoding. The warm start runs it on held-out tasks and stops the run when too few pass."""
        return None

    def episode_tools(self, task: Task) -> list[Tool | Callable[..., Any]]:
        """The tools of the episode posing ``task`` (default: the constructor's)."""
        return list(self.tools)

    def call_flags(self, info: dict[str, Any], calls: list[ToolCall]) -> dict[str, bool]:
        """What a subclass reports of an episode's calls: for this step's well-formed ``calls`` of the
        task ``info``, each flag's value (every flag named at every step, calls or not). A flag stays 1.0
        once it held at some step of the episode, and reaches the metrics as ``env/<name>`` (step infos'
        ``metrics``). Default: none."""
        return {}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task, info = start_task(self, seed, options)
        self.runner = ToolRunner(self.episode_tools(task), **self.runner_settings)
        self._task, self._done = task, False
        self.last_calls: list[ToolCall] = []
        self._flags: dict[str, bool] = {}
        self._info = dict(info, tools=self.runner.schemas)
        return list(task.messages), dict(self._info)

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        check_step(self, self._task is not None, self._done, action)
        assert self.runner is not None
        entries = parse_tool_calls(action)
        # the well-formed calls of this step, for subclasses' metrics (parsed once, here)
        self.last_calls = [e for e in entries if isinstance(e, ToolCall)]
        results = self.runner.run_parsed(entries)
        info = dict(
            self._info or {},
            tool_calls=len(results),
            tool_failures=count_failures(results),
            tool_names=[r.name for r in results],
        )
        if flags := self.call_flags(self._info or {}, self.last_calls):
            self._flags = {k: self._flags.get(k, False) or v for k, v in flags.items()}
            info["metrics"] = {k: float(v) for k, v in self._flags.items()}
        if not results:  # no <tool_call>: the final answer
            self._done = True
            return [], 0.0, True, False, info
        return [tool_message(r) for r in results], 0.0, False, False, info
