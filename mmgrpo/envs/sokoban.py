"""A tiny Sokoban as a text game (registered env name ``sokoban``): one box, one target, a small room.

Issue 55's second planning task: pushing a box is irreversible, so a move that looks right (push the box
towards the target) can lose the game (the box stuck in a corner or against a wall away from the target),
and most puzzles need the player to walk round the box to push it from another side. The text::

    #____
    _B__T
    _P_#_
    _____

``#`` a wall, ``_`` floor, ``P`` the player (``p`` on the target), ``B`` the box, ``T`` the target; the
room's edge is a wall. A reply is one move (``left``, ``down``, ``right``, ``up``): the player steps, and
pushes the box when it walks into it and the cell beyond is free. Reward 1 when the box reaches the target
(the episode ends); the episode also ends, reward 0, as soon as no sequence of moves can solve the puzzle
any more (``info["deadlock"]``): a lost game says so at once instead of running out the turns.

Puzzles (:func:`draw_puzzle`): drawn from the reset's seed, rejected until solvable from the start, with
``min_moves`` to ``max_moves`` moves in a shortest solution and pushes in at least two directions (the
player has to walk round the box at least once). :func:`greedy_push` (walk behind the box, push it towards
the target, never look further) solves about 74% of these; ``greedy_fails=True`` keeps only the puzzles it
loses, where only looking ahead wins. As in ``gym_frozenlake.RandomMaps``, a puzzle's parity (a CRC of its
text) follows the seed's and ``GymChatEnv`` gives even seeds to training and odd ones to evaluation, so
held-out puzzles are never training puzzles.

``info["state"]`` (reset and step): the puzzle's text, the key turn-level credit (GiGPO) groups turns by.
:func:`solve` reads the text and returns the first move of a shortest solution: the warm start's
demonstration policy.
"""

from __future__ import annotations

import functools
import random
import string
import zlib
from collections import deque
from typing import Any

import gymnasium
from gymnasium import spaces

from mmgrpo.envs.gym_adapter import GymChatEnv
from mmgrpo.errors import ConfigError

__all__ = ["ACTIONS", "SokobanEnv", "TinySokoban", "draw_puzzle", "greedy_push", "render", "solve"]

ACTIONS = ("left", "down", "right", "up")
_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # (row, col) step of each action, in action order

Cell = tuple[int, int]


