"""Tools for tool-using episodes: describe a Python function to the model, parse its calls, run them safely.

A **tool** is a plain function with type hints and a Google-style docstring (an ``Args:`` section). Its JSON
schema comes from ``transformers.utils.get_json_schema`` (never hand-written), and the list of schemas reaches
the model through the chat template's ``tools=`` argument.

One assistant turn goes through three stages, each of which turns every problem into data, never an exception:

1. ``parse_tool_calls(text)`` (``mmgrpo.tools.calls``) finds the Hermes / Qwen2.5 calls
   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in order, each a ``ToolCall`` or a
   ``ToolFailure`` (``invalid_json`` / ``bad_call``); it never raises and stays fast on any string.
2. ``ToolRunner.run(text)`` checks each call against its tool's schema (``unknown_tool``, ``bad_arguments``,
   ``too_many_calls``), then runs the valid ones **concurrently**, each in its own thread and with its own
   deadline (``timeout``); a tool that raises gives ``tool_error``, one that returns something that is not
   JSON text (a set, an ``object()``, a numpy integer) or an image gives ``bad_result``, and a result longer
   than the cap is cut and says so (``oversized``). Control characters in every text it returns are written
   as escapes (``mmgrpo.tools.visible``): ``ESC ]52;`` reaches the model and transcripts as text, not a terminal.
3. ``tool_message(result)`` is the ``{"role": "tool", ...}`` message the model sees next. A failure's text
   says what was wrong and how to call the tool correctly, so that a bad call is something to learn from.

Threads cannot be killed: a pure-Python tool that never returns keeps its thread (and one of the runner's
``max_workers`` slots) for good; the call itself is reported as ``timeout`` at its deadline. Such *abandoned*
threads are counted per tool name across every runner of the process (an env makes a new runner per episode):
once ``max_abandoned`` threads of a tool are still running past their deadline, further calls of that tool fail
at once as ``overloaded`` instead of starting another thread, until some of them return. So a tool that hangs
costs at most ``max_abandoned`` threads (plus the calls in flight), however many episodes call it. The threads
are daemon threads rather than a ``ThreadPoolExecutor``'s, whose workers are joined at interpreter exit, so a
hung tool cannot keep a finished training run from exiting. Tools that run untrusted or possibly endless code
belong in a separate process, like the sandboxed ``python`` tool of ``mmgrpo.toolbox``; plain functions here
should be quick and bounded. A function may carry its own ``timeout_s`` attribute (the toolbox's ``python`` and
``http_*`` tools do: the longest a call can take by their own limits); the runner then waits at least that long.
Arguments are checked for JSON types, not coerced: ``3.0`` is not an ``integer``.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmgrpo.env import Message, Part, image_part, text_part
from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.tools.calls import (  # noqa: F401  (ToolCall, ToolFailure, parse_tool_calls, ... are public here)
    MAX_ECHO_CHARS,
    MAX_PARSED_CALLS,
    ToolCall,
    ToolFailure,
    _describe,
    _quote,
    check_arguments,
    parse_tool_calls,
    tool_call_text,
)
from mmgrpo.tools.visible import visible

FAILURE_KINDS = (
    "invalid_json",
    "bad_call",
    "unknown_tool",
    "bad_arguments",
    "tool_error",
    "timeout",
    "oversized",
    "too_many_calls",
    "bad_result",
    "overloaded",
)
"""Every value ``ToolResult.failure`` can take besides None (success)."""


# --------------------------------------------------------------------------------------------- tools
@dataclass
class Tool:
    """A function the model may call, with its JSON schema.

    ``name`` defaults to ``fn.__name__`` (and replaces it in the schema); ``timeout_s`` None means the runner's
    default. ``schema`` is ``get_json_schema(fn)``: ``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}``.
    """

    fn: Callable[..., Any]
    name: str | None = None
    timeout_s: float | None = None
    schema: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"Tool(fn=...): expected a function, got {type(self.fn).__name__}")
        name = self.name if self.name is not None else getattr(self.fn, "__name__", None)
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"Tool({self.fn!r:.80}): the tool needs a name, got {name!r}; pass name='my_tool'"
            )
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not self.timeout_s > 0
        ):
            raise ConfigError(
                f"Tool {name!r}: timeout_s must be a positive number or None, got {self.timeout_s!r}"
            )
        self.name = name
        self.schema = _function_schema(self.fn, name)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments object (``properties`` and ``required``)."""
        return self.schema["function"].get("parameters", {})

    def signature(self) -> str:
        """The call signature in JSON types, e.g. ``calculator(expression: string, digits: integer (optional))``."""
        params = self.parameters
        required = params.get("required", [])
        args = [
            f"{key}: {_describe(spec)}{'' if key in required else ' (optional)'}"
            for key, spec in params.get("properties", {}).items()
        ]
        return f"{self.name}({', '.join(args)})"


