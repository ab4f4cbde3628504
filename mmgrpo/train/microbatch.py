"""The update of one step, micro-batched: num_iterations optimizer steps over this process's rows.

Advantages arrive computed over whole groups (before any split). The rows are cut into micro-batches
(whole groups when they fit, each prompt then encoded once for its G rows; sorted by length to pad less);
every micro-batch's loss is normalised by the global sequence and token counts, so the sum of the
micro-batches' gradients over every process is the full batch's gradient, whatever the cut. Every process
runs as many backward passes (a process with fewer micro-batches adds zero-weight ones), because DDP
synchronises gradients on the last; with sharded weights (FSDP, ``policy.lockstep``) the passes without a
gradient do the same, since every forward is a collective there. ``reward_kl`` is the per-episode KL of
``grpo.kl_in=reward``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from mmgrpo.config.sections import GRPOConfig
from mmgrpo.grpo.kl_control import sequence_kl
from mmgrpo.grpo.losses import grpo_loss
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.batch import TokenBatch
from mmgrpo.model.policy import Policy
from mmgrpo.train.distributed import global_counts, global_sum


def micro_batches(tokens: TokenBatch, G: int, g: GRPOConfig) -> tuple[list[list[int]], list[TokenBatch]]:
    """Rows per micro-batch, whole groups when they fit (each prompt is then encoded once for its G
    rows), and their tokens with padding trimmed per micro-batch."""
    size = g.micro_batch_size // G * G or g.micro_batch_size
    order = list(range(len(tokens)))
    if len(tokens) > size and size % G == 0 and g.aggregation != "bnpo":
        order = by_length(tokens, G)  # whole groups, shortest first: less padding per micro-batch
    mbs = [order[i : i + size] for i in range(0, len(order), size)]
    return mbs, [tokens.select(rows) for rows in mbs]


def by_length(tokens: TokenBatch, G: int) -> list[int]:
    """Row order with the groups (runs of G rows) sorted by their padded length (longest prompt plus
    longest response), rows inside a group kept together and in order. Micro-batches cut from it hold
    sequences of similar length, so less padding; the loss is a sum over micro-batches with whole-batch
    normalisers, so the order does not change it (only bnpo's per-micro-batch means would, and it keeps
    the plain order)."""
    prompt_len = tokens.prompt_mask.sum(dim=1)  # (N,)
    response_len = tokens.response_mask.sum(dim=1)  # (N,)
    starts = list(range(0, len(tokens), G))
    key = {s: (int(prompt_len[s : s + G].max()) + int(response_len[s : s + G].max()), s) for s in starts}
    return [r for s in sorted(starts, key=key.__getitem__) for r in range(s, s + G)]


def reward_kl(
    policy: Policy, accelerator, tokens: TokenBatch, G: int, g: GRPOConfig
) -> tuple[torch.Tensor, float]:
    """grpo.kl_in=reward: each episode's KL to the reference, summed over its policy tokens, (N,); and
    this process's share of the step's token-mean KL (its KL sum over the global token count: the
    shares sum to the mean over every process, the quantity the loss reports as ``kl`` with kl_in=loss
    and the one ``target_kl`` is compared with)."""
    kl = torch.zeros(len(tokens), dtype=torch.float64)  # (N,)
    mbs, mb_tokens = micro_batches(tokens, G, g)
    with torch.no_grad(), policy.reference_on_device():
        for k in range(lockstep_passes(policy, accelerator, len(mbs))):
            rows, mb = (mbs[k], mb_tokens[k]) if k < len(mbs) else (mbs[0], mb_tokens[0])
            scored = mb.loss_mask.bool()  # (n, t): log-probs read there only
            now = policy.logprobs(mb, temperature=g.temperature, scored=scored)  # (n, t)
            ref = policy.logprobs(mb, temperature=g.temperature, reference=True, scored=scored)  # (n, t)
            if k >= len(mbs):
                continue  # a pass that only keeps this process in step with the others (sharded weights)
            mask = mb.loss_mask.to(now.device)
            kl[rows] = sequence_kl(now, ref, mask, g.kl_estimator).double().cpu()  # (n,)
    num_tokens = int(global_counts(accelerator, int(tokens.loss_mask.sum()))[:, 0].sum())
    return kl.float(), float(kl.sum()) / max(num_tokens, 1)


def lockstep_passes(policy: Policy, accelerator, local: int) -> int:
    """How many scoring passes this process runs: its ``local`` micro-batches, or with sharded weights
    (every forward a collective) the most any process has."""
    if not policy.lockstep:
        return local
    return int(global_counts(accelerator, local)[:, 0].max())


def update(
    policy: Policy,
    optimizer,
    scheduler,
    accelerator,
    tokens: TokenBatch,
    adv: torch.Tensor,
    G: int,
    g: GRPOConfig,
    *,
    beta: float,
    step: int,
) -> tuple[dict[str, float], str | None]:
    """num_iterations optimizer steps on this process's rows ``tokens`` with advantages ``adv`` (N,); the
    loss is normalised by the global token and sequence counts. Returns the loss statistics and, when the
    loss is not finite, what went wrong (no optimizer step is taken then). ``step`` is the step being
    trained (for messages)."""
    acc, world = accelerator, accelerator.num_processes
    loss_mask = tokens.loss_mask  # (n, T)
    n_rows = len(tokens)
    kept = trained_rows(tokens, adv, G, g, beta)  # None: every row
    if kept is not None:  # the normalisers below still count every row and token
        tokens, adv = tokens.select(kept), adv[torch.as_tensor(kept, dtype=torch.long)]
    mbs, mb_tokens = micro_batches(tokens, G, g)
    counts = global_counts(acc, n_rows, int(loss_mask.sum()), len(mbs))  # (W, 3)
    N, num_tokens = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    n_mb = int(counts[:, 2].max())  # every process runs as many backward passes (DDP syncs on the last)

    ref_lp, old_lp = [], []
    spare = n_mb - len(mbs) if policy.lockstep else 0  # sharded weights: every process runs n_mb passes
    with torch.no_grad(), policy.reference_on_device():
        for mb in mb_tokens + mb_tokens[:1] * spare:
            scored = mb.loss_mask.bool()  # (n, t): the loss reads log-probs there only
            ref = (
                policy.logprobs(mb, temperature=g.temperature, reference=True, scored=scored)
                if beta > 0
                else None
            )
            old = (
                policy.logprobs(mb, temperature=g.temperature, scored=scored)
                if g.num_iterations > 1
                else None
            )
            ref_lp.append(ref)
            old_lp.append(old)

    stats = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    # bnpo: each micro-batch is a token mean; their average over the real micro-batches of every
    # process (not the zero-weight passes that pad a process with fewer up to n_mb)
    n_means = int(counts[:, 2].sum()) if g.aggregation == "bnpo" else 1
    policy.model.train()
    for _ in range(g.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for k in range(n_mb):
            real = k < len(mbs)
            rows, mb = (mbs[k], mb_tokens[k]) if real else (mbs[0], mb_tokens[0])
            sync = contextlib.nullcontext() if k == n_mb - 1 else acc.no_sync(policy.model)
            idle = idle_vision(policy, mb) if world > 1 else 0.0
            with sync:
                logp, entropy = policy.logprobs(
                    mb,
                    temperature=g.temperature,
                    with_entropy=True,
                    entropy_grad=g.entropy_coef > 0,
                    scored=mb.loss_mask.bool(),
                )  # (n, t), (n, t): 0 outside the loss mask
                if not real:  # a process with fewer micro-batches joins the others' gradient sync
                    acc.backward(logp.sum() * 0.0 + idle)
                    continue
                out = grpo_loss(
                    logp,
                    old_lp[k],
                    ref_lp[k],
                    adv[rows][..., : logp.shape[1]].to(logp.device) if adv.dim() == 2 else adv[rows].to(logp.device),
                    mb.loss_mask.to(logp.device),
                    clip_eps_low=g.clip_eps_low,
                    clip_eps_high=g.clip_eps_high,
                    beta=beta,
                    aggregation=g.aggregation,
                    importance=g.importance,
                    dual_clip=g.dual_clip,
                    num_sequences=N,
                    num_tokens=num_tokens,
                    max_new_tokens=g.max_new_tokens,
                    kl_estimator=g.kl_estimator,
                    num_micro_batches=n_means,
                    entropy=entropy,
                    entropy_coef=g.entropy_coef,
                    sampled_logp=mb.sampled_logp,
                    sampler_cap=g.sampler_cap if g.sampler_correction == "tis" else None,
                )
                # DDP averages gradients over the W processes; x W makes that the global-batch gradient
                acc.backward((out.loss * world + idle) if world > 1 else out.loss)
            share = mb.loss_mask.sum().item() / max(num_tokens, 1) / g.num_iterations
            loss_sum += float(out.loss.detach())
            stats["loss"] += float(out.loss.detach()) / g.num_iterations
            for key in ("kl", "clip_frac", "ratio_mean", "entropy"):
                stats[key] += float(getattr(out, key)) * share
            for key, value in (out.mismatch or {}).items():  # the sampler's gap to this pass (max: over all)
                name = f"mismatch/{key}"
                v = float(value)
                stats[name] = max(stats.get(name, 0.0), v) if key == "max_abs" else stats.get(name, 0.0) + v * share
        total = global_sum(acc, float(loss_sum))
        if not math.isfinite(total):
            return stats, (
                f"step {step}: the loss is {total} (rewards and advantages were finite); "
                "likely a learning rate too high for this model (lower grpo.lr) or a reward of huge "
                "magnitude"
            )
        norm = acc.clip_grad_norm_(policy.model.parameters(), g.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # sharded gradients (FSDP): the norm over every process's shards
            norm = norm.full_tensor()
        stats["grad_norm"] = float(norm) if norm is not None else float("nan")  # DeepSpeed clips itself
        optimizer.step()
        scheduler.step()
    stats["trained_frac"] = len(tokens) / max(n_rows, 1)
    return stats, None


SKIP_SILENT_GROUPS = True
"""Leave groups whose every advantage is 0 out of the training pass where their loss terms are exactly 0
(``trained_rows``); False: every row runs (the tests compare both)."""


def trained_rows(
    tokens: TokenBatch, adv: torch.Tensor, G: int, g: GRPOConfig, beta: float
) -> list[int] | None:
    """The rows the training pass must run (whole groups, in order), or None for every row.

    A group whose every advantage is 0 (all G rewards equal: late in a run most groups) adds nothing to
    the loss or its gradient when nothing else in the loss reads its tokens: no KL term (``beta`` 0), no
    entropy bonus, and an aggregation normalised by whole-batch counts (not bnpo's per-micro-batch
    means); ``update`` keeps those counts, so the gradient is the same sum without its zero terms. Kept
    anyway: one group when every group is silent, and one silent group with images when the rows kept
    hold none, so that the same parameters get a gradient (a zero one) as with every row, and AdamW
    moves the same parameters. Statistics (entropy, clip fraction, the sampler's mismatch) are then means
    over the rows trained; ``trained_frac`` says how many."""
    N = len(tokens)
    if not SKIP_SILENT_GROUPS or beta != 0 or g.entropy_coef != 0 or g.aggregation == "bnpo" or N % G:
        return None
    silent = (adv.reshape(N, -1) == 0).all(dim=1).view(-1, G).all(dim=1).tolist()  # (N/G,) per group
    if not any(silent):
        return None
    owners = tokens.row_prompts()
    rv = tokens.response_vision if tokens.has_response_images else None

    def images(k: int) -> bool:  # group k holds an image (its prompt's or inside a response)
        rows = range(k * G, k * G + G)
        prompts = any(tokens.vision.seqs[owners[r]] for r in rows)
        return prompts or (rv is not None and any(rv.seqs[r] for r in rows))

    keep = [k for k, s in enumerate(silent) if not s] or [0]
    if not any(images(k) for k in keep):
        keep += [k for k, s in enumerate(silent) if s and k not in keep and images(k)][:1]
    return [r for k in sorted(keep) for r in range(k * G, k * G + G)]


def idle_vision(policy: Policy, mb: TokenBatch) -> torch.Tensor | float:
    """0 x every trainable vision parameter when ``mb`` holds no image, else 0.0. DDP reduces gradients in
    buckets that fire once each of their parameters has one; a micro-batch without images (bare prompts
    whose episodes never zoomed) gives the vision tower none, so its buckets would fire on the processes
    whose batches had images and not on this one, and the processes' collectives would no longer match.
    The zero term gives those parameters a zero gradient here instead."""
    if not mb.vision.empty or mb.has_response_images:
        return 0.0
    vision = [
        p
        for n, p in unwrap(policy.model).named_parameters()
        if p.requires_grad and policy.adapter.is_vision_param(n)
    ]
    return sum(p.sum() for p in vision) * 0.0 if vision else 0.0
