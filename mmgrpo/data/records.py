"""Task rows from files and datasets, and the images they refer to (user guide: ``docs/data.md``).

This module owns reading records and checking them; the dataset envs (``vqa``, ``text_qa``) build tasks from
them. Nothing here knows about models.

- ``read_records(path, limit=None)``: the rows of a JSONL file, a JSON file holding a list, a parquet file, a
  folder written by ``datasets``' ``save_to_disk`` or a Hugging Face hub id (``"name"`` or ``"name:split"``;
  ``datasets`` is imported only then). Each :class:`Record` keeps its ``source`` for error messages:
  ``file:line`` for JSONL (lines count from 1, as in an editor) and ``file:row N`` for the others (rows count
  from 0, as ``ds[N]`` and ``df.iloc[N]``). A line that is not a JSON object becomes a record with a
  ``problem`` instead of raising, so that ``check_records`` can report it with the others.
- ``open_image(ref, base_dir)``: one image reference (a path, relative to ``base_dir`` or absolute, a
  ``file://`` path, an http(s) URL, a ``data:image/...;base64,`` URI, raw bytes, a ``{"bytes", "path"}`` dict
  as ``datasets`` stores images, or a PIL image) as a decoded RGB PIL image; DataError naming the problem.
- ``check_records(records, ...)``: validate every record and raise ONE DataError listing every bad row (its
  source and what is wrong: malformed line, missing field, missing or undecodable image, wrong type), so a
  dataset is fixed in one pass and before any model loads. URLs are checked for syntax only.
- ``load_video(ref, base_dir)``: a video file's frames through ``qwen_vl_utils.fetch_video`` (needs a
  video reader: torchcodec or decord). A video given as a list of frame images needs no reader: each frame
  is an image. ``is_video_ref`` tells a video file (by its suffix) from an image.
- ``model_image_size(size, factor, min_pixels, max_pixels)``: the size a Qwen-VL processor resizes an image to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgrpo.data.media import (  # noqa: F401  (the media names stay importable from here)
    NO_VIDEO_READER,
    describe_ref,
    is_video_ref,
    load_video,
    model_image_size,
    open_image,
    ref_image_size,
    to_rgb,
    video_path,
    video_reader,
)
from mmgrpo.errors import ConfigError, DataError, did_you_mean

__all__ = [
    "Record",
    "check_records",
    "describe_ref",
    "is_video_ref",
    "load_video",
    "model_image_size",
    "open_image",
    "read_records",
    "to_rgb",
    "video_reader",
]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
FILE_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet")


@dataclass
class Record:
    """One row: ``fields`` as read, ``source`` (``file:line`` or ``file:row N``) for messages, ``base_dir``
    (the folder relative image paths are resolved against; None = the working directory) and ``problem``
    (why the row could not be read, e.g. a malformed JSON line; ``fields`` is then empty)."""

    source: str
    fields: dict[str, Any]
    base_dir: Path | None = None
    problem: str | None = None


# --------------------------------------------------------------------------------------------- reading
def read_records(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Record]:
    """The rows of ``path`` (see the module docstring for the formats), at most ``limit`` of them.

    Raises DataError when the source cannot be read at all (no such file, not parquet, a JSON file that is
    not one list, an unknown hub dataset); a single bad JSONL line is a record with ``problem`` set instead.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConfigError(f"read_records(limit={limit!r}): expected an int >= 0 or None")
    name = os.fspath(path)
    p = Path(name).expanduser()
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            return _read_jsonl(p, name, limit)
        if suffix == ".json":
            return _read_json(p, name, limit)
        if suffix == ".parquet":
            return _read_parquet(p, name, limit)
        raise DataError(
            f"{name}: unsupported data format '{p.suffix or '(no suffix)'}'. Give a .jsonl file (one JSON "
            "object per line), a .json file (a list of objects), a .parquet file, a folder written by "
            "datasets' save_to_disk, or a Hugging Face hub id."
        )
    if p.is_dir():
        return _read_dataset_folder(p, name, None, limit)
    folder, colon, split = name.rpartition(":")
    if colon and folder and Path(folder).expanduser().is_dir():
        return _read_dataset_folder(Path(folder).expanduser(), name, split, limit)
    local = p.suffix.lower() in FILE_SUFFIXES or name.startswith((".", "/", "~"))
    if local or (len(p.parts) > 1 and p.parent.is_dir()):  # a hub id's owner is no local folder
        raise DataError(
            f"data file '{name}' does not exist (relative paths are relative to the working directory "
            f"{Path.cwd()})."
        )
    return _read_hub(name, limit)


