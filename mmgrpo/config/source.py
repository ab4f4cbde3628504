"""Where config values come from: a YAML file (remembering the line of every key) and `--set key=value` overrides.

This module only reads text into a plain dict and keeps, for every key path, the location to blame in an error
message ("runs/a.yaml:12" or "--set grpo.lr=1e-4"). Turning the dict into typed dataclasses is config.py's job.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from mmgrpo.errors import ConfigError

KeyPath = tuple[str | int, ...]


def dotted(path: KeyPath) -> str:
    """('verifiers', 0, 'name') -> 'verifiers[0].name'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class Sources:
    """Key path -> where its value was written, for error messages; unknown paths fall back to a parent."""

    def __init__(self, default: str) -> None:
        self.default = default
        self._at: dict[KeyPath, str] = {}

    def set(self, path: KeyPath, where: str) -> None:
        self._at[path] = where

    def replace_under(self, path: KeyPath, where: str) -> None:
        """The value at ``path`` was replaced wholesale: forget the old locations of it and its children."""
        for key in [k for k in self._at if k[: len(path)] == path]:
            del self._at[key]
        self._at[path] = where

    def locate(self, path: KeyPath) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self._at:
                return self._at[path[:n]]
        return self.default


def read_yaml(path: str | Path) -> tuple[dict[str, Any], Sources]:
    """Parse a YAML config file into a dict and the line of every key. Raises ConfigError naming file and line."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{file}: config file not found (working directory {Path.cwd()}). "
            "Pass the path of a YAML file, e.g. one under examples/, or no file for the defaults."
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{file}: not UTF-8 text (byte {e.start} is {e.object[e.start : e.start + 1]!r}); save the config "
            "as UTF-8 (most editors: 'Save with encoding')"
        ) from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read config file: {e}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        context = f" ({e.context})" if e.context else ""
        context += "; indent with spaces, not tabs" if "\\t" in str(e.problem) else ""
        raise ConfigError(
            f"{where}: invalid YAML: {e.problem}{context}. Check the indentation and quoting on or just "
            "before this line."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    sources = Sources(file)
    if data is None:
        return {}, sources
    if not isinstance(data, dict):
        raise ConfigError(
            f"{file}:{node.start_mark.line + 1}: the top level of a config must be a mapping of keys "
            f"(seed:, model:, grpo:, ...), got {type(data).__name__}."
        )
    _record_lines(node, (), sources, file)
    return data, sources


def _record_lines(node: yaml.Node, path: KeyPath, sources: Sources, file: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in seen and key != "<<":
                raise ConfigError(
                    f"{file}:{line}: duplicate key '{dotted(path + (key,))}' (first set on line {seen[key]}); "
                    "keep only one."
                )
            seen[key] = line
            sources.set(path + (key,), f"{file}:{line}")
            _record_lines(value_node, path + (key,), sources, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sources.set(path + (i,), f"{file}:{item.start_mark.line + 1}")
            _record_lines(item, path + (i,), sources, file)


def apply_override(
    data: dict[str, Any], sources: Sources, override: str, defaults: dict[str, Any] | None = None
) -> None:
    """Apply one ``key.sub=value`` override to ``data`` in place; the value is parsed as YAML.

    Intermediate sections are created as needed; a digit part indexes into a list (``verifiers.0.weight=2``),
    taken from ``defaults`` when the data has none yet.
    """
    where = f"--set {override}"
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"{where}: expected KEY=VALUE with a dotted key, e.g. --set grpo.lr=1e-4")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{where}: cannot parse the value as YAML ({e}); quote it, e.g. key='text'"
        ) from None
    node: Any = data
    path: KeyPath = ()
    for i, part in enumerate(p.strip() for p in parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"{where}: '{dotted(path)}' is a list of {len(node)} items; index it with 0..{len(node) - 1}"
                )
            index: str | int = int(part)
        elif isinstance(node, dict):
            index = part
            if not last and not isinstance(node.get(part), (dict, list)):
                if node.get(part) is not None:
                    raise ConfigError(
                        f"{where}: cannot set a key inside '{dotted(path + (part,))}': it is a "
                        f"{type(node[part]).__name__}, not a section"
                    )
                default = _lookup(defaults, path + (part,))
                node[part] = copy.deepcopy(default) if isinstance(default, list) else {}
                sources.set(path + (part,), where)
        else:  # pragma: no cover - guarded by the check above
            raise ConfigError(f"{where}: '{dotted(path)}' is not a section")
        path += (index,)
        if last:
            node[index] = value
            sources.replace_under(path, where)
        else:
            node = node[index]


def _lookup(tree: Any, path: KeyPath) -> Any:
    for part in path:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
        else:
            return None
    return tree
