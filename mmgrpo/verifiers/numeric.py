"""Numeric answers written the many ways people write numbers: ``3/4``, ``1 1/2``, ``1,000``, ``50%``, ``$5``.

:func:`parse_numeric` reads one number from a short answer; :func:`number_equiv` is the verifier built on it.
It is the forgiving sibling of ``number_match`` (which wants a plain number such as ``3`` or ``1,000``):

- fractions ``3/4``, mixed numbers ``1 1/2`` / ``-1 1/2``, vulgar fractions ``½``, LaTeX ``\\frac{3}{4}``,
  ``\\dfrac``, ``\\tfrac``, ``\\frac34``, ``1\\frac{1}{2}``;
- thousands separators: commas ``1,000`` and spaces ``1 000`` (also LaTeX ``1\\,000`` and ``1{,}000``);
- scientific notation ``1.5e-3``, ``1.5 \\times 10^{-3}``, ``1.5 x 10^-3``, ``1.5*10^-3``;
- percentages ``50%``, ``50\\%``, ``50 percent``: 50, or 0.5 with ``percent_as_fraction=True``;
- currency and units around the number are dropped when nothing else in the answer is a number:
  ``$5``, ``-$5``, ``USD 5``, ``5 dollars``, ``12 cm``, ``3.5kg``, ``9.8 m/s^2``, ``90°``, ``x = 5``;
- ``$...$``, ``\\(...\\)``, ``\\boxed{...}``, ``\\text{...}`` wrappers are unwrapped.

Anything with a second number outside those forms (``5 or 6``, ``12 cm 5 mm``, ``1 2``) is ambiguous and reads
as no number. European decimal commas are not supported: ``1,5`` is not a number and ``1,500`` is 1500.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode
from mmgrpo.verifiers.answers import _answer_text, _targets, parse_number

__all__ = ["number_equiv", "parse_numeric"]

# -- normalisation -----------------------------------------------------------------------------------------
_SPACES = re.compile(r"[\s\u00a0\u2007\u2009\u202f]+")
_TEXT_COMMAND = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}; and the brace-less \frac34 (single digits)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_LATEX_SPACING = re.compile(r"\\[,;:! ]|~|\\left|\\right|\\displaystyle")
# a squared / cubed unit: "m^2", "cm^{3}", "m²" -- removed so that the 2 does not count as a second number
_UNIT_POWER = re.compile(r"(?<=[^\W\d_])(?:\^\s*\{?\s*[23]\s*\}?|[²³])")

_LATEX_REPLACEMENTS = (
    ("\\%", "%"),
    ("\\$", "$"),
    ("{,}", ","),
    ("^{\\circ}", "°"),
    ("^\\circ", "°"),
    ("\\circ", "°"),
    ("\\times", "×"),
    ("\\cdot", "×"),
    ("\\approx", "≈"),
    ("\u2212", "-"),  # unicode minus
    ("\u2044", "/"),  # fraction slash
)


def _unwrap_command(text: str, command: str) -> str:
    """``text`` with every ``\\command{...}`` replaced by its (brace-matched) content."""
    out = []
    i = 0
    while True:
        start = text.find(command, i)
        if start < 0:
            out.append(text[i:])
            return "".join(out)
        j = start + len(command)
        while j < len(text) and text[j] == " ":
            j += 1
        if j >= len(text) or text[j] != "{":
            out.append(text[i:j])
            i = j
            continue
        depth = 0
        for k in range(j, len(text)):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[i:start])
                    out.append(text[j + 1 : k])
                    i = k + 1
                    break
        else:  # unbalanced: leave the rest as it is
            out.append(text[i:])
            return "".join(out)


def _strip_math_delimiters(text: str) -> str:
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            return text[len(left) : len(text) - len(right)].strip()
    # "$x$" is LaTeX math, "$5" is currency: only a pair of unescaped dollars around everything is math
    if len(text) > 2 and text[0] == "$" and text[-1] == "$" and text[-2] != "\\" and text.count("$") == 2:
        return text[1:-1].strip()
    return text


def _normalise(text: str) -> str:
    text = _SPACES.sub(" ", text).strip()
    text = _unwrap_command(text, "\\boxed").strip()
    text = _strip_math_delimiters(text)
    text = _TEXT_COMMAND.sub(r" \1 ", text)
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    text = _LATEX_SPACING.sub(lambda m: " " if m.group() in ("\\,", "\\;", "\\:", "\\ ", "~") else "", text)
    text = _LATEX_FRAC.sub(lambda m: f" {m.group(1).strip()}/{m.group(2).strip()}", text)
    text = _LATEX_FRAC_SHORT.sub(r" \1/\2", text)
    text = "".join(_vulgar(ch) for ch in text)
    text = _UNIT_POWER.sub("", text)
    return _SPACES.sub(" ", text).strip()


def _vulgar(ch: str) -> str:
    """'½' -> ' 1/2' (so that '1½' reads as the mixed number '1 1/2'); other characters unchanged."""
    if ch.isascii() or not unicodedata.decomposition(ch).startswith("<fraction>"):
        return ch
    return " " + unicodedata.normalize("NFKC", ch).replace("\u2044", "/")


# -- the grammar -------------------------------------------------------------------------------------------
# plain number: thousands grouped with commas or single spaces, optional decimals and exponent
_INT = r"\d{1,3}(?:(?:,\d{3})+|(?:[ ]\d{3})+)(?!\d)|\d+"  # spaces as [ ]: the pattern is VERBOSE
_NUM = rf"(?:(?:{_INT})(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_CURRENCY = r"[$€£¥₹]|(?:USD|EUR|GBP|JPY|CNY|RMB|INR|CAD|AUD|Rs\.?)(?=[ ]?[\d.+-])"
# a unit: letters, spaces, "." "/" "'" "-" and currency symbols ("cm", "km/h", "sq. ft", "dollars", "€");
# nothing that could be maths (digits, brackets, operators, backslashes)
_UNIT = r"(?:[^\W\d_]|[°'$€£¥₹])(?:[^\W\d_]|[ ./'°$€£¥₹-])*"
# a trailing "unit" that is really a variable or constant: "2π", "3i", "5x" are not 2, 3, 5
_NOT_UNITS = frozenset({"π", "pi", "i", "e", "x", "y", "z"})

_FULL = re.compile(
    rf"""
    (?:(?:[A-Za-z]\w*\ ?)?(?:=|≈)\ ?)?                  # "x = 5", "= 5", "≈ 5"
    (?P<sign1>[+-])?\ ?
    (?:{_CURRENCY})?\ ?
    (?P<sign2>[+-])?\ ?
    (?:
        (?P<whole>\d+)\ (?P<mnum>[1-9]\d*)\ ?/\ ?(?P<mden>\d+)               # mixed number 1 1/2
      | (?P<fnum>{_NUM})\ ?/\ ?(?P<fden>{_NUM})                          # fraction 3/4, 1.5/3
      | (?P<num>{_NUM})(?:\ ?(?:×|x|\*)\ ?10\ ?\^\ ?[{{]?\ ?(?P<exp>[+-]?\d+)\ ?[}}]?)?   # 1.5 × 10^{-3}
    )
    \ ?(?P<pct>%|percent\b|per\ cent\b)?
    (?:\ ?(?P<unit>{_UNIT}))?
    """,
    re.VERBOSE,
)
_MAX_UNIT_WORDS = 4


def _plain(text: str) -> float | None:
    """A plain number, space-grouped thousands allowed, via ``parse_number``."""
    return parse_number(text.replace(" ", ""))


def parse_numeric(text: Any, percent_as_fraction: bool = False) -> float | None:
    """The one number a short answer states, or None (nothing numeric, or more than one number).

    See the module docstring for what is accepted. ``percent_as_fraction``: ``50%`` is 0.5 instead of 50.
    An int or float (not bool) passes through when finite.

    >>> parse_numeric("1 1/2"), parse_numeric("$1,000"), parse_numeric("\\\\frac{3}{4}")
    (1.5, 1000.0, 0.75)
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text) if math.isfinite(text) else None
    if not isinstance(text, str):
        return None
    s = _normalise(text)
    m = _FULL.fullmatch(s)
    if m is None:
        return None
    if m["sign1"] and m["sign2"]:
        return None
    unit = (m["unit"] or "").strip()
    if unit and (len(unit.split()) > _MAX_UNIT_WORDS or unit.split()[0].rstrip(".") in _NOT_UNITS):
        return None
    if m["whole"] is not None:
        whole, num, den = int(m["whole"]), int(m["mnum"]), int(m["mden"])
        if num >= den:  # "1 3/2" is no mixed number; "1 000/3" went to the fraction branch
            return None
        value = whole + num / den
    elif m["fnum"] is not None:
        num, den = _plain(m["fnum"]), _plain(m["fden"])
        if num is None or den is None or den == 0:
            return None
        value = num / den
    else:
        value = _plain(m["num"])
        if value is None:
            return None
        if m["exp"] is not None:
            try:
                value = value * 10.0 ** int(m["exp"])
            except OverflowError:
                return None
    if m["pct"] and percent_as_fraction:
        value /= 100.0
    if "-" in (m["sign1"] or "", m["sign2"] or ""):
        value = -value
    return value if math.isfinite(value) else None


