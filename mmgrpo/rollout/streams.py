"""Episodes that do not wait for each other: with an engine in another process (``rollout.engine: vllm``),
each episode is its own stream of requests. Its turn is sent as soon as its env has answered; its env step
runs (in the step pool) as soon as its turn is sampled, while the engine goes on with the other episodes'
turns. The group still trains together: the rollout returns when every episode has ended.

The bookkeeping per turn is ``mmgrpo.rollout.turn_rules``'s, the same as the turn-at-a-time loop's, so the
two schedules differ only in when each turn is sampled (tests/test_vllm_engine.py compares them)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from mmgrpo.model.batch import VisionInputs
from mmgrpo.rollout.turn_rules import append_env_turn, take_env_result, take_policy_turn, turn_budget


def run_streams(
    policy,
    envs: list,
    trajs: list,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    vision: VisionInputs,
    tools: list,
    *,
    step: Callable,
    pool: ThreadPoolExecutor,
    max_turns: int,
    max_new_tokens: int,
    budget: int,
    limit: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
) -> list[list[VisionInputs]]:
    """Run every episode of ``trajs`` (row i's env is ``envs[i]``, its prompt row ``trajs[i].group`` of
    ``prompt_ids`` (B, P) / ``prompt_mask`` (B, P)) to its end through ``policy.sampler``'s request streams;
    fills the trajectories in place and returns, per row, the vision inputs of its env turns."""
    from mmgrpo.model.vllm_engine import image_inputs, one_placeholder

    engine = policy.sampler
    engine.sync(policy.model)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    prompt_lens = [len(p) for p in prompts]
    resp_images: list[list[VisionInputs]] = [[] for _ in trajs]
    sampling = {"temperature": max(float(temperature), 0.0), "top_p": float(top_p), "top_k": int(top_k)}
    stop_ids = [int(i) for i in policy.stop_ids]

    def request(i: int) -> dict:
        t = trajs[i]
        seq = prompts[t.group] + t.response_ids
        if not resp_images[i]:
            images = None if group_images is None else group_images[t.group]
        else:
            row_vision = VisionInputs.join(vision.select([t.group]), VisionInputs.one_sequence(resp_images[i]))
            images = image_inputs(policy, row_vision, 1)[0]
        if images is not None:
            seq = one_placeholder(seq, policy.image_token_id)
        return {
            "id": i,
            "prompt": seq,
            "images": images,
            "max_tokens": turn_budget(t, max_new_tokens, budget),
            "stop_ids": stop_ids,
            **sampling,
        }

    group_images = image_inputs(policy, vision, len(prompts))  # turn 1's, once per task, not per row
    closed = [True] * len(trajs)
    stepping: dict[Future, int] = {}
    engine.submit([request(i) for i in range(len(trajs))])
    running = len(trajs)
    while running or stepping:
        if running:
            done, running = engine.poll()
            for i, ids, logprobs in done:
                (ids,), (finished,) = policy._cut_at_stop([ids])
                text, closed[i] = take_policy_turn(policy, trajs[i], ids, finished, logprobs)
                if not trajs[i].truncated:
                    stepping[pool.submit(step, envs[i], text)] = i
        if not stepping:
            continue
        ready = [f for f in stepping if f.done()]
        if not ready and not running:  # nothing sampling: wait for the first env to answer
            ready = list(wait(stepping, return_when=FIRST_COMPLETED).done)
        follow = []
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
            follow.append(request(i))
        if follow:
            engine.submit(follow)
            running += len(follow)
    return resp_images
