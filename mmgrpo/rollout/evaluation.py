"""Held-out evaluation: greedy episodes on the eval split, scored by the verifiers.

Eval seeds ``seed_offset .. seed_offset + n - 1`` on the env's ``eval`` split, which every built-in env maps
to scenes disjoint from the training split. One verifier is the metric (``eval.metric``, by default the
first verifier of the config): the result holds its mean ``score`` and the ``success`` rate under a rule
that the env or the verifier states (``mmgrpo.rollout.success``; a score >= 0.5 when neither does), with the
rule written out in ``success_rule``. ``accuracy`` and ``correct`` are kept for older readers: the success
rate and the number of successes.

Every env an evaluation makes is closed when it ends, also on an error or Ctrl-C.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmgrpo.env import ChatEnv
from mmgrpo.errors import DataError
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.answers import answer_table
from mmgrpo.rollout.episodes import Trajectory, episode_metrics, rollout
from mmgrpo.rollout.success import SuccessRule, choose_rule, env_rule, successes, verifier_rule
from mmgrpo.tools.visible import visible
from mmgrpo.verifier import Rewards


@dataclass
class EvalResult:
    accuracy: float
    """The success rate (``success``), under this name for older readers."""
    n: int
    metric: str
    correct: int = 0
    """Episodes that succeeded under ``success_rule`` (accuracy = success = correct / n)."""
    score: float | None = None
    """The metric verifier's mean score (None in results made by hand without it)."""
    success: float | None = None
    """The share of episodes that succeeded under ``success_rule`` (equal to ``accuracy``)."""
    success_rule: str = "score >= 0.5, the default"
    """What a success is, and who said so: ``env: ...``, ``verifier: ...`` or the default threshold."""
    success_source: str = "default"
    """Who defined success: ``env``, ``verifier`` or ``default`` (mmgrpo.rollout.success.SOURCES)."""
    per_verifier: dict[str, float] = field(default_factory=dict)
    format_failures: int = 0
    samples: list[dict] = field(default_factory=list)
    episode_metrics: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes: turns, tool calls and failures per episode, truncation (rollout.episode_metrics)."""
    transcripts: list[list[dict]] = field(default_factory=list)
    """Multi-turn episodes: the first few whole conversations (``write_transcripts`` saves them)."""
    answers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Tasks with a few short answers (counts, choices): true answer -> {answer given: episodes}
    (``answer_table``); empty for other tasks."""

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "transcripts"}
        d["samples"] = d["samples"][:20]
        return d


def evaluate(
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    rewards: Rewards,
    *,
    episodes: int,
    metric: str,
    batch_size: int = 64,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    seed_offset: int = 0,
    max_turns: int = 1,
    max_episode_tokens: int | None = None,
    progress: bool = False,
    seeds: list[int] | None = None,
) -> EvalResult:
    """Mean score and success rate of ``policy`` on ``episodes`` held-out tasks (one greedy episode per
    task): seeds ``seed_offset .. seed_offset + episodes - 1``, or the given ``seeds`` (one process's share
    of them). The envs it makes are closed before it returns or raises."""
    envs: list[ChatEnv] = []
    try:
        envs.append(make_env())  # the first env also tells how many distinct eval tasks there are
        if seeds is None:
            episodes = distinct_episodes(lambda: envs[0], episodes, warn=True)
        all_seeds = list(seeds) if seeds is not None else list(range(seed_offset, seed_offset + episodes))
        if not all_seeds:
            raise ValueError("evaluate: no episodes to run (episodes=0 or an empty seeds list)")
        envs += [make_env() for _ in range(min(batch_size, len(all_seeds)) - 1)]
        return _evaluate(
            policy,
            envs,
            rewards,
            all_seeds,
            metric=metric,
            batch_size=batch_size,
            progress=progress,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            max_episode_tokens=max_episode_tokens,
        )
    finally:
        close_envs(envs)


