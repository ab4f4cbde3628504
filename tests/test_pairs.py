"""Every built-in env/verifier pair: the env's reference answer gets full marks, a wrong one gets 0."""

from __future__ import annotations

import pytest

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.registry import make_verifier
from mmgrpo.verifier import Episode

SEEDS = range(25)


def _episode(env: CountingEnv, seed: int, split: str, completion: str) -> Episode:
    messages, info = env.reset(seed=seed, options={"split": split})
    return Episode(completion=completion, messages=messages, task=info)


@pytest.mark.parametrize("name", ["number_match", "number_distance", "exact_match", "format"])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_counting_reference_answer_scores_one(name, split):
    env = CountingEnv(distractors=2)
    verifier = make_verifier(name)
    for seed in SEEDS:
        _, info = env.reset(seed=seed, options={"split": split})
        ep = _episode(env, seed, split, CountingEnv.reference_completion(info))
        assert verifier.score([ep]) == [1.0], (seed, info["answer"])


@pytest.mark.parametrize("name", ["number_match", "exact_match"])
def test_counting_wrong_answer_scores_zero(name):
    env = CountingEnv(max_count=5)
    verifier = make_verifier(name)
    for seed in SEEDS:
        _, info = env.reset(seed=seed)
        wrong = int(info["answer"]) % 5 + 1  # another count in 1..5
        ep = _episode(env, seed, "train", f"<answer>{wrong}</answer>")
        assert verifier.score([ep]) == [0.0]
        assert verifier.score([_episode(env, seed, "train", info["answer"])]) == [0.0]  # no tags, no credit
