"""The two samplers besides mmgrpo's own decode loop (``mmgrpo.model.engine.generate``), for ``Policy.generate``:
Hugging Face ``generate`` (tests compare against it) and an engine in another process (vLLM,
``mmgrpo.model.vllm_engine``) that ``Policy.sampler`` names. Both return what the decode loop returns: B * G
rows, prompt b's samples at rows b*G .. b*G+G-1, each up to and including its first stop token."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mmgrpo.model.batch import VisionInputs


def hf_generate(
    policy,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    vision: VisionInputs,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    num_samples: int,
):
    """Hugging Face ``generate`` on the policy's model: (completions, finished)."""
    greedy = temperature <= 0
    gen_kw: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        eos_token_id=policy.stop_ids,
        pad_token_id=policy.pad_token_id,
        suppress_tokens=policy.suppress_ids or None,
        num_return_sequences=num_samples,
    )
    if not greedy:
        gen_kw.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
    else:
        gen_kw.update(temperature=None, top_p=None, top_k=None)
    inputs = policy._model_inputs(prompt_ids, prompt_mask, vision.without_encoded(), policy.model)
    out = policy.model.generate(**inputs, **gen_kw)
    return policy._cut_at_stop(out[:, prompt_ids.shape[1] :].tolist())  # (N, <= max_new_tokens)


def engine_generate(
    policy,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    vision: VisionInputs,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    num_samples: int,
    return_logprobs: bool,
):
    """The policy's ``sampler`` (an engine in another process) on the prompts' real tokens, its weights
    pushed first when an optimizer stepped since: (completions, finished[, log-probs])."""
    from mmgrpo.model.vllm_engine import image_inputs, one_placeholder

    engine = policy.sampler
    engine.sync(policy.model)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]
    images = image_inputs(policy, vision, len(prompts))
    if images is not None:
        prompts = [one_placeholder(p, policy.image_token_id) for p in prompts]
    rows = engine.generate(
        prompts,
        n=num_samples,
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_ids=policy.stop_ids,
        images=images,
    )
    completions, finished = policy._cut_at_stop([ids for ids, _ in rows])
    if return_logprobs:
        return completions, finished, [lps[: len(c)] for (_, lps), c in zip(rows, completions, strict=True)]
    return completions, finished
