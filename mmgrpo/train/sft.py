"""Supervised fine-tuning on (messages -> response) rows: ``mmgrpo sft CONFIG`` (DeepSeek-R1's cold start).

R1's recipe is a supervised stage on demonstrations, then RL. ``mmgrpo sft`` runs the first stage from the
same config as ``mmgrpo train``: it reads ``sft.data``, trains the policy of ``model`` (its precision, LoRA
and gradient checkpointing apply, through ``mmgrpo.train.trainer.load_policy``) to imitate each row's response,
and saves ``{output_dir}/final`` as the trainer does. ``mmgrpo train CONFIG --set model.path=OUT/final``
then runs GRPO from it. The format warm start (``mmgrpo.train.warmstart``) is the special case whose targets are
generated instead of read.

Rows (a JSONL, JSON or parquet file, a ``datasets`` folder or a hub id, read by
``mmgrpo.data.records.read_records``), in one of three forms:

    {"messages": [..., {"role": "assistant", "content": "<answer>3</answer>"}]}  (the last message: target)
    {"messages": [...], "response": "<answer>3</answer>"}                       (the messages: prompt)
    {"question": "How many?", "image": "imgs/1.png", "system": "...", "response": "<answer>3</answer>"}

A message is ``{"role": system|user|assistant|tool, "content": str or [part, ...]}`` and a part
``{"type": "text", "text": ...}`` or ``{"type": "image", "image": REF}`` (``"path"`` or ``"url"`` instead of
``"image"`` also work). REF is anything ``mmgrpo.data.records.open_image`` reads; a relative path is resolved against
the data file's folder. An image part without a reference, ``{"type": "image"}``, takes the row's next
``images`` (or ``image``) entry, the layout of TRL's vision datasets. In the question form the images
(``image``: one reference, ``images``: a list) come first in one user message, then the question, after the
optional ``system`` message: the layout of the built-in envs' prompts, so the three forms of one example
give the same tokens. Only the target is trained; earlier assistant turns of ``messages`` are context.
Other fields (``answer``, ids, ...) are ignored.

Every row of ``sft.data`` and ``sft.eval_data`` is checked, each image decoded, before any model loads; a
bad dataset fails with ONE DataError listing every bad row by ``file:line`` (``file:row N`` for the formats
without lines).

A batch is laid out as the rollout lays out an episode (``mmgrpo.model.batch``): the prompt templated with the
generation prompt, then the target's tokens and the end-of-turn token (``policy.end_of_turn_id``), with the
loss on those only. The loss is the mean negative log-likelihood per target token of the batch. Only the
language side trains unless ``sft.train_vision`` is on (see ``mmgrpo.train.warmstart`` for why). Records
``{"stage": "sft", "step", "loss", "tokens", "lr", "grad_norm", "epoch"}`` go to
``{output_dir}/metrics.jsonl``, and ``{"stage": "sft", "step", "eval_loss"}`` when ``sft.eval_data`` is set
(step 0 is the model before training).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmgrpo.config.core import Config, config_to_dict, save_config
from mmgrpo.data.records import Record, check_records, describe_ref, is_video_ref, open_image, read_records
from mmgrpo.errors import ConfigError, DataError, did_you_mean
from mmgrpo.model.batch import TokenBatch, pad_right
from mmgrpo.model.policy import Policy
from mmgrpo.train.optim import adamw

__all__ = [
    "Example",
    "parse_row",
    "read_examples",
    "load_examples",
    "supervised_batch",
    "masked_nll",
    "batch_rows",
    "eval_loss",
    "run_sft",
]

ROLES = ("system", "user", "assistant", "tool")
FORMS = (
    "A row is {messages: [...]} ending with the assistant target, {messages: [...], response: '...'}, or "
    "{question: '...', response: '...'} with optional image / images and system."
)


@dataclass
class Example:
    """One parsed row: the prompt (messages whose image parts hold unopened references) and the target."""

    source: str
    prompt: list[dict[str, Any]]
    target: str
    base_dir: Path | None = None

    @property
    def image_refs(self) -> list[Any]:
        """The image references of the prompt, in order."""
        return [p["image"] for m in self.prompt for p in m["content"] if p["type"] == "image"]

    def messages(self) -> list[dict[str, Any]]:
        """The prompt with every image opened (``mmgrpo.data.records.open_image``: decoded, RGB)."""
        return [
            dict(
                m,
                content=[
                    dict(p, image=open_image(p["image"], self.base_dir)) if p["type"] == "image" else p
                    for p in m["content"]
                ],
            )
            for m in self.prompt
        ]


# --------------------------------------------------------------------------------------------- rows
def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(ref: Any) -> dict[str, Any]:
    return {"type": "image", "image": ref}


def _refs(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _content(content: Any, where: str, row_images: list[Any], problems: list[str]) -> list[dict[str, Any]]:
    """A message's content as parts; a placeholder image part takes the next of ``row_images``."""
    if isinstance(content, str):
        return [_text(content)]
    if not isinstance(content, list):
        problems.append(f"{where}: content must be text or a list of parts, got {type(content).__name__}")
        return []
    parts = []
    for j, part in enumerate(content):
        at = f"{where} part {j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(_text(part["text"]))
        elif kind == "image":
            ref = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
            if ref is None:
                if not row_images:
                    problems.append(f"{at}: an image part without a reference, and no more row 'images' left")
                    continue
                ref = row_images.pop(0)
            parts.append(_image(ref))
        elif kind == "text":
            problems.append(f"{at}: a text part's 'text' must be a string")
        else:
            problems.append(
                f"{at}: expected {{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': ...}}, "
                f"got {str(part)[:80]}"
            )
    return parts


def _messages(value: Any, row_images: list[Any], problems: list[str]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        problems.append(f"'messages' must be a non-empty list of messages, got {str(value)[:60]}")
        return []
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            problems.append(f"message {i} is {type(m).__name__}, expected {{'role': ..., 'content': ...}}")
            continue
        role = m.get("role")
        if role not in ROLES:
            problems.append(
                f"message {i} has role {role!r}; roles are {list(ROLES)}.{did_you_mean(str(role), ROLES)}"
            )
            continue
        out.append(
            {
                "role": role,
                "content": _content(m.get("content"), f"message {i} ({role})", row_images, problems),
            }
        )
    return out


def _target_text(message: dict[str, Any], problems: list[str]) -> str:
    if any(p["type"] != "text" for p in message["content"]):
        problems.append("the target (the last, assistant message) may hold text only")
    return "".join(p["text"] for p in message["content"] if p["type"] == "text")


def parse_row(record: Record) -> tuple[Example | None, list[str]]:
    """The example of ``record`` and what is wrong with it (images are not opened here)."""
    f = record.fields
    present = [k for k, v in f.items() if v is not None]
    if f.get("messages") is not None and f.get("question") is not None:
        return None, ["has both 'messages' and 'question'; give one"]
    if f.get("messages") is None and f.get("question") is None:
        return None, [f"has neither 'messages' nor 'question'. {FORMS} Row fields: {present}"]
    problems: list[str] = []
    response = f.get("response")
    if response is not None and (not isinstance(response, str) or not response.strip()):
        problems.append(f"'response' must be non-empty text, got {str(response)[:60]!r}")
    if f.get("image") is not None and f.get("images") is not None:
        problems.append("has both 'image' and 'images'; give one")
    images = f["images"] if f.get("images") is not None else f.get("image")
    row_images = [] if images is None else _refs(images)

    if f.get("question") is not None:
        if response is None:
            hint = (
                " ('answer' is the verifiers' field; SFT needs the whole target text, e.g. "
                "'<answer>3</answer>')"
            )
            problems.append(f"missing field 'response'{hint if 'answer' in f else ''}. Row fields: {present}")
        question, sys_prompt = f["question"], f.get("system")
        if not isinstance(question, str):
            problems.append(f"'question' must be text, got {type(question).__name__}")
        if sys_prompt is not None and not isinstance(sys_prompt, str):
            problems.append(f"'system' must be text, got {type(sys_prompt).__name__}")
        if problems:
            return None, problems
        prompt = [{"role": "system", "content": [_text(sys_prompt)]}] if sys_prompt is not None else []
        prompt.append({"role": "user", "content": [*map(_image, row_images), _text(question)]})
        return Example(record.source, prompt, response, record.base_dir), []

    if f.get("system") is not None:
        problems.append("'system' goes with 'question'; with 'messages' put a system message first")
    messages = _messages(f["messages"], row_images, problems)
    if row_images:
        problems.append(
            f"{len(row_images)} of the row's images are not used: give one {{'type': 'image'}} part per image"
        )
    if problems:
        return None, problems
    last = messages[-1]
    if response is None:
        if last["role"] != "assistant":
            return None, [
                f"the last message is a {last['role']} message: end 'messages' with the assistant target or "
                "add 'response'"
            ]
        prompt, target = messages[:-1], _target_text(last, problems)
        if not target.strip():
            problems.append("the target (the last, assistant message) is empty")
    else:
        if last["role"] == "assistant":
            return None, [
                "'messages' ends with an assistant message and the row has 'response': give one target"
            ]
        prompt, target = messages, response
    if not prompt:
        problems.append("no prompt: 'messages' holds only the target")
    return (None, problems) if problems else (Example(record.source, prompt, target, record.base_dir), [])


def _image_problem(ref: Any, base_dir: Path | None) -> str | None:
    if is_video_ref(ref):
        return f"video {describe_ref(ref)}: sft takes images only (give a video as a list of frame images)"
    try:
        open_image(ref, base_dir)
    except DataError as e:
        return str(e)
    return None


def read_examples(paths: Sequence[str]) -> list[list[Example]]:
    """The examples of each path, every row of every path checked first, images decoded: ONE DataError
    listing every bad row (``mmgrpo.data.records.check_records``) when any is wrong."""
    per_path = [read_records(p) for p in paths]
    records = [r for rs in per_path for r in rs]
    parsed = {id(r): parse_row(r) if r.problem is None else (None, []) for r in records}
    jobs = [(r, ref) for r in records if parsed[id(r)][0] is not None for ref in parsed[id(r)][0].image_refs]

    def check(job: tuple[Record, Any]) -> str | None:
        return _image_problem(job[1], job[0].base_dir)

    workers = max(1, min(8, os.cpu_count() or 1, len(jobs)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        image_problems: dict[int, list[str]] = {}
        for (r, _), problem in zip(jobs, pool.map(check, jobs), strict=True):
            if problem is not None:
                image_problems.setdefault(id(r), []).append(problem)
    check_records(records, validate=lambda r: parsed[id(r)][1] + image_problems.get(id(r), []))
    for path, rs in zip(paths, per_path, strict=True):
        if not rs:
            raise DataError(f"{path}: no rows. {FORMS}")
    return [[parsed[id(r)][0] for r in rs] for rs in per_path]  # type: ignore[misc]


def load_examples(cfg: Config) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples of ``cfg.sft``: every row of both checked before anything else happens."""
    s = cfg.sft
    if not s.data:
        raise ConfigError(
            "sft.data is empty: set it in the config (sft: {data: PATH}) or with --set sft.data=PATH, "
            "a .jsonl / .json / .parquet file, a datasets folder or a hub id. " + FORMS
        )
    parts = read_examples([s.data, s.eval_data] if s.eval_data else [s.data])
    return parts[0], parts[1] if s.eval_data else []


# --------------------------------------------------------------------------------------------- batches
def supervised_batch(
    policy: Policy,
    prompts: list[list[dict]],
    targets: list[str],
    tools: list[list[dict] | None] | None = None,
) -> TokenBatch:
    """``prompts`` (templated with the generation prompt, with each one's ``tools`` schemas as the rollout
    renders them) | each target's ids and the end-of-turn token; loss_mask 1 on the target tokens."""
    prompt_ids, prompt_mask, vision = policy.encode_prompts(prompts, tools)  # (B, P)
    responses = [policy.encode_text(t) + [policy.end_of_turn_id] for t in targets]
    response_ids, response_mask = pad_right(responses, policy.pad_token_id)  # (B, T)
    return TokenBatch(prompt_ids, prompt_mask, response_ids, response_mask, response_mask, vision)


def example_batch(policy: Policy, examples: Sequence[Example]) -> TokenBatch:
    return supervised_batch(policy, [e.messages() for e in examples], [e.target for e in examples])


def masked_nll(logp: Tensor, mask: Tensor, num_tokens: int | None = None) -> Tensor:
    """Negative log-likelihood summed over ``mask`` (N, T) and divided by ``num_tokens`` (default: the
    mask's own count), so that micro-batches divided by the batch's count sum to the batch mean."""
    mask = mask.to(logp.device).bool()  # (N, T)
    denom = int(mask.sum()) if num_tokens is None else num_tokens
    return -torch.where(mask, logp, 0.0).sum() / max(denom, 1)


def batch_rows(n: int, batch_size: int, steps: int, seed: int, shuffle: bool) -> Iterator[list[int]]:
    """``steps`` batches of row indices of ``n`` rows: epoch after epoch, each in a fresh order drawn from
    ``seed`` (file order without ``shuffle``); a batch may run on into the next epoch."""
    rng = random.Random(seed)
    pool: list[int] = []
    for _ in range(steps):
        rows: list[int] = []
        while len(rows) < batch_size:
            if not pool:
                pool = list(range(n))
                if shuffle:
                    rng.shuffle(pool)
            take = min(batch_size - len(rows), len(pool))
            rows, pool = rows + pool[:take], pool[take:]
        yield rows


def _lengths(policy: Policy, examples: list[Example], chunk: int = 32) -> list[int]:
    """Tokens of each example: its prompt (image placeholders expanded) and its response."""
    out = []
    for i in range(0, len(examples), chunk):
        part = examples[i : i + chunk]
        _, mask, _ = policy.encode_prompts([e.messages() for e in part])  # (B, P)
        out += [
            int(m) + len(policy.encode_text(e.target)) + 1 for m, e in zip(mask.sum(1), part, strict=True)
        ]
    return out


@torch.no_grad()
def eval_loss(policy: Policy, examples: Sequence[Example], batch_size: int) -> float:
    """Mean negative log-likelihood per target token of ``examples``."""
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = example_batch(policy, examples[i : i + batch_size])
        logp = policy.logprobs(batch, scored=batch.loss_mask.bool())  # (B, T)
        n = int(batch.loss_mask.sum())
        total += float(masked_nll(logp, batch.loss_mask)) * n
        count += n
    return total / max(count, 1)


# --------------------------------------------------------------------------------------------- the run
def _check_fits(policy: Policy, examples: list[Example], what: str) -> None:
    if policy.is_vision:
        return
    with_images = [e.source for e in examples if e.image_refs]
    if with_images:
        raise DataError(
            f"{len(with_images)} {what} rows have images but the model {policy.name_or_path!r} is text-only "
            f"(first: {', '.join(with_images[:3])}); use an image-text-to-text model or rows without images"
        )


def _drop_long(
    policy: Policy, examples: list[Example], max_length: int | None, what: str
) -> tuple[list[Example], int]:
    if max_length is None or not examples:
        return examples, 0
    lengths = _lengths(policy, examples)
    kept = [e for e, n in zip(examples, lengths, strict=True) if n <= max_length]
    if not kept:
        raise DataError(
            f"every {what} row is longer than sft.max_length={max_length} tokens (the shortest has "
            f"{min(lengths)}): raise sft.max_length, or lower model.max_pixels for fewer image tokens"
        )
    return kept, len(examples) - len(kept)


class SftInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``run_sft``: the model after ``step`` of ``steps`` steps was saved to ``path``."""

    def __init__(self, path: Path, step: int, steps: int):
        super().__init__(f"sft interrupted after step {step} of {steps}; the model so far is in {path}")
        self.path, self.step, self.steps = path, step, steps


def run_sft(cfg: Config, policy: Policy | None = None, progress: bool = True) -> dict[str, Any]:
    """Supervised fine-tuning of ``cfg.sft`` (see the module docstring); saves ``{output_dir}/final``.

    ``policy``: train this one instead of loading ``model.path`` (it is trained in place; its vision
    parameters' ``requires_grad`` is restored at the end). Returns a summary: ``steps``, ``first_loss``,
    ``last_loss``, ``tokens``, ``examples``, ``dropped``, ``eval_loss_before`` / ``eval_loss`` (with
    eval_data), ``seconds`` and ``final`` (the saved folder).
    """
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from mmgrpo.model.io import PRECISION
    from mmgrpo.train.builders import flat_config, load_policy, make_accelerator
    from mmgrpo.train.lr_schedule import make_scheduler
    from mmgrpo.train.saving import save_run

    t0 = time.perf_counter()
    s = cfg.sft
    if policy is None:
        cfg.require_model()
    train, held = load_examples(cfg)  # every row checked before any model loads
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or load_policy(cfg)
    _check_fits(policy, train + held, "sft")
    train, dropped = _drop_long(policy, train, s.max_length, "sft.data")
    held, _ = _drop_long(policy, held, s.max_length, "sft.eval_data")
    steps = s.steps or max(1, math.ceil(s.epochs * len(train) / s.batch_size))
    micro = s.micro_batch_size or s.batch_size

    # the vision side stays as it is unless sft.train_vision (and not model.freeze_vision): frozen for the
    # run, its requires_grad restored at the end
    train_vision = s.train_vision and not cfg.model.freeze_vision
    frozen = [
        p
        for n, p in policy.model.named_parameters()
        if p.requires_grad and not train_vision and policy.adapter.is_vision_param(n)
    ]
    for p in frozen:
        p.requires_grad_(False)
    try:
        groups = policy.param_groups(s.lr, cfg.model.vision_lr)
        params = [p for g in groups for p in g["params"]]
        if not params:
            raise ConfigError("sft: the model has no trainable parameters (everything is frozen)")
        optimizer = adamw(groups, lr=s.lr, weight_decay=0.0)
        scheduler = make_scheduler(s.lr_schedule, optimizer, warmup_steps=s.warmup_steps, steps=steps)
        accelerator = make_accelerator(
            cpu=str(policy.device) == "cpu",
            mixed_precision=PRECISION[cfg.model.dtype].replace("fp32", "no"),
            log_with=list(cfg.logging.report_to),
            project_dir=out,
        )
        if cfg.logging.report_to:
            accelerator.init_trackers(cfg.logging.project, config=flat_config(config_to_dict(cfg)))
        policy.model, optimizer, scheduler = accelerator.prepare(policy.model, optimizer, scheduler)
        metrics_path = out / "metrics.jsonl"

        def log(record: dict[str, Any]) -> None:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if cfg.logging.report_to:
                nums = {
                    f"sft/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"
                }
                accelerator.log(nums, step=int(record["step"]))

        save_config(cfg, out / "config.yaml")
        summary: dict[str, Any] = {"examples": len(train), "dropped": dropped}
        if held:
            summary["eval_loss_before"] = eval_loss(policy, held, micro)
            log({"stage": "sft", "step": 0, "eval_loss": summary["eval_loss_before"]})
        policy.model.train()
        losses: list[float] = []
        total_tokens = 0
        bar = tqdm(total=steps, desc="sft", unit="step", disable=not progress)
        try:
            for step, rows in enumerate(batch_rows(len(train), s.batch_size, steps, cfg.seed, s.shuffle), 1):
                batch = example_batch(policy, [train[i] for i in rows])
                num_tokens = int(batch.loss_mask.sum())
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for start in range(0, len(rows), micro):
                    mb = (
                        batch
                        if micro >= len(rows)
                        else batch.select(list(range(start, min(start + micro, len(rows)))))
                    )
                    part = masked_nll(
                        policy.logprobs(mb, scored=mb.loss_mask.bool()), mb.loss_mask, num_tokens
                    )
                    accelerator.backward(part)
                    loss += float(part.detach())
                if not math.isfinite(loss):
                    raise FloatingPointError(f"sft step {step}: loss is {loss}; lower sft.lr")
                grad_norm = float(accelerator.clip_grad_norm_(params, s.max_grad_norm))
                optimizer.step()
                scheduler.step()
                losses.append(loss)
                total_tokens += num_tokens
                if step % s.log_every == 0 or step == steps:
                    log(
                        {
                            "stage": "sft",
                            "step": step,
                            "loss": loss,
                            "tokens": num_tokens,
                            "lr": scheduler.get_last_lr()[0],
                            "grad_norm": grad_norm,
                            "epoch": step * s.batch_size / len(train),
                        }
                    )
                if held and s.eval_every and step % s.eval_every == 0 and step != steps:
                    log({"stage": "sft", "step": step, "eval_loss": eval_loss(policy, held, micro)})
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
        except KeyboardInterrupt:  # Ctrl-C: keep the model so far, as `mmgrpo train` does
            bar.close()
            where = out / "interrupted"
            save_run(accelerator, policy, cfg, where)
            raise SftInterrupted(where, len(losses), steps) from None
        bar.close()
        if held:
            summary["eval_loss"] = eval_loss(policy, held, micro)
            log({"stage": "sft", "step": steps, "eval_loss": summary["eval_loss"]})
        final = out / "final"
        save_run(accelerator, policy, cfg, final)
        if cfg.logging.report_to:
            accelerator.end_training()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    summary.update(
        steps=steps,
        first_loss=losses[0],
        last_loss=losses[-1],
        tokens=total_tokens,
        seconds=time.perf_counter() - t0,
        final=str(final),
    )
    return summary
