"""The answers a model gave, per true answer, for tasks with a few short answers (counts, choices): the
table ``mmgrpo eval`` prints and saves, the demos draw, and each GRPO step sums up as ``answer_coverage``.

Plain Python on the episodes' task answers and completions (no torch here; ``mmgrpo.train.plots``, which
draws the table, imports it only when it draws, since the ``mmgrpo.rollout`` package itself loads torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mmgrpo.tools.visible import visible
from mmgrpo.verifier import extract_tag

ANSWERS_MAX = 12
"""``answer_table`` is kept for tasks with at most this many distinct true answers."""

NO_ANSWER = "(none)"
"""The column of episodes with no ``<answer>...</answer>`` in their completion."""


def answer_table(trajectories: Iterable[Any], tag: str = "answer") -> dict[str, dict[str, int]]:
    """True answer -> {what the model put in ``<tag>...</tag>``: episodes}, for tasks whose ``answer`` is
    one short value with at most ``ANSWERS_MAX`` distinct values over the episodes (counts, choices);
    ``{}`` otherwise. It tells a policy that collapsed onto a few answers (each row spread over the same
    two or three columns) from one that is off by one here and there (mass on and beside the diagonal)."""
    rows: dict[str, dict[str, int]] = {}
    for t in trajectories:
        true = t.task.get("answer")
        if isinstance(true, bool) or not isinstance(true, (int, float, str)) or len(str(true)) > 16:
            return {}
        given = extract_tag(t.completion, tag)
        given = NO_ANSWER if given is None else given[:16]
        row = rows.setdefault(str(true), {})
        row[given] = row.get(given, 0) + 1
        if len(rows) > ANSWERS_MAX:
            return {}
    return {
        k: dict(sorted(v.items(), key=lambda kv: -kv[1]))
        for k, v in sorted(rows.items(), key=lambda kv: answer_order(kv[0]))
    }


def answer_coverage(table: dict[str, dict[str, int]]) -> float | None:
    """The share of the true answers in ``table`` (``answer_table``) that the model gave at least once, to
    any task: 1.0 while every answer is still sampled somewhere; 0.6 when a policy answering only 1, 3 and 5
    meets tasks whose answers are 1 to 5 (no group can then reward a 2 or a 4). None for an empty table."""
    if not table:
        return None
    given = {g for row in table.values() for g in row}
    return sum(any(same_answer(true, g) for g in given) for true in table) / len(table)


def same_answer(true: str, given: str) -> bool:
    """Whether an answer given is the true one: as numbers when both are, else as stripped text."""
    if is_number(true) and is_number(given):
        return float(true) == float(given)
    return true.strip() == given.strip()


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def answer_order(text: str) -> tuple[int, float, str]:
    """A sort key for answers: numbers in numeric order first, then text."""
    return (0, float(text), "") if is_number(text) else (1, 0.0, text)


def answer_table_lines(table: dict[str, dict[str, int]], top: int = 4) -> list[str]:
    """One line per true answer: ``true 2 (n=46): "1" 26, "3" 20`` (its ``top`` most given answers)."""
    lines = []
    for true, given in table.items():
        shown = ", ".join(
            (g if g == NO_ANSWER else f'"{visible(g)}"') + f" {n}" for g, n in list(given.items())[:top]
        )
        rest = sum(list(given.values())[top:])
        more = f", {rest} other" if rest else ""
        lines.append(f"true {visible(true)} (n={sum(given.values())}): {shown}{more}")
    return lines
