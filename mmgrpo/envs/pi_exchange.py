"""The in-process side of the ``verifiers`` adapter: mmgrpo's policy plays the agent of a PI environment.

In Prime Intellect's ``verifiers.v1`` an episode is a coroutine, ``Env.run(task, agents)``; an agent's
``interaction(task)`` hands it ``turn(message) -> Segment`` calls, each of which runs the agent's *harness* (a
program talking to a model server) until the model answers. Here the harness is mmgrpo's rollout: the
:class:`LocalAgent` stand-ins below keep PI's surface (``run``, ``interaction``, ``turn``, ``trace``), but a
turn suspends the episode coroutine on a future until the rollout calls ``env.step(text)`` with the
policy's reply. One event loop per adapter instance runs the coroutine between hand-offs
(:class:`Handoff`): no thread per episode, no model client, no HTTP.

A turn of the stand-in is what PI's chat harness does in one segment: the policy's reply is appended to the
trace; if the task has tools (PI ``Toolset`` methods marked ``@vf.tool``) and the reply holds
``<tool_call>`` blocks, the calls run in the same loop (each with a timeout, every failure a tool message,
never an exception) and the policy answers again; a reply without calls ends the segment.

Finishing an interaction runs the task's hooks as PI's rollout does: ``finalize`` then ``score`` (its
``@vf.reward`` and ``@vf.metric`` functions), with no runtime (signals that require one are skipped by PI).
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from PIL import Image

from mmgrpo.env import Message, image_part, text_part
from mmgrpo.errors import EnvError
from mmgrpo.tools import (
    ToolCall,
    ToolFailure,
    ToolResult,
    check_arguments,
    parse_tool_calls,
    result_problem,
    to_content,
    tool_message,
    truncate,
)

TOOL_TIMEOUT_S = 10.0
"""Seconds one PI tool call may run before it is reported as ``timeout``."""
MAX_CALLS_PER_TURN = 4
"""Tool calls run per assistant turn; the rest are reported as ``too_many_calls``."""
MAX_RESULT_CHARS = 2000
"""A tool result longer than this is cut (and reported as ``oversized``)."""


# --------------------------------------------------------------------------------------------- the hand-off
class Handoff:
    """The event loop of one adapter instance and the one-slot hand-off between its episode and ``step``.

    ``start(coro)`` and ``reply(text)`` run the loop until the episode either asks for the policy's next
    reply (``asked``) or ends; ``outbox`` collects the messages (user, tool) the episode produced meanwhile.
    The loop runs only inside these calls, in the caller's thread, so nothing runs between them.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.outbox: list[Message] = []
        self._episode: asyncio.Task | None = None
        self._asked: asyncio.Future | None = None
        self._reply: asyncio.Future | None = None

    @property
    def running(self) -> bool:
        """Whether an episode is under way (started, not finished)."""
        return self._episode is not None and not self._episode.done()

    def start(self, coro: Any) -> bool:
        """Start the episode coroutine; True while it waits for a reply, False once it finished."""
        self.cancel()
        self.outbox = []
        self._episode = self.loop.create_task(coro)
        return self._advance()

    def reply(self, text: str) -> bool:
        """Hand the policy's reply to the waiting episode; True while it waits for the next one."""
        if self._reply is None or self._reply.done():
            raise EnvError("the verifiers episode is not waiting for a reply: call reset() first")
        self.outbox = []
        self._reply.set_result(text)
        return self._advance()

    async def ask(self) -> str:
        """Inside the episode: suspend until ``reply(text)`` and return the text."""
        assert self._asked is not None
        self._reply = self.loop.create_future()
        self._asked.set_result(None)
        return await self._reply

    def result(self) -> Any:
        """The finished episode's return value (re-raises what it raised)."""
        assert self._episode is not None and self._episode.done()
        return self._episode.result()

    def _advance(self) -> bool:
        assert self._episode is not None
        self._asked = self.loop.create_future()
        waiting = asyncio.wait([self._asked, self._episode], return_when=asyncio.FIRST_COMPLETED)
        self.loop.run_until_complete(waiting)
        return not self._episode.done()

    def cancel(self) -> None:
        """Cancel an unfinished episode (the rollout cut it: max_turns, token budget) and let it unwind."""
        if self.running:
            assert self._episode is not None
            self._episode.cancel()
            self.loop.run_until_complete(asyncio.gather(self._episode, return_exceptions=True))
        self._reply = None

    def close(self) -> None:
        """Cancel what runs and close the loop (idempotent)."""
        if not self.loop.is_closed():
            self.cancel()
            self.loop.close()


