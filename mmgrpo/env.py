"""The episode protocol: a ``gymnasium.Env`` whose observations are chat messages and whose action is text.

This module owns the message format (Hugging Face chat format, see ``docs/interfaces.md``), the spaces that
describe it, the ``ChatEnv`` / ``SingleTurnEnv`` base classes and ``check_env``. It knows nothing about models
or tokens: the rollout turns messages into tokens, the env only ever sees the assistant's decoded text.

A message is ``{"role": "system"|"user"|"assistant"|"tool", "content": [part, ...]}`` and a part is
``{"type": "text", "text": str}`` or ``{"type": "image", "image": PIL.Image.Image}``. Extra keys on a message
or part (``tool_call_id``, ``resized_height``, ...) are allowed and passed through untouched.

Protocol (gymnasium's, with messages as observations):

- ``reset(seed=None, options=None) -> (messages, info)``: the whole prompt; ``info`` holds the task fields
  (``"answer"`` where the task has one). ``options={"split": "train"|"eval"}``; the same (seed, split) always
  gives the same task, and train and eval seeds map to disjoint tasks.
- ``step(text) -> (new_messages, reward, terminated, truncated, info)``: only the messages the env appends
  (a tool result, feedback); an empty list when the episode ends. ``reward`` is the env's own (0.0 if none);
  verifiers score the finished episode separately.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium.spaces import Space, Text
from PIL import Image

from mmgrpo.errors import ConfigError, EnvError, did_you_mean

Part = dict[str, Any]
"""``{"type": "text", "text": str}`` or ``{"type": "image", "image": PIL.Image.Image}``."""
Message = dict[str, Any]
"""``{"role": str, "content": list[Part]}``."""

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image")
SPLITS = ("train", "eval")
MAX_ACTION_CHARS = 1_000_000


# --------------------------------------------------------------------------------------------- builders
def text_part(text: str) -> Part:
    """A text part."""
    return {"type": "text", "text": text}


def image_part(image: Image.Image) -> Part:
    """An image part holding a PIL image (not a path or URL: envs hand over pixels)."""
    return {"type": "image", "image": image}


def _as_part(item: str | Image.Image | Part) -> Part:
    if isinstance(item, str):
        return text_part(item)
    if isinstance(item, Image.Image):
        return image_part(item)
    if isinstance(item, dict):
        return item
    raise TypeError(f"a message part must be a str, a PIL image or a part dict, got {type(item).__name__}")


def user(*parts: str | Image.Image | Part) -> Message:
    """A user message; strings become text parts and PIL images become image parts, in order."""
    return {"role": "user", "content": [_as_part(p) for p in parts]}


def tool(*parts: str | Image.Image | Part) -> Message:
    """A tool-result message (same part rules as ``user``)."""
    return {"role": "tool", "content": [_as_part(p) for p in parts]}


def system(text: str) -> Message:
    """A system message with one text part."""
    return {"role": "system", "content": [text_part(text)]}


def assistant(text: str) -> Message:
    """An assistant message with one text part."""
    return {"role": "assistant", "content": [text_part(text)]}


def message_text(message: Message) -> str:
    """The concatenated text parts of one message (a plain-string ``content`` is returned as is)."""
    content = message.get("content", [])
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")


def bare_prompt(messages: Sequence[Message]) -> list[Message]:
    """The text of the prompt's last user message, alone: no system prompt, tool schemas or images.

    A bare prompt lets a small model find a skill in a short context, where its attention is not spread over
    hundreds of other tokens (``warm_start.drill_bare_steps``, ``grpo.bare_steps``). Measured on the tiny
    VLM (zoom_count's drill, lr 1e-3): on full prompts (344 tokens: system prompt, tool schemas, image) the
    copied digit stayed at chance for 400 steps (2500 at 3e-4); on bare prompts (about 20 tokens) it was
    learnt by step 275, and on full prompts after that within 50 more steps."""
    last = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if last is None:
        raise ConfigError(
            "bare prompts (warm_start.drill_bare_steps, grpo.bare_steps) keep the prompt's last user message, "
            "and this env's prompt has none: set both to 0"
        )
    return [user(message_text(last))]


def message_images(messages: Sequence[Message]) -> list[Image.Image]:
    """Every image of ``messages``, in conversation order."""
    return [
        p["image"]
        for m in messages
        if not isinstance(m.get("content"), str)
        for p in m.get("content", [])
        if isinstance(p, dict) and p.get("type") == "image"
    ]


def message_problem(messages: Any) -> str | None:
    """Why ``messages`` is not a well-formed list of messages, or None when it is."""
    if not isinstance(messages, list):
        return f"expected a list of messages, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is a {type(m).__name__}, expected a dict with 'role' and 'content'"
        role = m.get("role")
        if role not in ROLES:
            return f"message {i} has role {role!r}; roles are {list(ROLES)}.{did_you_mean(str(role), ROLES)}"
        content = m.get("content")
        if not isinstance(content, list):
            return (
                f"message {i} ({role}) has content of type {type(content).__name__}; content must be a list "
                "of parts, e.g. [text_part('...')] (use the builders user(), system(), assistant())"
            )
        for j, p in enumerate(content):
            where = f"message {i} ({role}) part {j}"
            if not isinstance(p, dict):
                return f"{where} is a {type(p).__name__}, expected a dict with a 'type' key"
            kind = p.get("type")
            if kind == "text":
                if not isinstance(p.get("text"), str):
                    return f"{where} is a text part whose 'text' is {type(p.get('text')).__name__}, not str"
            elif kind == "image":
                if not isinstance(p.get("image"), Image.Image):
                    return (
                        f"{where} is an image part whose 'image' is {type(p.get('image')).__name__}; "
                        "envs must hand over a PIL.Image.Image (load paths/URLs in the env)"
                    )
            else:
                return f"{where} has type {kind!r}; part types are {list(PART_TYPES)}"
    return None


# --------------------------------------------------------------------------------------------- spaces
class MessagesSpace(Space):
    """The observation space: any well-formed list of chat messages (see ``message_problem``)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return message_problem(x) is None

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        """A trivial member (one empty user message); messages have no meaningful random distribution."""
        return [user("")]

    def __repr__(self) -> str:
        return "MessagesSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace)

    __hash__ = Space.__hash__


class AssistantText(Text):
    """The action space: any string up to ``max_length`` characters, including the empty string.

    ``gymnasium.spaces.Text`` only admits characters of a fixed charset; a model may write any Unicode, so
    ``contains`` checks the type and length only. ``sample`` draws from printable ASCII.
    """

    def __init__(self, max_length: int = MAX_ACTION_CHARS, seed: int | None = None) -> None:
        super().__init__(max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AssistantText(max_length={self.max_length})"


# --------------------------------------------------------------------------------------------- envs
@dataclass(frozen=True)
class Shown:
    """A policy turn of a demonstration that is shown, not taught: the warm start plays it through ``step``
    and lays out its tokens like any policy turn, but trains on none of them (loss mask 0). It lets a
    demonstration drill one skill (copy a tool's result into the answer) on a context that the policy is
    not taught to produce (the right call, which GRPO has to find)."""

    text: str


DemoTurn = str | Shown | tuple[str | Shown, ...]
"""A demonstration turn: taught text, a ``Shown`` turn, or a tuple of pieces (taught text and ``Shown``)."""


def turn_pieces(turn: DemoTurn) -> list[tuple[str, bool]]:
    """A demonstration turn as (text, taught) pieces, in order."""
    items = turn if isinstance(turn, tuple) else (turn,)
    return [(p.text, False) if isinstance(p, Shown) else (p, True) for p in items]


class ChatEnv(gymnasium.Env):
    """Base class of every mmgrpo environment: observations are messages, the action is assistant text.

    Subclasses implement ``reset`` and ``step`` with the contract in the module docstring and call
    ``super().reset(seed=seed)`` in ``reset`` so that ``self.np_random`` is seeded the gymnasium way.
    Single-turn question/answer tasks should subclass ``SingleTurnEnv`` instead.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    observation_space = MessagesSpace()
    action_space = AssistantText()

    def num_tasks(self, split: str) -> int | None:
        """How many distinct tasks ``split`` holds (a dataset's rows: seeds beyond repeat them), or None
        when every seed is a new task (procedural envs). Evaluation never reports more episodes than this."""
        return None


@dataclass
class Task:
    """One task: the prompt messages and the task fields (``answer``, ...) that verifiers read."""

    messages: list[Message]
    info: dict[str, Any] = field(default_factory=dict)


def check_split(split: Any) -> str:
    """Return ``split`` if it is a known split, else raise EnvError naming it."""
    if split not in SPLITS:
        raise EnvError(
            f"unknown split {split!r}: pass options={{'split': 'train'}} or {{'split': 'eval'}}."
            f"{did_you_mean(str(split), SPLITS)}"
        )
    return split


def start_task(env: ChatEnv, seed: Any, options: Any) -> tuple[Task, dict[str, Any]]:
    """The ``reset`` of a task env (``SingleTurnEnv``, ``ToolEnv``): validate ``seed`` and ``options``, seed
    ``env.np_random`` the gymnasium way, draw a seed from it when ``seed`` is None and call
    ``env.make_task(seed, split)``. Returns the task and its info (``task.info`` plus ``seed`` and ``split``).
    """
    name = type(env).__name__
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise EnvError(f"{name}.reset: seed must be a non-negative int or None, got {seed!r}")
        seed = int(seed)
    gymnasium.Env.reset(env, seed=seed)
    if options is not None and not isinstance(options, dict):
        raise EnvError(f"{name}.reset: options must be a dict or None, got {type(options).__name__}")
    split = check_split((options or {}).get("split", "train"))
    if seed is None:
        seed = int(env.np_random.integers(0, 2**31 - 1))
    task = env.make_task(seed, split)
    if not isinstance(task, Task):
        raise EnvError(
            f"{name}.make_task returned {type(task).__name__}; return "
            "Task(messages=[...], info={...}) (from mmgrpo.env import Task)"
        )
    return task, dict(task.info, seed=seed, split=split)


def check_step(env: ChatEnv, started: bool, done: bool, action: Any) -> None:
    """Raise EnvError when ``step`` comes before ``reset``, after the episode ended, or with a non-str action."""
    name = type(env).__name__
    if not started:
        raise EnvError(f"{name}.step() was called before reset(): call env.reset(seed=...) first.")
    if done:
        raise EnvError(
            f"{name}.step() was called after the episode ended (terminated=True): call env.reset() "
            "to start a new episode."
        )
    if not isinstance(action, str):
        raise EnvError(f"{name}.step() takes the assistant's text (str), got {type(action).__name__}")


class SingleTurnEnv(ChatEnv):
    """A question/answer env: ``reset`` poses a task, the first ``step`` ends the episode.

    Subclasses implement ``make_task(seed, split) -> Task``, a pure function of its arguments (draw every
    random choice from a generator seeded by them) so that the same (seed, split) gives the same task and
    train and eval seeds give disjoint tasks. ``reset(seed=None)`` draws a seed from ``self.np_random``.
    """

    _task: Task | None = None
    _info: dict[str, Any] | None = None
    _done: bool = True

    def make_task(self, seed: int, split: str) -> Task:
        raise NotImplementedError(f"{type(self).__name__} must implement make_task(seed, split) -> Task")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task, self._info = start_task(self, seed, options)
        self._task, self._done = task, False
        return list(task.messages), dict(self._info)

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        check_step(self, self._task is not None, self._done, action)
        self._done = True
        return [], 0.0, True, False, dict(self._info or {})

    def reset_like(self, other: SingleTurnEnv, seed: int) -> bool:
        """Start the task ``other`` was just reset to with ``seed``, without building it again (the G
        envs of a group pose one task: make_task is a pure function of (seed, split), so its result can be
        shared; a scene is then drawn once per group, not G times). False when this env's class changes
        reset, so that the caller resets it the normal way."""
        if (
            type(self) is not type(other)
            or type(self).reset is not SingleTurnEnv.reset
            or other._task is None
        ):
            return False
        gymnasium.Env.reset(self, seed=seed)  # the same np_random state a reset(seed) leaves
        self._task, self._info, self._done = other._task, dict(other._info or {}), False
        return True


# --------------------------------------------------------------------------------------------- checker
def _fingerprint(messages: list[Message]) -> list[tuple]:
    """A comparable summary of messages: roles, texts and image mode/size/pixel hashes."""
    out = []
    for m in messages:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                img = p["image"]
                parts.append(("image", img.mode, img.size, hashlib.sha256(img.tobytes()).hexdigest()))
            else:
                parts.append(("text", p["text"]))
        out.append((m["role"], tuple(parts)))
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays in info: not comparable with ==, do not judge
        return True


def check_env(env: gymnasium.Env, seeds: Sequence[int] = (0, 1), action: str = "") -> None:
    """Check that ``env`` follows the ChatEnv protocol; raise EnvError naming the problem and the fix.

    For each seed and split: ``reset`` returns ``(messages, info)`` with valid messages and a dict info (a
    string ``answer`` if any); resetting again with the same seed and split gives identical messages (texts and
    image pixels) and info; ``step(action)`` returns ``(list, float, bool, bool, dict)`` until the episode
    ends (at most 64 steps checked). Also checks that ``reset()`` without a seed works.
    """
    name = type(env).__name__
    if not isinstance(env, gymnasium.Env):
        raise EnvError(f"check_env: expected a gymnasium.Env (subclass mmgrpo.env.ChatEnv), got {name}")
    space = getattr(env, "observation_space", None)

    def reset(**kw: Any) -> tuple[list[Message], dict[str, Any]]:
        call = f"{name}.reset({', '.join(f'{k}={v!r}' for k, v in kw.items())})"
        out = env.reset(**kw)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise EnvError(
                f"{call} must return a tuple (messages, info), got {type(out).__name__}: {out!r:.200}"
            )
        messages, info = out
        problem = message_problem(messages)
        if problem:
            raise EnvError(f"{call} returned malformed messages: {problem}")
        if space is not None and not space.contains(messages):
            raise EnvError(f"{call}: the messages are not in {name}.observation_space ({space!r})")
        if not isinstance(info, dict):
            raise EnvError(f"{call} must return info as a dict, got {type(info).__name__}")
        if "answer" in info and not isinstance(info["answer"], str):
            raise EnvError(
                f"{call}: info['answer'] must be a str (verifiers compare text), got "
                f"{type(info['answer']).__name__}; use str(answer)"
            )
        return messages, info

    def run_episode(call: str) -> None:
        for _ in range(64):
            out = env.step(action)
            if not (isinstance(out, tuple) and len(out) == 5):
                raise EnvError(
                    f"{call} then step({action!r}) must return (messages, reward, terminated, truncated, info), "
                    f"got {type(out).__name__} of length {len(out) if isinstance(out, tuple) else '-'}"
                )
            messages, reward, terminated, truncated, info = out
            problem = message_problem(messages)
            if problem:
                raise EnvError(
                    f"{name}.step() returned malformed new messages: {problem} (return [] if none)"
                )
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise EnvError(f"{name}.step() reward must be a finite float (0.0 if none), got {reward!r}")
            for flag, value in (("terminated", terminated), ("truncated", truncated)):
                if not isinstance(value, (bool, np.bool_)):
                    raise EnvError(f"{name}.step() {flag} must be a bool, got {type(value).__name__}")
            if not isinstance(info, dict):
                raise EnvError(f"{name}.step() info must be a dict, got {type(info).__name__}")
            if terminated or truncated:
                if messages:
                    raise EnvError(
                        f"{name}.step() ended the episode but returned {len(messages)} new message(s); "
                        "return an empty list when terminated or truncated"
                    )
                return

    for seed in seeds:
        for split in SPLITS:
            kw = {"seed": seed, "options": {"split": split}}
            call = f"{name}.reset(seed={seed}, options={{'split': {split!r}}})"
            first, info1 = reset(**kw)
            fp1 = _fingerprint(first)
            run_episode(call)
            second, info2 = reset(**kw)
            if _fingerprint(second) != fp1:
                raise EnvError(
                    f"{call} is not deterministic: two resets gave different messages. Draw every random choice "
                    "from a generator seeded by (seed, split), e.g. random.Random(2 * seed + (split == 'eval'))"
                )
            if not _same(info1, info2):
                raise EnvError(
                    f"{call} is not deterministic: info differs between two resets ({info1!r:.200})"
                )
            run_episode(call)
    reset()
    run_episode(f"{name}.reset()")
