"""Rollout: run G episodes per task against environments with a Policy, token in / token out, multi-turn.

For B tasks the G environment copies of a task are reset on the same seed. All live episodes advance one
turn per batched generation:

  turn 1   each task's prompt (images and tool list included) is templated and encoded once and shared by
           its G rows (one prefill per group, G samples decoded on the repeated KV cache);
  step     every live episode's ``env.step(text)`` runs at once in a thread pool (tools run there, each
           with its own timeout, so one slow tool does not serialise the batch);
  append   the env's new messages are rendered by the chat template and appended as new token ids
           (``Policy.encode_continuation``: a prefix extension, checked), images processed once and kept
           with their row; earlier turns are never decoded and re-encoded;
  turn k   the KV cache of turn 1 lives on (``mmgrpo.model.turns``): finished rows leave it, and only the
           tokens it lacks (the env's new turn, its images) are run before the next turn is sampled. The
           prompt stays encoded once per group, earlier turns are never run again. Families that cannot
           continue a cache (Gemma 3's sliding layers; see ``turns.supported``) encode the live rows'
           whole sequences instead, as does a Policy subclass that samples with its own ``generate``.

An episode ends when the env terminates or truncates it, when a turn ends without a stop token
(``max_new_tokens`` per turn), at ``max_turns`` policy turns, or when its response would exceed the token
budget ``max_episode_tokens``; the last three count as truncated, with the reason kept. The model's positions
(``max_position_embeddings``) are a budget too: an episode whose prompt, response, new env turn and a full
next turn (``max_new_tokens``) would not fit ends there, truncated ("token_budget"), and the rest of the
batch goes on (only a prompt that cannot fit with one turn is an error: a config to change).

A turn that stops on a stop id other than the template's end-of-turn token (Qwen's ``<|endoftext|>`` next to
``<|im_end|>``) keeps that sampled token; when the env answers, its appended tokens first close the turn as
the template does (``<|im_end|>\n``), so that the ids stay the template's rendering of the conversation.

Layout of the returned batch (see mmgrpo.model.batch): prompt_ids (N, P) left-padded, response_ids (N, T)
right-padded (policy turns and env turns), loss_mask (N, T) = 1 only on sampled tokens, per-row response
images, and ``group_ids`` (N,): row i belongs to the task ``group_ids[i]`` (rows g*G .. g*G+G-1 today).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.env import ChatEnv, SingleTurnEnv, bare_prompt
from mmgrpo.errors import ConfigError, DataError, EnvError
from mmgrpo.model.batch import TokenBatch, VisionInputs, pad_right
from mmgrpo.model.policy import Policy
from mmgrpo.model.turn_engines import Sampling, positions_limit, turn_engine
from mmgrpo.rollout.schedule import run_turns
from mmgrpo.verifier import Episode

TRUNCATION_REASONS = ("max_new_tokens", "max_turns", "token_budget", "env")


@dataclass
class Trajectory:
    """One finished episode.

    response_ids: ids after the prompt (policy turns and env turns), as sampled / as appended
    loss_mask: 1 per response token the policy generated, 0 for environment tokens
    turn_rewards: the environment's reward after each policy turn
    """

    group: int
    task: dict[str, Any]
    messages: list[dict]
    completion: str
    response_ids: list[int]
    loss_mask: list[int]
    turn_rewards: list[float] = field(default_factory=list)
    truncated: bool = False
    env_error: str | None = None
    turns: int = 0
    truncation: str | None = None  # one of TRUNCATION_REASONS when truncated
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    response_vision: VisionInputs = field(default_factory=lambda: VisionInputs(images_per_seq=[0]))
    seed: int | None = None  # the task seed the env was reset on
    env_metrics: dict[str, float] = field(default_factory=dict)  # the env's own, last value per name
    turn_states: list = field(default_factory=list)
    """Per policy turn, the env's ``info["state"]`` it answered (from reset, then from each step), where the
    env gives one: GiGPO's step groups (grpo.credit)."""
    sampled_logp: list[float] | None = field(default_factory=list)
    """Per response token, the sampler's log-prob as it was drawn (NaN on env tokens); None when a turn came
    from a sampler that gives none (a Policy subclass's own ``generate``)."""

    @property
    def num_policy_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def to_episode(self) -> Episode:
        return Episode(
            completion=self.completion,
            messages=self.messages,
            task=self.task,
            env_reward=float(sum(self.turn_rewards)),
            truncated=self.truncated,
        )


