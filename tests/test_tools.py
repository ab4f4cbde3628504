"""Tools: schemas from docstrings, the tool-call parser, argument checks, result conversion and the runner.

Hand-written cases cover every failure kind; property-based tests (hypothesis) throw malformed, truncated,
nested, huge and adversarial turns at the parser and the runner and check that nothing escapes.
"""

from __future__ import annotations

import json
import random
import time
from enum import Enum
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmgrpo.env import message_problem
from mmgrpo.errors import ConfigError
from mmgrpo.tools.calls import MAX_PARSE_CHARS, MAX_PARSED_CALLS
from mmgrpo.tools.runner import (
    FAILURE_KINDS,
    Tool,
    ToolCall,
    ToolFailure,
    ToolResult,
    ToolRunner,
    as_tool,
    check_arguments,
    count_failures,
    parse_tool_calls,
    to_content,
    tool_message,
    tool_schemas,
    truncate,
)


# --------------------------------------------------------------------------------------------- test tools
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: any text.
    """
    return text


def scale(x: float, factor: float | None = None) -> float:
    """Scale a number.

    Args:
        x: the number.
        factor: the factor (1 when omitted).
    """
    return x * (1.0 if factor is None else factor)


class Color(Enum):
    RED = "red"
    BLUE = "blue"


def kinds(
    flag: bool,
    items: list[int],
    mapping: dict[str, int],
    mode: Literal["fast", "slow"],
    pair: tuple[int, str],
) -> str:
    """Accept one argument of each JSON kind.

    Args:
        flag: a boolean.
        items: integers.
        mapping: string to integer.
        mode: how to run.
        pair: an integer and a string.
    """
    return "ok"


def fail(message: str) -> str:
    """Raise ValueError with the message.

    Args:
        message: what to say.
    """
    raise ValueError(message)


def sleep(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def picture(n: int) -> list:
    """Return a caption, a red square and a second caption.

    Args:
        n: the square's side in pixels.
    """
    return ["before", Image.new("RGB", (n, n), "red"), "after"]


def big(n: int) -> str:
    """Return n characters.

    Args:
        n: how many.
    """
    return "x" * n


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# --------------------------------------------------------------------------------------------- Tool
def test_tool_schema_comes_from_get_json_schema():
    tool = Tool(add)
    fn = tool.schema["function"]
    assert tool.name == "add" and fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first integer."}
    assert fn["parameters"]["required"] == ["a"]
    assert tool.signature() == "add(a: integer, b: integer (optional))"


def test_tool_name_override_renames_the_schema():
    tool = Tool(add, name="plus", timeout_s=1.5)
    assert tool.schema["function"]["name"] == "plus" and tool.timeout_s == 1.5
    assert Tool(add).schema["function"]["name"] == "add"  # the override did not leak into a shared schema


def test_closures_of_one_factory_read_their_schema_once(monkeypatch):
    import transformers.utils

    from mmgrpo.tools import runner

    reads = []
    real = transformers.utils.get_json_schema
    monkeypatch.setattr(transformers.utils, "get_json_schema", lambda fn: reads.append(fn) or real(fn))
    monkeypatch.setattr(runner, "_SCHEMAS", {})

    def bound(offset: int):
        def shift(x: int) -> int:
            """Shift a number.

            Args:
                x: the number.
            """
            return x + offset

        return shift

    tools = [Tool(bound(k)) for k in range(5)]  # an env that binds its tool to each episode's data
    assert len(reads) == 1 and all(t.schema == tools[0].schema for t in tools)
    assert [t.fn(1) for t in tools] == [1, 2, 3, 4, 5]  # each keeps its own function
    tools[0].schema["function"]["description"] = "changed"  # a schema is the tool's own copy
    assert Tool(bound(9)).schema["function"]["description"] == "Shift a number." and len(reads) == 1
    assert Tool(bound(1), name="move").schema["function"]["name"] == "move" and len(reads) == 2

    def other(x: int) -> int:
        """Another function.

        Args:
            x: the number.
        """
        return x

    assert Tool(other).schema["function"]["description"] == "Another function." and len(reads) == 3


def test_tool_without_args_section_says_what_to_add():
    def area(width: int, height: int) -> int:
        """Multiply."""
        return width * height

    with pytest.raises(
        ConfigError, match=r"(?s)'width'.*Args:.*width: what width is\..*height: what height is"
    ):
        Tool(area)


def test_tool_without_docstring_or_type_hints_raises_config_error():
    def bare(x: int) -> int:
        return x

    def untyped(x):
        """Untyped.

        Args:
            x: a value.
        """

    with pytest.raises(ConfigError, match="docstring"):
        Tool(bare)
    with pytest.raises(ConfigError, match="type hint"):
        Tool(untyped)


@pytest.mark.parametrize("bad", [0, -1, True, "1"])
def test_tool_timeout_must_be_positive(bad):
    with pytest.raises(ConfigError, match="timeout_s"):
        Tool(add, timeout_s=bad)


def test_as_tool_and_tool_schemas():
    tool = Tool(add)
    assert as_tool(tool) is tool and as_tool(echo).name == "echo"
    assert [s["function"]["name"] for s in tool_schemas([tool, echo])] == ["add", "echo"]
    with pytest.raises(ConfigError, match="expected a Tool or a function"):
        as_tool(3)


def test_runner_rejects_duplicate_names_and_bad_settings():
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        ToolRunner([add, Tool(echo, name="add")])
    with pytest.raises(ConfigError, match="timeout_s"):
        ToolRunner([add], timeout_s=0)
    with pytest.raises(ConfigError, match="max_workers"):
        ToolRunner([add], max_workers=2, max_calls_per_turn=4)


# --------------------------------------------------------------------------------------------- parsing
def test_parse_several_calls_with_whitespace_in_order():
    text = (
        'Let me compute.\n<tool_call>\n  {"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call> done'
    )
    first, second = parse_tool_calls(text)
    assert first == ToolCall("add", {"a": 1, "b": 2}, first.raw) and first.raw.startswith("<tool_call>\n")
    assert second == ToolCall(
        "echo", {"text": "hi"}, '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
    )


def test_parse_arguments_as_json_string_and_missing_arguments():
    (c,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>')
    assert c.arguments == {"a": 5}
    (c,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert isinstance(c, ToolCall) and c.arguments == {}


def test_parse_without_calls_is_empty():
    assert parse_tool_calls("") == [] and parse_tool_calls("The answer is 4. </tool_call>") == []


@pytest.mark.parametrize(
    "body, kind, match",
    [
        ('{"name": "add", "arguments": {"a": 1}', "invalid_json", "not valid JSON"),
        ("", "invalid_json", "not valid JSON"),
        ("add(1, 2)", "invalid_json", "not valid JSON"),
        ("[1, 2]", "bad_call", "must be a JSON object, got array"),
        ('"add"', "bad_call", "got string"),
        ('{"arguments": {}}', "bad_call", 'no "name"'),
        ('{"name": 3, "arguments": {}}', "bad_call", '"name" must be a non-empty string'),
        ('{"name": "", "arguments": {}}', "bad_call", '"name" must be a non-empty string'),
        ('{"name": "add", "arguments": [1]}', "bad_call", '"arguments" must be a JSON object, got array'),
        ('{"name": "add", "arguments": "a=1"}', "bad_call", "got string"),
        ('{"name": "add", "arguments": "[1]"}', "bad_call", "got array"),
        ('{"name": "add", "arguments": null}', "bad_call", "got null"),
        ("[" * 20_000 + "]" * 20_000, "invalid_json", "nested too deeply"),
        ("1" * 5000, "invalid_json", "not valid JSON"),  # over Python's int-digits limit: a ValueError
    ],
    ids=lambda v: v[:24] + (f"...({len(v)} chars)" if len(v) > 24 else ""),
)
def test_parse_failures(body, kind, match):
    (f,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(f, ToolFailure) and f.kind == kind and match in f.message


def test_unclosed_call_at_the_end_is_invalid_json():
    valid = call("add", a=1)
    calls = parse_tool_calls(valid + '<tool_call>{"name": "add", "arguments": {"a": 2}}')
    assert isinstance(calls[0], ToolCall)
    assert calls[1].kind == "invalid_json" and "not closed" in calls[1].message


def test_a_broken_call_does_not_swallow_the_next_one():
    broken, good = parse_tool_calls('<tool_call>{"name": "add", ' + call("echo", text="x"))
    assert broken.kind == "invalid_json" and "not closed" in broken.message
    assert good == ToolCall("echo", {"text": "x"}, call("echo", text="x"))


def test_tag_text_inside_a_json_string_is_kept():
    (c,) = parse_tool_calls(call("echo", text="a <tool_call> b"))
    assert c.arguments == {"text": "a <tool_call> b"}


def test_parse_caps_text_length_and_number_of_calls():
    assert len(parse_tool_calls(call("add", a=1) * 100)) == MAX_PARSED_CALLS
    assert parse_tool_calls(" " * MAX_PARSE_CHARS + call("add", a=1)) == []


def test_every_truncation_of_valid_calls_parses():
    text = call("add", a=1, b=2) + "\n" + call("echo", text='q"uote <tool_call> \\ é')
    for i in range(len(text) + 1):
        for entry in parse_tool_calls(text[:i]):
            assert _well_formed(entry, text)


# --------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "fn, arguments, problem",
    [
        (add, {}, 'missing required argument "a"'),
        (add, {"a": 1, "c": 2, "d": 3}, 'unexpected arguments "c", "d"'),
        (add, {"a": 1.5}, 'argument "a" should be integer, got number 1.5'),
        (add, {"a": True}, 'argument "a" should be integer, got boolean true'),
        (add, {"a": "1"}, 'argument "a" should be integer, got string "1"'),
        (scale, {"x": True}, 'argument "x" should be number, got boolean'),
        (echo, {"text": None}, 'argument "text" should be string, got null'),
        (kinds, {"flag": 1}, 'argument "flag" should be boolean, got integer'),
        (kinds, {"items": [1, "2"]}, 'argument "items"[1] should be integer, got string'),
        (kinds, {"items": {}}, 'argument "items" should be array of integer, got object'),
        (kinds, {"mapping": {"k": "v"}}, 'argument "mapping"["k"] should be integer'),
        (kinds, {"mapping": []}, 'argument "mapping" should be object, got array'),
        (kinds, {"mode": "medium"}, 'argument "mode" should be one of ["fast", "slow"]'),
        (kinds, {"pair": [1]}, 'argument "pair" should have exactly 2 items, got 1'),
        (kinds, {"pair": [1, 2]}, 'argument "pair"[1] should be string'),
    ],
)
def test_argument_problems(fn, arguments, problem):
    assert any(problem in p for p in check_arguments(Tool(fn), arguments)), check_arguments(
        Tool(fn), arguments
    )


@pytest.mark.parametrize(
    "fn, arguments",
    [
        (add, {"a": 1}),
        (add, {"a": -3, "b": 10**30}),
        (scale, {"x": 2}),  # an integer is a number
        (scale, {"x": 2.5, "factor": None}),  # Optional accepts null
        (kinds, {"flag": False, "items": [], "mapping": {"a": 1}, "mode": "slow", "pair": [1, "x"]}),
    ],
)
def test_valid_arguments_have_no_problems(fn, arguments):
    assert check_arguments(Tool(fn), arguments) == []


def test_enum_type_hint_is_checked():
    def paint(color: Color) -> str:
        """Paint.

        Args:
            color: the colour.
        """
        return color

    assert check_arguments(Tool(paint), {"color": "red"}) == []
    assert "one of" in check_arguments(Tool(paint), {"color": "green"})[0]


# --------------------------------------------------------------------------------------------- results
@pytest.mark.parametrize(
    "value, text",
    [
        ("hi", "hi"),
        (3, "3"),
        (2.5, "2.5"),
        (True, "True"),
        ({"a": [1, "é"]}, '{"a": [1, "é"]}'),
        ([1, 2], "[1, 2]"),
        ((1, "x"), '[1, "x"]'),
        (None, "None"),
        ({1, 2}, "{1, 2}"),
        ({"s": {1}}, "{'s': {1}}"),  # not JSON-able: str()
    ],
)
def test_to_content_text(value, text):
    assert to_content(value) == [{"type": "text", "text": text}]


def test_to_content_images_in_order():
    img = Image.new("RGB", (4, 4))
    assert to_content(img) == [{"type": "image", "image": img}]
    parts = to_content(("a", img, 7))
    assert [p["type"] for p in parts] == ["text", "image", "text"] and parts[2]["text"] == "7"


def test_truncate_says_what_was_cut():
    (part,), cut = truncate([{"type": "text", "text": "x" * 12345}], 2000)
    assert cut and part["text"] == "x" * 2000 + "...[truncated: result was 12345 characters, limit 2000]"
    img = Image.new("RGB", (2, 2))
    parts, cut = truncate(
        [{"type": "text", "text": "ab"}, {"type": "image", "image": img}, {"type": "text", "text": "cdef"}], 4
    )
    assert cut and parts[0]["text"] == "ab" and parts[2]["text"].startswith("cd...[truncated: result was 6")
    same = [{"type": "text", "text": "abc"}]
    assert truncate(same, 3) == (same, False)


# --------------------------------------------------------------------------------------------- runner
@pytest.fixture(scope="module")
def runner():
    return ToolRunner([add, echo, fail, picture, big, kinds, Tool(sleep, timeout_s=0.2)], timeout_s=2.0)


def test_run_several_calls_in_one_turn(runner):
    results = runner.run(call("add", a=2, b=3) + "thinking..." + call("echo", text="hi"))
    assert [(r.name, r.failure, r.content) for r in results] == [
        ("add", None, [{"type": "text", "text": "5"}]),
        ("echo", None, [{"type": "text", "text": "hi"}]),
    ]
    assert tool_message(results[0]) == {
        "role": "tool",
        "name": "add",
        "content": [{"type": "text", "text": "5"}],
        "error": None,
    }


def test_run_json_string_arguments(runner):
    (r,) = runner.run('<tool_call>{"name": "add", "arguments": "{\\"a\\": 40, \\"b\\": 2}"}</tool_call>')
    assert r.failure is None and r.content[0]["text"] == "42"


def test_run_image_result(runner):
    (r,) = runner.run(call("picture", n=8))
    assert r.failure is None and [p["type"] for p in r.content] == ["text", "image", "text"]
    assert r.content[1]["image"].size == (8, 8)
    assert message_problem([tool_message(r)]) is None


def test_run_oversized_result_is_truncated(runner):
    (r,) = runner.run(call("big", n=12345))
    assert r.failure == "oversized"
    assert r.content[0]["text"].endswith("x...[truncated: result was 12345 characters, limit 2000]")


def _text(result: ToolResult) -> str:
    return "".join(p["text"] for p in result.content if p["type"] == "text")


def test_run_unknown_tool_lists_tools_and_suggests(runner):
    (r,) = runner.run(call("ech", text="x"))
    assert r.failure == "unknown_tool" and r.name == "ech"
    assert _text(r).startswith(
        "error: unknown tool \"ech\". Did you mean 'echo'? Available tools: add, echo, fail"
    )
    assert '<tool_call>{"name": "add", "arguments": {...}}</tool_call>' in _text(r)


def test_run_bad_arguments_shows_signature(runner):
    (r,) = runner.run(call("add", x=1))
    assert r.failure == "bad_arguments"
    assert _text(r) == (
        'error: bad arguments for add: missing required argument "a"; unexpected argument "x". '
        "Expected add(a: integer, b: integer (optional))."
    )


def test_run_tool_error(runner):
    (r,) = runner.run(call("fail", message="no luck"))
    assert r.failure == "tool_error" and _text(r) == "error: fail raised ValueError: no luck"


def test_run_parse_failures_teach_the_format(runner):
    bad_json, bad_call = runner.run("<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>")
    assert (bad_json.failure, bad_call.failure) == ("invalid_json", "bad_call")
    assert bad_json.name == "" and "Call a tool as <tool_call>" in _text(bad_json)


def test_run_too_many_calls(runner):
    results = runner.run(call("add", a=1) * 6)
    assert [r.failure for r in results] == [None] * 4 + ["too_many_calls"] * 2
    assert "at most 4 tool calls" in _text(results[4]) and "call 5" in _text(results[4])


def test_run_timeout(runner):
    t0 = time.perf_counter()
    (r,) = runner.run(call("sleep", seconds=2))
    elapsed = time.perf_counter() - t0
    assert r.failure == "timeout" and "did not finish within 0.2 s" in _text(r)
    assert 0.19 < elapsed < 0.6 and 0.19 < r.seconds < 0.6


def test_slow_calls_of_one_turn_run_concurrently():
    runner = ToolRunner([sleep], timeout_s=0.2)
    t0 = time.perf_counter()
    results = runner.run(call("sleep", seconds=2) * 4)
    elapsed = time.perf_counter() - t0
    assert [r.failure for r in results] == ["timeout"] * 4
    assert 0.19 < elapsed < 0.5, f"4 calls took {elapsed:.2f} s: they ran one after another"
    ok = runner.run(call("sleep", seconds=0.05) * 4)  # and quick ones finish on time, together
    assert [_text(r) for r in ok] == ["awake"] * 4


def test_hung_calls_cannot_pile_up():
    runner = ToolRunner([sleep], timeout_s=0.05, max_workers=2, max_calls_per_turn=2)
    assert [r.failure for r in runner.run(call("sleep", seconds=1) * 2)] == ["timeout"] * 2
    (r,) = runner.run(call("sleep", seconds=0))  # both slots are still held by the sleeping threads
    assert r.failure == "timeout" and "could not start" in _text(r) and r.seconds == 0.0


def test_tool_raising_timeout_error_is_a_tool_error():
    def slow_io(path: str) -> str:
        """Read.

        Args:
            path: where.
        """
        raise TimeoutError("socket")

    (r,) = ToolRunner([slow_io]).run(call("slow_io", path="/"))
    assert r.failure == "tool_error" and _text(r) == "error: slow_io raised TimeoutError: socket"


def test_lone_surrogates_never_reach_a_message(runner):
    (r,) = runner.run('<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>')
    assert r.failure is None and _text(r) == "a?b"
    (r,) = runner.run('<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>')
    assert r.failure == "unknown_tool" and r.name == "?" and _text(r).encode("utf-8")


def test_failure_counts(runner):
    results = runner.run(call("add", a=1) + call("nope") + call("add") + call("nope"))
    assert count_failures(results) == {"unknown_tool": 2, "bad_arguments": 1}


# --------------------------------------------------------------------------------------------- properties
# Hypothesis spends ~2 ms per example on a small machine before the test body even runs, so the bulk of the
# fuzzing draws one integer and builds the turn with random.Random(seed): cheap to generate, reproducible from
# the falsifying seed. Plain-text and JSON strategies cover the rest.
def _well_formed(entry: ToolCall | ToolFailure, text: str) -> bool:
    if isinstance(entry, ToolCall):
        return isinstance(entry.name, str) and entry.name != "" and isinstance(entry.arguments, dict)
    return entry.kind in ("invalid_json", "bad_call") and isinstance(entry.message, str) and entry.raw in text


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_call",
    "tool_call>",
    '{"name": "add", "arguments": ',
    '{"name": "echo", "arguments": {"text": ',
    '{"name": ',
    '"arguments": ',
    '{"a": 1}',
    '"{\\"a\\": 2}"',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ",",
    ":",
    "\n",
    " ",
    "null",
    "1e999",
    "NaN",
    "-0",
    "true",
    '"\\ud800"',
    "\u00e9\U0001f600",
    "\x00",
]
NAMES = ["add", "echo", "kinds", "fail", "ad", "", "Add", "echo ", "<tool_call>"]
KEYS = ["a", "b", "text", "x", "items", "flag", "mode", ""]


def random_json(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value: scalars of every kind, nested lists and objects."""
    roll = rng.random()
    if depth > 3 or roll < 0.5:
        return rng.choice(
            [
                None,
                True,
                False,
                0,
                -7,
                2**70,
                1.5,
                -0.0,
                1e308,
                "",
                "x",
                "é\U0001f600",
                "</tool_call>",
                "\ud800",
            ]
        )
    if roll < 0.75:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(KEYS): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def random_call(rng: random.Random) -> str:
    """A call that is well-formed, wrong in content, or cut off anywhere."""
    args = (
        {rng.choice(KEYS): random_json(rng) for _ in range(rng.randint(0, 3))}
        if rng.random() < 0.8
        else random_json(rng)
    )
    if rng.random() < 0.2:
        args = json.dumps(args)  # arguments as a JSON string
    obj = {"name": rng.choice(NAMES), "arguments": args} if rng.random() < 0.9 else random_json(rng)
    text = (
        "<tool_call>"
        + rng.choice(["", "\n", "  "])
        + json.dumps(obj, ensure_ascii=rng.random() < 0.5)
        + "</tool_call>"
    )
    return text[: rng.randint(0, len(text))] if rng.random() < 0.3 else text