def _read_jsonl(p: Path, name: str, limit: int | None) -> list[Record]:
    records: list[Record] = []
    base = p.parent
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                records.append(Record(f"{name}:{lineno}", {}, base, f"not UTF-8 text ({e.reason})"))
                continue
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            source = f"{name}:{lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                records.append(Record(source, {}, base, f"malformed JSON: {e.msg} (column {e.colno})"))
                continue
            if not isinstance(value, dict):
                records.append(
                    Record(source, {}, base, f"expected a JSON object {{...}}, got {_json_kind(value)}")
                )
                continue
            records.append(Record(source, value, base))
    return records


def _read_json(p: Path, name: str, limit: int | None) -> list[Record]:
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip()[:1] == "{":  # one object per line in a file named .json: read it as JSONL
            return _read_jsonl(p, name, limit)
        raise DataError(
            f"{name}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno}). A .json file must hold one list "
            "of objects; for one object per line name the file .jsonl."
        ) from None
    if not isinstance(value, list):
        lists = [k for k, v in value.items() if isinstance(v, list)] if isinstance(value, dict) else []
        hint = f" (its key '{lists[0]}' holds a list: save that list alone)" if lists else ""
        raise DataError(
            f"{name}: expected a JSON list of objects [{{...}}, ...], got {_json_kind(value)}{hint}"
        )
    records = []
    for i, item in enumerate(value[:limit] if limit is not None else value):
        source = f"{name}:row {i}"
        if isinstance(item, dict):
            records.append(Record(source, item, p.parent))
        else:
            records.append(
                Record(source, {}, p.parent, f"expected a JSON object {{...}}, got {_json_kind(item)}")
            )
    return records


def _read_parquet(p: Path, name: str, limit: int | None) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{name}: reading parquet needs the optional package `pyarrow`: pip install pyarrow"
        ) from None

    try:
        parquet = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not parquet
        raise DataError(f"{name}: cannot be read as parquet ({type(e).__name__}: {e})") from None
    records: list[Record] = []
    for batch in parquet.iter_batches(batch_size=1024):
        for fields in batch.to_pylist():
            if limit is not None and len(records) >= limit:
                return records
            records.append(Record(f"{name}:row {len(records)}", fields, p.parent))
    return records


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset (a save_to_disk folder or a hub id) needs the optional "
            "package `datasets`: pip install datasets. JSONL, JSON and parquet files need nothing extra."
        ) from None
    return datasets


def _read_dataset_folder(folder: Path, name: str, split: str | None, limit: int | None) -> list[Record]:
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as e:
        raise DataError(
            f"{name}: the folder is not a dataset written by datasets' save_to_disk ({e}). Give a .jsonl, "
            ".json or .parquet file, or such a folder."
        ) from None
    return _dataset_records(_pick_split(loaded, split, name), name, folder, limit)


def _read_hub(name: str, limit: int | None) -> list[Record]:
    datasets = _datasets()
    hub_id, colon, split = name.partition(":")
    try:
        loaded = datasets.load_dataset(hub_id, split=split or None)
    except Exception as e:  # network, authentication, unknown id: all mean "cannot read this source"
        raise DataError(
            f"'{name}' is not a file or folder here (working directory {Path.cwd()}), and loading it as a "
            f"Hugging Face hub dataset failed: {type(e).__name__}: {str(e)[:500]}"
        ) from None
    return _dataset_records(_pick_split(loaded, None, name), name, None, limit)


def _pick_split(loaded: Any, split: str | None, name: str) -> Any:
    """The Dataset of ``loaded`` (a Dataset or a DatasetDict): ``split``, else 'train', else the only one."""
    if not hasattr(loaded, "keys"):  # a Dataset
        if split:
            raise DataError(f"{name}: the dataset has no splits, drop ':{split}'")
        return loaded
    splits = list(loaded.keys())
    if split:
        if split not in splits:
            raise DataError(f"{name}: no split '{split}'; splits are {splits}.{did_you_mean(split, splits)}")
        return loaded[split]
    if "train" in splits:
        return loaded["train"]
    if len(splits) == 1:
        return loaded[splits[0]]
    raise DataError(f"{name}: the dataset has splits {splits}; name one as '{name}:<split>'")


