"""Any reasoning-gym task as a single-turn env (registered env name ``reasoning_gym``; extra ``reasoning-gym``).

    env: {name: reasoning_gym, kwargs: {task: chain_sum, config: {min_terms: 2, max_terms: 3}}}
    verifiers: [{name: reasoning_gym}]

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates procedural tasks, each with its own
scorer. A task here is one item of ``reasoning_gym.create_dataset(task, **config)``: the item's question is
the user message, its answer ``info["answer"]``, and the item itself ``info["entry"]``, which the
``reasoning_gym`` verifier (``mmgrpo.verifiers.reasoning_gym_score``) hands to the dataset's own
``score_answer`` together with the text of the completion's last ``<answer>...</answer>``, as
reasoning-gym's own training scripts do.

Determinism and splits: reasoning-gym draws item ``idx`` from ``random.Random(dataset_seed + idx)``. The
dataset seed is ``config.seed`` (0 unless given: reasoning-gym would otherwise draw one at random), and
the item of (seed, split) is ``idx = 2 * (seed % half) + (split == "eval")`` with ``half = config.size // 2``:
train tasks are the even items of the dataset, eval tasks the odd ones, so the two splits never share an
item (a small task space may still pose the same question in both), and the same (seed, split) is always
the same item. Each split holds ``size // 2`` tasks (``num_tasks``); seeds beyond repeat them, and
``config.size`` (reasoning-gym's default for most tasks: 500) sets how many there are.
"""

from __future__ import annotations

from typing import Any

from mmgrpo.env import SingleTurnEnv, Task, system, user
from mmgrpo.errors import ConfigError
from mmgrpo.verifiers.reasoning_gym_score import dataset, import_reasoning_gym

DEFAULT_SEED = 0
"""The dataset seed when ``config`` gives none (reasoning-gym itself would draw one at random)."""


def _system_prompt(system_prompt: str | None) -> str | None:
    """``system_prompt`` as text: a key of reasoning-gym's ``SYSTEM_PROMPTS`` names one of its prompts."""
    if system_prompt is None:
        return None
    if not isinstance(system_prompt, str):
        raise ConfigError(
            f"env.kwargs.system_prompt must be a string or null, got {type(system_prompt).__name__}"
        )
    import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


class ReasoningGymEnv(SingleTurnEnv):
    """Answer one item of a reasoning-gym dataset; scored by its own ``score_answer`` (verifier
    ``reasoning_gym``).

    Args (all keyword):
        task: the reasoning-gym dataset name (``chain_sum``, ``basic_arithmetic``, ``countdown``, ...).
        config: the dataset's config fields (``reasoning_gym.create_dataset(task, **config)``); ``seed``
            defaults to 0 and ``size`` (the tasks per split are ``size // 2``) to the dataset's default.
        system_prompt: the system message: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (default
            ``"default"``: think, then give the answer inside ``<answer></answer>``), any other text, or
            None for none.

    ``reset`` info: ``answer`` (str), ``entry`` (the reasoning-gym item, for its scorer), ``task``,
    ``index`` (the item's index), plus ``seed`` and ``split``.
    """

    def __init__(
        self, *, task: str, config: dict[str, Any] | None = None, system_prompt: str | None = "default"
    ) -> None:
        if not isinstance(task, str) or not task:
            raise ConfigError(f"env.kwargs.task must name a reasoning-gym task, e.g. chain_sum; got {task!r}")
        if config is not None and not isinstance(config, dict):
            raise ConfigError(
                f"env.kwargs.config must be a mapping of the task's config fields, got {type(config).__name__}"
            )
        self.task = task
        self.config = {"seed": DEFAULT_SEED, **(config or {})}
        self.dataset = dataset(task, self.config)
        self.half = len(self.dataset) // 2
        if self.half < 1:
            raise ConfigError(
                f"env.kwargs.config.size={len(self.dataset)}: need at least 2 items (one per split); the "
                "train split is the dataset's even items and the eval split its odd ones"
            )
        self.system_prompt = _system_prompt(system_prompt)

    def num_tasks(self, split: str) -> int:
        return self.half

    def make_task(self, seed: int, split: str) -> Task:
        index = 2 * (seed % self.half) + (split == "eval")
        entry = self.dataset[index]
        messages = [system(self.system_prompt)] if self.system_prompt else []
        messages.append(user(str(entry["question"])))
        info = {
            "answer": str(entry["answer"]),
            "entry": entry,
            "task": self.task,
            "index": index,
            "reasoning_gym": {"task": self.task, "config": self.config},
        }
        return Task(messages, info)

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A completion that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"
