"""Any gymnasium env with text observations as a chat env (registered env name ``gym``).

``GymChatEnv`` wraps a ``gymnasium.Env`` (an instance, or an id for ``gymnasium.make``) so that a model
plays it in chat: each observation becomes a user message, each assistant reply becomes an action. The
wrapped env's own rewards are the training signal: with ``verifiers: [{name: env_reward}]`` they are
scored, weighted and logged with no verifier written::

    env:
      name: gym
      kwargs: {env: "my_package.games:GuessNumber-v0", system: "Guess the number. Reply with it only."}
    verifiers:
      - {name: env_reward}

(``"module:Id-v0"`` makes gymnasium import ``module`` first, which registers the id.)

Observations -> messages: ``obs_to_text(obs)`` (default: strings as they are, numbers and numpy values as
text, dicts and lists as JSON). It may also return a list of strings, PIL images and parts: one multimodal
user message.

Replies -> actions: ``text_to_action(text)`` when given; it raises ValueError (or returns None) for a reply
it cannot use. Without it, the action is read from the last ``<answer>...</answer>`` when the reply has
one, else from the whole reply, stripped: a ``Text`` action space takes that text, a ``Discrete(n, start)``
space one integer (or one of ``action_names``). Other action spaces need ``text_to_action``.

A reply that is not a valid action is an observation, not a crash: the env answers with a user message
saying what was wrong and which actions are valid, reward 0.0, the wrapped env is not stepped, and the turn
counts towards ``max_steps``.

Seeds: ``reset(seed, options={"split": ...})`` resets the wrapped env with ``2 * seed + (split == "eval")``
(the counting env's rule), so train and eval never share a wrapped-env seed and the same (seed, split)
gives the same episode, as long as the wrapped env draws its randomness from its ``np_random``.
"""

from __future__ import annotations

import importlib
import json
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from PIL import Image

from mmgrpo.env import ChatEnv, Message, check_split, user
from mmgrpo.env import system as system_message
from mmgrpo.envs.counting import scene_seed
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.verifier import extract_tag

__all__ = ["GymChatEnv", "default_obs_to_text"]

_INTEGER = re.compile(r"[+-]?\d+")
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError)


def _plain(value: Any) -> Any:
    """numpy arrays and scalars as Python lists and numbers, recursively through dicts, lists and tuples."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def default_obs_to_text(obs: Any) -> str:
    """A string observation as it is; numbers (numpy too) as text; dicts, lists and arrays as JSON."""
    if isinstance(obs, str):
        return obs
    obs = _plain(obs)
    if isinstance(obs, (dict, list)):
        return json.dumps(obs, default=str)
    return str(obs)


def _resolve(value: Any, key: str) -> Callable[..., Any] | None:
    """A callable, or a ``"module:attribute"`` string (for YAML configs) imported to one; None stays None."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) and value.count(":") == 1:
        module_name, attribute = value.split(":")
        try:
            obj = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"GymChatEnv({key}={value!r}): cannot import it: {exc}.") from exc
        if callable(obj):
            return obj
    raise ConfigError(
        f"GymChatEnv({key}={value!r}): expected a function or a 'module:function' string, "
        f"e.g. 'my_package.parsers:{key}'."
    )