def _dataset_records(ds: Any, name: str, base: Path | None, limit: int | None) -> list[Record]:
    """Rows of a ``datasets.Dataset`` as stored (Arrow), so images stay ``{"bytes", "path"}`` dicts: nothing
    is decoded here, and a corrupt image is reported by ``check_records`` instead of raising mid-read."""
    n = len(ds) if limit is None else min(limit, len(ds))
    arrow = ds.with_format("arrow")
    records: list[Record] = []
    for start in range(0, n, 1024):
        for fields in arrow[start : min(start + 1024, n)].to_pylist():
            records.append(Record(f"{name}:row {len(records)}", fields, base))
    return records


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


# --------------------------------------------------------------------------------------------- images
def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _missing(record: Record, field: str) -> str:
    present = [k for k, v in record.fields.items() if v is not None]
    hint = did_you_mean(field, present)
    return f"missing field '{field}'{' (it is null)' if field in record.fields else ''}.{hint} Row fields: {present}"


def check_records(
    records: Sequence[Record],
    required: Iterable[str] = (),
    image_fields: Iterable[str] = (),
    base_dir: Path | str | None = None,
    max_listed: int = 20,
    *,
    decode: bool = True,
    validate: Callable[[Record], list[str]] | None = None,
    check_size: Callable[[tuple[int, int]], str | None] | None = None,
) -> None:
    """Check every record; raise ONE DataError listing every bad row (up to ``max_listed``, then a count).

    Each bad row is listed as ``source: problem; problem``. Checked: rows that could not be read (a
    malformed JSON line); ``required`` fields (absent or null); each image of ``image_fields`` (the field is
    required and holds one reference or a list of them): the reference's type, that a file exists and that it
    decodes (``decode=False`` reads only the header: faster, but a truncated file passes). A reference to a
    video file (``is_video_ref``) is checked to exist and that a video reader is installed, not decoded.
    URLs are checked for syntax only, never fetched. Relative paths are resolved against ``base_dir``, or each
    record's own ``base_dir`` when None.

    ``validate(record) -> [problem, ...]`` adds the caller's own checks (types, templates); it runs on rows
    that have every required field. ``check_size((width, height)) -> problem | None`` is called for every
    decoded image. Images are checked on a few threads (decoding releases the GIL).
    """
    required, image_fields = tuple(required), tuple(image_fields)
    problems: list[list[str]] = [[] for _ in records]
    jobs: list[tuple[int, Any, Path | str | None]] = []  # (record index, image reference, base dir)
    no_reader: bool | None = None  # looked up at the first video file
    for i, record in enumerate(records):
        if record.problem is not None:
            problems[i].append(record.problem)
            continue
        for field in dict.fromkeys((*required, *image_fields)):
            if record.fields.get(field) is None:
                problems[i].append(_missing(record, field))
        base = base_dir if base_dir is not None else record.base_dir
        for field in image_fields:
            value = record.fields.get(field)
            if value is None:
                continue
            refs = _as_list(value)
            if not refs:
                problems[i].append(f"'{field}' is an empty list")
            for ref in refs:
                if not is_video_ref(ref):
                    jobs.append((i, ref, base))
                    continue
                try:
                    video_path(ref, base)
                except DataError as e:
                    problems[i].append(str(e))
                    continue
                if no_reader is None:
                    no_reader = video_reader() is None
                if no_reader:
                    problems[i].append(f"video {describe_ref(ref)}: {NO_VIDEO_READER}")
        if validate is not None and not problems[i]:
            problems[i].extend(validate(record))

    def check_one(job: tuple[int, Any, Path | str | None]) -> str | None:
        _, ref, base = job
        try:
            size = ref_image_size(ref, base, decode)
        except DataError as e:
            return str(e)
        if size is not None and check_size is not None:
            return check_size(size)
        return None

    workers = max(1, min(8, os.cpu_count() or 1, len(jobs)))
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(check_one, jobs))
    else:
        results = [check_one(job) for job in jobs]
    for (i, _, _), problem in zip(jobs, results, strict=True):
        if problem is not None:
            problems[i].append(problem)

    bad = [(records[i].source, p) for i, p in enumerate(problems) if p]
    if not bad:
        return
    lines = [f"  {source}: {'; '.join(p)}" for source, p in bad[:max_listed]]
    if len(bad) > max_listed:
        lines.append(f"  ... and {len(bad) - max_listed} more")
    raise DataError(
        f"{len(bad)} of {len(records)} rows cannot be used:\n" + "\n".join(lines) + "\n"
        "Fix or remove these rows (every row is checked before any model is loaded)."
    )