def random_turn(seed: int) -> str:
    """An adversarial assistant turn: fragments, random Unicode, calls (valid, wrong, truncated), deep nesting,
    huge strings and tags inside strings, concatenated."""
    rng = random.Random(seed)
    pieces = []
    for _ in range(rng.randint(0, 10)):
        roll = rng.random()
        if roll < 0.35:
            pieces.append(rng.choice(FRAGMENTS))
        elif roll < 0.5:
            pieces.append(
                "".join(
                    chr(rng.randint(0, 0x10FFFF if rng.random() < 0.3 else 127))
                    for _ in range(rng.randint(0, 20))
                )
            )
        elif roll < 0.85:
            pieces.append(random_call(rng))
        elif roll < 0.93:
            depth = rng.choice([5, 998, 1001, 3000, 40_000])
            pieces.append(rng.choice(["<tool_call>", "", '<tool_call>{"name": "echo", "arguments": ']))
            pieces.append(
                "[" * depth
                + ("]" * depth if rng.random() < 0.5 else "")
                + rng.choice(["", "}", "</tool_call>"])
            )
        elif roll < 0.97:
            pieces.append(
                call("echo", text=rng.choice(["<tool_call>", "</tool_call>", "<tool_call>{}</tool_call>"]))
            )
        else:
            pieces.append(
                rng.choice(["a", "<tool_call>", "</tool_call>", "["]) * rng.choice([1000, 30_000, 120_000])
            )
    return "".join(pieces)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)
