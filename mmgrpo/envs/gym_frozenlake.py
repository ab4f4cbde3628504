"""FrozenLake as a text game for ``GymChatEnv``: a new map per seed, the grid as text, a scripted solver.

Pieces for ``examples/frozenlake_tiny.yaml`` (and a model of how to fit any gymnasium game), used with
``env: FrozenLake-v1`` (``is_slippery: false``) through the adapter's ``wrappers`` and ``demo_policy``:

- :class:`RandomMaps`: each reset draws a new valid map (``generate_random_map`` of the map's size) from the
  reset's seed, so that tasks differ by their map (the start is always the top-left corner and the goal the
  bottom-right one). The map's parity (a CRC of its text) follows the seed's, and ``GymChatEnv`` gives the
  wrapped env even seeds for training and odd ones for evaluation: held-out maps are never training maps.
- :class:`GridText`: the observation (a cell number) as the grid with the player ``P`` on it, and a line
  listing the moves that stay on the map and out of holes, as a text adventure lists its exits, in the
  order up, left, right, down (``safe: up, right, down``): the last one listed heads for the goal when a
  move can. Why the line: the tiny model, built from scratch, did not learn to read holes off the grid
  within the example's budget (80 warm-start steps with a line naming what lies in each direction: its
  greedy replies were "down" until the wall, then "right", holes or not, 0.40 held-out success). With the
  line it learns to take the last safe move (the move next to its reply), and that alone reaches the goal
  on 74% of maps; the shortest path, which needs the grid, on all of them.
- :func:`shortest_path`: the action of a shortest path to the goal that avoids holes, read from that text:
  the example's demonstration policy.
"""

from __future__ import annotations

import string
import zlib
from collections import deque
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from mmgrpo.errors import ConfigError

__all__ = ["ACTION_NAMES", "GridText", "RandomMaps", "shortest_path"]

ACTION_NAMES = ("left", "down", "right", "up")
"""FrozenLake's actions 0..3, as ``GymChatEnv(action_names=...)`` names them."""

_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # (row, col) step of each action, in action order
_LISTED = (3, 0, 2, 1)  # the order safe moves are listed in: up, left, right, down (towards the goal last)


def _frozenlake(env: gymnasium.Env, wrapper: str) -> FrozenLakeEnv:
    inner = env.unwrapped
    if not isinstance(inner, FrozenLakeEnv):
        raise ConfigError(
            f"{wrapper} wraps FrozenLake only (env: FrozenLake-v1); got {type(inner).__name__}."
        )
    return inner


def map_parity(desc: list[str]) -> int:
    """0 or 1: a stable hash of the map's text (the same in every process and run)."""
    return zlib.crc32("\n".join(desc).encode()) % 2


class RandomMaps(gymnasium.Wrapper):
    """A new valid map per reset, drawn from the reset's seed, whose parity matches the seed's.

    Args:
        env: a FrozenLake env (``gymnasium.make("FrozenLake-v1", ...)``); its other settings (``is_slippery``,
            ``success_rate``, ``reward_schedule``) are kept.
        p: the probability that a tile is frozen (``generate_random_map``'s ``p``).
    """

    def __init__(self, env: gymnasium.Env, p: float = 0.8) -> None:
        super().__init__(env)
        inner = _frozenlake(env, "RandomMaps")
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"RandomMaps(p={p!r}): expected a probability in (0, 1].")
        self.p = float(p)
        self.size = int(inner.nrow)
        spec_kwargs = dict(inner.spec.kwargs) if inner.spec is not None else {}
        self._kwargs = {k: v for k, v in spec_kwargs.items() if k not in ("desc", "map_name", "render_mode")}

    def draw_map(self, seed: int) -> list[str]:
        """The map of ``seed``: the first of ``generate_random_map(seed=64 * seed + k)``, k = 0, 1, ... whose
        parity is the seed's."""
        for k in range(64):
            desc = generate_random_map(self.size, self.p, seed=64 * seed + k)
            if map_parity(desc) == seed % 2:
                return desc
        raise RuntimeError(f"RandomMaps: no map of parity {seed % 2} in 64 draws (p={self.p})")  # ~2**-64

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        inner = _frozenlake(self.env, "RandomMaps")
        map_seed = seed if seed is not None else int(np.random.default_rng().integers(2**31))
        fresh = FrozenLakeEnv(desc=self.draw_map(map_seed), **self._kwargs)
        for name in ("desc", "nrow", "ncol", "P", "initial_state_distrib"):
            setattr(inner, name, getattr(fresh, name))
        return self.env.reset(seed=seed, options=options)


