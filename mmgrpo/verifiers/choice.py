"""Multiple-choice answers: does the model pick the right option, named by its letter or by its text?

The task's answer (field ``answer``) is the option's letter (``"B"``, ``"(B)"``), its 0-based index (``1``,
or ``"1"``; see ``index_base``) or, when the task lists its options (field ``choices``), the option's text.
The model may answer with the letter in any usual form -- ``B``, ``(B)``, ``B.``, ``B) cats``,
``the answer is B``, ``Option B`` -- or with the option's text (case and spacing ignored). An answer naming
two different options (``A or B``, ``B, not C``) is ambiguous and scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode
from mmgrpo.verifiers.answers import _answer_text, _targets

__all__ = ["multiple_choice", "choice_index"]

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# the whole answer is a label: "B", "(b)", "[B]", "B.", "B)", "B:"
_LABEL_ONLY = re.compile(r"[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?")
# the answer starts with a label, then the option's text: "B) cats", "(B) cats", "B. cats", "B: cats"
_LABEL_THEN_TEXT = re.compile(r"(?:[(\[]([A-Za-z])[)\]]|([A-Za-z])[.):])\s*(\S.*)", re.DOTALL)
# a label written as one: "(B)", "[b]", or "B)" not inside a word
_BRACKETED = re.compile(r"[(\[]\s*([A-Za-z])\s*[)\]]|(?<![\w'’])([A-Za-z])\)")
# "answer is b", "answer: (b)", "option b", "choice: B" -- a lowercase letter only before punctuation or end
_CUED = re.compile(
    r"\b(?:answer|option|choice)\s*(?:is\s*)?(?:[:=-]\s*)?[(\[]?\s*([A-Za-z])(?![\w'’])(?=\s*[)\].,;:!?]|\s*$)",
    re.IGNORECASE,
)
# a free-standing capital letter: "B is right", "I pick C."
_CAPITAL = re.compile(r"(?<![\w'’])([A-Z])(?![\w'’])")
# "A cat", "I think": an article or pronoun, not a label -- unless the next word is one of these
_ARTICLE_FOLLOWER = re.compile(r"\s+([a-z]+)")
_LABEL_VERBS = frozenset({"is", "or", "and", "was", "seems", "looks", "fits", "matches", "would", "should"})


def _norm(text: str) -> str:
    """Case- and space-insensitive form of an option's text; trailing ``.``/``!`` and quotes dropped."""
    text = " ".join(str(text).split()).casefold()
    return text.strip("\"'`").rstrip(".!").strip()


def _letter_index(letter: str) -> int:
    return _LETTERS.index(letter.upper())


def _choice_of_text(text: str, choices: list[str] | None) -> int | None:
    """Index of the option whose text is ``text`` (normalised), or None."""
    if not choices:
        return None
    norm = _norm(text)
    if not norm:
        return None
    matches = [i for i, c in enumerate(choices) if _norm(c) == norm]
    return matches[0] if len(matches) == 1 else None  # two options with the same text: no telling which


def _mentions(text: str, n: int) -> set[int]:
    """Indices of every option label mentioned in free text (see the module docstring)."""
    found: set[int] = set()
    for m in _BRACKETED.finditer(text):
        found.add(_letter_index(m.group(1) or m.group(2)))
    for m in _CUED.finditer(text):
        found.add(_letter_index(m.group(1)))
    for m in _CAPITAL.finditer(text):
        letter = m.group(1)
        if letter in "AI":
            follower = _ARTICLE_FOLLOWER.match(text, m.end())
            if follower and follower.group(1) not in _LABEL_VERBS:
                continue  # "A cat", "I think"
        if _letter_index(letter) < n:  # a capital beyond the options ("I" with four options) is a word
            found.add(_letter_index(letter))
    return found