# --------------------------------------------------------------------------------------------- messages
def to_mmgrpo(message: Any) -> Message:
    """A PI message (pydantic ``SystemMessage`` / ``UserMessage`` / ``ToolMessage`` or a wire dict) in
    mmgrpo's chat format; ``data:`` image URLs become PIL images."""
    import verifiers.v1 as vf

    if isinstance(message, dict):
        from pydantic import TypeAdapter

        message = TypeAdapter(vf.Message).validate_python(message)
    content = message.content
    parts = [text_part(content or "")] if not isinstance(content, list) else []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, vf.TextContentPart):
            parts.append(text_part(part.text))
        else:
            parts.append(image_part(_data_url_image(part.image_url.url)))
    out: Message = {"role": message.role, "content": parts}
    if isinstance(message, vf.ToolMessage) and message.name:
        out["name"] = message.name
    return out


def _data_url_image(url: str) -> Image.Image:
    if not url.startswith("data:") or "," not in url:
        raise EnvError(
            f"verifiers env: image part {url[:60]!r} is not a data: URL; mmgrpo hands the model pixels, not "
            "links: put the image in the task as data:image/png;base64,... (or fetch it in the taskset)"
        )
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    image.load()
    return image


def prompt_messages(data: Any) -> list[Any]:
    """The PI messages a task opens with: its system prompt, then its prompt (text or messages)."""
    import verifiers.v1 as vf

    out: list[Any] = []
    if data.system_prompt:
        out.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        out.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        out.extend(data.prompt)
    return out


# --------------------------------------------------------------------------------------------- tools
@dataclass
class LocalTool:
    """One ``@vf.tool`` method of a PI Toolset, called in-process: ``name`` as PI's harnesses show it
    (``<server>_<tool>``), ``fn`` the bound method, ``schema`` for the chat template."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    server: Any = None

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The function schema of ``fn`` (its signature's hints, defaults and docstring), as MCP shows it."""
    import pydantic

    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hints.get(p.name, Any), default)
    parameters = _strip_titles(pydantic.create_model(f"{name}_arguments", **fields).model_json_schema())
    parameters.setdefault("properties", {})
    description = inspect.cleandoc(fn.__doc__ or "")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def toolset_tools(toolsets: list[Any]) -> list[LocalTool]:
    """The tools of PI ``Toolset`` instances, named as PI's harnesses name them."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools: dict[str, LocalTool] = {}
    for server in toolsets:
        for fn in discover_decorated(server, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{server.server_name}_{raw}" if server.server_name else raw
            if name in tools:
                raise EnvError(
                    f"verifiers env: two tools are named {name!r}; give the toolsets a TOOL_PREFIX"
                )
            tools[name] = LocalTool(name, fn, tool_schema(name, fn), server)
    return list(tools.values())


async def _call_tool(tool: LocalTool, arguments: dict[str, Any], state: Any) -> Any:
    from verifiers.v1.mcp import server as mcp_server

    token = mcp_server._call_state.set(state)  # what `Toolset.state` reads during the call (PI's own var)
    try:
        out = tool.fn(**arguments)
        return await out if inspect.isawaitable(out) else out
    finally:
        mcp_server._call_state.reset(token)


async def run_tools(
    entries: list[ToolCall | ToolFailure], tools: list[LocalTool], state: Any
) -> list[ToolResult]:
    """Run one turn's parsed calls in order; every problem is a failed result, never an exception."""
    by_name = {t.name: t for t in tools}
    results = []
    for k, entry in enumerate(entries):
        if isinstance(entry, ToolFailure):
            results.append(ToolResult(entry.name or "", [text_part(entry.message)], entry.kind))
            continue
        if k >= MAX_CALLS_PER_TURN:
            note = f"only {MAX_CALLS_PER_TURN} tool calls run per turn; this one did not"
            results.append(ToolResult(entry.name, [text_part(note)], "too_many_calls"))
            continue
        tool = by_name.get(entry.name)
        if tool is None:
            note = f"unknown tool {entry.name!r}; the tools are {sorted(by_name)}"
            results.append(ToolResult(entry.name, [text_part(note)], "unknown_tool"))
            continue
        if problems := check_arguments(tool, entry.arguments):
            results.append(ToolResult(entry.name, [text_part("; ".join(problems))], "bad_arguments"))
            continue
        try:
            value = await asyncio.wait_for(_call_tool(tool, entry.arguments, state), TOOL_TIMEOUT_S)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            results.append(
                ToolResult(entry.name, [text_part(f"timed out after {TOOL_TIMEOUT_S:g}s")], "timeout")
            )
            continue
        except Exception as e:  # a tool that raises is an observation
            results.append(ToolResult(entry.name, [text_part(f"{type(e).__name__}: {e}")], "tool_error"))
            continue
        if problem := result_problem(value):
            results.append(ToolResult(entry.name, [text_part(problem)], "bad_result"))
            continue
        content, cut = truncate(to_content(value), MAX_RESULT_CHARS)
        results.append(ToolResult(entry.name, content, "oversized" if cut else None))
    return results


