"""Text question answering over a dataset file (registered env name ``text_qa``); user guide: ``docs/data.md``.

The text-only sibling of ``vqa`` (``mmgrpo.envs.vqa``), sharing its machinery (``QADatasetEnv``): rows hold a
``question`` and an ``answer`` (text, a number, or a list of accepted answers) plus any other fields, which
are passed through into the task info. The formats, the checks (every row in ``__init__``, one DataError
listing every bad row), the splits (``eval_path``, or ``eval_fraction`` by a hash of each row) and
``reset(seed)`` picking row ``seed % n`` of the split are those of ``vqa``. The info holds ``answer``, the
row's other fields and ``source`` (the row's ``file:line`` or ``file:row N``).
"""

from __future__ import annotations

from mmgrpo.envs.vqa import QADatasetEnv

DEFAULT_SYSTEM_PROMPT = (
    "Answer the question. Give your final answer inside <answer></answer>, e.g. <answer>Paris</answer>."
)


class TextQAEnv(QADatasetEnv):
    """Answer a question from a dataset (no images); the answer is the row's answer.

    Args (all keyword):
        path: the data: a .jsonl / .json / .parquet file, a folder written by ``datasets``' save_to_disk
            (``"folder:split"`` picks a split) or a Hugging Face hub id (``"name"`` or ``"name:split"``).
        eval_path: a held-out dataset for the eval split (then every row of ``path`` is for training).
        eval_fraction: without ``eval_path``, the share of rows held out for eval, chosen by a hash of each
            row's content (default 0.1; 0 = no eval split).
        question_field, answer_field: the fields holding the question and the answer (``answer_field=None``:
            rows need no answer, for tasks scored from other fields; another answer field, e.g. TRL's
            ``solution``, is in the info under its name too). ``question_field=None``: ``question``, else
            ``prompt`` (TRL's column: text, or chat messages used as the prompt).
        system_prompt: the system message (None: no system message).
        prompt_template: the user text, ``str.format`` ed with the row's fields (default
            ``"{<question_field>}"``).
        limit: read at most this many rows of each file.

    ``reset`` info: ``answer`` (str or list of str), the row's other fields, ``source``, ``seed``, ``split``.
    """

    with_images = False

    def __init__(
        self,
        *,
        path: str,
        eval_path: str | None = None,
        eval_fraction: float | None = None,
        question_field: str | None = None,
        answer_field: str | None = "answer",
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prompt_template: str | None = None,
        limit: int | None = None,
    ) -> None:
        self._setup(
            path=path,
            eval_path=eval_path,
            eval_fraction=eval_fraction,
            question_field=question_field,
            answer_field=answer_field,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            limit=limit,
        )
