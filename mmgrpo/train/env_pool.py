"""The envs a run makes, and their ``close()``: every env the trainer builds is closed when it is done with
it, also when the run fails or is stopped (Ctrl-C, SIGTERM).

An env may hold threads, processes, sockets or a game server (a wrapped env's threads kept ``mmgrpo train``
alive after "model saved" when nothing closed them). ``EnvPool`` makes them through the run's factory and
remembers each one: ``pool.envs`` are the rollout's envs (made again by ``open()`` after a ``close()``);
``with pool.scope() as make_env:`` hands out a factory whose envs are closed when the block ends (the warm
start's and each evaluation's); ``close()`` closes every env still open. gymnasium's contract makes
``close()`` safe to call twice, so an env also closed by its other user is no problem.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from mmgrpo.env import ChatEnv

__all__ = ["EnvPool", "close_envs"]


def close_envs(envs: Iterable[ChatEnv]) -> int:
    """Close each env in turn; returns how many raised. A failing ``close()`` is one warning line on stderr
    (naming the env's class and the error), never an exception: it must not hide the error that may be
    ending the run, nor leave the other envs open."""
    failed = 0
    for env in envs:
        try:
            env.close()
        except Exception as exc:  # the run's own outcome matters more than one env's cleanup
            failed += 1
            print(
                f"mmgrpo: warning: {type(env).__name__}.close() raised {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
    return failed


class EnvPool:
    """Every env made through :meth:`make` (the rollout's ``n`` envs of :meth:`open` among them), each
    closed by :meth:`close` or at the end of the :meth:`scope` it was made in."""

    def __init__(self, make_env: Callable[[], ChatEnv]) -> None:
        self.make_env, self.n = make_env, 0
        self.made: list[ChatEnv] = []  # every env made and not yet closed, in order
        self.envs: list[ChatEnv] = []

    def make(self) -> ChatEnv:
        """A new env from the factory, closed by :meth:`close` (or its scope's end)."""
        env = self.make_env()
        self.made.append(env)
        return env

    def open(self, n: int | None = None) -> list[ChatEnv]:
        """The rollout's ``n`` envs (``n`` kept from the last call when None), made now when they were
        closed or never made."""
        self.n = self.n if n is None else n
        if len(self.envs) != self.n:
            close_envs(self.envs)
            self.made = [e for e in self.made if all(e is not r for r in self.envs)]
            self.envs = [self.make() for _ in range(self.n)]
        return self.envs

    @contextmanager
    def scope(self) -> Iterator[Callable[[], ChatEnv]]:
        """A factory whose envs are closed when the block ends, however it ends."""
        before = {id(e) for e in self.made}
        try:
            yield self.make
        finally:
            keep = before | {id(e) for e in self.envs}  # the rollout's envs stay open
            inside = [e for e in self.made if id(e) not in keep]
            self.made = [e for e in self.made if id(e) in keep]
            close_envs(inside)

    def close(self) -> None:
        """Close every env made and still open (the rollout's too: :meth:`open` makes new ones)."""
        made, self.made, self.envs = self.made, [], []
        close_envs(made)
