"""What happens to one episode at each point of a multi-turn rollout, the same whichever way the turns are
scheduled (``mmgrpo.rollout.schedule``: every live episode a turn at a time, or each episode on its own): a
policy turn is taken as sampled, the env's answer ends the episode or goes on,
and the env's turn is appended as tokens within the budgets."""

from __future__ import annotations

from typing import Any

from mmgrpo.env import assistant
from mmgrpo.model.batch import VisionInputs


def take_policy_turn(policy, t, ids: list[int], done: bool, logprobs: list[float] | None) -> tuple[str, bool]:
    """Append a sampled turn to trajectory ``t`` as it was sampled (loss mask 1, the sampler's log-probs
    kept): (its text, whether it ended at the end-of-turn token). A turn without a stop id truncates."""
    t.response_ids += ids
    t.loss_mask += [1] * len(ids)
    if logprobs is None or t.sampled_logp is None:
        t.sampled_logp = None
    else:
        t.sampled_logp += logprobs[: len(ids)]
    t.turns += 1
    text = policy.decode(ids)
    t.completion = text
    t.messages.append(assistant(text))
    if not done:
        t.truncated, t.truncation = True, "max_new_tokens"
    return text, bool(ids) and ids[-1] == policy.end_of_turn_id


def take_env_result(t, result: tuple, max_turns: int) -> list[dict] | None:
    """Record one ``env.step`` result (``episodes._step``'s tuple) on ``t``: the env's new messages when the
    episode goes on, None when it ended here (terminated, an env error, truncated, max_turns, no answer)."""
    obs, reward, terminated, env_truncated, info, error = result
    t.turn_rewards.append(reward)
    t.env_error = error
    t.tool_calls += int(info.get("tool_calls", 0))
    for kind, n in (info.get("tool_failures") or {}).items():
        t.tool_failures[kind] = t.tool_failures.get(kind, 0) + int(n)
    if "state" in info:  # the state the next turn answers (GiGPO's step groups)
        t.turn_states.append(info["state"])
    for name, value in (info.get("metrics") or {}).items():
        if isinstance(value, (int, float)):
            t.env_metrics[str(name)] = float(value)
    if terminated or error is not None:
        return None
    if env_truncated:
        t.truncated, t.truncation = True, "env"
    elif t.turns >= max_turns:
        t.truncated, t.truncation = True, "max_turns"
    elif not obs:
        t.truncated, t.truncation = True, "env"  # the env neither ended the episode nor answered
    else:
        return obs
    return None


def append_env_turn(
    policy,
    t,
    obs: list[dict],
    tools: Any,
    *,
    closed: bool,
    prompt_len: int,
    limit: int | None,
    budget: int,
    max_new_tokens: int,
) -> VisionInputs | None:
    """The env's turn appended to ``t`` as tokens (loss mask 0, NaN log-probs), its images processed once:
    the turn's vision inputs, or None when no next turn fits (truncated, "token_budget")."""
    ids, new_vision = policy.encode_continuation(t.messages, obs, tools, closed=closed)
    length = len(t.response_ids) + len(ids)  # the response with this env turn
    too_long = limit is not None and prompt_len + length + max_new_tokens > limit
    if length + 1 > budget or too_long:  # no room for the next turn: it ends here
        t.truncated, t.truncation = True, "token_budget"
        return None
    t.messages += obs
    t.response_ids += ids
    t.loss_mask += [0] * len(ids)
    if t.sampled_logp is not None:
        t.sampled_logp += [float("nan")] * len(ids)
    return new_vision


def turn_budget(t, max_new_tokens: int, budget: int) -> int:
    """New tokens the next policy turn of ``t`` may take."""
    return max(1, min(max_new_tokens, budget - len(t.response_ids)))
