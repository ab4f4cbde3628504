"""Prime Intellect's ``verifiers`` environments as an mmgrpo env (registered env name ``verifiers``).

One line of YAML trains on a PI environment (``pip install 'mmgrpo[pi-verifiers]'``, verifiers >= 0.4)::

    env:
      name: verifiers
      max_turns: 4
      kwargs: {env: my_taskset, args: {num_tasks: 200}, max_turns: 4}
    verifiers:
      - {name: verifiers_rubric}

``env`` is what PI calls a taskset id: an importable module (or installed environment package) exporting one
``vf.Taskset`` subclass in ``__all__``, and optionally a ``vf.Env`` subclass that drives a multi-turn
episode (a game engine, a scripted user); ``args`` are the fields of its ``TasksetConfig`` (what PI's CLI
takes as ``--env.taskset.*``). ``env_id`` names an ``Env`` package explicitly (PI's ``--env.id``).

How PI's parts map onto the episode protocol (``mmgrpo.env``):

- ``reset(seed, split)`` picks task ``seed % n`` of the split and starts PI's ``Env.run(task, agents)``
  coroutine; it runs until the agent seat is first asked to answer. The observation is what the episode
  produced by then: the task's system prompt and prompt (or, for a prompt-less task, the opening user
  message of the env's own ``run``). ``info`` holds ``tools`` (the schemas of the task's ``@vf.tool``
  methods), ``task`` (its index) and the task's extra data fields (``answer`` as text).
- ``step(text)`` hands the reply to the waiting episode (mmgrpo's policy plays PI's harness; see
  :mod:`mmgrpo.envs.pi_exchange`): tool calls in it run, an env's ``run`` answers with its next user
  message; the new messages come back with ``terminated=False``.
- When ``run`` returns, the task's ``finalize`` and ``score`` hooks run and the env's ``finalize``; the
  step's reward is the trace's weighted reward sum (PI's ``trace.reward``), and ``info["metrics"]`` carries
  each ``@vf.reward`` function's score (unweighted) and each ``@vf.metric`` under its own name, plus
  ``verifiers_reward`` (the total): logged as ``env/<name>``. ``verifiers_rubric`` passes the total on as
  the verifier's reward.
- ``max_turns`` (a kwarg of this env, or the seat's PI ``max_turns``) ends the exchange as PI's limit does:
  the episode is scored on what it has and ends ``truncated``. Set it to ``env.max_turns``: an episode the
  rollout cuts without telling the env (its own ``max_turns``, the token budget) is never scored (reward 0).

Splits: PI tasksets have none. ``eval_args`` loads the eval split as a second taskset (``args`` updated by
it, e.g. ``{split: test}``); without it the last ``eval_tasks`` tasks (default: a tenth, at least one when
there are two or more) are held out from training. An infinite taskset is read up to ``max_tasks`` tasks.

Not supported (each refused or skipped with a message): tasks that need a container or a runtime
(``NEEDS_CONTAINER``, hooks or signals with a required ``runtime``), envs with more than one agent seat (the
other seat would need a second model), PI judges that call a model, ``@vf.stop`` hooks on a Request or
Response, and the classic 0.3 API (``SingleTurnEnv`` / ``MultiTurnEnv`` / ``Rubric``), which verifiers 0.4
no longer ships.
"""

from __future__ import annotations

import numbers
from typing import Any

import gymnasium

from mmgrpo.env import ChatEnv, Message, check_split, check_step
from mmgrpo.envs.pi_exchange import EpisodeLog, Handoff, LocalAgent, LocalTool, toolset_tools
from mmgrpo.errors import ConfigError, EnvError

__all__ = ["VerifiersEnv"]

TOTAL = "verifiers_reward"
"""The metric name of the weighted reward sum (PI's ``trace.reward``)."""


def _import_v1() -> Any:
    from mmgrpo.registry import import_optional

    verifiers = import_optional(
        "verifiers",
        "env 'verifiers'",
        "Prime Intellect verifiers (>= 0.4)",
        "pip install 'mmgrpo[pi-verifiers]'",
    )
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(
            f"env 'verifiers': the installed verifiers {getattr(verifiers, '__version__', '?')} "
            f"({getattr(verifiers, '__file__', '?')}) has no verifiers.v1; this adapter drives the v1 API "
            "(Env / Taskset): pip install 'verifiers>=0.4' (the classic 0.3 API is not supported)"
        ) from e
    return vf