# --------------------------------------------------------------------------------------------- the agent
@dataclass
class EpisodeLog:
    """What one episode's stand-in agents record: finished traces and the tool calls made."""

    traces: list[Any] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)


class Exchange:
    """PI's ``Interaction`` over mmgrpo's policy: ``turn(message)`` runs one segment, ``trace`` is PI's
    ``Trace`` of the exchange (its nodes the messages so far, rewards and metrics once closed)."""

    def __init__(self, agent: LocalAgent, task: Any) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls

        self._agent, self._task = agent, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=agent.config, name=agent.name, trainable=agent.trainable),
        )
        self._started = False
        self._over = False
        self._ids = itertools.count()

    def _append(self, message: Any, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(message=message, parent=parent, sampled=sampled))
        if not sampled:
            self._agent.handoff.outbox.append(to_mmgrpo(message))

    async def open(self) -> None:
        """The task's opening messages and its ``setup`` hook (without a runtime)."""
        from verifiers.v1.utils.decorators import invoke

        for message in prompt_messages(self._task.data):
            self._append(message)
        out = invoke(self._task.setup, {"trace": self.trace, "runtime": None})
        if inspect.isawaitable(out):
            await out

    async def turn(self, message: Any = None) -> Any:
        """One user turn (None for a prompted task's opening reply) and the policy's segment: PI's
        ``Interaction.turn``. A ``terminated`` segment means the exchange is over (a limit or ``@stop``)."""
        import verifiers.v1 as vf
        from verifiers.v1.agent import Segment

        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self._started and self._task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        self._started = True
        if isinstance(message, str):
            self._append(vf.UserMessage(content=message))
        elif message is not None:
            for m in message:
                self._append(m if not isinstance(m, dict) else _pi_message(m))
        segment: list[Any] = []
        while True:
            if self.trace.stop_condition is not None or self._agent.turn_cap_reached(self.trace):
                self.trace.stop("max_turns")
                self._over = True
                return Segment(messages=[], terminated=True)
            text = await self._agent.handoff.ask()
            entries = parse_tool_calls(text) if self._agent.tools else []
            calls = [
                vf.ToolCall(id=f"call_{next(self._ids)}", name=e.name, arguments=_json(e.arguments))
                for e in entries
                if isinstance(e, ToolCall)
            ]
            reply = vf.AssistantMessage(content=text, tool_calls=calls or None)
            self._append(reply, sampled=True)
            segment.append(reply)
            await self._run_stops()
            if not entries:
                return Segment(messages=segment)
            results = await run_tools(entries, self._agent.tools, self.trace.state)
            ids = iter(c.id for c in calls)
            log = self._agent.log
            for entry, result in zip(entries, results, strict=True):
                log.tool_calls += 1
                if result.failure is not None:
                    log.tool_failures[result.failure] = log.tool_failures.get(result.failure, 0) + 1
                call_id = next(ids) if isinstance(entry, ToolCall) else f"call_{next(self._ids)}"
                text_out = "\n".join(p["text"] for p in result.content if p["type"] == "text")
                pi = vf.ToolMessage(tool_call_id=call_id, content=text_out, name=result.name or None)
                self._append_tool(pi, tool_message(result))
                segment.append(pi)

    def _append_tool(self, message: Any, mm: Message) -> None:
        from verifiers.v1.graph import MessageNode

        self.trace.nodes.append(MessageNode(message=message, parent=len(self.trace.nodes) - 1))
        self._agent.handoff.outbox.append(mm)  # mmgrpo's tool message: images and the failure kind kept

    async def _run_stops(self) -> None:
        """The task's ``@vf.stop`` hooks that read the trace (Request/Response hooks have no model call here)."""
        import verifiers.v1 as vf

        for fn in self._task.hooks("stop"):
            names = [
                name
                for name, hint in get_type_hints(fn).items()
                if name != "return" and isinstance(hint, type) and issubclass(hint, vf.Trace)
            ]
            if not names:
                continue
            out = fn(**{name: self.trace for name in names})
            if await out if inspect.isawaitable(out) else out:
                self.trace.stop(fn.__name__)
                return

    async def close(self) -> Any:
        """Finish the exchange as PI's rollout does: ``finalize``, then ``score`` (rewards and metrics);
        an error there is recorded on the trace (a bad episode is data)."""
        from verifiers.v1.utils.decorators import invoke

        self.trace.stop("user_closed")
        try:
            out = invoke(self._task.finalize, {"trace": self.trace, "runtime": None})
            if inspect.isawaitable(out):
                await out
            await self._task.score(self.trace, None)
        except Exception as e:
            self.trace.record_error(e)
        else:
            self.trace.ok = True
        self.trace.is_completed = True
        return self.trace