def choice_index(text: str, choices: list[str] | None = None) -> int | None:
    """The 0-based option ``text`` picks, or None (no option named, or two different ones).

    ``choices`` (the options' texts) allow answering with an option's text and bound the letters to
    ``A..`` the number of options; without them any letter ``A``-``Z`` counts.

    >>> choice_index("(B)"), choice_index("the answer is c"), choice_index("dogs", ["cats", "dogs"])
    (1, 2, 1)
    >>> choice_index("A or B") is None
    True
    """
    if not isinstance(text, str):
        return None
    text = text.strip()
    n = len(choices) if choices else len(_LETTERS)
    by_text = _choice_of_text(text, choices)
    if by_text is not None:
        return by_text
    m = _LABEL_ONLY.fullmatch(text)
    if m:
        return _letter_index(m.group(1))
    m = _LABEL_THEN_TEXT.fullmatch(text)
    if m:
        index = _letter_index(m.group(1) or m.group(2))
        rest = m.group(3)
        named = _choice_of_text(rest, choices)
        if named is not None and named != index:
            return None  # "B) cats" where cats is option A: which one?
        others = {_letter_index(x.group(1) or x.group(2)) for x in _BRACKETED.finditer(rest)} - {index}
        return None if others else index  # "A) cats or B) dogs"
    found = _mentions(text, n)
    return found.pop() if len(found) == 1 else None


def _choices(episode: Episode, field: str | None) -> list[str] | None:
    if field is None or field not in episode.task:
        return None
    value = episode.task[field]
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise VerifierError(
            f"Task field '{field}' must be a non-empty list of the options' texts, got {value!r:.80}."
        )
    if len(value) > len(_LETTERS):
        raise VerifierError(
            f"Task field '{field}' has {len(value)} options; at most {len(_LETTERS)} are supported."
        )
    return [str(c) for c in value]


def _target(value: Any, choices: list[str] | None, field: str, index_base: int) -> int | str:
    """The right option's index, or (no options listed and the answer is not a label) its normalised text."""
    n = len(choices) if choices else len(_LETTERS)

    def from_index(i: int) -> int:
        index = i - index_base
        if not 0 <= index < n:
            raise VerifierError(
                f"Task field '{field}' = {value!r} is out of range for {n} options (index_base={index_base})."
            )
        return index

    if isinstance(value, int) and not isinstance(value, bool):
        return from_index(value)
    if not isinstance(value, str):
        raise VerifierError(
            f"Task field '{field}' = {value!r:.80} is neither an option letter, an index nor an option's text."
        )
    text = value.strip()
    m = _LABEL_ONLY.fullmatch(text)
    if m and _letter_index(m.group(1)) < n:
        return _letter_index(m.group(1))
    by_text = _choice_of_text(text, choices)
    if by_text is not None:
        return by_text
    if text.isdigit():
        return from_index(int(text))
    if choices:
        raise VerifierError(
            f"Task field '{field}' = {value!r:.80} is neither an option letter (A-{_LETTERS[n - 1]}), an index "
            f"nor one of the options {choices!r:.200}."
        )
    return _norm(text)


def multiple_choice(
    tag: str | None = "answer",
    field: str = "answer",
    choices_field: str | None = "choices",
    index_base: int = 0,
) -> Callable[[Episode], float]:
    """1.0 when the answer inside ``<tag>`` picks the task's option (by letter or by text), else 0.0.

    ``task[field]`` is the right option: its letter (``"B"``), its index (``1`` is B with the default
    ``index_base=0``; ``index_base=1`` makes ``1`` mean A) or its text. ``task[choices_field]``, when present,
    lists the options' texts (``["cats", "dogs", ...]``): the model may then answer with an option's text,
    and letters beyond the options do not count. Without options, an answer given as text is compared with
    a text answer (case and spacing ignored). The task field may hold a list of accepted answers.
    Answers naming two different options score 0.0; so do an absent tag and an answer naming none.
    ``tag=None`` reads the whole completion.
    """
    if isinstance(index_base, bool) or not isinstance(index_base, int) or index_base not in (0, 1):
        raise ConfigError(f"multiple_choice: index_base must be 0 or 1, got {index_base!r}.")
    if choices_field is not None and (not isinstance(choices_field, str) or not choices_field):
        raise ConfigError(
            f"multiple_choice: choices_field must be a task field name or null, got {choices_field!r}."
        )

    def choice_score(episode: Episode) -> float:
        choices = _choices(episode, choices_field)
        targets = [_target(t, choices, field, index_base) for t in _targets(episode, field)]
        text = _answer_text(episode, tag)
        if text is None:
            return 0.0
        picked = choice_index(text, choices)
        if picked is not None and picked in targets:
            return 1.0
        # without options a text answer is compared as text ("Vitamin C" names no letter here)
        return 1.0 if not choices and _norm(text) in targets else 0.0

    return choice_score