def _evaluate(
    policy: Policy,
    envs: list[ChatEnv],
    rewards: Rewards,
    all_seeds: list[int],
    *,
    metric: str,
    batch_size: int,
    progress: bool,
    max_turns: int,
    **sampling,
) -> EvalResult:
    """``evaluate`` on envs already made (the caller closes them)."""
    from tqdm.auto import tqdm

    episodes = len(all_seeds)
    scores, samples = {v.name: 0.0 for v in rewards.verifiers}, []
    metric_scores: list[float] = []
    trajectories: list[Trajectory] = []
    bar = tqdm(total=episodes, desc="eval", unit="ep", disable=not progress, leave=False)
    for start in range(0, episodes, batch_size):
        seeds = all_seeds[start : start + batch_size]
        batch = rollout(
            policy,
            envs,
            seeds,
            group_size=1,
            split="eval",
            max_turns=max_turns,
            **sampling,
        )
        trajectories += batch.trajectories
        breakdown = rewards.score(batch.episodes)
        values = breakdown.per_verifier[metric]  # (n,)
        metric_scores += values.tolist()
        for name, v in breakdown.per_verifier.items():
            scores[name] += float(v.sum())
        for t, v in zip(batch.trajectories, values.tolist(), strict=True):
            if len(samples) < 50:
                samples.append(
                    {
                        "seed": t.task.get("seed"),
                        "answer": t.task.get("answer"),
                        "completion": t.completion,
                        "score": v,
                    }
                )
        bar.update(len(seeds))
    bar.close()
    rule = eval_success_rule(envs[0], rewards, metric, trajectories)
    env_success = [None if t.env_error else t.env_metrics.get("success") for t in trajectories]
    succeeded = successes(rule, metric_scores, env_success)
    for sample, ok in zip(samples, succeeded, strict=False):
        sample["success"] = ok
    correct = sum(succeeded)
    return EvalResult(
        accuracy=correct / episodes,
        n=episodes,
        metric=metric,
        correct=correct,
        score=sum(metric_scores) / episodes,
        success=correct / episodes,
        success_rule=rule.describe(),
        success_source=rule.source,
        per_verifier={k: v / episodes for k, v in scores.items()},
        samples=samples,
        episode_metrics=episode_metrics(trajectories) if max_turns > 1 else {},
        transcripts=[t.messages for t in trajectories[:TRANSCRIPTS]] if max_turns > 1 else [],
        answers=answer_table(trajectories),
    )


def eval_success_rule(
    env: ChatEnv, rewards: Rewards, metric: str, trajectories: list[Trajectory]
) -> SuccessRule:
    """The success rule of an evaluation: the env's, else the metric verifier's, else the default
    (``mmgrpo.rollout.success``)."""
    verifier = next((v for v in rewards.verifiers if v.name == metric), None)
    return choose_rule(
        env_rule(env),
        any("success" in t.env_metrics for t in trajectories),
        verifier_rule(verifier.fn, metric) if verifier is not None else None,
    )