@dataclass
class RolloutBatch:
    trajectories: list[Trajectory]
    tokens: TokenBatch
    group_size: int
    failed_tasks: list[tuple[int, str]] = field(default_factory=list)
    """Tasks whose env raised in ``reset``: (seed, error). They are left out of the batch, not a crash."""

    @property
    def episodes(self) -> list[Episode]:
        return [t.to_episode() for t in self.trajectories]

    @property
    def group_ids(self) -> list[int]:
        """Per row, the task (group) it belongs to: group statistics are taken over equal ids."""
        return [t.group for t in self.trajectories]


def reset_group(envs: list[ChatEnv], seed: int, split: str) -> tuple[list[dict], dict]:
    """Reset every env of one group on the same task; returns the shared prompt and task info."""
    first_obs, first_info = envs[0].reset(seed=seed, options={"split": split})
    for env in envs[1:]:
        shared = isinstance(env, SingleTurnEnv) and env.reset_like(envs[0], seed)
        if not shared:
            env.reset(seed=seed, options={"split": split})
    return first_obs, first_info


def _step(env: ChatEnv, text: str) -> tuple[list[dict], float, bool, bool, dict, str | None]:
    """env.step(text); an exception ends the episode and is kept as data (a bad episode is not a crash)."""
    try:
        obs, reward, terminated, truncated, info = env.step(text)
        return list(obs or []), float(reward), bool(terminated), bool(truncated), dict(info or {}), None
    except Exception as exc:
        return [], 0.0, True, False, {}, f"{type(exc).__name__}: {exc}"


_STEP_POOL: ThreadPoolExecutor | None = None


def _step_pool() -> ThreadPoolExecutor:
    global _STEP_POOL
    if _STEP_POOL is None:
        _STEP_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="mmgrpo-env-step")
    return _STEP_POOL


