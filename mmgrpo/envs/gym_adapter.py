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

Wrappers: ``wrappers`` are applied in order to the env made from an id, each a ``gymnasium.Wrapper`` class (or
any ``env -> env`` callable), a ``"module:Name"`` string, or ``{"name": "module:Name", "kwargs": {...}}``;
e.g. ``mmgrpo.envs.gym_frozenlake`` turns FrozenLake into a text game with a new map per seed.

Warm start (``warm_start: {source: env}``): an untrained model's first reply is no valid action (it runs to
``max_new_tokens``, which ends the episode), so every episode ends at turn 1 and GRPO has nothing to compare.
``demonstration(info, rng)`` plays the task's episode on the wrapped env with a demonstration policy and
returns its replies as the warm start's targets: ``demo_policy(obs) -> action`` when given (e.g. a scripted
solver; ``demo_policy(obs, rng)`` for a random one), else a random valid action; ``demo_random_share`` of the
steps take a random valid action instead, so the demonstrations show the reply format and a bias towards
good moves, not the whole game. Each reply is
``demo_reply`` with ``{action}`` replaced by the action's text (its name with ``action_names``, the number
for a Discrete space, the string for a Text space, or ``action_to_text(action)``), and it must parse back to
the same action. The wrapped env must replay the same episode from the same seed (its randomness from
``np_random``): the warm start then plays the replies through ``step``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import numbers
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from PIL import Image

from mmgrpo.env import ChatEnv, DemoTurn, Message, check_split, user
from mmgrpo.env import system as system_message
from mmgrpo.envs.counting import scene_seed
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.verifier import extract_tag

__all__ = ["GymChatEnv", "default_obs_to_text", "make_gym_env"]

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


_MAKE_KEYS = ("max_episode_steps", "disable_env_checker")  # gymnasium.make's own keyword arguments


def _accepted_keys(env_id: str) -> list[str] | None:
    """The keyword arguments ``gymnasium.make(env_id, ...)`` accepts: the env creator's parameters and make's
    own; None when they cannot be known (an unregistered id, or a creator taking ``**kwargs``)."""
    try:
        module, _, name = env_id.rpartition(":")
        if module:
            importlib.import_module(module)  # "module:Name-v0": the module registers the id
        creator = gymnasium.spec(name).entry_point
        if isinstance(creator, str):
            creator = gymnasium.envs.registration.load_env_creator(creator)
        params = inspect.signature(creator).parameters.values()
    except Exception:  # not registered, a module that does not import, no signature: say nothing more
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.name != "self"] + list(_MAKE_KEYS)


def _unknown_key_error(env_id: str, key: str, accepted: list[str] | None) -> ConfigError:
    close = difflib.get_close_matches(key, accepted or [], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    known = f"; {env_id} accepts: {', '.join(accepted)}" if accepted else ""
    return ConfigError(
        f"GymChatEnv(env={env_id!r}): env_kwargs has an unknown key {key!r}{hint}{known}. "
        "Fix env.kwargs.env_kwargs in the config."
    )


def make_gym_env(env_id: str, env_kwargs: dict[str, Any] | None = None) -> gymnasium.Env:
    """``gymnasium.make(env_id, **env_kwargs)``; a key the env does not accept, or any failure to make it, is
    one ConfigError line naming the id (and the key, with the accepted keys where the env's signature gives
    them), not gymnasium's traceback."""
    if env_kwargs is not None and not isinstance(env_kwargs, dict):
        raise ConfigError(
            f"GymChatEnv(env={env_id!r}): env_kwargs must be a mapping of keyword arguments, got "
            f"{type(env_kwargs).__name__}."
        )
    kwargs = dict(env_kwargs or {})
    accepted = _accepted_keys(env_id)
    if accepted is not None:
        for key in kwargs:
            if key not in accepted:
                raise _unknown_key_error(env_id, str(key), accepted)
    try:
        return gymnasium.make(env_id, **kwargs)
    except (gymnasium.error.Error, ModuleNotFoundError) as exc:
        raise ConfigError(
            f"GymChatEnv(env={env_id!r}): gymnasium cannot make it ({type(exc).__name__}: {exc}). "
            "Register the id with gymnasium.register(...) in a module, and write "
            "'that_module:Name-v0' so that gymnasium imports it first."
        ) from exc
    except Exception as exc:  # a bad value (map_name: 5x5 is a KeyError inside FrozenLake): still one line
        unexpected = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if isinstance(exc, TypeError) and unexpected and unexpected.group(1) in kwargs:
            raise _unknown_key_error(env_id, unexpected.group(1), accepted) from exc  # a creator's **kwargs
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"GymChatEnv(env={env_id!r}): gymnasium.make failed with env_kwargs={kwargs!r} "
            f"({type(exc).__name__}: {first}). Fix env.kwargs.env_kwargs."
        ) from exc


