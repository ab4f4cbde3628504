"""What a step reports: its metrics record over every process (``step_record``), the multi-turn counters
computed over every process's episodes at once, and sample episodes as text (``save_samples``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mmgrpo.config.core import Config
from mmgrpo.grpo.advantages import group_stats
from mmgrpo.rollout.answers import NO_ANSWER, answer_coverage, answer_table
from mmgrpo.rollout.episodes import RolloutBatch, episode_metrics
from mmgrpo.rollout.sampling import LENGTH_CUTS
from mmgrpo.train.diagnostics import repetition
from mmgrpo.train.distributed import gather_objects, reduce_records


def step_record(
    cfg: Config,
    accelerator,
    step: int,
    batch: RolloutBatch,
    scored: Any,
    adv: torch.Tensor,
    stats: dict[str, float],
    *,
    G: int,
    lr: float,
    times: tuple[float, float, float],
) -> dict[str, Any]:
    """Step ``step``'s metrics over all processes (mmgrpo.train.distributed.reduce_records); ``times`` are the
    rollout and update seconds and the step's start (perf_counter)."""
    t_rollout, t_train, t0 = times
    rewards = scored.total
    N = len(batch.trajectories)
    lengths = [t.num_policy_tokens for t in batch.trajectories]
    scored_rows = rewards[~scored.unscored]  # TRL: an episode no verifier scored is left out of the mean
    record: dict[str, Any] = {
        "step": step,
        "reward": float(scored_rows.mean()) if scored_rows.numel() else float("nan"),
        **{f"reward/{k}": scored.mean_scored(k) for k in scored.per_verifier},  # over the scored episodes
        **(
            group_stats(rewards, G)
            if bool(torch.isfinite(rewards).all())
            else {"reward_std_within_group": float("nan"), "frac_zero_std_groups": float("nan")}
        ),
        "adv_abs_mean": float(_on_policy(adv, batch).abs().mean()),
        **stats,
        "lr": lr,
        "completion_len": sum(lengths) / len(lengths),
        "repetition": repetition([t.completion for t in batch.trajectories]),
        **answer_metrics(batch.trajectories),
        "truncated_frac": sum(t.truncated for t in batch.trajectories) / N,
        **(
            {"overlong/masked_frac": sum(t.truncation in LENGTH_CUTS for t in batch.trajectories) / N}
            if cfg.grpo.overlong == "mask"
            else {}
        ),
        "verifier_failures": sum(scored.failures.values()),
        "reward_none": sum(scored.none_counts().values()),  # a verifier's None: that episode not scored
        "reward_unscored": int(scored.unscored.sum()),  # episodes no verifier scored (advantage 0)
        "env_errors": sum(t.env_error is not None for t in batch.trajectories),
        "env_reset_failures": len(batch.failed_tasks),
        "num_episodes": N,
        "group_size": G,
        "rollout_time": t_rollout,
        "train_time": t_train,
        "step_time": time.perf_counter() - t0,
    }
    record = reduce_records(gather_objects(accelerator, record))
    # the env's own metrics (env/<name>) for every run; the turn and tool counters for multi-turn runs
    more = all_episode_metrics(accelerator, batch.trajectories)
    record.update(more if cfg.env.max_turns > 1 else {k: v for k, v in more.items() if k.startswith("env/")})
    return record


def answer_metrics(trajectories: list) -> dict[str, float]:
    """``answer_coverage`` (``mmgrpo.rollout.answers``) for tasks with a few short answers: the share of
    this step's true answers that some episode gave. Nothing for other tasks, nor while fewer than half the
    episodes answer at all (a missing format is another symptom: zero-variance groups)."""
    table = answer_table(trajectories)
    counts = [(g, n) for row in table.values() for g, n in row.items()]
    answered = sum(n for g, n in counts if g != NO_ANSWER)
    if not counts or answered < 0.5 * sum(n for _, n in counts):
        return {}
    return {"answer_coverage": answer_coverage(table)}


def all_episode_metrics(accelerator, trajectories: list) -> dict[str, float]:
    """``episode_metrics`` over the episodes of every process at once, the same on each: exact, where
    reducing each process's means would not be (a tool failure kind one process never saw counts as 0 for
    its episodes, not as missing; an env metric is averaged over the episodes that reported it)."""
    parts = gather_objects(accelerator, episode_counters(trajectories))
    return episode_metrics([c for part in parts for c in part])


def episode_counters(trajectories: list) -> list[SimpleNamespace]:
    """What ``episode_metrics`` reads of each episode, small enough to gather from every process."""
    return [
        SimpleNamespace(
            turns=t.turns,
            tool_calls=t.tool_calls,
            tool_failures=dict(t.tool_failures),
            truncation=t.truncation,
            env_metrics=dict(t.env_metrics),
        )
        for t in trajectories
    ]


def save_samples(out_dir: Path, batch: RolloutBatch, scored: Any, step: int, n: int) -> Path:
    """The first ``n`` of this step's episodes, as text with their rewards: out_dir/samples/step-N.jsonl."""
    out = out_dir / "samples" / f"step-{step}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    n = min(n, len(batch.trajectories))
    with out.open("w") as f:
        for i, (t, ep) in enumerate(zip(batch.trajectories[:n], batch.episodes[:n], strict=True)):
            row = {
                "step": step,
                "group": t.group,
                "seed": t.seed,
                "prompt": prompt_text(t.messages),
                "completion": ep.completion,
                "reward": float(scored.total[i]),
                **{f"reward/{k}": float(v[i]) for k, v in scored.per_verifier.items()},
                "truncated": t.truncated,
            }
            f.write(json.dumps(row) + "\n")
    return out


def prompt_text(messages: list[dict]) -> str:
    """The text of the messages before the first assistant turn (images as <image>)."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            break
        c = m["content"]
        text = c if isinstance(c, str) else "".join(p.get("text", "<image>") for p in c)
        parts.append(f"{m['role']}: {text}")
    return "\n".join(parts)


def _on_policy(adv: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """Advantages per episode (N,) as they are; per token (N, T, grpo.credit) on the policy's tokens only."""
    if adv.dim() == 2:
        on = batch.tokens.loss_mask.bool()
        return adv[on] if bool(on.any()) else adv.new_zeros(1)
    return adv
