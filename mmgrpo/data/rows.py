"""A dataset row's answer as a task holds it, and the row's split (user guide: ``docs/data.md``).

- ``answer_value(value)``: a row's answer as the task info holds it (text; numbers as text; a list of them).
- ``row_unit(fields)`` and ``split_rows(records, eval_fraction)``: the held-out split by a hash of each row's
  content, deterministic and independent of the seed and of the row order.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from mmgrpo.data.records import Record

__all__ = ["answer_value", "row_unit", "split_rows"]


def answer_value(value: Any) -> str | list[str]:
    """A row's answer as the info holds it: text as is, a number as text (``3.0`` as ``"3"``), a list as a
    list of those. Raises ValueError naming what is wrong (null, bool, empty, nested, not finite)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("answer is an empty list; give at least one accepted answer")
        out = []
        for item in value:
            if isinstance(item, (list, tuple, dict)):
                raise ValueError(
                    f"answer list holds a {type(item).__name__}; list items must be text or numbers"
                )
            out.append(answer_value(item))
        return out
    if isinstance(value, bool):
        raise ValueError(
            f'answer is the boolean {value}; write it as the text the model should give, e.g. "yes"'
        )
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("answer is an empty string")
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer is {value}, not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    raise ValueError(
        f"answer is {type(value).__name__}; expected text, a number or a list of accepted answers"
    )


def row_unit(fields: dict[str, Any]) -> float:
    """A number in [0, 1) that is a hash of the row's content (bytes hashed as their sha256): the split key."""

    def digestible(obj: Any) -> str:
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return "sha256:" + hashlib.sha256(bytes(obj)).hexdigest()
        return str(obj)

    blob = json.dumps(fields, sort_keys=True, ensure_ascii=False, default=digestible).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") / 2**64


def split_rows(records: Sequence[Record], eval_fraction: float) -> tuple[list[Record], list[Record]]:
    """(train, eval): a row is eval when ``row_unit(row) < eval_fraction``. With ``eval_fraction > 0`` and at
    least two rows the eval split is never empty (the row of smallest hash goes there if none fell below)."""
    units = [row_unit(r.fields) for r in records]
    eval_ids = {i for i, u in enumerate(units) if u < eval_fraction}
    if eval_fraction > 0 and not eval_ids and len(records) >= 2:
        eval_ids = {min(range(len(records)), key=units.__getitem__)}
    train = [r for i, r in enumerate(records) if i not in eval_ids]
    return train, [r for i, r in enumerate(records) if i in eval_ids]
