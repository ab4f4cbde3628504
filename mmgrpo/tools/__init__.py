"""Tools for tool-using episodes: a Python function described to the model (``Tool``), its calls parsed from
the assistant's text (``calls``) and run with timeouts and bounds, every problem turned into data
(``runner``). The built-in tools live in ``mmgrpo.toolbox``.
"""

from mmgrpo.tools.calls import (
    MAX_PARSED_CALLS,
    ToolCall,
    ToolFailure,
    check_arguments,
    parse_tool_calls,
    tool_call_text,
)
from mmgrpo.tools.runner import (
    FAILURE_KINDS,
    Tool,
    ToolResult,
    ToolRunner,
    abandoned_threads,
    as_tool,
    count_failures,
    result_problem,
    to_content,
    tool_message,
    tool_schemas,
    truncate,
)

__all__ = [
    "FAILURE_KINDS",
    "MAX_PARSED_CALLS",
    "Tool",
    "ToolCall",
    "ToolFailure",
    "ToolResult",
    "ToolRunner",
    "abandoned_threads",
    "as_tool",
    "check_arguments",
    "count_failures",
    "parse_tool_calls",
    "result_problem",
    "to_content",
    "tool_call_text",
    "tool_message",
    "tool_schemas",
    "truncate",
]
