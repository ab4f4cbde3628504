"""Telling the model which tools exist when its chat template cannot.

A chat template renders ``tools=`` only if it has a tools section (Qwen2.5, Hermes, Llama 3.1 do; LLaVA,
Idefics3 / SmolVLM, Gemma 3 and Llama 3 do not). Hugging Face passes ``tools=`` to every template and one
without a tools section silently drops it, so training would go on with tools the model never sees.
``Policy.render`` therefore asks once per policy how the tools reach the model (``placement``):

    "template"  the template renders them itself (its own block, nothing added)
    "system"    mmgrpo writes ``tools_block(tools)`` into the system message (appended to its text,
                or a system message of its own first when there is none)
    "user"      the template drops or rejects system messages: the block opens the first user message

Each is tried on a probe conversation and kept when the probe tool's name and a word of its schema appear
in the rendering; when none does, ``placement`` raises ConfigError naming the template. The block is
Qwen2.5's (the tiny model's template renders the same text), so the call format it teaches is the one
``mmgrpo.tools.calls`` parses. It only changes the first message, which every turn of an episode shares:
a longer conversation still renders as a prefix extension of a shorter one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, DataError

# The tools block of Qwen2.5's template: one JSON schema a line, then how to call (the Hermes form).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
PLACEMENTS = ("template", "system", "user")

# A tool no real conversation mentions; its name and a word of its schema must survive a rendering.
_PROBE_NAME = "mmgrpo_probe_tool"
_PROBE_WORD = "mmgrpo_probe_argument"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_NAME,
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {_PROBE_WORD: {"type": "integer", "description": "A probe."}},
                "required": [_PROBE_WORD],
            },
        },
    }
]
_PROBE_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

Render = Callable[[list[dict], list[dict] | None], str]
"""``render(messages, tools)``: the chat template's text of ``messages`` with a generation prompt."""


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The tool list as Qwen2.5's template writes it: the JSON schemas, then how to call them."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_POSTAMBLE


def with_tools_block(messages: list[dict], tools: list[dict[str, Any]], placement: str) -> list[dict]:
    """``messages`` with ``tools_block(tools)`` in the system message ("system") or at the start of the
    first user message ("user"). A copy: the caller's messages are not changed. Content keeps its shape (a
    string stays a string, a list of parts gets a text part), which every family's template accepts."""
    block = tools_block(tools)
    out = list(messages)
    if placement == "system":
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=_join(out[0]["content"], block, after=True))
        else:
            like = out[0]["content"] if out else ""
            out.insert(0, {"role": "system", "content": block if isinstance(like, str) else [_text(block)]})
        return out
    if placement == "user":  # the template drops or rejects system messages (Gemma 2 raises on them): the
        # block opens the first user message, where such templates put a system prompt themselves
        at = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if at is None:
            raise DataError(
                "the chat template renders no system message, so mmgrpo writes the tool list into the first "
                "user message, but this conversation has none: start the environment's prompt with a user "
                "message."
            )
        out[at] = dict(out[at], content=_join(out[at]["content"], block, after=False))
        return out
    raise ValueError(f"placement must be 'system' or 'user' here, got {placement!r}")


def find_placement(render: Render, template_name: str) -> str:
    """How tools reach the model under this template: "template", "system" or "user" (see the module
    docstring), tried in that order on a probe conversation. Raises ConfigError when none shows them."""
    errors: list[str] = []
    if _shows_probe(render, _PROBE_MESSAGES, _PROBE_TOOLS, errors):
        return "template"
    for placement in ("system", "user"):
        if _shows_probe(render, with_tools_block(_PROBE_MESSAGES, _PROBE_TOOLS, placement), None, errors):
            return placement
    why = f" (rendering failed: {errors[-1]})" if errors else ""
    raise ConfigError(
        f"the chat template of {template_name!r} shows the model no tool list{why}: it renders no tools "
        "section for tools=, and drops both a system message and text mmgrpo adds to the first user "
        "message, so the model could not see the tools it is trained to call. Use a template that renders "
        "tools= (or at least system messages or user text): set chat_template in the checkpoint's "
        "tokenizer_config.json or processor config."
    )


def _shows_probe(render: Render, messages: list[dict], tools: list[dict] | None, errors: list[str]) -> bool:
    try:
        text = render(messages, tools)
    except Exception as e:  # a template may reject tools= or a system role (Gemma 2: "System role not
        # supported"); a model without a chat template fails every probe
        errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        return False
    return _PROBE_NAME in text and _PROBE_WORD in text


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _join(content: str | list[dict], block: str, *, after: bool) -> str | list[dict]:
    """``content`` with ``block`` after it (a system message, as Qwen2.5 writes it) or before it (a user
    message), a blank line between them when the content has text."""
    if isinstance(content, str):
        if not content:
            return block
        return content + "\n\n" + block if after else block + "\n\n" + content
    has_text = any(p.get("type") == "text" and p.get("text") for p in content)
    sep = "\n\n" if has_text else ""
    return [*content, _text(sep + block)] if after else [_text(block + sep), *content]