FUZZ_RUNNER = ToolRunner([add, echo, kinds, fail])  # quick tools only: fuzzed arguments may be anything
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


def check_parse(text: str) -> None:
    entries = parse_tool_calls(text)
    assert len(entries) <= MAX_PARSED_CALLS
    assert all(_well_formed(e, text) for e in entries), entries


def check_run(text: str) -> None:
    results = FUZZ_RUNNER.run(text)
    assert len(results) == len(parse_tool_calls(text))
    for r in results:
        assert r.failure is None or r.failure in FAILURE_KINDS
        assert r.failure in (None, "oversized") or _text(r).startswith("error: ")
    assert message_problem([tool_message(r) for r in results]) is None
    for r in results:
        _text(r).encode("utf-8")  # no lone surrogates: every tokenizer can encode it


@settings(max_examples=1200, **SETTINGS)
@given(st.integers(0, 2**32))
def test_parse_random_turns(seed):
    check_parse(random_turn(seed))


@settings(max_examples=200, **SETTINGS)
@given(st.text(max_size=60), st.text(max_size=60), st.text(max_size=60))
def test_parse_random_text_around_tags(a, b, c):
    check_parse(a)
    check_parse(f"{a}<tool_call>{b}</tool_call>{c}")
    check_parse(f"<tool_call>{a}<tool_call>{b}</tool_call>{c}</tool_call>")