_SCHEMAS: dict[tuple, dict[str, Any]] = {}
"""Schemas already read, by what they are read from (see ``_schema_key``): an env that binds its tools to each
task's data makes a new closure per episode (the zoom tool: 128 a step, 1 ms of docstring parsing each)."""


def _schema_key(fn: Callable[..., Any], name: str) -> tuple | None:
    """What ``get_json_schema(fn)`` reads: the code, docstring, annotations and defaults of a plain function
    (closures of one factory share them); None for other callables (read every time)."""
    code = getattr(fn, "__code__", None)
    if not inspect.isfunction(fn) or code is None:
        return None
    try:
        parts = (fn.__doc__, repr(fn.__annotations__), repr(fn.__defaults__), repr(fn.__kwdefaults__))
    except Exception:  # an annotation or default whose repr fails: no key, read it again
        return None
    return (code, name, *parts)


def _function_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    key = _schema_key(fn, name)
    if key is not None and key in _SCHEMAS:
        return copy.deepcopy(_SCHEMAS[key])
    schema = _read_schema(fn, name)
    if key is not None:
        if (
            len(_SCHEMAS) >= 1024
        ):  # keys that never repeat (a default whose repr names its address): start over
            _SCHEMAS.clear()
        _SCHEMAS[key] = copy.deepcopy(schema)
    return schema


def _read_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    where = f"tool {name!r}{_where(fn)}"
    try:
        schema = copy.deepcopy(get_json_schema(fn))  # a private copy: the name is replaced below
    except DocstringParsingException as e:
        raise ConfigError(
            f"{where}: {str(e).rstrip('.!')}. Give it a Google-style docstring with a one-line description "
            f"and an Args: section describing every argument, e.g.\n{_docstring_example(fn)}"
        ) from None
    except TypeHintParsingException as e:
        raise ConfigError(
            f"{where}: {str(e).rstrip('.!')}. Annotate every argument with a JSON-able type (str, int, float, "
            "bool, list[...], dict[str, ...], Literal[...] or a union of these)."
        ) from None
    except Exception as e:  # e.g. an object get_json_schema cannot inspect
        raise ConfigError(
            f"{where}: transformers.utils.get_json_schema failed ({type(e).__name__}: {e}); "
            "pass a plain function with type hints and a Google-style docstring"
        ) from None
    schema["function"]["name"] = name
    return schema


def _where(fn: Callable[..., Any]) -> str:
    try:
        return f" ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError):
        return ""


def _docstring_example(fn: Callable[..., Any]) -> str:
    try:
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
        params = ["x"]
    lines = ['    """What the tool does, in one line.', "", "    Args:"]
    lines += [f"        {p}: what {p} is." for p in params or ["x"]]
    return "\n".join([*lines, '    """'])


def as_tool(x: Tool | Callable[..., Any]) -> Tool:
    """``x`` if it is a Tool, else ``Tool(x)`` (a function with type hints and a docstring)."""
    if isinstance(x, Tool):
        return x
    if callable(x):
        return Tool(x)
    raise ConfigError(f"expected a Tool or a function, got {type(x).__name__}: {x!r:.80}")


