"""Supervised cold start that teaches the answer FORMAT only (DeepSeek-R1's "cold start", minimal form).

A freshly built (or a weak) model never writes ``<answer>N</answer>``, so every GRPO group scores all
zeros and nothing is learned. This stage fine-tunes on the environment's own prompts paired with
completions made from a template whose number is drawn at random (``<answer>{random}</answer>``): the
targets carry no information about the image, so the model learns where and how to answer, not what.
Its accuracy alone is about chance (1/5 on counts 1..5); the demo reports it as the "before" number.

Only the language side is trained (``train_vision=False``, the default): the targets say nothing about the
image, so there is nothing for the vision encoder to learn, and measured on the tiny model, training it
on content-free targets at this learning rate collapses its features to a near-constant vector (patch
features differing by ~2% instead of ~80%), after which GRPO cannot learn to count at all.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from mmgrpo.batch import TokenBatch, pad_right
from mmgrpo.env import ChatEnv
from mmgrpo.policy import Policy
from mmgrpo.rollout import reset_group


def format_targets(template: str, low: int, high: int, n: int, rng: random.Random) -> list[str]:
    """n completions from ``template`` with ``{random}`` replaced by a uniform integer in [low, high]."""
    return [template.format(random=rng.randint(low, high)) for _ in range(n)]


def warm_start(
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    template: str,
    low: int,
    high: int,
    seed: int,
    train_vision: bool = False,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
) -> float:
    """Run ``steps`` supervised steps; returns the last loss (mean negative log-likelihood per token)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    env = make_env()
    params = list(policy.model.parameters()) if train_vision else policy.language_parameters()
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.model.train()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc="warm start (format only)", unit="step", disable=not progress)
    for step in bar:
        # training-split seeds far from the GRPO stage's (which start at 0), so the two stages see other scenes
        seeds = [10_000_000 + step * batch_size + i for i in range(batch_size)]
        prompts = [reset_group([env], s, "train")[0] for s in seeds]
        prompt_ids, prompt_mask, vision = policy.encode_prompts(prompts)  # (B, P)
        targets = format_targets(template, low, high, batch_size, rng)
        responses = [policy.encode_text(t) + [policy.eos_token_id] for t in targets]
        response_ids, response_mask = pad_right(responses, policy.pad_token_id)  # (B, T)
        batch = TokenBatch(prompt_ids, prompt_mask, response_ids, response_mask, response_mask, vision)
        logp = policy.logprobs(batch)  # (B, T)
        mask = response_mask.to(logp.device).bool()  # (B, T)
        loss = -torch.where(mask, logp, 0.0).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
        bar.set_postfix(nll=f"{loss_value:.3f}")
        if log is not None:
            log({"stage": "warm_start", "step": step + 1, "nll": loss_value})
    bar.close()
    return loss_value