@settings(max_examples=150, **SETTINGS)
@given(json_values, st.integers(0, 200))
def test_parse_random_json_in_tags(value, cut):
    text = f"<tool_call>{json.dumps(value)}</tool_call>"
    check_parse(text)
    check_parse(text[:cut])
    check_parse(f'<tool_call>{{"name": "echo", "arguments": {json.dumps(json.dumps(value))}}}</tool_call>')


@settings(max_examples=400, **SETTINGS)
@given(st.integers(0, 2**32))
def test_run_random_turns(seed):
    check_run(random_turn(seed))


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 20_000,
        "</tool_call>" * 20_000,
        "<tool_call></tool_call>" * 10_000,
        "<tool_call>" + "[" * 200_000,
        "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
        '<tool_call>{"name": "echo", "arguments": {"text": "' + "a" * 1_000_000 + '"}}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": {"text": "' + "a" * 90_000 + '"}}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": "' + "[" * 5000 + '"}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": {"text": "</tool_call>"}}</tool_call>',
        '<tool_call>{"name": "' + "n" * 90_000 + '"}</tool_call>',
        "\ud800<tool_call>\udfff</tool_call>",
    ],
    ids=lambda text: f"{text[:24]}...({len(text)} chars)",
)
def test_huge_and_adversarial_turns_are_fast(text):
    t0 = time.perf_counter()
    check_parse(text)
    check_run(text)
    assert time.perf_counter() - t0 < 1.0