def safe_moves(desc: np.ndarray, state: int) -> list[str]:
    """The moves from ``state`` that neither leave the map nor step into a hole, listed up, left, right,
    down: the last one heads for the goal (bottom right) when a move can."""
    nrow, ncol = desc.shape
    row, col = divmod(int(state), ncol)
    safe = []
    for action in _LISTED:
        r, c = row + _MOVES[action][0], col + _MOVES[action][1]
        if 0 <= r < nrow and 0 <= c < ncol and bytes(desc[r, c]) != b"H":
            safe.append(ACTION_NAMES[action])
    return safe


def render_grid(desc: np.ndarray, state: int, hint: bool = True) -> str:
    """The map with ``P`` where the player stands, then (``hint``) the safe moves (``safe: right, down``)."""
    row, col = divmod(int(state), desc.shape[1])
    grid = [[bytes(c).decode() for c in line] for line in desc]
    grid[row][col] = "P"
    text = "\n".join("".join(line) for line in grid)
    return text + "\nsafe: " + ", ".join(safe_moves(desc, state)) if hint else text


class GridText(gymnasium.ObservationWrapper):
    """FrozenLake's observation (the player's cell number) as text::

    SFFF
    FPFH
    FFFH
    HFFG
    safe: up, left, right, down

    Args:
        hint: show the ``safe:`` line (default). ``hint=False`` shows the bare grid: the player must read
            the holes off the map and plan the way round them (issue 55's planning task).

    ``reset`` and ``step`` info carry ``state``: the grid with the player, without the hint line, the same
    text for the same map and cell in every episode; turn-level credit (GiGPO) groups turns by it.
    """

    def __init__(self, env: gymnasium.Env, hint: bool = True) -> None:
        super().__init__(env)
        inner = _frozenlake(env, "GridText")
        if not isinstance(hint, bool):
            raise ConfigError(f"GridText(hint={hint!r}): expected true or false.")
        self.hint = hint
        self.observation_space = spaces.Text(
            max_length=(inner.ncol + 1) * inner.nrow + 40, charset=string.printable
        )

    def observation(self, observation: Any) -> str:
        return render_grid(self.env.unwrapped.desc, int(observation), self.hint)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        return self.observation(obs), {**info, "state": render_grid(self.env.unwrapped.desc, obs, False)}

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        state = render_grid(self.env.unwrapped.desc, obs, False)
        return self.observation(obs), reward, terminated, truncated, {**info, "state": state}


def shortest_path(obs: str) -> int:
    """The first action of a shortest hole-free path from ``P`` to ``G`` on a :class:`GridText` observation
    (ties: the first in action order left, down, right, up); 1 (down) when no path exists."""
    lines = [line for line in obs.splitlines() if line and set(line) <= set("SFHGP")]
    nrow, ncol = len(lines), len(lines[0])
    start = next((r, c) for r in range(nrow) for c in range(ncol) if lines[r][c] == "P")
    goal = next(((r, c) for r in range(nrow) for c in range(ncol) if lines[r][c] == "G"), None)
    if goal is None:
        return 1
    dist = {goal: 0}  # breadth-first from the goal over cells that are not holes
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _MOVES:
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < nrow and 0 <= nxt[1] < ncol and nxt not in dist and lines[nxt[0]][nxt[1]] != "H":
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    best, best_dist = 1, None
    for action, (dr, dc) in enumerate(_MOVES):
        nxt = (start[0] + dr, start[1] + dc)
        if nxt in dist and (best_dist is None or dist[nxt] < best_dist):
            best, best_dist = action, dist[nxt]
    return best
