"""Built-in tools: plain functions with type hints and an ``Args:`` docstring, ready for ``mmgrpo.tools.Tool``.

- ``calculator(expression)``: arithmetic, parsed with ``ast`` (never ``eval``); ``mmgrpo.toolbox.calculator``.
- ``python(code)``: runs a program in a sandboxed subprocess; ``mmgrpo.toolbox.sandbox``, ``docs/sandbox.md``.
- ``http_get(url)`` / ``http_post(url, data)``: HTTP limited to configured base URLs; ``mmgrpo.toolbox.http``.
- ``crop(x0, y0, x1, y1)`` / ``zoom(cell)``: bound to one episode's image, ``image_tools(image)``.

``make_tool(name, **settings)`` makes the named tool from config-file settings::

    make_tool("calculator")
    make_tool("python", cpu_seconds=2, memory_mb=256)
    make_tool("http_get", base_urls=["http://127.0.0.1:8000/api"])

Tools that wait (``python``, ``http_*``) carry a ``timeout_s`` attribute: the longest a call can take by their
own limits. Importing this package is cheap: each module (and ``httpx``, ``PIL``) is imported when first used.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, did_you_mean
from mmgrpo.toolbox.calculator import calculator  # cheap; makes the name the function, not the module

__all__ = ["BUILTIN_TOOLS", "calculator", "image_tools", "make_tool", "run_python"]

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
    if attr == name:  # a plain function, no settings
        if settings:
            key = next(iter(settings))
            raise ConfigError(f"tool {name!r} takes no settings, got {key!r}")
        return target
    known = [p for p in inspect.signature(target).parameters if p != "limits"]
    if attr == "make_python_tool":
        from mmgrpo.toolbox.sandbox import LIMIT_NAMES

        known += LIMIT_NAMES
    for key in settings:
        if key not in known:
            raise ConfigError(
                f"tool {name!r}: unknown setting {key!r}.{did_you_mean(key, known)} Known settings: {', '.join(known)}"
            )
    missing = [key for key in required if key not in settings]
    if missing:
        raise ConfigError(
            f"tool {name!r} needs the setting {missing[0]!r}, e.g. "
            f"make_tool({name!r}, base_urls=['http://127.0.0.1:8000/api'])"
        )
    return target(**settings)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmgrpo.toolbox' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
