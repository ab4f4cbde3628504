"""A single-player TextArena game as a multi-turn env (registered env name ``textarena``; extra ``textarena``).

    env: {name: textarena, max_turns: 10, kwargs: {env_id: GuessTheNumber-v0}}
    verifiers: [{name: env_reward}]

TextArena (https://github.com/LeonGuertler/TextArena) games take the player's text as a move
(``env.step(text) -> (done, info)``) and show the player one observation string that grows over the game
(its ``LLMObservationWrapper`` replays the whole history every turn). The chat already holds that history,
so each env turn here is only the part that is new since the last one, without the echo of the model's own
move.

Reward and success are kept apart. At the game's end TextArena's reward for player 0 (``env.close()``) is the
step's reward: 1 for a win, a shaped value otherwise (GuessTheNumber: how close the last valid guess was,
also when the game is lost by invalid moves, e.g. 0.89). ``info["metrics"]`` carries ``success`` (1.0 only
for a game won: reward >= 1 and not ended by an invalid move), ``invalid_move`` and ``game_reward``; the
trainer logs them as ``env/...`` and ``mmgrpo eval`` counts ``success`` under the rule ``game won``.

Determinism and splits: the game of (seed, split) is TextArena's ``reset(num_players=1, seed=2 * seed +
(split == "eval"))``, so train and eval games never share a seed. TextArena games draw from Python's global
``random``; each env here keeps its own generator state and swaps it in around every call into TextArena
(under a lock, as the rollout steps envs from threads), so neither the games nor the caller's ``random``
depend on what else runs in the process.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

from mmgrpo.env import ChatEnv, Message, Task, check_step, start_task, system, user
from mmgrpo.envs.counting import scene_seed
from mmgrpo.errors import ConfigError, EnvError, did_you_mean

EXTRA = "pip install 'mmgrpo[textarena]' (or pip install textarena)"
_GLOBAL_RANDOM = threading.Lock()
"""Held while a TextArena call runs with an env's own state in Python's global ``random``."""


def import_textarena() -> Any:
    """The ``textarena`` module, or a ConfigError naming the extra that installs it."""
    from mmgrpo.registry import import_optional

    return import_optional("textarena", "env 'textarena'", "textarena", EXTRA)


def new_part(previous: str, current: str, role: str = "Player") -> str:
    """What ``current`` (TextArena's whole observation string) adds to ``previous``, without the echo of the
    player's own move (``\\n[Player] <move>``) at its start; all of ``current`` when it does not extend
    ``previous``."""
    part = current[len(previous) :] if current.startswith(previous) else current
    echo = f"\n[{role}] "
    if part.startswith(echo):
        cut = part.find("\n[", len(echo))
        part = part[cut:] if cut >= 0 else ""
    return part.strip()


def forget_history(game: Any) -> None:
    """Empty the history TextArena's observation wrappers keep (``full_observations``): their ``reset``
    leaves it, so a new game's first observation would replay the last game."""
    layer = game
    while layer is not None:
        history = getattr(layer, "full_observations", None)
        if isinstance(history, dict):
            history.clear()
        layer = getattr(layer, "env", None)


class TextArenaEnv(ChatEnv):
    """Play one single-player TextArena game; the model's whole reply is its move.

    Args (all keyword):
        env_id: the TextArena id, e.g. ``GuessTheNumber-v0``, ``TowerOfHanoi-v0``, ``Wordle-v0`` (a
            single-player game; ``ta.make(env_id)`` with its default wrappers).
        env_kwargs: keyword arguments for ``ta.make`` (the game's settings).
        system_prompt: an optional system message before the game's first observation.

    ``reset`` info: ``env_id``, ``seed``, ``split``. Step info at the game's end: ``reason`` (TextArena's),
    ``metrics`` (``success``, ``invalid_move``, ``game_reward``); on other turns ``metrics.success`` is 0.
    """

    success_rule = "game won"
    """Read by ``mmgrpo eval`` (mmgrpo.rollout.success): a success is a won game, whatever the shaped reward."""

    def __init__(
        self, *, env_id: str, env_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None
    ) -> None:
        ta = import_textarena()
        from textarena.envs.registration import ENV_REGISTRY

        if not isinstance(env_id, str) or env_id not in ENV_REGISTRY:
            raise ConfigError(
                f"env.kwargs.env_id={env_id!r} is not a TextArena env id."
                f"{did_you_mean(str(env_id), tuple(ENV_REGISTRY))} Single-player examples: GuessTheNumber-v0, "
                "TowerOfHanoi-v0, Wordle-v0"
            )
        if env_kwargs is not None and not isinstance(env_kwargs, dict):
            raise ConfigError(f"env.kwargs.env_kwargs must be a mapping, got {type(env_kwargs).__name__}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f"env.kwargs.system_prompt must be a string or null, got {system_prompt!r}")
        try:
            self.game = ta.make(env_id=env_id, **(env_kwargs or {}))
        except TypeError as exc:
            raise ConfigError(f"env.kwargs.env_kwargs={env_kwargs!r} do not fit {env_id} ({exc})") from None
        self.env_id, self.system_prompt = env_id, system_prompt
        self._random = random.Random(0).getstate()
        self._seen, self._started, self._done = "", False, True

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run the body with this env's generator state in Python's global ``random``, then put the
        caller's back."""
        with _GLOBAL_RANDOM:
            theirs = random.getstate()
            random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(theirs)

    def _observe(self) -> str:
        _, observation = self.game.get_observation()
        text = observation if isinstance(observation, str) else str(observation)
        part = new_part(self._seen, text)
        self._seen = text
        return part

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task, info = start_task(self, seed, options)
        return list(task.messages), info

    def make_task(self, seed: int, split: str) -> Task:
        with self._own_random():
            try:
                self.game.reset(num_players=1, seed=scene_seed(seed, split))
            except AssertionError as exc:  # SinglePlayerState asserts num_players == 1
                raise EnvError(
                    f"{self.env_id} is not a single-player TextArena game ({exc}); the textarena env plays "
                    "single-player games only"
                ) from None
            forget_history(self.game)
            self._seen = ""
            first = self._observe()
        self._started, self._done = True, False
        messages = [system(self.system_prompt)] if self.system_prompt else []
        messages.append(user(first))
        return Task(messages, {"env_id": self.env_id})

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        check_step(self, self._started, self._done, action)
        with self._own_random():
            done, _ = self.game.step(action)
            if not done:
                part = self._observe()
                return (
                    [user(part or "(no new observation)")],
                    0.0,
                    False,
                    False,
                    {"metrics": {"success": 0.0}},
                )
            rewards, game_info = self.game.close()
        self._done = True
        reward = float((rewards or {}).get(0, 0.0))
        player = (game_info or {}).get(0, {})
        invalid = bool(player.get("invalid_move", False))
        won = reward >= 1.0 and not invalid
        metrics = {"success": float(won), "invalid_move": float(invalid), "game_reward": reward}
        return [], reward, True, False, {"metrics": metrics, "reason": player.get("reason"), "success": won}