class GymChatEnv(ChatEnv):
    """A gymnasium env played in chat: observations as user messages, replies as actions.

    Args:
        env: a ``gymnasium.Env``, or an id for ``gymnasium.make`` (``"ns/Name-v0"``, or
            ``"module:Name-v0"`` to import the module that registers it first).
        system: an optional system message (say here which replies are valid actions).
        obs_to_text: ``obs -> str`` (or a list of str / PIL images / parts); default
            :func:`default_obs_to_text`. A callable or a ``"module:function"`` string.
        text_to_action: ``reply text -> action``; raise ValueError or return None for an unusable reply.
            Default: see the module docstring (Text and Discrete action spaces only).
        action_names: for a Discrete space without ``text_to_action``: one name per action, in order; a
            reply may give the name (case-insensitive) or the number.
        action_help: what a rejected reply is told about valid actions (default: from the action space).
        max_steps: end the episode (truncated) after this many replies, invalid ones included; None: only
            the wrapped env's own limit (and the rollout's ``max_turns``).
        env_kwargs: keyword arguments for ``gymnasium.make`` when ``env`` is an id.

    ``reset`` info: a copy of the wrapped env's info (an ``answer`` converted to str), plus ``seed`` and
    ``split``. ``step`` info: the wrapped env's step info, plus ``steps`` (replies so far),
    ``invalid_action`` (why the reply was rejected, or None) and, once the episode ends after a real step,
    ``final_message`` (the last observation as a message, which the episode does not show).
    """

    def __init__(
        self,
        env: str | gymnasium.Env,
        *,
        system: str | None = None,
        obs_to_text: Callable[[Any], Any] | str | None = None,
        text_to_action: Callable[[str], Any] | str | None = None,
        action_names: Sequence[str] | None = None,
        action_help: str | None = None,
        max_steps: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(env, str):
            try:
                env = gymnasium.make(env, **(env_kwargs or {}))
            except (gymnasium.error.Error, ModuleNotFoundError) as exc:
                raise ConfigError(
                    f"GymChatEnv(env={env!r}): gymnasium cannot make it ({type(exc).__name__}: {exc}). "
                    "Register the id with gymnasium.register(...) in a module, and write "
                    "'that_module:Name-v0' so that gymnasium imports it first."
                ) from exc
        elif not isinstance(env, gymnasium.Env):
            raise ConfigError(
                f"GymChatEnv(env=...): expected a gymnasium.Env or a gymnasium id string, got "
                f"{type(env).__name__}."
            )
        elif env_kwargs:
            raise ConfigError("GymChatEnv(env_kwargs=...) applies to an env id only; got an env instance.")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"GymChatEnv(system=...): expected a str or None, got {type(system).__name__}.")
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral) or max_steps < 1
        ):
            raise ConfigError(f"GymChatEnv(max_steps={max_steps!r}): expected an int >= 1 or None.")
        self.env = env
        self.system = system
        self.max_steps = None if max_steps is None else int(max_steps)
        self.obs_to_text = _resolve(obs_to_text, "obs_to_text") or default_obs_to_text
        self.text_to_action = _resolve(text_to_action, "text_to_action")
        space = env.action_space
        if action_names is not None:
            if not isinstance(space, spaces.Discrete) or self.text_to_action is not None:
                raise ConfigError(
                    "GymChatEnv(action_names=...) names the actions of a Discrete action space read by the "
                    f"default parser; this env's action space is {space} and text_to_action is "
                    f"{'given' if self.text_to_action else 'not given'}."
                )
            names = list(action_names)
            if len(names) != int(space.n) or not all(isinstance(n, str) and n.strip() for n in names):
                raise ConfigError(
                    f"GymChatEnv(action_names={names!r}): expected {int(space.n)} non-empty names, one per "
                    f"action of {space}."
                )
            if len({n.strip().casefold() for n in names}) != len(names):
                raise ConfigError(
                    f"GymChatEnv(action_names={names!r}): names must differ (case-insensitive)."
                )
            action_names = names
        if self.text_to_action is None and not isinstance(space, (spaces.Text, spaces.Discrete)):
            raise ConfigError(
                f"GymChatEnv: the wrapped env's action space is {space}; only Text and Discrete spaces have a "
                "default reply parser. Pass text_to_action=<function from the reply text to an action>."
            )
        self.action_names = action_names
        self.action_help = action_help if action_help is not None else self._describe_actions()
        self._info: dict[str, Any] | None = None
        self._steps = 0
        self._done = True

    # -- conversions ---------------------------------------------------------------------------------------
    def _describe_actions(self) -> str:
        space = self.env.action_space
        if isinstance(space, spaces.Discrete):
            first, last = int(space.start), int(space.start + space.n - 1)
            if self.action_names:
                return f"Reply with one of: {', '.join(self.action_names)}."
            return f"Reply with one integer from {first} to {last}."
        if isinstance(space, spaces.Text):
            chars = "".join(sorted(space.character_set))
            allowed = f" using only the characters {chars!r}" if len(chars) <= 100 else ""
            return f"Reply with {space.min_length} to {space.max_length} characters{allowed}."
        return f"Reply with a valid action for the action space {space}."

    def _observe(self, obs: Any) -> Message:
        try:
            converted = self.obs_to_text(obs)
            parts = list(converted) if isinstance(converted, (list, tuple)) else [converted]
            if not parts or not all(isinstance(p, (str, dict, Image.Image)) for p in parts):
                raise TypeError(f"it returned {type(converted).__name__}")
            return user(*parts)
        except Exception as exc:
            raise EnvError(
                f"GymChatEnv: obs_to_text could not turn the observation {obs!r:.100} into a message "
                f"({type(exc).__name__}: {exc}); it must return a str, or a list of str / PIL images / parts."
            ) from exc

    def _parse(self, text: str) -> Any:
        """The action for ``text``; raises ValueError (or another parse error) saying why there is none."""
        if self.text_to_action is not None:
            action = self.text_to_action(text)
            if action is None:
                raise ValueError("the reply names no action")
            return action
        tagged = extract_tag(text, "answer")
        body = (tagged if tagged is not None else text).strip()
        space = self.env.action_space
        if isinstance(space, spaces.Text):
            return body
        if self.action_names:
            folded = [name.strip().casefold() for name in self.action_names]
            if body.casefold() in folded:
                return int(space.start) + folded.index(body.casefold())
        if not _INTEGER.fullmatch(body):
            raise ValueError(f"{body!r:.60} is not an action")
        return int(body)

    def _action(self, text: str) -> tuple[Any, str | None]:
        """(action, None), or (None, why the reply is not a valid action)."""
        try:
            action = self._parse(text)
        except _PARSE_ERRORS as exc:
            return None, str(exc) or type(exc).__name__
        space = self.env.action_space
        try:
            valid = space.contains(action)
        except Exception:  # a parser returning a value of the wrong kind
            valid = False
        if not valid:
            return None, f"{action!r:.60} is not a valid action"
        return action, None

    # -- protocol ------------------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
                raise EnvError(f"GymChatEnv.reset: seed must be a non-negative int or None, got {seed!r}")
            seed = int(seed)
        super().reset(seed=seed)
        if options is not None and not isinstance(options, dict):
            raise EnvError(f"GymChatEnv.reset: options must be a dict or None, got {type(options).__name__}")
        inner_options = dict(options or {})
        split = check_split(inner_options.pop("split", "train"))
        if seed is None:
            seed = int(self.np_random.integers(0, 2**31 - 1))
        obs, info = self.env.reset(seed=scene_seed(seed, split), options=inner_options or None)
        info = dict(info)
        if "answer" in info and not isinstance(info["answer"], str):
            info["answer"] = str(_plain(info["answer"]))
        info.update(seed=seed, split=split)
        self._info, self._steps, self._done = info, 0, False
        messages = [system_message(self.system)] if self.system is not None else []
        messages.append(self._observe(obs))
        return messages, dict(info)

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._info is None:
            raise EnvError("GymChatEnv.step() was called before reset(): call env.reset(seed=...) first.")
        if self._done:
            raise EnvError(
                "GymChatEnv.step() was called after the episode ended: call env.reset() to start a new one."
            )
        if not isinstance(action, str):
            raise EnvError(f"GymChatEnv.step() takes the assistant's text (str), got {type(action).__name__}")
        self._steps += 1
        gym_action, problem = self._action(action)
        if problem is not None:
            message: Message | None = user(f"Invalid action: {problem}. {self.action_help}")
            reward, terminated, truncated, info = 0.0, False, False, {}
        else:
            obs, reward, terminated, truncated, info = self.env.step(gym_action)
            message = self._observe(obs)
            info = dict(info)
        truncated = bool(truncated) or (self.max_steps is not None and self._steps >= self.max_steps)
        terminated = bool(terminated)
        info.update(steps=self._steps, invalid_action=problem)
        if terminated or truncated:
            self._done = True
            if problem is None:
                info["final_message"] = message
            return [], float(reward), terminated, truncated, info
        return [message], float(reward), terminated, truncated, info

    def close(self) -> None:
        self.env.close()
        super().close()