def tool_schemas(tools: Iterable[Tool | Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schemas to pass to the chat template as ``tools=``."""
    return [as_tool(t).schema for t in tools]


# --------------------------------------------------------------------------------------------- calls and results
@dataclass
class ToolResult:
    """The outcome of one call: content parts for the tool message, ``failure`` (a FAILURE_KINDS entry or None).

    ``name`` is the called tool's name ('' when the call had no readable name); ``seconds`` the wall time spent.
    """

    name: str
    content: list[Part]
    failure: str | None = None
    seconds: float = 0.0


def tool_message(result: ToolResult) -> Message:
    """The ``tool`` message for one result; ``error`` carries the failure kind (None on success)."""
    return {"role": "tool", "name": result.name, "content": list(result.content), "error": result.failure}


def count_failures(results: Iterable[ToolResult]) -> dict[str, int]:
    """``{kind: count}`` over ``results``, non-zero kinds only."""
    counts: dict[str, int] = {}
    for r in results:
        if r.failure is not None:
            counts[r.failure] = counts.get(r.failure, 0) + 1
    return counts


# --------------------------------------------------------------------------------------------- results
def to_content(value: Any) -> list[Part]:
    """A tool's return value as message parts: str/number/bool -> text, dict/list -> JSON text, PIL image ->
    image part, a list/tuple holding images -> parts in order, anything else -> ``str(value)``."""
    if isinstance(value, Image.Image):
        return [image_part(value)]
    if isinstance(value, (list, tuple)) and any(isinstance(v, Image.Image) for v in value):
        return [image_part(v) if isinstance(v, Image.Image) else text_part(_to_text(v)) for v in value]
    return [text_part(_to_text(value))]


def result_problem(value: Any) -> str | None:
    """Why a tool's return value cannot be shown to the model, or None when it can.

    A result is a str, a PIL image, a list or tuple mixing images with values of the other kinds, or anything
    ``json.dumps`` encodes as it is (numbers, bools, None, lists and dicts of these). The rest (a set, an
    ``object()``, a numpy integer, a dict holding one of them, a circular list) has no text the model could
    read, only a ``repr`` such as ``<object object at 0x...>``: the runner reports it as ``bad_result``.
    """
    if isinstance(value, (str, Image.Image)):
        return None
    if isinstance(value, (list, tuple)) and any(isinstance(v, Image.Image) for v in value):
        return next((p for v in value if not isinstance(v, Image.Image) and (p := result_problem(v))), None)
    try:
        json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        kind = _type_name(value)
        detail = "nested too deeply" if isinstance(e, RecursionError) else _exception_text(e)
        why = (
            ""
            if detail == f"Object of type {type(value).__name__} is not JSON serializable"
            else f" ({detail})"
        )
        return f"a value of type {kind}{why}, which is not JSON"
    return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            pass
    return str(value)


def truncate(content: list[Part], max_chars: int) -> tuple[list[Part], bool]:
    """``content`` with at most ``max_chars`` characters of text; what is cut is replaced by a note saying so.

    Returns the parts and whether anything was cut. Parts after the cut are dropped.
    """
    total = sum(len(p["text"]) for p in content if p["type"] == "text")
    if total <= max_chars:
        return content, False
    out: list[Part] = []
    budget = max_chars
    note = f"...[truncated: result was {total} characters, limit {max_chars}]"
    for p in content:
        if p["type"] != "text":
            out.append(p)
        elif len(p["text"]) <= budget:
            out.append(p)
            budget -= len(p["text"])
        else:
            out.append(text_part(p["text"][:budget] + note))
            break
    return out, True


def _clean(text: str) -> str:
    """``text`` without lone surrogates (``json.loads('"\\ud800"')`` makes them), which tokenizers cannot encode."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


# --------------------------------------------------------------------------------------------- runner
@dataclass
class _Outcome:
    content: list[Part] | None = None
    error: str | None = None
    seconds: float = 0.0
    kind: str = "tool_error"  # the failure kind of ``error``


MAX_ABANDONED = 8
"""Default of ``ToolRunner(max_abandoned=...)``: threads of one tool left running past their deadline."""
_abandoned: dict[str, int] = {}  # tool name -> threads still running past their deadline, in this process
_abandoned_lock = threading.Lock()


def abandoned_threads() -> dict[str, int]:
    """``{tool name: threads still running past their deadline}`` in this process, non-zero names only."""
    with _abandoned_lock:
        return dict(_abandoned)


class _Call:
    """One running call: a daemon thread (a hung tool must not block the process from exiting) holding one of
    the runner's slots until the tool returns; counted in ``_abandoned`` from its deadline until it returns."""

    def __init__(
        self, tool: Tool, arguments: dict[str, Any], slots: threading.Semaphore, timeout: float
    ) -> None:
        self.tool, self.timeout, self.slots = tool, timeout, slots
        self.outcome: _Outcome | None = None
        self.done = threading.Event()
        self.finished = self.abandoned = False  # both guarded by _abandoned_lock
        self.t0 = time.perf_counter()
        name = f"mmgrpo-tool-{tool.name}"
        threading.Thread(target=self._run, args=(arguments,), name=name, daemon=True).start()

    def _run(self, arguments: dict[str, Any]) -> None:
        try:
            self.outcome = _execute(self.tool, arguments)
        finally:
            self.slots.release()
            with _abandoned_lock:
                self.finished = True
                if self.abandoned:
                    left = _abandoned.get(self.tool.name, 1) - 1
                    if left > 0:
                        _abandoned[self.tool.name] = left
                    else:
                        _abandoned.pop(self.tool.name, None)
            self.done.set()

    def abandon(self) -> bool:
        """Count the call as abandoned (its thread runs on past the deadline); False if it has just finished."""
        with _abandoned_lock:
            if self.finished:
                return False
            self.abandoned = True
            _abandoned[self.tool.name] = _abandoned.get(self.tool.name, 0) + 1
            return True


def _execute(tool: Tool, arguments: dict[str, Any]) -> _Outcome:
    """Call the tool and convert its value; errors are returned, never raised, in the tool's thread."""
    t0 = time.perf_counter()
    try:
        value = tool.fn(**arguments)
    except BaseException as e:  # SystemExit too: a tool calling sys.exit() is a tool error
        return _Outcome(
            error=f"{tool.name} raised {type(e).__name__}: {_exception_text(e)}", seconds=_since(t0)
        )
    try:
        if problem := result_problem(value):
            return _Outcome(
                error=f"{tool.name} returned {problem}; a tool must return a str, a number, a bool, None, a "
                "list or dict of these, or a PIL image",
                seconds=_since(t0),
                kind="bad_result",
            )
        return _Outcome(content=to_content(value), seconds=_since(t0))
    except Exception as e:
        return _Outcome(
            error=f"{tool.name} returned a {type(value).__name__} that could not be turned into text "
            f"({type(e).__name__}: {_exception_text(e)})",
            seconds=_since(t0),
        )


def _own_timeout(tool: Tool) -> float:
    """The function's own ``timeout_s`` attribute (the longest a call takes by its own limits), or 0."""
    value = getattr(tool.fn, "timeout_s", None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok and value < float("inf") else 0.0


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _exception_text(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = "(unprintable message)"
    return text if len(text) <= 500 else text[:500] + "..."


class ToolRunner:
    """Parses one assistant turn, checks every call and runs the valid ones concurrently; ``run`` never raises.

    ``timeout_s`` is the default per-call deadline (a Tool's own ``timeout_s`` wins), ``max_result_chars`` the
    cap on a result's text, ``max_calls_per_turn`` how many calls of one turn are run (the rest get
    ``too_many_calls``). Each call runs in its own daemon thread; ``max_workers`` bounds how many of this
    runner's may be alive at once (once all are taken, further calls fail at once with ``timeout``), and
    ``max_abandoned`` how many threads of one tool, counted across every runner of the process, may be left
    running past their deadline (then further calls of that tool fail at once with ``overloaded``), so that tools
    which hang (their threads live on) cannot pile up, however many episodes call them. A call's deadline is
    the Tool's ``timeout_s``, else the longer of ``timeout_s`` and the function's own ``timeout_s`` attribute
    (the toolbox's ``python`` and ``http_*`` tools carry one: their own limits, which report more clearly).
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        *,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        max_calls_per_turn: int = 4,
        max_workers: int = 16,
        max_abandoned: int = MAX_ABANDONED,
    ) -> None:
        for key, value, kinds in (
            ("timeout_s", timeout_s, (int, float)),
            ("max_result_chars", max_result_chars, int),
            ("max_calls_per_turn", max_calls_per_turn, int),
            ("max_workers", max_workers, int),
            ("max_abandoned", max_abandoned, int),
        ):
            if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
                raise ConfigError(f"ToolRunner({key}={value!r}): expected a positive number")
        if max_workers < max_calls_per_turn:
            raise ConfigError(
                f"ToolRunner(max_workers={max_workers}, max_calls_per_turn={max_calls_per_turn}): the calls of "
                "one turn run concurrently, so max_workers must be at least max_calls_per_turn"
            )
        self.tools: dict[str, Tool] = {}
        for t in map(as_tool, tools):
            if t.name in self.tools:
                raise ConfigError(
                    f"ToolRunner: two tools are named {t.name!r}; pass Tool(fn, name=...) to rename one"
                )
            self.tools[t.name] = t
        self.timeout_s = float(timeout_s)
        self.max_result_chars = max_result_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.max_workers = max_workers
        self.max_abandoned = max_abandoned
        self._slots = threading.BoundedSemaphore(max_workers)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas of the tools, for the chat template's ``tools=``."""
        return [t.schema for t in self.tools.values()]

    def run(self, text: str) -> list[ToolResult]:
        """One result per call of ``text`` (the ``MAX_PARSED_CALLS`` first), in order; [] when there is none."""
        return self.run_parsed(parse_tool_calls(text))

    def run_parsed(self, entries: list[ToolCall | ToolFailure]) -> list[ToolResult]:
        """:meth:`run` on calls already parsed by :func:`parse_tool_calls`."""
        outcomes: list[ToolResult | _Call] = [self._start(i, entry) for i, entry in enumerate(entries)]
        return [self._finish(x) if isinstance(x, _Call) else x for x in outcomes]

    def _start(self, i: int, entry: ToolCall | ToolFailure) -> ToolResult | _Call:
        """A result for a call that cannot run, else the started call."""
        if i >= self.max_calls_per_turn:
            return self._fail(
                entry.name or "",
                "too_many_calls",
                f"not run: at most {self.max_calls_per_turn} tool calls are run per turn and this was call "
                f"{i + 1}. Wait for these results, then make the remaining calls in your next turn.",
            )
        if isinstance(entry, ToolFailure):
            return self._fail(
                entry.name or "", entry.kind, f"{entry.message}. Call a tool as {self._example()}."
            )
        tool = self.tools.get(entry.name)
        if tool is None:
            return self._fail(
                entry.name,
                "unknown_tool",
                f"unknown tool {_quote(entry.name)}.{did_you_mean(entry.name, self.tools)} Available tools: "
                f"{self._names()}. Call a tool as {self._example()}.",
            )
        if problems := check_arguments(tool, entry.arguments):
            return self._fail(
                tool.name,
                "bad_arguments",
                f"bad arguments for {tool.name}: {'; '.join(problems)}. Expected {tool.signature()}.",
            )
        if not self._slots.acquire(blocking=False):
            return self._fail(
                tool.name,
                "timeout",
                f"{tool.name} could not start: {self.max_workers} earlier tool calls are still running past "
                "their deadline. Answer without tools, or try again later.",
            )
        with _abandoned_lock:
            hung = _abandoned.get(tool.name, 0)
        if hung >= self.max_abandoned:
            self._slots.release()
            return self._fail(
                tool.name,
                "overloaded",
                f"{tool.name} is not available: {hung} earlier calls of it are still running past their "
                "deadline. Answer without it, or try again later.",
            )
        timeout = tool.timeout_s if tool.timeout_s is not None else max(self.timeout_s, _own_timeout(tool))
        try:
            return _Call(tool, entry.arguments, self._slots, timeout)
        except RuntimeError as e:  # "can't start new thread"
            self._slots.release()
            return self._fail(tool.name, "tool_error", f"{tool.name} could not be started ({e})")

    def _finish(self, call: _Call) -> ToolResult:
        """Wait for ``call`` until its own deadline (counted from its start) and turn it into a result."""
        name = call.tool.name
        if not call.done.wait(max(0.0, call.t0 + call.timeout - time.perf_counter())) and call.abandon():
            return self._fail(
                name,
                "timeout",
                f"{name} did not finish within {call.timeout:g} s and was abandoned. "
                "Try a smaller input or a different approach.",
                seconds=_since(call.t0),
            )
        call.done.wait()  # set at once after the tool returned (it may have returned just past the deadline)
        outcome = call.outcome or _Outcome(error=f"{name} failed")
        if outcome.error is not None:
            return self._fail(name, outcome.kind, outcome.error, outcome.seconds)
        # control characters as escapes first (so the limit counts what is shown), on the part of each text
        # that can be kept at all: escapes only lengthen text, so what lies past max_result_chars is cut anyway
        # (and counted in the note as it was)
        limit = self.max_result_chars
        content = [
            text_part(visible(p["text"][:limit]) + p["text"][limit:]) if p["type"] == "text" else p
            for p in outcome.content or []
        ]
        content, cut = truncate(content, limit)
        content = [text_part(_clean(p["text"])) if p["type"] == "text" else p for p in content]
        return ToolResult(name, content, "oversized" if cut else None, outcome.seconds)

    def _fail(self, name: str, kind: str, message: str, seconds: float = 0.0) -> ToolResult:
        text = _clean(visible(f"error: {message}"))
        return ToolResult(_clean(visible(name[:MAX_ECHO_CHARS])), [text_part(text)], kind, seconds)

    def _names(self) -> str:
        return ", ".join(self.tools) or "(none)"

    def _example(self) -> str:
        name = next(iter(self.tools), "tool_name")
        return (
            f'<tool_call>{{"name": "{name}", "arguments": {{...}}}}</tool_call> with one of: {self._names()}'
        )
