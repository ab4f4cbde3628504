"""The multi-turn schedule: every episode of a rollout from its first turn to its end, through one engine
(``mmgrpo.model.turn_engines``), whichever engine it is.

An episode's turn is sent to the engine; when it comes back sampled, the episode's ``env.step`` runs in the
step pool (tools run there, each with its own timeout); when the env answers, its turn is appended as tokens
and the episode's next turn is sent. An engine that batches (``batches_turns``: mmgrpo's own decode loop)
gets every live episode's turn at once, after the last env of the turn has answered; an engine whose
requests end on their own (vLLM) gets each episode's turn as soon as its env has answered, so no episode
waits for another's turn or tool. The group still trains together: the schedule returns when every
episode has ended.

The bookkeeping per turn is ``mmgrpo.rollout.turn_rules``'s: the two schedules differ only in when each
turn is sampled (tests compare them)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.turn_engines import TurnRequest
from mmgrpo.rollout.turn_rules import append_env_turn, take_env_result, take_policy_turn, turn_budget


def run_turns(
    engine,
    policy,
    envs: list,
    trajs: list,
    prompt_lens: list[int],
    tools: list,
    *,
    step: Callable,
    pool: ThreadPoolExecutor,
    max_turns: int,
    max_new_tokens: int,
    budget: int,
    limit: int | None,
) -> list[list[VisionInputs]]:
    """Run every episode of ``trajs`` (row i's env is ``envs[i]``, its prompt ``trajs[i].group``, opened on
    ``engine`` with ``begin``) to its end; fills the trajectories in place and returns, per row, the vision
    inputs of its env turns."""
    resp_images: list[list[VisionInputs]] = [[] for _ in trajs]
    latest: dict[int, VisionInputs] = {}  # per row, the images of its newest env turn
    closed = [True] * len(trajs)  # per row, whether its last turn ended at the end-of-turn token

    def request(i: int) -> TurnRequest:
        t = trajs[i]
        return TurnRequest(
            row=i,
            group=t.group,
            response_ids=list(t.response_ids),
            max_tokens=turn_budget(t, max_new_tokens, budget),
            images=resp_images[i],
            latest=latest.get(i),
        )

    engine.submit([request(i) for i in range(len(trajs))])
    sampling = len(trajs)  # turns sent and not back yet
    stepping: dict[Future, int] = {}
    waiting: list[int] = []  # rows whose next turn is held back until the batch's turn (batches_turns)
    while sampling or stepping or waiting:
        if sampling:
            for r in engine.poll():
                sampling -= 1
                text, closed[r.row] = take_policy_turn(policy, trajs[r.row], r.ids, r.finished, r.logprobs)
                if not trajs[r.row].truncated:
                    stepping[pool.submit(step, envs[r.row], text)] = r.row
        ready = [f for f in stepping if f.done()]
        if stepping and not ready and not sampling:  # nothing sampling: wait for the first env to answer
            ready = list(wait(stepping, return_when=FIRST_COMPLETED).done)
        for future in ready:
            i = stepping.pop(future)
            t = trajs[i]
            obs = take_env_result(t, future.result(), max_turns)
            if obs is None:
                continue
            new_vision = append_env_turn(
                policy,
                t,
                obs,
                tools[t.group],
                closed=closed[i],
                prompt_len=prompt_lens[t.group],
                limit=limit,
                budget=budget,
                max_new_tokens=max_new_tokens,
            )
            if new_vision is None:
                continue
            if not new_vision.empty:
                resp_images[i].append(new_vision)
            latest[i] = new_vision
            waiting.append(i)
        if waiting and (not engine.batches_turns or not (sampling or stepping)):
            engine.submit([request(i) for i in sorted(waiting)])
            sampling, waiting = sampling + len(waiting), []
    return resp_images
