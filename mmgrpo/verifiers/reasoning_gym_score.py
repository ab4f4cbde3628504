"""reasoning-gym's own scorer as a verifier (registered verifier name ``reasoning_gym``).

The verifier of the ``reasoning_gym`` env (``mmgrpo.envs.reasoning_gym_env``): it takes the text of the
completion's last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``: no tag, no answer) and
returns ``dataset.score_answer(answer, entry)`` of the task's dataset, the score reasoning-gym defines for
that task (1.0 when right; some tasks give partial credit). A success at evaluation is a score of 1.

The datasets live here, made once per process (``dataset``), so that the env's copies and the verifier
share them; the env imports them from here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from mmgrpo.errors import ConfigError, VerifierError, did_you_mean
from mmgrpo.verifier import Episode

__all__ = ["dataset", "import_reasoning_gym", "reasoning_gym_score"]

EXTRA = "pip install 'mmgrpo[reasoning-gym]' (or pip install reasoning-gym)"


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or a ConfigError naming the extra that installs it."""
    from mmgrpo.registry import import_optional

    return import_optional("reasoning_gym", "env 'reasoning_gym'", "reasoning-gym", EXTRA)


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str) -> Any:
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ConfigError(
            f"env.kwargs.task={task!r} is not a reasoning-gym task.{did_you_mean(task, tuple(DATASETS))} "
            f"There are {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:8])}, ..."
        )
    config = json.loads(config_json)
    try:
        return rg.create_dataset(task, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(
            f"env.kwargs.config={config!r} is not a valid config of reasoning-gym's {task!r} "
            f"({type(exc).__name__}: {exc}); its fields are those of its config class "
            f"({DATASETS[task][1].__name__})"
        ) from None


def dataset(task: str, config: dict[str, Any]) -> Any:
    """The reasoning-gym dataset of ``task`` with ``config`` (made once per process and shared: the env's
    copies and the verifier use the same one)."""
    try:
        key = json.dumps(config, sort_keys=True)
    except TypeError as exc:
        raise ConfigError(
            f"env.kwargs.config must hold plain YAML values (numbers, strings, lists), got {config!r} ({exc})"
        ) from None
    return _dataset(task, key)


def reasoning_gym_score(tag: str = "answer") -> Callable[[Episode], float]:
    """The reasoning-gym score of the answer inside the completion's last ``<tag>...</tag>`` (0.0 without
    one): by the task's own dataset for tasks of the ``reasoning_gym`` env (their info holds ``entry`` and
    ``reasoning_gym``), by reasoning-gym's base rule against ``answer`` for other tasks."""
    import_reasoning_gym()
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.utils import extract_answer

    def score(episode: Episode) -> float:
        task = episode.task
        answer = extract_answer(episode.completion, tag_name=tag)
        if "entry" in task and "reasoning_gym" in task:
            source = task["reasoning_gym"]
            return float(dataset(source["task"], source["config"]).score_answer(answer, task["entry"]))
        if "answer" not in task:
            raise VerifierError(
                f"verifier 'reasoning_gym' scores tasks of the reasoning_gym env (task fields 'entry' and "
                f"'reasoning_gym') or, elsewhere, against the field 'answer'; this task has neither (task keys: "
                f"{sorted(task)}). Use env: {{name: reasoning_gym}}, or another verifier for this env."
            )
        # a task of another env: reasoning-gym's base rule (exact 1.0; the answer inside a longer reply, the
        # share of it that the answer is), which does not read the dataset
        return float(ProceduralDataset.score_answer(None, answer, {"answer": str(task["answer"])}))

    score.success_at = 1.0  # read by mmgrpo eval: a success is full marks, not the partial credit
    score.success_rule = "score == 1 (reasoning-gym's scorer)"
    return score
