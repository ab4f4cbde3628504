"""The typed-config machinery behind config.py: type checks, coercion of parsed YAML into dataclasses, field docs.

Generic over any dataclass whose fields are annotated with int, float, bool, str, ``X | None``, ``Literal``,
``list[...]``, ``dict`` or another dataclass; config.py holds the schema itself.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any, Literal

from mmgrpo.config.source import KeyPath, Sources, dotted
from mmgrpo.errors import ConfigError, closest, did_you_mean


class FieldError(ConfigError):
    """A field failed validation; the loader re-raises it with the dotted key and the file line."""

    def __init__(self, field: str, tail: str) -> None:
        super().__init__(f"'{field}' {tail}")
        self.field, self.tail = field, tail


class Section:
    """Base of every config section: type check every field, then the section's own rules."""

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        self._validate()

    def _validate(self) -> None:
        pass

    def _require(self, ok: bool, name: str, rule: str, why: str = "") -> None:
        if not ok:
            raise FieldError(name, f"{rule}, got {getattr(self, name)!r}" + (f". {why}" if why else ""))


# ---------------------------------------------------------------- types: check, coerce, describe


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(hint)
    return typing.get_args(hint) if origin is typing.Union or origin is types.UnionType else None


def type_name(hint: Any) -> str:
    if (args := _union_args(hint)) is not None:
        return " or ".join(type_name(a) for a in args)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return {type(None): "null", dict: "dict"}.get(
        typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint))
    )


def _type_ok(value: Any, hint: Any) -> bool:
    if (args := _union_args(hint)) is not None:
        return any(_type_ok(value, a) for a in args)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, typing.get_args(hint)[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, origin or hint)


def _check_type(name: str, value: Any, hint: Any) -> None:
    if _type_ok(value, hint):
        return
    if typing.get_origin(hint) is Literal and isinstance(value, str):
        choices = typing.get_args(hint)
        raise FieldError(name, f"must be {type_name(hint)}; got '{value}'.{did_you_mean(value, choices)}")
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    extra = " (write true or false, unquoted)" if hint is bool and isinstance(value, str) else ""
    raise FieldError(name, f"must be {type_name(hint)}, got {type(value).__name__} {shown}{extra}")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, hint: Any, path: KeyPath, sources: Sources) -> Any:
    """Turn parsed YAML into field values: sections into dataclasses, numbers into floats ('3e-4' too)."""
    if (args := _union_args(hint)) is not None:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint) and (value is None or isinstance(value, dict)):
        return build(hint, value or {}, path, sources)  # type: ignore[arg-type]
    if typing.get_origin(hint) is list and isinstance(value, list):
        item = typing.get_args(hint)[0]
        return [_coerce(v, item, path + (i,), sources) for i, v in enumerate(value)]
    if hint is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def build(cls: type, data: dict[str, Any], path: KeyPath, sources: Sources) -> Any:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            full = dotted(path + (str(key),))
            aliases: dict[str, str] = getattr(cls, "_aliases", {})
            alias = str(key) if str(key) in aliases else closest(str(key), aliases)
            match = aliases.get(str(key)) or closest(str(key), names) or (aliases[alias] if alias else None)
            hint = f" Did you mean '{dotted(path + (match,))}'?" if match else ""
            under = f"under '{dotted(path)}'" if path else "at the top level"
            raise ConfigError(
                f"{sources.locate(path + (str(key),))}: unknown key '{full}'.{hint} "
                f"Valid keys {under}: {', '.join(names)}"
            )
    hints = type_hints(cls)
    kwargs = {k: _coerce(v, hints[k], path + (k,), sources) for k, v in data.items()}
    missing = [n for n in names if n not in kwargs and _has_no_default(cls, n)]
    if missing:
        raise ConfigError(
            f"{sources.locate(path)}: '{dotted(path)}' needs the key '{missing[0]}', "
            f"e.g. {{{missing[0]}: ...}}"
        )
    try:
        return cls(**kwargs)
    except FieldError as e:
        key = path + (e.field,)
        raise ConfigError(f"{sources.locate(key)}: '{dotted(key)}' {e.tail}") from None


def _has_no_default(cls: type, name: str) -> bool:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def describe_fields(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal under the field), in declaration order."""
    docs = _field_docs(cls)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def reference_table(cls: type, markdown: bool = False) -> str:
    """Every config key with its type, default and docstring: for the README and `--help-config`."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(klass: type, prefix: str) -> None:
        hints, docs = type_hints(klass), describe_fields(klass)
        for f in dataclasses.fields(klass):
            key, hint = prefix + f.name, hints[f.name]
            item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")  # type: ignore[arg-type]
                continue
            section = next((a for a in _union_args(hint) or () if dataclasses.is_dataclass(a)), None)
            if f.default is not dataclasses.MISSING:
                default = json.dumps(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = json.dumps(f.default_factory(), default=dataclasses.asdict)
            else:
                default = "(required)"
            rows.append((key, type_name(hint), default, docs[f.name]))
            if section is not None:  # an optional section (e.g. model.lora): its keys when given
                walk(section, key + ".")  # type: ignore[arg-type]
            if dataclasses.is_dataclass(item):
                walk(item, key + "[].")  # type: ignore[arg-type]

    walk(cls, "")
    if markdown:
        lines = ["| key | type | default | description |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| `{k}` | {t} | `{d}` | {doc} |" for k, t, d, doc in rows])
    return "\n".join(f"{k}: {t} = {d}\n    {doc}" for k, t, d, doc in rows)
