"""Rows whose prompt is a conversation: TRL's conversational dataset format (user guide: ``docs/data.md``).

TRL's prompt-only datasets hold the prompt in a ``prompt`` column, either as text (the "standard" format,
which the dataset envs read as any text question) or as a list of chat messages (the "conversational"
format, read here)::

    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
     "image": "imgs/0001.jpg", "solution": "red"}

A message's ``content`` is a string or a list of parts (``{"type": "text", "text": ...}`` and image
placeholders ``{"type": "image"}``). The row's images (its ``image`` or ``images`` column) fill the
placeholders in order, as TRL's ``prepare_multimodal_messages`` does, including its rule for prompts
without placeholders: when the first user message's content is a string, the images go before its text.
The number of placeholders must equal the number of images (``conversation_problems`` says so, naming the
counts; the dataset env prefixes the row's ``file:line``).

Nothing here reads files or knows about models: the dataset env opens the images and hands them over.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

__all__ = ["conversation_messages", "conversation_problems", "is_conversation", "placeholder_count"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles TRL's ``prepare_multimodal_messages`` accepts (and ``mmgrpo.env.ROLES``)."""


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(image: Image.Image) -> dict[str, Any]:
    return {"type": "image", "image": image}


def is_conversation(value: Any) -> bool:
    """Whether a prompt value is a list of chat messages (TRL's conversational format) rather than text."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)


def placeholder_count(messages: list[dict], images: int) -> int:
    """The image slots of ``messages`` given ``images`` images: the ``{"type": "image"}`` parts (without an
    image of their own), plus ``images`` when a user message's content is a string (TRL puts the images
    before the text of the first such message). Tool messages carry no placeholders, as in TRL."""
    explicit = sum(
        1
        for m in messages
        if m.get("role") != "tool" and isinstance(m.get("content"), (list, tuple))
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is None
    )
    if any(m.get("role") == "user" and isinstance(m.get("content"), str) for m in messages):
        return explicit + images
    return explicit


def conversation_problems(value: Any, field: str, images: int | None) -> list[str]:
    """What is wrong with a conversational prompt ``value`` of column ``field``: its messages' shape, and
    (``images``: the row's number of images, None for an env without images) the count of image
    placeholders against the count of images."""
    problems: list[str] = []
    for i, m in enumerate(value):
        where = f"'{field}' message {i}"
        role = m.get("role")
        if role not in ROLES:
            problems.append(f"{where} has role {role!r}; roles are {list(ROLES)}")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, (list, tuple)):
            problems.append(
                f"{where} has content of type {type(content).__name__}; expected text or a list of parts "
                '({"type": "text", "text": ...} and {"type": "image"})'
            )
            continue
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                continue
            if kind == "image" and p.get("image") is None:
                continue
            problems.append(
                f"{where} part {j} is {str(p)[:80]}; expected {{'type': 'text', 'text': ...}} or an image "
                "placeholder {'type': 'image'} (the row's image column fills it)"
            )
    if not any(m.get("role") == "user" for m in value):
        problems.append(f"'{field}' has no user message")
    if problems:
        return problems
    slots = placeholder_count(list(value), images or 0)
    if images is None and slots:
        problems.append(
            f"'{field}' has {slots} image placeholder(s) but this env takes no images: use the env vqa"
        )
    elif images is not None and slots != images:
        problems.append(
            f"'{field}' has {slots} image placeholder(s) ({{'type': 'image'}}) but the row has {images} "
            "image(s); give one placeholder per image, in order"
        )
    return problems


def conversation_messages(
    value: list[dict], images: list[Image.Image], system_prompt: str | None
) -> list[dict]:
    """The prompt messages of a conversational row (checked by ``conversation_problems``) in mmgrpo's
    format: every content a list of parts, the placeholders filled with ``images`` in order (all of them
    before the text of the first user message whose content is a string, as TRL does). ``system_prompt`` opens the
    conversation when it has no system message of its own."""
    queue = list(images)
    out: list[dict] = []
    if system_prompt is not None and not any(m.get("role") == "system" for m in value):
        out.append({"role": "system", "content": [_text(system_prompt)]})
    placed_first = False
    for m in value:
        content = m.get("content")
        if isinstance(content, str):
            parts: list[dict] = []
            if m.get("role") == "user" and not placed_first:
                parts, queue, placed_first = [_image(im) for im in queue], [], True
            parts.append(_text(content))
        else:
            parts = [
                _image(queue.pop(0)) if p.get("type") == "image" else _text(p["text"])
                for p in content
            ]
        out.append({"role": m["role"], "content": parts})
    return out
