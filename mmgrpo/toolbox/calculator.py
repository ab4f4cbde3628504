"""The ``calculator`` tool: arithmetic on numbers, parsed with ``ast`` and evaluated by a small tree walker.

Nothing is ever passed to ``eval``: the expression is parsed into a syntax tree, and only number literals,
``+ - * / // % **``, unary ``+``/``-`` and parentheses are accepted. Every intermediate result is checked,
so ``9**9**9`` or ``10**10**10`` is refused *before* it is computed (a huge power would hang the thread and
eat the memory), and the input length is capped, so that no string a model writes costs more than a few
microseconds.

Bad input raises ``ValueError`` with a message written for the model (the tool runner turns it into a
``tool_error`` observation): what was wrong and what is allowed.
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["MAX_ABS", "MAX_CHARS", "calculator", "format_number", "value_of"]

MAX_CHARS = 200
"""Longest expression accepted."""
MAX_ABS = 10**100
"""Largest magnitude of any intermediate or final result."""
SIGNIFICANT_DIGITS = 10
"""Floats are printed with at most this many significant digits."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>"}

Number = int | float


# The docstring is the tool's description in every prompt (get_json_schema): short costs few tokens.
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: e.g. "12 * (3 + 4)"
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string like '12 * (3 + 4)', got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("empty expression; write something like '12 * (3 + 4)'")
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression too long ({len(text)} characters, at most {MAX_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(
            f"cannot parse {text!r}: use numbers, + - * / // % ** and parentheses, e.g. '12 * (3 + 4)'"
        ) from None
    except (ValueError, RecursionError, MemoryError):  # null bytes, absurd nesting
        raise ValueError(f"cannot parse {text!r}") from None
    return format_number(_evaluate(tree.body))


def value_of(expression: object) -> float | None:
    """The calculator's value of ``expression`` as a float, or None where it refuses it (for env metrics)."""
    try:
        return float(calculator(str(expression)))
    except ValueError:
        return None


def format_number(value: Number) -> str:
    """``1786`` for ints; floats with up to ``SIGNIFICANT_DIGITS`` significant digits, no trailing zeros
    (``2.5``, ``0.3333333333``, ``5`` for 5.0, ``1.5e+20`` for large magnitudes)."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"  # also for -0.0
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"only numbers are allowed, got {value!r}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
        hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
        raise ValueError(f"operator {_SYMBOL[type(node.op)]} is not supported{hint}")
    raise ValueError(f"{_describe(node)} is not allowed: use numbers, + - * / // % ** and parentheses")


def _power(base: Number, exponent: Number) -> Number:
    if base == 0 and exponent < 0:
        raise ValueError("division by zero (0 to a negative power)")
    if base < 0 and not float(exponent).is_integer():
        raise ValueError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and exponent > 0:
        # the size of the result, known before computing it: log10|base ** exponent|
        if exponent * math.log10(abs(base)) > math.log10(MAX_ABS):
            raise ValueError(f"result too large (more than 1e{round(math.log10(MAX_ABS))})")
    try:
        return _checked(base**exponent)
    except OverflowError:  # float ** float overflows; a negative int ** huge int cannot get here
        raise ValueError("result too large") from None


def _checked(value: Number) -> Number:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result too large (or not a number)")
    if abs(value) > MAX_ABS:
        raise ValueError(f"result too large (more than 1e{round(math.log10(MAX_ABS))})")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "an attribute"
    if isinstance(node, ast.Compare):
        return "a comparison"
    if isinstance(node, (ast.Tuple, ast.List)):
        return "a list of values (write numbers without thousands separators, e.g. 1000 not 1,000)"
    return f"this syntax ({type(node).__name__})"