def rollout(
    policy: Policy,
    envs: list[ChatEnv],
    seeds: list[int],
    *,
    group_size: int,
    split: str = "train",
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_turns: int = 1,
    max_episode_tokens: int | None = None,
    kv_across_turns: bool = True,
    bare: bool | Sequence[bool] = False,
) -> RolloutBatch:
    """Run len(seeds) * group_size episodes; ``envs`` holds that many env instances (row order).

    ``kv_across_turns=False`` encodes every live row's whole sequence again at each turn (the way before
    the cache was kept; the tests compare both). ``bare=True`` cuts each prompt to ``bare_prompt`` (the
    question alone: no system prompt, tool schemas or images; the tools still run on the task's own data);
    a sequence says it per seed."""
    if max_turns < 1:
        raise ConfigError(f"env.max_turns={max_turns}: an episode needs at least one policy turn")
    B, G = len(seeds), group_size
    N = B * G
    if len(envs) < N:
        raise ValueError(f"rollout needs {N} envs for {B} tasks x G={G}, got {len(envs)}")
    budget = max_episode_tokens or 10**9  # response tokens (policy and env) an episode may hold
    prompts, tasks, kept, failed = [], [], [], []
    bare_tasks = [bare] * B if isinstance(bare, bool) else list(bare)
    if len(bare_tasks) != B:
        raise ValueError(f"rollout: bare has {len(bare_tasks)} flags for {B} tasks")
    for b, seed in enumerate(seeds):
        try:
            obs, info = reset_group(envs[b * G : (b + 1) * G], seed, split)
            if bare_tasks[b]:
                obs, info = bare_prompt(obs), {**info, "tools": None}
        except Exception as exc:  # a task the env cannot pose is data: leave it out, say which
            failed.append((seed, f"{type(exc).__name__}: {exc}"))
            continue
        prompts.append(obs)
        tasks.append(info)
        kept.append(b)
    if not kept:
        raise EnvError(
            f"the environment raised in reset() for every task of this batch ({split} seeds {seeds}); first: "
            f"seed {failed[0][0]}: {failed[0][1]}"
        )
    envs = [env for b in kept for env in envs[b * G : (b + 1) * G]]  # row order of the kept tasks
    B, N = len(kept), len(kept) * G
    tools = [info.get("tools") or None for info in tasks]  # JSON schemas for the chat template

    prompt_ids, prompt_mask, vision = policy.encode_prompts(prompts, tools)  # (B, P), (B, P)
    vision = policy.encode_images(vision)  # a frozen encoder runs here, once per image, for every pass
    limit = positions_limit(policy)
    prompt_lens = prompt_mask.sum(dim=1).tolist()  # (B,) real tokens of each group's prompt
    if limit is not None and prompt_ids.shape[1] + max_new_tokens > limit:
        raise DataError(
            f"a prompt of {prompt_ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's {limit} positions (task seeds {seeds}); lower grpo.max_new_tokens or the image budget "
            "(model.max_pixels). Image tokens are never truncated."
        )
    rows = [b for b in range(B) for _ in range(G)]  # row i belongs to group i // G
    trajs = [
        Trajectory(
            group=rows[i],
            task=tasks[rows[i]],
            messages=list(prompts[rows[i]]),
            completion="",
            response_ids=[],
            loss_mask=[],
            seed=seeds[kept[rows[i]]],
            turn_states=[tasks[rows[i]]["state"]] if "state" in tasks[rows[i]] else [],
        )
        for i in range(N)
    ]
    engine = turn_engine(
        policy,
        Sampling(temperature=temperature, top_p=top_p, top_k=top_k),
        keep_cache=kv_across_turns and max_turns > 1,
    )
    engine.begin(prompt_ids, prompt_mask, vision, G)
    try:
        resp_images = run_turns(
            engine,
            policy,
            envs,
            trajs,
            prompt_lens,
            tools,
            step=_step,
            pool=_step_pool(),
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            budget=budget,
            limit=limit,
        )
    finally:
        engine.end()

    response_ids, response_mask = pad_right([t.response_ids for t in trajs], policy.pad_token_id)  # (N, T)
    loss_mask, _ = pad_right([t.loss_mask for t in trajs], 0)  # (N, T)
    for i, t in enumerate(trajs):
        t.response_vision = VisionInputs.one_sequence(resp_images[i])
    response_vision = VisionInputs.concat_rows([t.response_vision for t in trajs])
    idx = torch.as_tensor(rows)
    sampled_logp = None  # (N, T) the sampler's log-probs, NaN off the policy tokens
    if all(t.sampled_logp is not None for t in trajs):
        sampled_logp = torch.full(response_ids.shape, float("nan"))
        for i, t in enumerate(trajs):
            sampled_logp[i, : len(t.sampled_logp)] = torch.tensor(t.sampled_logp, dtype=torch.float32)
    tokens = TokenBatch(  # the prompt's ids repeated per row; its pixels held once (prompt_index)
        prompt_ids[idx],
        prompt_mask[idx],
        response_ids,
        response_mask,
        loss_mask,
        vision,
        prompt_index=rows,
        response_vision=None if response_vision.empty else response_vision,
        sampled_logp=sampled_logp,
    )
    return RolloutBatch(trajs, tokens, G, failed_tasks=failed)


def episode_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-episode means of the multi-turn and tool-use counters, for the metrics log and ``mmgrpo eval``.

    turns, tool_calls (per episode), tools/used_frac (share of episodes with at least one call),
    tools/failures (per episode) and tools/fail/<kind> (per episode, every kind seen), truncated/<reason>
    (share of episodes cut by max_new_tokens, max_turns, token_budget or the env), and env/<name> for
    every number an env reported in its step infos under ``info["metrics"]`` (last value per episode,
    averaged over the episodes that reported it).
    """
    n = max(len(trajectories), 1)
    out: dict[str, float] = {
        "turns": sum(t.turns for t in trajectories) / n,
        "tool_calls": sum(t.tool_calls for t in trajectories) / n,
        "tools/used_frac": sum(t.tool_calls > 0 for t in trajectories) / n,
        "tools/failures": sum(sum(t.tool_failures.values()) for t in trajectories) / n,
    }
    kinds = sorted({k for t in trajectories for k in t.tool_failures})
    for kind in kinds:
        out[f"tools/fail/{kind}"] = sum(t.tool_failures.get(kind, 0) for t in trajectories) / n
    for reason in TRUNCATION_REASONS:
        out[f"truncated/{reason}"] = sum(t.truncation == reason for t in trajectories) / n
    for name in sorted(
        {k for t in trajectories for k in t.env_metrics}
    ):  # mean over the episodes reporting it
        values = [t.env_metrics[name] for t in trajectories if name in t.env_metrics]
        out[f"env/{name}"] = sum(values) / len(values)
    return out
