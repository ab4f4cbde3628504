"""Rollout: run G episodes per task against environments with a Policy, token in / token out.

For B tasks the G environment copies of a task are reset on the same seed; the prompt of each task is
templated and encoded once (images included) and shared by its G rows; the policy samples; each env's
``step(text)`` ends the episode (or, in later releases, answers with a new turn). The result keeps the
token ids that were sampled (never decoded and re-encoded), a loss mask that is 1 only on them, and the
decoded text and conversation for the verifiers.

Layout of the returned batch (see mmgrpo.policy): prompt_ids (N, P) left-padded, response_ids (N, T)
right-padded, loss_mask (N, T), with N = B * G and rows g*G .. g*G+G-1 forming group g.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.batch import TokenBatch, pad_right
from mmgrpo.env import ChatEnv
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.policy import Policy
from mmgrpo.verifier import Episode


@dataclass
class Trajectory:
    """One finished episode.

    response_ids: ids after the prompt (policy turns; later also env turns), as sampled
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

    @property
    def episodes(self) -> list[Episode]:
        return [t.to_episode() for t in self.trajectories]


def reset_group(envs: list[ChatEnv], seed: int, split: str) -> tuple[list[dict], dict]:
    """Reset every env of one group on the same task; returns the shared prompt and task info."""
    first_obs, first_info = envs[0].reset(seed=seed, options={"split": split})
    for env in envs[1:]:
        env.reset(seed=seed, options={"split": split})
    return first_obs, first_info


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
) -> RolloutBatch:
    """Run len(seeds) * group_size episodes; ``envs`` holds that many env instances (row order)."""
    if max_turns != 1:
        raise ConfigError(
            f"env.max_turns={max_turns}: this release runs single-turn episodes only; set env.max_turns=1."
        )
    B, G = len(seeds), group_size
    if len(envs) < B * G:
        raise ValueError(f"rollout needs {B * G} envs for {B} tasks x G={G}, got {len(envs)}")
    prompts, tasks = [], []
    for b, seed in enumerate(seeds):
        obs, info = reset_group(envs[b * G : (b + 1) * G], seed, split)
        prompts.append(obs)
        tasks.append(info)

    prompt_ids, prompt_mask, vision = policy.encode_prompts(prompts)  # (B, P), (B, P)
    limit = getattr(policy.model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and prompt_ids.shape[1] + max_new_tokens > limit:
        raise DataError(
            f"a prompt of {prompt_ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's {limit} positions (task seeds {seeds}); lower grpo.max_new_tokens or the image budget "
            "(model.max_pixels). Image tokens are never truncated."
        )
    rows = [b for b in range(B) for _ in range(G)]  # row i belongs to group i // G
    completions, finished = policy.generate(
        prompt_ids,
        prompt_mask,
        vision,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        num_samples=G,
    )

    trajectories = []
    for i, (ids, done) in enumerate(zip(completions, finished, strict=True)):
        b = rows[i]
        text = policy.decode(ids)
        env_error, reward, truncated = None, 0.0, not done
        try:
            _, reward, _, env_truncated, _ = envs[i].step(text)
            truncated = truncated or bool(env_truncated)
        except Exception as exc:  # a bad episode is data, not a crash
            env_error = f"{type(exc).__name__}: {exc}"
        messages = list(prompts[b]) + [{"role": "assistant", "content": [{"type": "text", "text": text}]}]
        trajectories.append(
            Trajectory(
                group=b,
                task=tasks[b],
                messages=messages,
                completion=text,
                response_ids=ids,
                loss_mask=[1] * len(ids),
                turn_rewards=[float(reward)],
                truncated=truncated,
                env_error=env_error,
            )
        )

    response_ids, response_mask = pad_right([t.response_ids for t in trajectories], policy.pad_token_id)
    loss_mask, _ = pad_right([t.loss_mask for t in trajectories], 0)  # (N, T)
    idx = torch.as_tensor(rows)
    tokens = TokenBatch(  # the prompt's ids repeated per row; its pixels held once (prompt_index)
        prompt_ids[idx], prompt_mask[idx], response_ids, response_mask, loss_mask, vision, prompt_index=rows
    )
    return RolloutBatch(trajectories, tokens, G)