class Puzzle:
    """A room (rows x cols, ``walls`` a set of cells) with the target, the box and the player's cells."""

    def __init__(self, rows: int, cols: int, walls: frozenset[Cell], target: Cell, box: Cell, player: Cell):
        self.rows, self.cols, self.walls, self.target = rows, cols, walls, target
        self.box, self.player = box, player

    def free(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.rows and 0 <= c < self.cols and cell not in self.walls

    def move(self, player: Cell, box: Cell, action: int) -> tuple[Cell, Cell]:
        """(player, box) after ``action``: a step, a push, or nothing (a wall, or a box that cannot move)."""
        dr, dc = _MOVES[action]
        nxt = (player[0] + dr, player[1] + dc)
        if not self.free(nxt):
            return player, box
        if nxt == box:
            beyond = (box[0] + dr, box[1] + dc)
            return (nxt, beyond) if self.free(beyond) else (player, box)
        return nxt, box

    def plan(self, player: Cell, box: Cell) -> list[int] | None:
        """A shortest list of actions that brings the box to the target (breadth-first over (player, box);
        ties in action order), or None when none does."""
        start = (player, box)
        back: dict[tuple[Cell, Cell], tuple[tuple[Cell, Cell], int] | None] = {start: None}
        queue = deque([start])
        while queue:
            state = queue.popleft()
            if state[1] == self.target:
                actions = []
                while back[state] is not None:
                    state, action = back[state]
                    actions.append(action)
                return actions[::-1]
            for action in range(4):
                nxt = self.move(*state, action)
                if nxt not in back:
                    back[nxt] = (state, action)
                    queue.append(nxt)
        return None


def render(p: Puzzle) -> str:
    """The room as text (see the module docstring)."""
    lines = []
    for r in range(p.rows):
        row = []
        for c in range(p.cols):
            cell = (r, c)
            if cell == p.player:
                row.append("p" if cell == p.target else "P")
            elif cell == p.box:
                row.append("B")
            elif cell == p.target:
                row.append("T")
            else:
                row.append("#" if cell in p.walls else "_")
        lines.append("".join(row))
    return "\n".join(lines)


def parse(text: str) -> Puzzle:
    """The :class:`Puzzle` shown by ``text`` (the lines made of the game's characters)."""
    lines = [line for line in text.splitlines() if line and set(line) <= set("#_PpBT")]
    cells = {(r, c): ch for r, line in enumerate(lines) for c, ch in enumerate(line)}
    find = {ch: [cell for cell, v in cells.items() if v == ch] for ch in "PpBT"}
    player = (find["P"] + find["p"])[0]
    target = (find["T"] + find["p"])[0]
    walls = frozenset(cell for cell, v in cells.items() if v == "#")
    return Puzzle(len(lines), len(lines[0]), walls, target, find["B"][0], player)


def _push_directions(p: Puzzle, actions: list[int]) -> int:
    player, box, pushed = p.player, p.box, set()
    for action in actions:
        player, new_box = p.move(player, box, action)
        if new_box != box:
            pushed.add(action)
        box = new_box
    return len(pushed)


@functools.lru_cache(maxsize=4096)  # G episodes of a task reset on the same seed
def _draw(
    seed: int,
    rows: int = 4,
    cols: int = 5,
    walls: int = 2,
    min_moves: int = 4,
    max_moves: int = 8,
    greedy_fails: bool = False,
) -> tuple[int, int, frozenset[Cell], Cell, Cell, Cell]:
    """The first solvable room of ``seed`` that fits (see :func:`draw_puzzle`), as Puzzle's arguments (cached,
    immutable: G episodes of a task reset on the same seed)."""
    rng = random.Random(seed)
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    for _ in range(10_000):
        picked = rng.sample(cells, walls + 3)
        p = Puzzle(rows, cols, frozenset(picked[3:]), picked[0], picked[1], picked[2])
        plan = p.plan(p.player, p.box)
        if plan is None or not min_moves <= len(plan) <= max_moves or _push_directions(p, plan) < 2:
            continue
        if zlib.crc32(render(p).encode()) % 2 != seed % 2:
            continue
        if not greedy_fails or not _greedy_solves(p, 3 * max_moves):
            return rows, cols, p.walls, p.target, p.box, p.player
    raise RuntimeError(
        f"draw_puzzle: no puzzle for seed {seed} in 10000 draws ({rows}x{cols}, {walls} walls)"
    )


def draw_puzzle(seed: int, *shape, **kw) -> Puzzle:
    """The puzzle of ``seed`` (``shape``: rows, cols, walls, min_moves, max_moves, greedy_fails, as
    :func:`_draw` takes them): the first random room (from ``random.Random(seed)``) that is solvable, takes
    ``min_moves`` to ``max_moves`` moves, pushes in two directions or more, and whose parity is the seed's;
    with ``greedy_fails``, also one that :func:`greedy_push` does not solve within 3 * ``max_moves`` moves."""
    return Puzzle(*_draw(seed, *shape, **kw))  # a new Puzzle each time: an episode moves its box and player


def solve(obs: str) -> int:
    """The first move of a shortest solution of the puzzle shown by ``obs``; 0 (left) when none exists."""
    p = parse(obs)
    plan = p.plan(p.player, p.box)
    return plan[0] if plan else 0


def greedy_push(obs: str) -> int:
    """A player who does not plan: walk (shortest way, round the box) to the cell behind the box on an axis
    that brings it closer to the target, then push; deadlocks are not foreseen. 0 (left) when stuck."""
    p = parse(obs)
    (br, bc), (tr, tc) = p.box, p.target
    wants = [a for a, ok in ((3, tr < br), (1, tr > br), (0, tc < bc), (2, tc > bc)) if ok]
    for action in wants:
        behind = (br - _MOVES[action][0], bc - _MOVES[action][1])
        if not p.free(behind):
            continue
        if p.player == behind:
            return action
        back: dict[Cell, tuple[Cell, int] | None] = {p.player: None}
        queue = deque([p.player])
        while queue and behind not in back:
            cell = queue.popleft()
            for a, (dr, dc) in enumerate(_MOVES):
                nxt = (cell[0] + dr, cell[1] + dc)
                if p.free(nxt) and nxt != p.box and nxt not in back:
                    back[nxt] = (cell, a)
                    queue.append(nxt)
        if behind in back:
            cell, first = behind, 0
            while back[cell] is not None:
                cell, first = back[cell]
            return first
    return 0


def _greedy_solves(p: Puzzle, max_steps: int) -> bool:
    player, box = p.player, p.box
    for _ in range(max_steps):
        shown = Puzzle(p.rows, p.cols, p.walls, p.target, box, player)
        player, box = p.move(player, box, greedy_push(render(shown)))
        if box == p.target:
            return True
    return False


class TinySokoban(gymnasium.Env):
    """The game as a gymnasium env: text observations, ``Discrete(4)`` actions (left, down, right, up)."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        rows: int = 4,
        cols: int = 5,
        walls: int = 2,
        min_moves: int = 4,
        max_moves: int = 8,
        greedy_fails: bool = False,
    ) -> None:
        for name, value, low in (
            ("rows", rows, 2),
            ("cols", cols, 2),
            ("walls", walls, 0),
            ("min_moves", min_moves, 1),
            ("max_moves", max_moves, min_moves),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"TinySokoban({name}={value!r}): expected an int >= {low}.")
        if walls + 3 > rows * cols:
            raise ConfigError(
                f"TinySokoban: {walls} walls, a box, a target and a player do not fit {rows}x{cols}."
            )
        if not isinstance(greedy_fails, bool):
            raise ConfigError(f"TinySokoban(greedy_fails={greedy_fails!r}): expected true or false.")
        self.size = (rows, cols, walls, min_moves, max_moves, greedy_fails)
        self.action_space = spaces.Discrete(4)
        self.observation_space = spaces.Text(max_length=(cols + 1) * rows, charset=string.printable)
        self.puzzle: Puzzle | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        puzzle_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        self.puzzle = draw_puzzle(puzzle_seed, *self.size)
        text = render(self.puzzle)
        return text, {"state": text}

    def step(self, action: int):
        p = self.puzzle
        if p is None:
            raise RuntimeError("TinySokoban.step() before reset()")
        p.player, p.box = p.move(p.player, p.box, int(action))
        text = render(p)
        solved = p.box == p.target
        deadlock = not solved and p.plan(p.player, p.box) is None
        return text, float(solved), solved or deadlock, False, {"state": text, "deadlock": deadlock}


SYSTEM = (
    "Push the box B onto the target T. You are P; # is a wall, _ is floor, the edge is a wall. "
    "You push a box by walking into it; you cannot pull it. Reply with one move: left, down, right or up."
)


class SokobanEnv(GymChatEnv):
    """A tiny Sokoban puzzle per task (one box, one target), played in chat; reward 1 when solved.

    Args (all keyword): rows, cols, walls, min_moves, max_moves, greedy_fails: the puzzles
    (:func:`draw_puzzle`: a shortest solution takes min_moves to max_moves moves; greedy_fails: only those
    a player who does not look ahead loses); max_steps: replies
    before the episode is cut (invalid ones count); system: the system message; demo_random_share: the
    share of warm-start demonstration moves that are random instead of a shortest solution's.
    """

    def __init__(
        self,
        *,
        rows: int = 4,
        cols: int = 5,
        walls: int = 2,
        min_moves: int = 4,
        max_moves: int = 8,
        greedy_fails: bool = False,
        max_steps: int = 12,
        system: str | None = SYSTEM,
        demo_random_share: float = 0.0,
    ) -> None:
        super().__init__(
            TinySokoban(rows, cols, walls, min_moves, max_moves, greedy_fails),
            system=system,
            action_names=list(ACTIONS),
            max_steps=max_steps,
            demo_policy=solve,
            demo_random_share=demo_random_share,
        )
