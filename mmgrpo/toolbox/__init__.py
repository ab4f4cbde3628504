"""Built-in tools: plain functions with type hints and an ``Args:`` docstring, ready for ``mmgrpo.tools.runner.Tool``.

- ``calculator(expression)``: arithmetic, parsed with ``ast`` (never ``eval``); ``mmgrpo.toolbox.calculator``.
- ``python(code)``: runs a program in a sandboxed subprocess; ``mmgrpo.toolbox.sandbox``, ``docs/sandbox.md``.
- ``http_get(url)`` / ``http_post(url, data)``: HTTP limited to configured base URLs; ``mmgrpo.toolbox.http``.
- ``crop(x0, y0, x1, y1)`` / ``zoom(cell)``: bound to one episode's image, ``image_tools(image)``.

``make_tool(name, **settings)`` makes the named tool from config-file settings::

    make_tool("calculator")
    make_tool("python", cpu_seconds=2, memory_mb=256)
    make_tool("http_get", base_urls=["http://127.0.0.1:8000/api"])

``make_tools(entries)`` makes a config file's list of tools, each a name or a mapping of the name and its
settings (the settings go to ``make_tool``)::

    tools: [calculator, {name: python, cpu_seconds: 2, wall_seconds: 10}]

Tools that wait (``python``, ``http_*``) carry a ``timeout_s`` attribute: the longest a call can take by their
own limits. Importing this package is cheap: each module (and ``httpx``, ``PIL``) is imported when first used.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox.calculator import calculator  # cheap; makes the name the function, not the module

__all__ = [
    "BUILTIN_TOOLS",
    "calculator",
    "image_tools",
    "make_tool",
    "make_tools",
    "run_python",
    "tool_entry",
]

# name -> (module, factory or function, required settings)
_BUILTINS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "calculator": ("mmgrpo.toolbox.calculator", "calculator", ()),
    "python": ("mmgrpo.toolbox.sandbox", "make_python_tool", ()),
    "http_get": ("mmgrpo.toolbox.http", "make_http_get", ("base_urls",)),
    "http_post": ("mmgrpo.toolbox.http", "make_http_post_json", ("base_urls",)),
}
BUILTIN_TOOLS: tuple[str, ...] = tuple(_BUILTINS)
"""Names ``make_tool`` knows. ``crop`` and ``zoom`` are not among them: they need the episode's image."""

_EPISODE_TOOLS = ("crop", "zoom")
_LAZY = {
    "image_tools": "mmgrpo.toolbox.image",
    "run_python": "mmgrpo.toolbox.sandbox",
}


def make_tool(name: str, /, **settings: Any) -> Callable[..., Any]:
    """The built-in tool ``name`` (one of ``BUILTIN_TOOLS``) made with ``settings``.

    Raises ConfigError for an unknown name, an unknown setting (with the known ones and a close match) or a
    missing required one.
    """
    if not isinstance(name, str):
        raise ConfigError(
            f"make_tool: expected a tool name, got {type(name).__name__} {name!r:.80}; for a config entry such "
            "as {name: python, cpu_seconds: 2} use make_tools([entry]) or make_tool('python', cpu_seconds=2)"
        )
    if name in _EPISODE_TOOLS:
        raise ConfigError(
            f"tool {name!r} is bound to an episode's image: make it in the env with "
            "mmgrpo.toolbox.image_tools(image), which returns [crop, zoom]"
        )
    if name not in _BUILTINS:
        raise ConfigError(
            f"unknown tool {name!r}.{did_you_mean(str(name), BUILTIN_TOOLS)} "
            f"Built-in tools: {', '.join(BUILTIN_TOOLS)} (and crop, zoom via image_tools(image))"
        )
    module_name, attr, required = _BUILTINS[name]
    target = getattr(importlib.import_module(module_name), attr)
    known = tool_settings(name)
    for key in settings:
        if key not in known:
            accepted = f"Known settings: {', '.join(known)}" if known else "It takes no settings."
            raise ConfigError(
                f"tool {name!r}: unknown setting {key!r}.{did_you_mean(str(key), known)} {accepted}"
            )
    if attr == name:  # a plain function, no settings
        return target
    missing = [key for key in required if key not in settings]
    if missing:
        raise ConfigError(
            f"tool {name!r} needs the setting {missing[0]!r}, e.g. "
            f"make_tool({name!r}, base_urls=['http://127.0.0.1:8000/api'])"
        )
    return target(**settings)


def tool_settings(name: str) -> list[str]:
    """The settings ``make_tool(name, ...)`` accepts (a ``BUILTIN_TOOLS`` name), in signature order."""
    module_name, attr, _ = _BUILTINS[name]
    if attr == name:  # a plain function
        return []
    target = getattr(importlib.import_module(module_name), attr)
    known = [p for p in inspect.signature(target).parameters if p != "limits"]
    if attr == "make_python_tool":
        from mmgrpo.toolbox.sandbox import LIMIT_NAMES

        known += LIMIT_NAMES
    return known


def tool_entry(
    entry: Any, where: str = "tools", example: str = "e.g. calculator or {name: python, cpu_seconds: 2}"
) -> tuple[str, dict[str, Any]]:
    """``(name, settings)`` of one config-file tool entry: a name (``"calculator"``) or a mapping of the name and
    the tool's settings (``{"name": "python", "cpu_seconds": 2}``). ``where`` names the entry in errors,
    ``example`` shows a good one."""
    if isinstance(entry, str):
        return entry, {}
    if not isinstance(entry, Mapping):
        raise ConfigError(
            f"{where}: expected a tool name or a mapping {{name: ..., <setting>: value}}, got "
            f"{type(entry).__name__} {entry!r:.80}; {example}"
        )
    settings = dict(entry)
    name = settings.pop("name", None)
    if not isinstance(name, str) or not name:
        single = next(iter(entry)) if len(entry) == 1 else None
        hint = (
            f" For the settings of {single!r} write {{name: {single}, <setting>: value}}"
            if isinstance(single, str) and single in BUILTIN_TOOLS
            else ""
        )
        raise ConfigError(
            f"{where}: a tool given as a mapping needs a 'name' key naming the tool, got {dict(entry)!r:.120}; "
            f"{example}.{hint}"
        )
    bad = next((key for key in settings if not isinstance(key, str)), None)
    if bad is not None:
        raise ConfigError(f"{where}: tool {name!r}: setting names are strings, got {bad!r}")
    return name, settings


def make_tools(entries: Any, where: str = "tools") -> list[Callable[..., Any]]:
    """The built-in tools of a config file's list, each entry a name or ``{name: ..., <setting>: value}``
    (``tool_entry``); the settings go to ``make_tool``. Errors name the entry (``tools[1]``), the tool, the key
    and the settings the tool accepts."""
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Sequence):
        raise ConfigError(
            f"{where}: expected a list of tools, e.g. [calculator] or [{{name: python, cpu_seconds: 2}}], got "
            f"{entries!r:.80}"
        )
    tools = []
    for i, entry in enumerate(entries):
        name, settings = tool_entry(entry, f"{where}[{i}]")
        try:
            tools.append(make_tool(name, **settings))
        except ConfigError as e:
            raise ConfigError(f"{where}[{i}]: {e}") from None
    return tools


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmgrpo.toolbox' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