def _takes_two(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with two positional arguments (a demo policy that takes ``rng``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: call it with the observation only
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in params) >= 2


def _wrap(env: gymnasium.Env, wrappers: Sequence[Any]) -> gymnasium.Env:
    """``env`` with each of ``wrappers`` applied in order (see the module docstring for the forms)."""
    if isinstance(wrappers, (str, dict)) or not isinstance(wrappers, Sequence):
        raise ConfigError(
            f"GymChatEnv(wrappers={wrappers!r}): expected a list, e.g. ['my_package.wrappers:MyWrapper']."
        )
    for item in wrappers:
        kwargs: dict[str, Any] = {}
        if isinstance(item, dict):
            if (
                set(item) - {"name", "kwargs"}
                or "name" not in item
                or not isinstance(item.get("kwargs", {}), dict)
            ):
                raise ConfigError(
                    f"GymChatEnv(wrappers=[{item!r}]): a wrapper given as a mapping needs 'name' and may "
                    "have 'kwargs' (a mapping), e.g. {name: 'my_package.wrappers:Wrap', kwargs: {size: 4}}."
                )
            item, kwargs = item["name"], dict(item.get("kwargs") or {})
        wrapper = _resolve(item, "wrappers")
        try:
            env = wrapper(env, **kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"GymChatEnv(wrappers=[{item!r}]): cannot apply it with kwargs {kwargs!r}: {exc}."
            ) from exc
        if not isinstance(env, gymnasium.Env):
            raise ConfigError(
                f"GymChatEnv(wrappers=[{item!r}]): it returned {type(env).__name__}, not a gymnasium.Env."
            )
    return env


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
        env_kwargs: keyword arguments for ``gymnasium.make`` when ``env`` is an id; a key the env does not
            accept is a ConfigError naming it and the accepted keys.
        wrappers: applied in order to the env made from an id (see the module docstring).
        demo_policy: ``obs -> action``, or ``(obs, rng) -> action`` for a random policy (``rng`` a
            ``random.Random`` of the warm start: the same seed, the same demonstrations), for the warm
            start's demonstrations (a callable or a ``"module:function"`` string); default: a random valid
            action.
        demo_random_share: the share of demonstration steps that take a random valid action instead of
            ``demo_policy``'s (0 to 1).
        demo_reply: a demonstration reply, ``{action}`` replaced by the action's text (e.g.
            ``"<answer>{action}</answer>"``); default the action's text alone.
        action_to_text: ``action -> reply text`` for demonstrations, the inverse of ``text_to_action``;
            default: the action's name, number or string.

    ``reset`` info: a copy of the wrapped env's info (an ``answer`` converted to str), plus ``seed`` and
    ``split``. ``step`` info: the wrapped env's step info, plus ``steps`` (replies so far),
    ``invalid_action`` (why the reply was rejected, or None) and, once the episode ends after a real step,
    ``final_message`` (the last observation as a message, which the episode does not show). When the
    wrapped env's info has a ``state`` (a key of the env's state for turn-level credit), a rejected reply's
    info repeats the last one: the wrapped env was not stepped.
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
        wrappers: Sequence[Any] = (),
        demo_policy: Callable[[Any], Any] | str | None = None,
        demo_random_share: float = 0.0,
        demo_reply: str = "{action}",
        action_to_text: Callable[[Any], str] | str | None = None,
    ) -> None:
        if isinstance(env, str):
            env = _wrap(make_gym_env(env, env_kwargs), wrappers)
        elif not isinstance(env, gymnasium.Env):
            raise ConfigError(
                f"GymChatEnv(env=...): expected a gymnasium.Env or a gymnasium id string, got "
                f"{type(env).__name__}."
            )
        elif env_kwargs or wrappers:
            raise ConfigError(
                "GymChatEnv(env_kwargs=..., wrappers=...) apply to an env id only; got an env instance (wrap "
                "it yourself)."
            )
        if (
            isinstance(demo_random_share, bool)
            or not isinstance(demo_random_share, numbers.Real)
            or not (0.0 <= demo_random_share <= 1.0)
        ):
            raise ConfigError(
                f"GymChatEnv(demo_random_share={demo_random_share!r}): expected a number in [0, 1]."
            )
        if not isinstance(demo_reply, str) or "{action}" not in demo_reply:
            raise ConfigError(
                f"GymChatEnv(demo_reply={demo_reply!r}): expected a str with '{{action}}' in it, e.g. "
                "'<answer>{action}</answer>'."
            )
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
        self.demo_policy = _resolve(demo_policy, "demo_policy")
        self._policy_takes_rng = self.demo_policy is not None and _takes_two(self.demo_policy)
        self.demo_random_share = float(demo_random_share)
        self.demo_reply = demo_reply
        self.action_to_text = _resolve(action_to_text, "action_to_text")
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
        self._state: Any = None  # the wrapped env's last info["state"] (a turn-level credit key), if any
        self._inner_options: dict[str, Any] | None = None
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
        self._inner_options = inner_options or None
        obs, info = self.env.reset(seed=scene_seed(seed, split), options=self._inner_options)
        info = dict(info)
        if "answer" in info and not isinstance(info["answer"], str):
            info["answer"] = str(_plain(info["answer"]))
        info.update(seed=seed, split=split)
        self._info, self._steps, self._done = info, 0, False
        self._state = info.get("state")
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
            if self._state is not None:  # the wrapped env did not move: its state key stays
                info["state"] = self._state
        else:
            obs, reward, terminated, truncated, info = self.env.step(gym_action)
            message = self._observe(obs)
            info = dict(info)
            self._state = info.get("state")
        truncated = bool(truncated) or (self.max_steps is not None and self._steps >= self.max_steps)
        terminated = bool(terminated)
        info.update(steps=self._steps, invalid_action=problem)
        if terminated or truncated:
            self._done = True
            if problem is None:
                info["final_message"] = message
            return [], float(reward), terminated, truncated, info
        return [message], float(reward), terminated, truncated, info

    # -- warm start ----------------------------------------------------------------------------------------
    def demonstration(self, info: dict[str, Any], rng: random.Random) -> list[DemoTurn]:
        """The replies of one demonstration episode of the task just reset (``info`` from ``reset``): the
        wrapped env is played from the same seed with ``demo_policy`` (random valid actions where none is
        given, and in ``demo_random_share`` of the steps), then reset again, so that the warm start's
        ``step`` calls replay the episode. At most ``max_steps`` replies (else the wrapped env's own limit,
        else 100). What they teach: the reply format, short replies that end the turn, and the demonstration
        policy's moves."""
        if self._info is None:
            raise EnvError(
                "GymChatEnv.demonstration() was called before reset(): call env.reset(seed=...) first."
            )
        inner_seed = scene_seed(int(info["seed"]), info.get("split", "train"))
        saved = (self._info, self._steps, self._done)
        obs, _ = self.env.reset(seed=inner_seed, options=self._inner_options)
        replies: list[DemoTurn] = []
        try:
            for _ in range(self.max_steps or 100):
                use_policy = self.demo_policy is not None and rng.random() >= self.demo_random_share
                if not use_policy:
                    action = self._random_action(rng)
                else:
                    action = self.demo_policy(obs, rng) if self._policy_takes_rng else self.demo_policy(obs)
                replies.append(self._reply(action))
                obs, _, terminated, truncated, _ = self.env.step(action)
                if terminated or truncated:
                    break
        finally:
            self.env.reset(seed=inner_seed, options=self._inner_options)  # the warm start replays the episode
            self._info, self._steps, self._done = saved
        return replies

    def _random_action(self, rng: random.Random) -> Any:
        """A valid action drawn with ``rng`` (so that a warm start's seed gives the same demonstrations)."""
        space = self.env.action_space
        if isinstance(space, spaces.Discrete):
            return int(space.start) + rng.randrange(int(space.n))
        if isinstance(space, spaces.Text):
            chars = sorted(c for c in space.character_set if not c.isspace()) or sorted(space.character_set)
            return "".join(
                rng.choice(chars) for _ in range(rng.randint(max(space.min_length, 1), space.max_length))
            )
        space.seed(rng.randrange(2**31))
        return space.sample()

    def _reply(self, action: Any) -> str:
        """The demonstration reply for ``action``; a ConfigError when it is no valid action or the reply would
        not parse back to it."""
        space = self.env.action_space
        try:
            valid = space.contains(action)
        except Exception:
            valid = False
        if not valid:
            raise ConfigError(
                f"GymChatEnv(demo_policy=...): it returned {action!r:.60}, which is not in the action space "
                f"{space}."
            )
        if self.action_to_text is not None:
            text = str(self.action_to_text(action))
        elif isinstance(space, spaces.Discrete) and self.action_names:
            text = self.action_names[int(action) - int(space.start)]
        else:
            text = str(_plain(action))
        reply = self.demo_reply.replace("{action}", text)
        back, problem = self._action(reply)
        same = problem is None and (
            back == action if not isinstance(back, np.ndarray) else np.array_equal(back, action)
        )
        if not same:
            raise ConfigError(
                f"GymChatEnv: the demonstration reply {reply!r:.60} for action {action!r:.60} does not parse "
                f"back to it ({problem or f'it reads as {back!r:.60}'}). Pass action_to_text=<function "
                "from an action to the reply text that text_to_action reads>, or change demo_reply."
            )
        return reply

    def close(self) -> None:
        self.env.close()
        super().close()