def _check_kwargs(args: Any, eval_args: Any, eval_tasks: Any, max_tasks: Any, max_turns: Any) -> None:
    for key, value in (("args", args), ("eval_args", eval_args)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"env.kwargs.{key} must be a mapping of taskset config fields, got {value!r}")
    for key, value, low in (
        ("eval_tasks", eval_tasks, 0),
        ("max_tasks", max_tasks, 1),
        ("max_turns", max_turns, 1),
    ):
        if value is None and key != "max_tasks":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ConfigError(f"env.kwargs.{key} must be an int >= {low}, got {value!r}")


class VerifiersEnv(ChatEnv):
    """A PI ``verifiers.v1`` environment (taskset, its tasks' tools and rubric, its ``Env.run``) as a
    ChatEnv; see the module docstring for the mapping and the kwargs."""

    def __init__(
        self,
        env: str,
        args: dict[str, Any] | None = None,
        env_id: str = "",
        eval_args: dict[str, Any] | None = None,
        eval_tasks: int | None = None,
        max_tasks: int = 100_000,
        max_turns: int | None = None,
    ) -> None:
        if not isinstance(env, str) or not env:
            raise ConfigError(f"env.kwargs.env must name a PI taskset (an importable module), got {env!r}")
        _check_kwargs(args, eval_args, eval_tasks, max_tasks, max_turns)
        vf = _import_v1()
        self.name = env
        self._pi_env = self._load(vf, env, env_id, args or {})
        seats = self._seats()
        if len(seats) != 1:
            raise ConfigError(
                f"env.kwargs.env {env!r}: its Env {type(self._pi_env).__name__} has {len(seats)} agent seats "
                f"({sorted(seats)}); mmgrpo's policy plays one seat and the others would need a model of their "
                "own: use a taskset whose Env has one seat"
            )
        ((self._seat, seat_config),) = seats.items()
        self._max_turns = max_turns if max_turns is not None else seat_config.max_turns
        task_cls = type(self._pi_env.taskset).task_type()
        if getattr(task_cls, "NEEDS_CONTAINER", False):
            raise ConfigError(
                f"env.kwargs.env {env!r}: its tasks ({task_cls.__name__}) need a container runtime, which mmgrpo "
                "does not provide: use a taskset whose tasks run in-process"
            )
        train = self._read(self._pi_env.taskset, max_tasks)
        if eval_args is not None:
            eval_env = self._load(vf, env, env_id, {**(args or {}), **eval_args})
            self._tasks = {"train": train, "eval": self._read(eval_env.taskset, max_tasks)}
        else:
            held = (
                eval_tasks if eval_tasks is not None else (max(1, len(train) // 10) if len(train) >= 2 else 0)
            )
            if held >= len(train) and held > 0:
                raise ConfigError(
                    f"env.kwargs.eval_tasks={held} holds out every one of the taskset's {len(train)} tasks: "
                    "lower it, or give the eval split its own tasks with env.kwargs.eval_args"
                )
            self._tasks = {"train": train[: len(train) - held], "eval": train[len(train) - held :] or train}
        self._shared = list(self._pi_env.taskset.toolsets(self._pi_env.taskset.config))
        self._shared_ready = False
        self._handoff = Handoff()
        self._log = EpisodeLog()
        self._info: dict[str, Any] = {}
        self._started = False
        self._done = True

    # ----------------------------------------------------------------------------------------- loading
    @staticmethod
    def _load(vf: Any, env: str, env_id: str, args: dict[str, Any]) -> Any:
        from pydantic import ValidationError

        try:
            config = vf.resolve_env_config({"id": env_id, "taskset": {**args, "id": env}})
            return vf.load_environment(config)
        except ValidationError as e:
            raise ConfigError(f"env.kwargs.args do not fit the taskset {env!r}'s config: {e}") from e
        except (ImportError, TypeError, AttributeError, ValueError) as e:
            raise ConfigError(
                f"env.kwargs.env {env!r} (env_id {env_id!r}) could not be loaded as a PI v1 environment: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _seats(self) -> dict[str, Any]:
        from verifiers.v1.configs.agent import agent_config_fields

        return agent_config_fields(self._pi_env.config)

    def _read(self, taskset: Any, max_tasks: int) -> list[Any]:
        tasks = list(taskset.take(max_tasks) if not taskset.bounded else taskset)[:max_tasks]
        if not tasks:
            raise ConfigError(
                f"env.kwargs.env {self.name!r}: the taskset yielded no task; check env.kwargs.args"
            )
        return tasks

    def num_tasks(self, split: str) -> int | None:
        return len(self._tasks[check_split(split)])

    # ----------------------------------------------------------------------------------------- episodes
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0
        ):
            raise EnvError(f"VerifiersEnv.reset: seed must be a non-negative int or None, got {seed!r}")
        gymnasium.Env.reset(self, seed=None if seed is None else int(seed))
        if options is not None and not isinstance(options, dict):
            raise EnvError(
                f"VerifiersEnv.reset: options must be a dict or None, got {type(options).__name__}"
            )
        split = check_split((options or {}).get("split", "train"))
        seed = int(self.np_random.integers(0, 2**31 - 1)) if seed is None else int(seed)
        tasks = self._tasks[split]
        index = seed % len(tasks)
        task = tasks[index]
        toolsets = [*type(task).toolsets(task.config)]
        tools = toolset_tools([*self._shared, *toolsets])
        self._log = EpisodeLog()
        self._started, self._done = True, False
        if not self._handoff.start(self._episode(task, toolsets, tools)):
            self._done = True
            self._handoff.result()  # re-raises what the episode raised
            raise EnvError(
                f"verifiers env {self.name!r}: the episode of task {index} ended before the agent was asked "
                "to answer (its Env.run ran no turn)"
            )
        self._info = {**_task_fields(task.data), "seed": seed, "split": split, "task": index}
        if tools:
            self._info["tools"] = [t.schema for t in tools]
        return list(self._handoff.outbox), dict(self._info)

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        check_step(self, self._started, self._done, action)
        calls, failures = self._log.tool_calls, dict(self._log.tool_failures)
        waiting = self._handoff.reply(action)
        info = dict(
            self._info, tool_calls=self._log.tool_calls - calls, tool_failures=_diff(self._log, failures)
        )
        if waiting:
            return list(self._handoff.outbox), 0.0, False, False, info
        self._done = True
        try:
            episode = self._handoff.result()
        except Exception as e:
            raise EnvError(f"verifiers env {self.name!r}: the episode raised {type(e).__name__}: {e}") from e
        traces = [t for t in episode.traces if t.agent.trainable]
        errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
        if errors:
            raise EnvError(f"verifiers env {self.name!r}: {errors[0].type}: {errors[0].message}")
        info["metrics"] = _metrics(traces)
        truncated = any(t.stop_condition == "max_turns" for t in traces)
        return [], float(sum(t.reward for t in traces)), not truncated, truncated, info

    async def _episode(self, task: Any, toolsets: list[Any], tools: list[LocalTool]) -> Any:
        """PI's ``Env.run_episode`` with local agents: ``setup``, ``run``, ``finalize``."""
        import verifiers.v1 as vf
        from verifiers.v1.agent import Agents

        if not self._shared_ready:
            for server in self._shared:
                await server.setup()
            self._shared_ready = True
        for server in toolsets:
            await server.setup()
            await server.setup_task(task)

        def make(name: str, config: Any) -> LocalAgent:
            return LocalAgent(name, config, self._handoff, self._log, tools, self._max_turns)

        agents = Agents(self._pi_env.config, make)
        episode = vf.Episode(
            env=vf.EnvInfo(id=self._pi_env.config.env_id),
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        )
        await self._pi_env.setup(agents)
        await self._pi_env.run(task, agents)
        episode.traces = list(self._log.traces)
        if not episode.traces:
            raise EnvError(f"{type(self._pi_env).__name__}.run() ran no agent")
        await self._pi_env.finalize(task, episode)
        episode.ok = all(t.ok for t in episode.traces)
        return episode

    def close(self) -> None:
        """Cancel a running episode and close the event loop."""
        self._handoff.close()


def _task_fields(data: Any) -> dict[str, Any]:
    """The task's own data fields (beyond PI's ``TaskData``) that are plain values; ``answer`` as text."""
    import verifiers.v1 as vf

    base = set(vf.TaskData.model_fields)
    out: dict[str, Any] = {}
    for key, value in data.model_dump(mode="json").items():
        if key in base or key in ("seed", "split", "task", "tools", "metrics"):
            continue
        out[key] = str(value) if key == "answer" else value
    return out


def _diff(log: EpisodeLog, before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in log.tool_failures.items() if n - before.get(k, 0)}


def _metrics(traces: list[Any]) -> dict[str, float]:
    """Each reward function's score (unweighted), each metric, and the weighted total, by name."""
    out: dict[str, float] = {}
    for trace in traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                out[name] = float(reward.score)
        for name, value in trace.metrics.items():
            if value is not None:
                out[name] = float(value)
    out[TOTAL] = float(sum(t.reward for t in traces))
    return out
