"""Benchmark: each prompt encoded once per group (KV cache repeated G times) against the plain way, on the
same batch, in one run, reported as ratios:
  - rollout: our decode loop on the shared prefill vs Hugging Face ``generate`` on all N rows;
  - training: forward+backward of the GRPO log-probs vs one full forward over prompt + response.

    python benchmarks/bench_shared_prompt.py [--group-size 8] [--tasks 16] [--repeats 5]

Builds the tiny Qwen2.5-VL in a temporary folder (offline). Also checks that both give the same log-probs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.vlm import build_tiny_model


def step(policy: Policy, tokens, share: bool) -> float:
    t0 = time.perf_counter()
    policy.model.zero_grad(set_to_none=True)
    logp = policy.logprobs(tokens, share_prompt=share)  # (N, T)
    mask = tokens.loss_mask.bool()
    (-torch.where(mask, logp, 0.0).sum() / mask.sum()).backward()
    return time.perf_counter() - t0


def gen(policy: Policy, tokens, G: int, shared: bool, max_new_tokens: int) -> float:
    """One rollout's generation: B prompts x G samples, shared prefill or HF generate on all rows."""
    t0 = time.perf_counter()
    if shared:
        heads = list(range(0, len(tokens), G))
        args = (tokens.prompt_ids[heads], tokens.prompt_mask[heads], tokens.vision)
        policy.generate(*args, max_new_tokens=max_new_tokens, temperature=1.0, num_samples=G)
    else:
        args = (tokens.prompt_ids, tokens.prompt_mask, tokens.row_vision())
        policy.generate(*args, max_new_tokens=max_new_tokens, temperature=1.0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        policy = Policy.from_pretrained(build_tiny_model(tmp))
        G, B = args.group_size, args.tasks
        envs = [CountingEnv() for _ in range(B * G)]
        tokens = rollout(policy, envs, list(range(B)), group_size=G, max_new_tokens=8).tokens
        with torch.no_grad():
            a = policy.logprobs(tokens, share_prompt=False)
            b = policy.logprobs(tokens, share_prompt=True)
        m = tokens.loss_mask.bool()
        diff = float((a[m] - b[m]).abs().max())
        times = {False: [], True: []}
        step(policy, tokens, True), step(policy, tokens, False)  # warm-up
        for _ in range(args.repeats):  # interleaved so that machine noise hits both alike
            for share in (False, True):
                times[share].append(step(policy, tokens, share))
        gtimes = {False: [], True: []}
        gen(policy, tokens, G, True, 8), gen(policy, tokens, G, False, 8)  # warm-up
        for _ in range(args.repeats):
            for shared in (False, True):
                gtimes[shared].append(gen(policy, tokens, G, shared, 8))
    full, shared = statistics.median(times[False]), statistics.median(times[True])
    P, T = tokens.prompt_ids.shape[1], tokens.response_ids.shape[1]
    print(f"batch: {B} tasks x G={G} = {B * G} sequences, prompt {P} tokens (16 image), response {T} tokens")
    print(f"full forward+backward:   {full * 1000:7.1f} ms (median of {args.repeats})")
    print(f"shared prompt encoding:  {shared * 1000:7.1f} ms")
    print(f"speed-up: {full / shared:.2f}x   max |logp difference| {diff:.2e}")
    hf, ours = statistics.median(gtimes[False]), statistics.median(gtimes[True])
    print(f"rollout, HF generate on all rows:   {hf * 1000:7.1f} ms (8 new tokens, temperature 1)")
    print(f"rollout, shared prefill + decode:   {ours * 1000:7.1f} ms")
    print(f"speed-up: {hf / ours:.2f}x")


if __name__ == "__main__":
    main()