# -- the verifier ------------------------------------------------------------------------------------------
def _tolerance(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value >= 0
        or not math.isfinite(value)
    ):
        raise ConfigError(f"number_equiv: {name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def number_equiv(
    tag: str | None = "answer",
    field: str = "answer",
    rel_tol: float = 1e-9,
    abs_tol: float = 0.0,
    percent_as_fraction: bool = False,
) -> Callable[[Episode], float]:
    """1.0 when the number inside ``<tag>`` equals ``task[field]`` within tolerance, read generously, else 0.0.

    Both sides are read with :func:`parse_numeric`: fractions, mixed numbers, ``1,000`` / ``1 000``,
    scientific notation, LaTeX ``\\frac``, percentages, and currency/units stripped (``$5``, ``12 cm``).
    Equal means ``math.isclose(predicted, target, rel_tol=rel_tol, abs_tol=abs_tol)``; the default only
    absorbs float rounding, so ``0.33`` is not ``1/3`` unless ``rel_tol`` or ``abs_tol`` allows it.
    ``percent_as_fraction=True`` reads ``50%`` as 0.5 (on both sides); by default it is 50.
    Tag absent or no single number in it: 0.0. ``tag=None`` reads the whole completion. The task field may
    hold one value or a list of accepted values; one that is not a number raises VerifierError.
    """
    rel = _tolerance("rel_tol", rel_tol)
    absolute = _tolerance("abs_tol", abs_tol)
    if not isinstance(percent_as_fraction, bool):
        raise ConfigError(
            f"number_equiv: percent_as_fraction must be true or false, got {percent_as_fraction!r}."
        )

    def number_equiv_score(episode: Episode) -> float:
        targets = []
        for raw in _targets(episode, field):
            target = parse_numeric(raw, percent_as_fraction)
            if target is None:
                raise VerifierError(
                    f"Task field '{field}' = {raw!r} is not a number; number_equiv needs a numeric answer."
                )
            targets.append(target)
        text = _answer_text(episode, tag)
        predicted = parse_numeric(text, percent_as_fraction) if text is not None else None
        if predicted is None:
            return 0.0
        return 1.0 if any(math.isclose(predicted, t, rel_tol=rel, abs_tol=absolute) for t in targets) else 0.0

    return number_equiv_score
