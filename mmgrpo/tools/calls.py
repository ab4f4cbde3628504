"""Reading tool calls: the Hermes / Qwen2.5 call format, and checking a call's arguments against its schema.

``parse_tool_calls(text)`` finds the calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of one
assistant turn, in order; each is a ``ToolCall`` or a ``ToolFailure`` (``invalid_json`` / ``bad_call``). Only
the first ``MAX_PARSE_CHARS`` characters and the first ``MAX_PARSED_CALLS`` calls are read, the scan is plain
``str.find`` (no regex to backtrack) and ``json.loads`` errors, ``RecursionError`` included, are caught: any
string is parsed quickly and without raising. ``check_arguments(tool, arguments)`` lists what is wrong with a
call's arguments (missing, unexpected, wrong JSON type) for the runner (``mmgrpo.tools.runner``) to report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARSE_CHARS = 100_000
"""Text after this many characters of one assistant turn is not searched for calls."""
MAX_PARSED_CALLS = 32
"""At most this many calls (valid or not) are parsed from one turn; the runner runs fewer (``max_calls_per_turn``)."""
MAX_ECHO_CHARS = 60
"""Model-written strings (names, keys, values) are quoted back in error texts up to this length."""


@dataclass
class ToolCall:
    """A well-formed call: ``name`` and ``arguments`` as the model wrote them, ``raw`` its text with the tags."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass
class ToolFailure:
    """A call that could not be read: ``kind`` is ``invalid_json`` or ``bad_call``, ``message`` says why."""

    kind: str
    message: str
    raw: str
    name: str | None = None


# --------------------------------------------------------------------------------------------- parsing
def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in the Hermes / Qwen2.5 form, formatted as Qwen2.5 writes it (what demonstrations use)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def parse_tool_calls(text: str, max_calls: int = MAX_PARSED_CALLS) -> list[ToolCall | ToolFailure]:
    """The ``<tool_call>...</tool_call>`` calls of one assistant turn, in order of appearance.

    Each body must be a JSON object ``{"name": str, "arguments": object}``; ``arguments`` may also be a JSON
    string holding an object, and a missing ``arguments`` means no arguments. A ``<tool_call>`` without its
    ``</tool_call>`` is an ``invalid_json`` failure (when another ``<tool_call>`` starts inside it, parsing
    resumes there). As in Qwen's own parser, a literal ``</tool_call>`` inside a JSON string ends the call early.
    Never raises for a str; reads at most ``MAX_PARSE_CHARS`` characters and ``max_calls`` calls.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls takes the assistant's text (str), got {type(text).__name__}")
    text = text[:MAX_PARSE_CHARS]
    out: list[ToolCall | ToolFailure] = []
    start = text.find(OPEN)
    while start != -1 and len(out) < max_calls:
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end == -1:
            out.append(_unclosed(text[start:]))
            break
        entry = _parse_body(text[body_start:end], text[start : end + len(CLOSE)])
        inner = text.find(OPEN, body_start, end)
        if isinstance(entry, ToolFailure) and entry.kind == "invalid_json" and inner != -1:
            out.append(_unclosed(text[start:inner]))  # "<tool_call>{broken <tool_call>{...}</tool_call>"
            start = inner
            continue
        out.append(entry)
        start = text.find(OPEN, end + len(CLOSE))
    return out


def _unclosed(raw: str) -> ToolFailure:
    return ToolFailure("invalid_json", "<tool_call> was not closed: end every call with </tool_call>", raw)


def _parse_body(body: str, raw: str) -> ToolCall | ToolFailure:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return ToolFailure("invalid_json", f"the call is not valid JSON ({_json_error(e)})", raw)
    if not isinstance(obj, dict):
        return ToolFailure("bad_call", f"the call must be a JSON object, got {_json_type(obj)}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        problem = (
            'it has no "name"' if name is None else f'"name" must be a non-empty string, got {_short(name)}'
        )
        return ToolFailure("bad_call", problem, raw)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # Qwen sometimes writes "arguments": "{\"x\": 1}"
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolFailure(
            "bad_call", f'"arguments" must be a JSON object, got {_json_type(arguments)}', raw, name=name
        )
    return ToolCall(name, arguments, raw)


def _json_error(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at character {e.pos}"
    return str(e)[:120]


# --------------------------------------------------------------------------------------------- argument checks
class HasSchema(Protocol):
    """What ``check_arguments`` reads of a tool (a ``mmgrpo.tools.Tool`` has it): its arguments' JSON schema."""

    @property
    def parameters(self) -> dict[str, Any]: ...