def close_envs(envs: Iterable[object]) -> None:
    """Call ``close()`` on each env; one that raises is reported on stderr and the others still close
    (a close must not hide the error or Ctrl-C that ended the evaluation)."""
    for env in envs:
        close = getattr(env, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - reported, and the remaining envs still close
            print(
                f"mmgrpo: eval: closing {type(env).__name__} raised {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )


def distinct_episodes(make_env: Callable[[], ChatEnv], episodes: int, *, warn: bool = False) -> int:
    """``episodes``, or fewer when the env's eval split holds fewer distinct tasks (a dataset's held-out
    rows): n consecutive seeds play n distinct tasks, more would repeat them and report an n the tasks do
    not support. ``warn`` prints one line when it cuts."""
    env = make_env()
    num_tasks = getattr(env, "num_tasks", None)  # envs not derived from ChatEnv may lack it
    distinct = num_tasks("eval") if num_tasks is not None else None
    if distinct == 0:
        raise DataError(
            f"the eval split of {type(env).__name__} holds no tasks ({_split_hint(env)}): hold rows out for "
            "evaluation (the env's eval_fraction, or eval_path: a file of held-out rows)"
        )
    if distinct is None or episodes <= distinct:
        return episodes
    if warn:
        print(
            f"mmgrpo: eval: the eval split holds {distinct} distinct tasks; evaluating {distinct} episodes, not "
            f"{episodes} (more would repeat them). Hold out more rows (eval_fraction, eval_path) for a finer "
            "accuracy.",
            file=sys.stderr,
            flush=True,
        )
    return distinct


def _split_hint(env) -> str:
    """How many rows each split holds, when the env says."""
    try:
        return f"{env.num_tasks('train')} rows train, {env.num_tasks('eval')} eval"
    except Exception:  # noqa: BLE001 - a hint only
        return "none held out"


TRANSCRIPTS = 8
"""How many whole held-out conversations a multi-turn evaluation keeps (and ``mmgrpo eval`` saves)."""


def evaluate_config(
    eval_cfg,
    env_cfg,
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    rewards: Rewards,
    metric: str,
    *,
    episodes: int | None = None,
    progress: bool = False,
    seeds: list[int] | None = None,
) -> EvalResult:
    """``evaluate`` with the settings of an ``EvalConfig`` (``episodes`` overrides its count, ``seeds``
    its seeds)."""
    return evaluate(
        policy,
        make_env,
        rewards,
        episodes=episodes or eval_cfg.episodes,
        metric=metric,
        batch_size=eval_cfg.batch_size,
        max_new_tokens=eval_cfg.max_new_tokens,
        temperature=eval_cfg.temperature,
        seed_offset=eval_cfg.seed_offset,
        max_turns=env_cfg.max_turns,
        max_episode_tokens=env_cfg.max_episode_tokens,
        progress=progress,
        seeds=seeds,
    )


def write_eval(result: EvalResult, model_dir: str | Path) -> Path:
    """Write ``eval.json`` next to the model; returns its path."""
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    path = Path(model_dir) / "eval.json"
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return path


def write_transcripts(result: EvalResult, out_dir: str | Path) -> Path | None:
    """Save the kept conversations as ``transcripts/episode-K.md`` (text, control characters written as
    escapes: ``mmgrpo.tools.visible``) with their images as PNG files beside them; returns the folder, or
    None when there is nothing to save. An empty or whitespace-only
    message shows as ``(empty reply)`` / ``(whitespace only: '\\n\\n')``, not as blank lines."""
    if not result.transcripts:
        return None

    def blank(text: str, role: str) -> str:  # a message with no image and no visible text
        empty = "(empty reply)" if role == "assistant" else "(empty message)"
        return empty if not text else f"(whitespace only: {text!r})"  # repr: control characters escaped

    folder = Path(out_dir) / "transcripts"
    folder.mkdir(parents=True, exist_ok=True)
    for k, messages in enumerate(result.transcripts):
        lines = [f"# held-out episode {k}", ""]
        for m in messages:
            lines.append(f"## {m['role']}" + (f" ({m['name']})" if m.get("name") else ""))
            content = (
                m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            )
            if not any(part.get("type") == "image" or part.get("text", "").strip() for part in content):
                lines.append(blank("".join(part.get("text", "") for part in content), m["role"]))
            for j, part in enumerate(content):
                if part.get("type") == "image":
                    name = f"episode-{k}-{len(lines)}-{j}.png"
                    part["image"].save(folder / name)
                    lines.append(f"![image]({name})")
                elif part.get("text", "").strip():
                    lines.append(visible(part["text"]))  # a terminal or viewer runs no escape from a tool
            lines.append("")
        (folder / f"episode-{k}.md").write_text("\n".join(lines))
    return folder