def _json(arguments: dict[str, Any]) -> str:
    import json

    return json.dumps(arguments)


def _pi_message(message: dict[str, Any]) -> Any:
    import verifiers.v1 as vf
    from pydantic import TypeAdapter

    return TypeAdapter(vf.Message).validate_python(message)


class LocalAgent:
    """PI's ``Agent`` as an env's ``run`` sees it (``agents.<seat>``), played by mmgrpo's policy."""

    def __init__(
        self,
        name: str,
        config: Any,
        handoff: Handoff,
        log: EpisodeLog,
        tools: list[LocalTool],
        max_turns: int | None,
    ) -> None:
        self.name, self.config, self.handoff, self.log, self.tools = name, config, handoff, log, tools
        self.trainable = True
        self.max_turns = max_turns

    def turn_cap_reached(self, trace: Any) -> bool:
        """Whether the seat's turn limit (PI's ``max_turns``, or the adapter's) forbids another reply."""
        return self.max_turns is not None and trace.num_turns >= self.max_turns

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on a prompted task: PI's ``Agent.run`` (the harness runs until it answers)."""
        async with self.interaction(task) as exchange:
            await exchange.turn()
        return exchange.trace

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> AsyncIterator[Exchange]:
        """PI's ``Agent.interaction``: the caller is the user; leaving the block scores the exchange."""
        exchange = Exchange(self, task)
        await exchange.open()
        try:
            yield exchange
        except BaseException as e:  # the env's run raised, or the rollout cut the episode (cancelled)
            if isinstance(e, Exception):
                exchange.trace.record_error(e)
            self.log.traces.append(exchange.trace)
            raise
        await exchange.close()
        self.log.traces.append(exchange.trace)
