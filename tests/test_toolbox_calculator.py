"""The calculator tool, make_tool and the schemas of every built-in tool."""

from __future__ import annotations

import time

import pytest
from PIL import Image
from transformers.utils import get_json_schema

from mmgrpo.errors import ConfigError
from mmgrpo.toolbox import BUILTIN_TOOLS, calculator, image_tools, make_tool


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("47 * 38", "1786"),
        ("7 / 2", "3.5"),
        ("10 / 2", "5"),  # an integral float prints as an integer
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("-3 ** 2", "-9"),  # Python precedence: -(3**2)
        ("+5 - -5", "10"),
        ("0.1 + 0.2", "0.3"),  # 10 significant digits hide the binary rounding
        ("1 / 3", "0.3333333333"),
        ("2 / 3", "0.6666666667"),
        ("1.5e3 * 2", "3000"),
        ("1e20 * 1.5", "1.5e+20"),
        ("4 ** 0.5", "2"),
        ("-0.0", "0"),
        ("  12  ", "12"),
        ("10 ** 100", str(10**100)),  # exactly at the magnitude limit
    ],
)
def test_calculator_results(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "function call"),
        ("().__class__", "attribute|not allowed"),
        ("x + 1", "the name 'x'"),
        ("abs(-3)", "function call"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 if 2 else 3", "not allowed"),
        ("[1, 2]", "list of values"),
        ("1,000 + 1", "list of values"),
        ("2 ^ 3", r"use \*\*"),
        ("1 < 2", "comparison"),
        ("lambda: 1", "not allowed"),
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("5 % 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e999", "too large"),
        ("1.5 ** 10000", "too large"),
        ("10 ** 101", "too large"),
        ("10 ** 60 * 10 ** 60", "too large"),
        ("1 +", "cannot parse"),
        ("", "empty"),
        ("1 + " * 60 + "1", "too long"),
        ("(" * 150 + "1" + ")" * 150, "too long|cannot parse"),
    ],
)
def test_calculator_refusals(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


@pytest.mark.parametrize(
    "expression", ["9**9**9", "10**10**10", "2**(2**64)", "(-7)**99999999999", "99**99**99"]
)
def test_huge_powers_are_refused_before_computing(expression):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        calculator(expression)
    assert time.perf_counter() - start < 0.1


def test_tiny_and_unit_powers_are_fine():
    assert calculator("1 ** 99999999999") == "1"
    assert calculator("(-1) ** 99999999999") == "-1"
    assert calculator("0.5 ** 10000") == "0"


def test_calculator_rejects_non_strings():
    with pytest.raises(ValueError, match="string"):
        calculator(12)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- make_tool
def test_make_tool_builds_every_builtin():
    assert set(BUILTIN_TOOLS) == {"calculator", "python", "http_get", "http_post"}
    assert make_tool("calculator") is calculator
    assert make_tool("python", cpu_seconds=1, memory_mb=128).__name__ == "python"
    http_get = make_tool("http_get", base_urls=["http://127.0.0.1:1/api"], timeout_s=1.0)
    assert http_get.__name__ == "http_get" and http_get.timeout_s == 3.0


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        ("calculater", {}, "unknown tool 'calculater'. Did you mean 'calculator'"),
        ("sql", {}, "Built-in tools: calculator, python, http_get"),
        ("python", {"cpu_second": 1}, "Did you mean 'cpu_seconds'"),
        ("python", {"memory_mb": -5}, "memory_mb must be a positive number"),
        ("http_get", {}, "needs the setting 'base_urls'"),
        ("http_get", {"base_url": ["http://x"]}, "Did you mean 'base_urls'"),
        ("http_get", {"base_urls": ["ftp://127.0.0.1/"]}, "http:// or https://"),
        ("http_get", {"base_urls": []}, "empty"),
        ("calculator", {"digits": 3}, "takes no settings"),
        ("zoom", {}, "image_tools"),
    ],
)
def test_make_tool_errors_teach(name, settings, message):
    with pytest.raises(ConfigError, match=message):
        make_tool(name, **settings)


def test_schema_of_every_builtin_tool():
    """get_json_schema (what mmgrpo.tools.runner.Tool uses) works on every built-in tool, with every argument typed
    and described."""
    tools = [
        make_tool("calculator"),
        make_tool("python"),
        make_tool("http_get", base_urls=["http://127.0.0.1:8000/api"]),
        make_tool("http_post", base_urls=["http://127.0.0.1:8000/api"], name="post_json"),
        *image_tools(Image.new("RGB", (64, 48))),
    ]
    expected = {
        "calculator": {"expression": "string"},
        "python": {"code": "string"},
        "http_get": {"url": "string"},
        "post_json": {"url": "string", "data": "object"},
        "crop": {"x0": "integer", "y0": "integer", "x1": "integer", "y1": "integer"},
        "zoom": {"cell": "integer"},
    }
    for tool in tools:
        function = get_json_schema(tool)["function"]
        assert function["name"] in expected
        params = function["parameters"]
        types = {key: spec["type"] for key, spec in params["properties"].items()}
        assert types == expected[function["name"]]
        assert params["required"] == list(types)
        assert function["description"]
        assert all(spec["description"] for spec in params["properties"].values())
    crop_doc = get_json_schema(tools[4])["function"]["description"]
    assert "64 pixels wide and 48 high" in crop_doc
    assert "127.0.0.1:8000/api" in get_json_schema(tools[2])["function"]["description"]


def test_importing_the_toolbox_is_cheap():
    import subprocess
    import sys

    code = (
        "import sys, mmgrpo.toolbox; "
        "print(sorted(m for m in ('httpx', 'PIL', 'mmgrpo.toolbox.sandbox', 'mmgrpo.toolbox.http') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
