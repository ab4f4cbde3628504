"""Does the model's answer depend on the question? The measurement behind the text_math finding (README).

For each of the first 12 of the 25 distinct questions of text_math (a, b in 0..4, "+"), take one small
SGD step on -log p("<answer>{true sum}</answer>" | question), and measure how much log p of that same
target rose for the question itself ("own") and, on average, for the 24 other questions ("others").
own == others means a gradient step on one question moves every question alike: the answer is
independent of the question, and policy-gradient steps can only move the marginal (GRPO then learns the
most frequent sum). own > others means the model can tell the questions apart.

    python benchmarks/answer_dependence.py MODEL_DIR [--lr 0.002]

Measured (lr 0.002): freshly built tiny text model own 2.8843 / others 2.8830; after the format-only warm
start 0.2793 / 0.2793; after a cold start on 8 true examples 0.8421 / 0.6249.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from mmgrpo.config.core import load_config
from mmgrpo.train.sft import supervised_batch
from mmgrpo.train.trainer import build_env_factory, load_policy

ROOT = Path(__file__).resolve().parent.parent


def target_logprobs(policy, prompts: list, answer: str) -> torch.Tensor:
    """log p("<answer>{answer}</answer>" | prompt) for every prompt, (Q,)."""
    batch = supervised_batch(policy, prompts, [f"<answer>{answer}</answer>"] * len(prompts))
    with torch.no_grad():
        lp = policy.logprobs(batch)  # (Q, T)
    return (lp * batch.loss_mask).sum(dim=1)  # (Q,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--questions", type=int, default=12)
    args = ap.parse_args()
    cfg = load_config(ROOT / "examples" / "text_math_tiny.yaml", [f"model.path={args.model}"])
    policy = load_policy(cfg)
    env = build_env_factory(cfg)()
    distinct: dict[tuple, tuple] = {}
    for seed in range(400):
        obs, info = env.reset(seed=seed, options={"split": "eval"})
        distinct.setdefault((info["a"], info["b"]), (obs, info["answer"]))
    questions = list(distinct.values())
    prompts = [obs for obs, _ in questions]
    own, others = [], []
    for i, (obs, answer) in enumerate(questions[: args.questions]):
        before = target_logprobs(policy, prompts, answer)  # (Q,)
        stepped = copy.deepcopy(policy)
        stepped.model.train()
        optimizer = torch.optim.SGD(stepped.model.parameters(), lr=args.lr)
        batch = supervised_batch(stepped, [obs], [f"<answer>{answer}</answer>"])
        (-(stepped.logprobs(batch) * batch.loss_mask).sum()).backward()
        optimizer.step()
        change = target_logprobs(stepped, prompts, answer) - before  # (Q,)
        own.append(float(change[i]))
        others.append(float(torch.cat([change[:i], change[i + 1 :]]).mean()))
    n = len(own)
    print(
        f"answer_dependence: {args.model}: own {sum(own) / n:.4f} others {sum(others) / n:.4f} "
        f"(mean log-prob rise over {n} questions, {len(questions)} distinct)"
    )


if __name__ == "__main__":
    main()