def check_arguments(tool: HasSchema, arguments: dict[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for ``tool`` (missing, unexpected, wrong JSON type); [] when fine."""
    params = tool.parameters
    properties = params.get("properties", {})
    problems = [
        f"missing required argument {_quote(k)}" for k in params.get("required", []) if k not in arguments
    ]
    unexpected = [k for k in arguments if k not in properties]
    if unexpected:
        shown = ", ".join(_quote(k) for k in unexpected[:5]) + (", ..." if len(unexpected) > 5 else "")
        problems.append(f"unexpected argument{'s' if len(unexpected) > 1 else ''} {shown}")
    for key, value in arguments.items():
        if key in properties:
            problem = _value_problem(value, properties[key], f"argument {_quote(key)}")
            if problem:
                problems.append(problem)
    return problems


def _value_problem(value: Any, spec: dict[str, Any], where: str) -> str | None:
    """Why ``value`` does not fit the schema ``spec`` (types, enum, items), or None. Follows the schema's depth."""
    if value is None and spec.get("nullable"):
        return None
    wrong = f"{where} should be {_describe(spec)}, got {_json_type(value)} {_short(value)}"
    if "anyOf" in spec:
        return None if any(_value_problem(value, s, where) is None for s in spec["anyOf"]) else wrong
    kinds = spec.get("type")
    if kinds is not None and not any(
        _is_type(value, k) for k in (kinds if isinstance(kinds, list) else [kinds])
    ):
        return wrong
    if "enum" in spec and not any(_same_json(value, e) for e in spec["enum"]):
        return wrong
    if isinstance(value, list) and isinstance(spec.get("prefixItems"), list):
        items = spec["prefixItems"]
        if len(value) != len(items):
            return f"{where} should have exactly {len(items)} items, got {len(value)}"
        for i, (v, s) in enumerate(zip(value, items, strict=True)):
            if problem := _value_problem(v, s, f"{where}[{i}]"):
                return problem
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        for i, v in enumerate(value):
            if problem := _value_problem(v, spec["items"], f"{where}[{i}]"):
                return problem
    if isinstance(value, dict) and isinstance(spec.get("additionalProperties"), dict):
        for k, v in value.items():
            if problem := _value_problem(v, spec["additionalProperties"], f"{where}[{_quote(k)}]"):
                return problem
    return None


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}
    return isinstance(value, checks[kind]) if kind in checks else True  # "image", "audio": the tool judges


def _same_json(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _describe(spec: dict[str, Any]) -> str:
    """A schema in words: ``integer``, ``array of string``, ``one of ["a", "b"]``, ``string or null``."""
    if "enum" in spec:
        text = "one of " + _dumps(spec["enum"])
    elif "anyOf" in spec:
        text = " or ".join(_describe(s) for s in spec["anyOf"])
    else:
        kinds = spec.get("type")
        text = " or ".join(kinds) if isinstance(kinds, list) else (kinds or "any value")
        if kinds == "array" and isinstance(spec.get("items"), dict):
            text = f"array of {_describe(spec['items'])}"
    return text + (" or null" if spec.get("nullable") else "")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind in ("boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, kind):
            return kind
    return type(value).__name__


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return "..."


def _short(value: Any) -> str:
    text = _dumps(value) if not isinstance(value, str) else _quote(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


def _quote(text: str) -> str:
    short = text[:MAX_ECHO_CHARS] + ("..." if len(text) > MAX_ECHO_CHARS else "")
    return f'"{short}"'
