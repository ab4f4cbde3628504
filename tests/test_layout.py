"""The layout holds its rules (docs/architecture.md): no import circles between mmgrpo's modules, imports
between packages only in the allowed directions (math <- model <- rollout <- train <- cli), no module over
600 lines, the public API importable from ``mmgrpo`` itself, and the plugin import paths kept.

Imports are read from the source (every ``import``/``from`` statement, inside functions and
``TYPE_CHECKING`` blocks too), so a lazy import cannot hide a circle; then every module is imported in a
fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# where the installed package's source lives (the built-in envs and verifiers are inside it, so no top-level
# folder of the repository shadows another package, e.g. Prime Intellect's ``verifiers``)
SOURCES = {"mmgrpo": ROOT / "mmgrpo"}
MAX_LINES = 600

# the room of each module (by name prefix; the longest prefix wins) and the rooms each room may import
ROOMS = {
    "mmgrpo": "api",  # the package itself: lazy exports only, by name
    "mmgrpo.__main__": "cli",
    "mmgrpo.errors": "errors",
    "mmgrpo.env": "protocols",
    "mmgrpo.verifier": "protocols",
    "mmgrpo.registry": "protocols",
    "mmgrpo.grpo": "grpo",
    "mmgrpo.data": "data",
    "mmgrpo.config": "config",
    "mmgrpo.model": "model",
    "mmgrpo.tools": "tools",
    "mmgrpo.toolbox": "toolbox",
    "mmgrpo.envs": "envs",
    "mmgrpo.verifiers": "verifiers",
    "mmgrpo.rollout": "rollout",
    "mmgrpo.tiny": "tiny",
    "mmgrpo.train": "train",
    "mmgrpo.cli": "cli",
}
ALLOWED = {
    "errors": set(),
    "protocols": {"errors"},
    "grpo": {"errors"},
    "data": {"errors"},
    "tools": {"errors", "protocols"},
    "toolbox": {"errors", "tools"},
    "verifiers": {"errors", "protocols", "tools"},
    "envs": {"errors", "protocols", "tools", "toolbox", "data", "verifiers"},  # self_correct scores with one
    "config": {"errors", "protocols", "envs"},  # validation asks the registry and the tool env
    "model": {"errors", "grpo"},
    "rollout": {"errors", "protocols", "grpo", "model", "tools"},
    "tiny": {"errors", "model", "data"},
    "train": {"errors", "protocols", "grpo", "model", "rollout", "config", "data", "tools", "envs"},
    "cli": {
        "api",
        "errors",
        "protocols",
        "grpo",
        "model",
        "rollout",
        "config",
        "data",
        "tools",
        "envs",
        "tiny",
        "train",
    },
    "api": set(),
}


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            out[name] = path
    return out


def room(module: str) -> str:
    best = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len)
    return ROOMS[best]


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The mmgrpo modules ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                package = module if is_package else module.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            # `from pkg import sub` imports the submodule pkg.sub; `from pkg import name` imports pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import mmgrpo.a.b` names mmgrpo.a.b (or its package)
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: imports_of(m, p, known) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 60  # every module was read
    assert cycles(graph) == []


def test_imports_run_only_in_the_allowed_directions():
    wrong = [
        f"{m} ({room(m)}) imports {t} ({room(t)})"
        for m, targets in sorted(import_graph().items())
        for t in sorted(targets)
        if room(t) != room(m) and room(t) not in ALLOWED[room(m)]
    ]
    assert wrong == []


def test_the_rules_catch_a_backward_import():
    # the model side importing the trainer, or the math importing the model, is refused
    assert "train" not in ALLOWED[room("mmgrpo.model.policy")]
    assert "model" not in ALLOWED[room("mmgrpo.grpo.losses")]
    assert "cli" not in ALLOWED[room("mmgrpo.train.trainer")]


def test_no_module_over_600_lines():
    long = {m: n for m, p in module_files().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_module_imports_in_a_fresh_interpreter():
    modules = sorted(m for m in module_files() if m != "mmgrpo.__main__")
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok', len(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


PUBLIC = [
    # plugin authors: environments, episodes, tools
    "ChatEnv",
    "SingleTurnEnv",
    "ToolEnv",
    "GymChatEnv",
    "Task",
    "Shown",
    "check_env",
    "system",
    "user",
    "assistant",
    "text_part",
    "image_part",
    "Tool",
    "ToolRunner",
    "ToolResult",
    "make_tool",
    # verifiers and the registry
    "Episode",
    "Verifier",
    "Rewards",
    "from_trl",
    "check_verifier",
    "extract_tag",
    "register_env",
    "make_env",
    "list_envs",
    "register_verifier",
    "make_verifier",
    "list_verifiers",
    # config, training, evaluation, models
    "Config",
    "load_config",
    "save_config",
    "Trainer",
    "evaluate",
    "Policy",
    "rollout",
    "Trajectory",
    "build_tiny_model",
    "group_advantages",
    "grpo_loss",
    # errors
    "MmgrpoError",
    "ConfigError",
    "RegistryError",
    "DataError",
    "EnvError",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_the_public_api_is_exported_from_mmgrpo(name):
    import mmgrpo

    assert name in mmgrpo.__all__
    assert getattr(mmgrpo, name) is not None


def test_importing_mmgrpo_loads_nothing_heavy():
    code = "import sys, mmgrpo; print(sorted(m for m in ('torch', 'transformers', 'mmgrpo.train.trainer') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


@pytest.mark.parametrize(
    "path, names",
    [
        ("mmgrpo.env", ["ChatEnv", "SingleTurnEnv", "Task", "check_env", "system", "user", "Shown"]),
        ("mmgrpo.verifier", ["Episode", "Verifier", "Rewards", "from_trl", "check_verifier", "extract_tag"]),
        ("mmgrpo.registry", ["register_env", "make_env", "register_verifier", "make_verifier", "describe"]),
        ("mmgrpo.tools", ["Tool", "ToolRunner", "ToolResult", "as_tool", "parse_tool_calls", "tool_message"]),
        ("mmgrpo.toolbox", ["make_tool", "make_tools"]),
        ("mmgrpo.envs.tool_env", ["ToolEnv"]),
        ("mmgrpo.config", ["Config", "load_config", "GRPOConfig", "config_reference"]),
        ("mmgrpo.data", ["read_records", "check_records", "open_image"]),
        ("mmgrpo.rollout", ["rollout", "Trajectory"]),
        ("mmgrpo.tiny", ["build_tiny_model", "TinyModelSpec"]),
        ("mmgrpo.cli", ["main"]),
    ],
)
def test_the_import_paths_plugins_use_keep_working(path, names):
    import importlib

    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == []
