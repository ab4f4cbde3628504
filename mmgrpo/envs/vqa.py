"""Visual question answering over a dataset file (registered env name ``vqa``); user guide: ``docs/data.md``.

Each row holds an image (``image``: one reference, or ``images``: several; ``video``: a video file or a list
of frames), a ``question`` and an ``answer`` (text, a number, or a list of accepted answers), plus any other
fields (``choices``, ``boxes``, ...), which are passed through into the task info for verifiers. Rows are read
by ``mmgrpo.data.records.read_records`` (JSONL, JSON, parquet, a ``datasets`` folder or hub id) and every row is
checked in ``__init__`` (``mmgrpo.data.records.check_records``): a bad dataset fails with one DataError listing every
bad row before any model is loaded. A process reads and checks a dataset once per set of data settings; the
many env copies the trainer builds share it.

Splits: ``eval_path`` names a held-out file; otherwise a row is in the eval split when a hash of its content
falls below ``eval_fraction`` (default 0.1): deterministic, independent of the seed and of the row order, and
duplicate rows land in the same split. ``reset(seed, options={"split": s})`` poses row ``seed % n`` of split
``s`` (``n`` = its number of rows), so the trainer's consecutive seeds walk the rows in file order.

The prompt: an optional system message and one user message holding the images then the text
``prompt_template.format(**row)``. When that text contains ``<image>`` placeholders (one per image), the
images go at those places instead. TRL's prompt-only formats are read as they are: without a ``question``
column the ``prompt`` column is the question; a ``prompt`` holding chat messages (TRL's conversational
format) is the prompt itself, its ``{"type": "image"}`` placeholders filled with the row's images in order
(``mmgrpo.data.conversation``). ``TextQAEnv`` (``text_qa``) is the same without images.

Reset info: ``answer`` (a str, or a list of str when the row lists accepted answers; numbers written as text,
``3.0`` as ``"3"``), every other row field except the image field (a field named like one of the keys the env
sets, ``source``, ``image_size``, ``model_image_size``, ``seed``, ``split`` or ``answer``, is kept as
``row_<name>``), ``source`` (the row's ``file:line`` or ``file:row N``), and for image rows ``image_size``
(the image's original ``[width, height]``; a list of them, one per image, when the row's image field is a
list or a video file) and ``model_image_size`` (likewise, the ``[width, height]`` the Qwen-VL
processor resizes it to: ``mmgrpo.data.records.model_image_size``, the processor's own rule, with ``image_factor``
(28) and the env's ``min_pixels``/``max_pixels``, Qwen2.5-VL's published defaults when None; set them to
the model's ``model.min_pixels``/``model.max_pixels`` so that they match). Qwen2.5-VL answers boxes in the
pixels of its resized input, so a grounding verifier scales a row's boxes (in original pixels) by
``model_image_size / image_size``.
"""

from __future__ import annotations

import copy
import os
import string
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from mmgrpo.data.conversation import conversation_messages, conversation_problems, is_conversation
from mmgrpo.data.records import (
    Record,
    check_records,
    is_video_ref,
    load_video,
    model_image_size,
    open_image,
    read_records,
)
from mmgrpo.data.rows import answer_value, row_unit, split_rows  # noqa: F401  (importable from here too)
from mmgrpo.env import SingleTurnEnv, Task, image_part, system, text_part, user
from mmgrpo.errors import ConfigError, DataError, EnvError, did_you_mean

DEFAULT_SYSTEM_PROMPT = (
    "Answer the question about the image. Give your final answer inside <answer></answer>, "
    "e.g. <answer>two</answer>."
)
DEFAULT_TEMPLATE = "{question}"
"""The prompt template of rows whose question is in ``question``; in general ``"{<question_field>}"``."""
QUESTION_FIELDS = ("question", "prompt")
"""The question fields ``question_field=None`` looks for, in this order (``prompt``: TRL's column)."""
IMAGE_FIELDS = ("image", "images", "video")
"""The image fields ``image_field=None`` looks for, in this order."""
IMAGE_PLACEHOLDER = "<image>"
RESIZES = ("none", "qwen")
RESERVED = ("answer", "source", "image_size", "model_image_size", "seed", "split")
"""Info keys the env sets; a row field with one of these names is kept as ``row_<name>``."""
CACHE_SIZE = 8


def _check_template(template: Any, name: str) -> None:
    """ConfigError unless ``template`` is a ``str.format`` template with named fields only."""
    if not isinstance(template, str):
        raise ConfigError(f"{name}(prompt_template=...): expected a str, got {type(template).__name__}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(
            f"{name}(prompt_template={template!r}): not a valid template ({e}); write literal braces as {{{{ }}}}"
        ) from None
    for _, field, _, _ in parsed:
        root = None if field is None else field.split(".")[0].split("[")[0]
        if root is not None and (not root or root.isdigit()):
            raise ConfigError(
                f"{name}(prompt_template={template!r}): use named fields such as {{question}}, not {{{field}}}"
            )


def _stamp(path: str | None) -> tuple[Any, ...]:
    """What identifies a data source's version in the cache key: path, mtime and size when it is local."""
    if path is None:
        return (None,)
    p = Path(path).expanduser()
    if p.exists():
        st = p.stat()
        return (str(p.resolve()), st.st_mtime_ns, st.st_size)
    return (path,)


@dataclass(frozen=True)
class _Dataset:
    """A checked dataset: its rows per split, the field holding the images (None for text rows) and the one
    holding the question."""

    rows: dict[str, list[Record]]
    image_field: str | None
    question_field: str


_CACHE: OrderedDict[tuple[Any, ...], _Dataset] = OrderedDict()


def clear_cache() -> None:
    """Forget every dataset read so far (the next env reads and checks its files again)."""
    _CACHE.clear()


# --------------------------------------------------------------------------------------------- envs
class QADatasetEnv(SingleTurnEnv):
    """The shared machinery of ``VQAEnv`` and ``TextQAEnv``: rows from a dataset, one question per episode.

    Subclasses set ``with_images`` and call ``_setup`` from an ``__init__`` whose signature lists their
    kwargs (the registry shows that signature when a kwarg is wrong).
    """

    with_images: ClassVar[bool] = True
    rows: dict[str, list[Record]]
    """The checked rows of each split, ``{"train": [...], "eval": [...]}``."""
    image_field: str | None

    def _setup(
        self,
        *,
        path: str | os.PathLike[str],
        eval_path: str | os.PathLike[str] | None,
        eval_fraction: float | None,
        question_field: str | None,
        answer_field: str | None,
        system_prompt: str | None,
        prompt_template: str | None,
        limit: int | None,
        image_field: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        resize: str = "none",
        image_factor: int = 28,
        video_fps: float = 2.0,
        check_pixels: bool = True,
    ) -> None:
        name = type(self).__name__
        for kwarg, value in (("path", path), ("eval_path", eval_path)):
            if value is None and kwarg == "eval_path":
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ConfigError(
                    f"{name}({kwarg}={value!r}): expected a data file, a save_to_disk folder or a hub id, "
                    f"e.g. {kwarg}='data/train.jsonl'"
                )
        path = os.fspath(path)
        eval_path = None if eval_path is None else os.fspath(eval_path)
        if eval_path is not None and eval_fraction is not None:
            raise ConfigError(
                f"{name}(eval_path={eval_path!r}, eval_fraction={eval_fraction!r}): give one of them, not both "
                "(eval_path is the held-out set; eval_fraction splits path)"
            )
        if eval_fraction is None:
            eval_fraction = 0.0 if eval_path is not None else 0.1
        if (
            isinstance(eval_fraction, bool)
            or not isinstance(eval_fraction, (int, float))
            or not (0 <= eval_fraction < 1)
        ):
            raise ConfigError(f"{name}(eval_fraction={eval_fraction!r}): expected a number in [0, 1)")
        if question_field is not None and (not isinstance(question_field, str) or not question_field):
            raise ConfigError(
                f"{name}(question_field={question_field!r}): expected a field name, or None ('question', else "
                "TRL's 'prompt')"
            )
        if answer_field is not None and (not isinstance(answer_field, str) or not answer_field):
            raise ConfigError(
                f"{name}(answer_field={answer_field!r}): expected a field name, or None for rows without an "
                "answer (tasks scored from other fields, e.g. grounding with 'box')"
            )
        if question_field is not None and question_field == answer_field:
            raise ConfigError(f"{name}: question_field and answer_field are both {question_field!r}")
        if image_field is not None and (not isinstance(image_field, str) or not image_field):
            raise ConfigError(f"{name}(image_field={image_field!r}): expected a field name or None (auto)")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(
                f"{name}(system_prompt=...): expected a str or None (no system message), got "
                f"{type(system_prompt).__name__}"
            )
        if prompt_template is not None:
            _check_template(prompt_template, name)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"{name}(limit={limit!r}): expected an int >= 1 or None (all rows)")
        for kwarg, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}({kwarg}={value!r}): expected an int >= 1 or None")
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise ConfigError(f"{name}(min_pixels={min_pixels}, max_pixels={max_pixels}): need min <= max")
        if resize not in RESIZES:
            raise ConfigError(
                f"{name}(resize={resize!r}): expected one of {list(RESIZES)}.{did_you_mean(str(resize), RESIZES)}"
            )
        if (
            isinstance(image_factor, bool)
            or not isinstance(image_factor, int)
            or image_factor < 2
            or image_factor % 2
        ):
            raise ConfigError(
                f"{name}(image_factor={image_factor!r}): expected an even int (28 for Qwen2-VL/Qwen2.5-VL, "
                "32 for Qwen3-VL)"
            )
        if isinstance(video_fps, bool) or not isinstance(video_fps, (int, float)) or not video_fps > 0:
            raise ConfigError(f"{name}(video_fps={video_fps!r}): expected a number > 0")
        if not isinstance(check_pixels, bool):
            raise ConfigError(f"{name}(check_pixels={check_pixels!r}): expected true or false")

        self.path, self.eval_path, self.eval_fraction = path, eval_path, float(eval_fraction)
        self.question_field, self.answer_field = question_field, answer_field
        self.system_prompt, self.template_given = system_prompt, prompt_template
        self.min_pixels, self.max_pixels, self.resize = min_pixels, max_pixels, resize
        self.image_factor, self.video_fps = image_factor, float(video_fps)
        key = (
            type(self).__name__,
            _stamp(path),
            _stamp(eval_path),
            self.eval_fraction,
            question_field,
            answer_field,
            image_field,
            prompt_template,
            limit,
            min_pixels,
            max_pixels,
            image_factor,
            check_pixels,
        )
        dataset = _CACHE.get(key)
        if dataset is None:
            dataset = self._load(limit, image_field, check_pixels)
            _CACHE[key] = dataset
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        _CACHE.move_to_end(key)
        self.rows, self.image_field = dataset.rows, dataset.image_field
        self._use_question_field(dataset.question_field)

    def _use_question_field(self, field: str) -> None:
        """Set the question field and the template (given, else ``"{<question_field>}"``)."""
        self.question_field = field
        given = self.template_given
        self.prompt_template = given if given is not None else "{" + field + "}"

    # ----------------------------------------------------------------------------------- loading
    def _load(self, limit: int | None, image_field: str | None, check_pixels: bool) -> _Dataset:
        """Read, check and split the rows (raises DataError listing every bad row)."""
        train = read_records(self.path, limit=limit)
        held_out = read_records(self.eval_path, limit=limit) if self.eval_path is not None else []
        every = train + held_out
        if not train:
            raise DataError(f"{self.path}: no rows (an empty file?)")
        if self.eval_path is not None and not held_out:
            raise DataError(f"{self.eval_path}: no rows (an empty file?)")
        if self.with_images and image_field is None:
            image_field = self._detect_image_field(every)
        if self.question_field is None:  # 'question', else TRL's 'prompt' when the rows have that
            found = [f for f in QUESTION_FIELDS if any(r.fields.get(f) is not None for r in every)]
            self._use_question_field(found[0] if found else QUESTION_FIELDS[0])
        else:
            self._use_question_field(self.question_field)
        required = (
            (self.question_field,) if self.answer_field is None else (self.question_field, self.answer_field)
        )
        check_records(
            every,
            required=required,
            image_fields=(image_field,) if image_field else (),
            decode=check_pixels,
            validate=lambda r: self._row_problems(r, image_field),
            check_size=self._size_problem if self.with_images else None,
        )
        if self.with_images and image_field is None:
            raise DataError(
                f"{self.path}: no row has an image field ({', '.join(repr(f) for f in IMAGE_FIELDS)}). Name "
                f"the field with image_field=..., or use the env text_qa for text-only rows."
            )
        if self.eval_path is None:
            train, held_out = split_rows(train, self.eval_fraction)
            if not train:
                raise DataError(
                    f"{self.path}: eval_fraction={self.eval_fraction} leaves no training rows "
                    f"({len(held_out)} row(s) in all); add rows or lower eval_fraction"
                )
        return _Dataset({"train": train, "eval": held_out}, image_field, self.question_field)

    def _detect_image_field(self, records: Sequence[Record]) -> str | None:
        found = [f for f in IMAGE_FIELDS if any(r.fields.get(f) is not None for r in records)]
        if len(found) > 1:
            raise ConfigError(
                f"{type(self).__name__}: the rows of {self.path} have several image fields {found}; choose one "
                f"with image_field=..."
            )
        return found[0] if found else None

    def _row_problems(self, record: Record, image_field: str | None) -> list[str]:
        """What is wrong with one row's question, answer and prompt (the images are checked separately)."""
        fields, problems = record.fields, []
        question = fields[self.question_field]
        refs = _as_list(fields[image_field]) if self.with_images and image_field else None
        conversational = is_conversation(question)
        if conversational:  # TRL's conversational format: the messages are the prompt
            problems.extend(
                conversation_problems(question, self.question_field, None if refs is None else len(refs))
            )
            if self.template_given is not None or any(map(is_video_ref, refs or [])):
                problems.append(
                    f"'{self.question_field}' holds chat messages, used as they are: they take images (not "
                    "video files) and no prompt_template"
                )
        elif not isinstance(question, str):
            problems.append(f"'{self.question_field}' is {type(question).__name__}, expected text")
        elif not question.strip():
            problems.append(f"'{self.question_field}' is empty")
        if self.answer_field is not None:
            try:
                answer_value(fields[self.answer_field])
            except ValueError as e:
                problems.append(f"'{self.answer_field}': {e}" if self.answer_field != "answer" else str(e))
        if conversational:
            return problems
        try:
            text = self.prompt_template.format_map(fields)
        except KeyError as e:
            present = [k for k, v in fields.items() if v is not None]
            return [
                *problems,
                f"prompt_template uses {{{e.args[0]}}} but the row has no field '{e.args[0]}'."
                f"{did_you_mean(str(e.args[0]), present)} Row fields: {present}",
            ]
        except (AttributeError, IndexError, TypeError, ValueError) as e:
            return [*problems, f"prompt_template cannot be filled from this row ({type(e).__name__}: {e})"]
        placeholders = text.count(IMAGE_PLACEHOLDER)
        if self.with_images and placeholders and image_field is not None:
            refs = _as_list(fields[image_field])
            if any(is_video_ref(ref) for ref in refs):
                problems.append(
                    f"the prompt has {IMAGE_PLACEHOLDER} placeholders and the row a video file, whose number "
                    f"of frames is not known in advance; remove the placeholders"
                )
            elif placeholders != len(refs):
                problems.append(
                    f"the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                    f"{len(refs)} image(s)"
                )
        return problems

    def _size_problem(self, size: tuple[int, int]) -> str | None:
        try:
            self.model_size(size)
        except ValueError as e:
            return f"image of {size[0]}x{size[1]} pixels cannot be given to a Qwen-VL model: {e}"
        return None

    def model_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (width, height) the Qwen-VL processor resizes an image of ``size`` (width, height) to, with the
        env's ``image_factor``, ``min_pixels`` and ``max_pixels`` (``mmgrpo.data.records.model_image_size``)."""
        return model_image_size(size, self.image_factor, self.min_pixels, self.max_pixels)

    # ----------------------------------------------------------------------------------- tasks
    def num_tasks(self, split: str) -> int | None:
        """The rows of ``split``: seed s plays row s mod that count."""
        return len(self.rows[split])

    def make_task(self, seed: int, split: str) -> Task:
        rows = self.rows[split]
        if not rows:
            raise EnvError(
                f"{type(self).__name__}: the {split} split of {self.path} has no rows; give eval_path or set "
                "eval_fraction > 0 (with at least two rows)"
                if split == "eval"
                else f"{type(self).__name__}: the {split} split of {self.path} has no rows"
            )
        record = rows[seed % len(rows)]
        fields = record.fields
        reserved = RESERVED if self.answer_field is not None else tuple(k for k in RESERVED if k != "answer")
        info: dict[str, Any] = {
            (f"row_{k}" if k in reserved else k): copy.deepcopy(v)
            for k, v in fields.items()
            if k not in (self.answer_field, self.image_field)
        }
        if self.answer_field is not None:
            info["answer"] = answer_value(fields[self.answer_field])
            if self.answer_field != "answer":  # also under its own name (TRL: accuracy_reward(solution=...))
                info[self.answer_field] = copy.deepcopy(fields[self.answer_field])
        info["source"] = record.source
        images: list[Image.Image] = []
        if self.image_field is not None:
            images, sizes = self._images(record)
            image_size = [list(s) for s in sizes]
            model_size = [list(self.model_size(s)) for s in sizes]
            value = fields[self.image_field]
            if not isinstance(value, (list, tuple)) and not is_video_ref(value):  # one image: one [w, h]
                image_size, model_size = image_size[0], model_size[0]
            info["image_size"], info["model_image_size"] = image_size, model_size
        question = fields[self.question_field]
        if is_conversation(question):  # TRL's conversational format (checked in __init__)
            return Task(messages=conversation_messages(question, images, self.system_prompt), info=info)
        text = self.prompt_template.format_map(fields)
        if self.image_field is None:
            parts = [text_part(text)]
        elif self.image_field == "video" and getattr(self, "video_as", "frames") == "video":
            parts = [{"type": "video", "video": images}, text_part(text)]  # the frames as one video
        else:
            parts = _interleave(text, images)
        messages = [system(self.system_prompt)] if self.system_prompt is not None else []
        messages.append(user(*parts))
        return Task(messages=messages, info=info)

    def _images(self, record: Record) -> tuple[list[Image.Image], list[tuple[int, int]]]:
        """The row's images (RGB; video files as their frames) and each one's original (width, height)."""
        images, sizes = [], []
        pixels = {
            k: v
            for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels))
            if v is not None
        }
        try:
            for ref in _as_list(record.fields[self.image_field]):
                if is_video_ref(ref):
                    frames = load_video(
                        ref, record.base_dir, fps=self.video_fps, image_factor=self.image_factor, **pixels
                    )
                    images.extend(frames)
                    sizes.extend(f.size for f in frames)
                    continue
                image = open_image(ref, record.base_dir)
                sizes.append(image.size)
                if self.resize == "qwen":
                    image = image.resize(self.model_size(image.size), Image.Resampling.BICUBIC)
                images.append(image)
        except DataError as e:
            raise DataError(f"{record.source}: {e}") from None
        return images, sizes

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A completion that deserves full reward from an answer verifier for the task described by ``info``."""
        answer = info["answer"]
        return f"<answer>{answer[0] if isinstance(answer, list) else answer}</answer>"


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _interleave(text: str, images: list[Image.Image]) -> list[Any]:
    """The user message's parts: the images at the ``<image>`` placeholders of ``text``, or all of them
    before the text when it has none."""
    if IMAGE_PLACEHOLDER not in text:
        return [*(image_part(im) for im in images), text_part(text)]
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts: list[Any] = []
    for i, piece in enumerate(pieces):
        if piece:
            parts.append(text_part(piece))
        if i < len(images):
            parts.append(image_part(images[i]))
    return parts


class VQAEnv(QADatasetEnv):
    """Answer a question about one or more images from a dataset; the answer is the row's answer.

    Args (all keyword):
        path: the data: a .jsonl / .json / .parquet file, a folder written by ``datasets``' save_to_disk
            (``"folder:split"`` picks a split) or a Hugging Face hub id (``"name"`` or ``"name:split"``).
            Relative image paths in a file are relative to the file's folder.
        eval_path: a held-out dataset for the eval split (then every row of ``path`` is for training).
        eval_fraction: without ``eval_path``, the share of rows held out for eval, chosen by a hash of each
            row's content (default 0.1; 0 = no eval split).
        question_field, answer_field: the fields holding the question and the answer (``answer_field=None``:
            rows need no answer, for tasks scored from other fields, e.g. grounding with ``box``; another
            answer field, e.g. TRL's ``solution``, is in the info under its name too). ``question_field=None``:
            ``question``, else ``prompt`` (TRL's column: text, or chat messages used as the prompt).
        image_field: the field holding the image(s); None picks ``image``, ``images`` or ``video``,
            whichever the rows have. It holds one reference or a list (several images, or a video's
            frames); a path ending in a video suffix is a video file, read at ``video_fps``.
        system_prompt: the system message (None: no system message).
        prompt_template: the user text, ``str.format`` ed with the row's fields (default
            ``"{<question_field>}"``); ``<image>`` placeholders in it place the images.
        min_pixels, max_pixels, image_factor: the Qwen-VL processor's image budget and resize factor, for
            ``model_image_size`` and ``resize="qwen"`` (None: the processor's defaults).
        resize: ``"none"`` (default: images at their original size; the model's processor resizes them)
            or ``"qwen"`` (resized here to ``model_image_size``, bicubic, as ``qwen_vl_utils.fetch_image``
            does; the processor then leaves them as they are).
        video_fps: frames per second sampled from a video file.
        video_as: "video" (default) sends a ``video`` row's frames as one video part (Qwen-VL's video
            input: pixel_values_videos, 2 frames per temporal patch); "frames" sends them as separate
            images, for families without a video processor.
        check_pixels: decode every image in ``__init__`` (default; False reads only headers, faster on
            large datasets, but a truncated file is found only when its row is drawn).
        limit: read at most this many rows of each file.

    ``reset`` info: ``answer`` (str or list of str), the row's other fields, ``source``, ``image_size``,
    ``model_image_size`` (``[width, height]``, or a list of them when the image field holds a list or a video
    file), ``seed`` and ``split``.
    """

    with_images = True

    def __init__(
        self,
        *,
        path: str,
        eval_path: str | None = None,
        eval_fraction: float | None = None,
        question_field: str | None = None,
        answer_field: str | None = "answer",
        image_field: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prompt_template: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        resize: str = "none",
        image_factor: int = 28,
        video_fps: float = 2.0,
        video_as: str = "video",
        check_pixels: bool = True,
        limit: int | None = None,
    ) -> None:
        if video_as not in ("video", "frames"):
            raise ConfigError(
                f"VQAEnv(video_as={video_as!r}): expected 'video' (one video part: Qwen-VL models) or 'frames' "
                "(the frames as separate images: models without a video processor)"
            )
        self.video_as = video_as
        self._setup(
            path=path,
            eval_path=eval_path,
            eval_fraction=eval_fraction,
            question_field=question_field,
            answer_field=answer_field,
            image_field=image_field,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            resize=resize,
            image_factor=image_factor,
            video_fps=video_fps,
            check_pixels=check_pixels,
            limit=limit,
        )
