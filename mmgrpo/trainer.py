"""The GRPO loop: rollout -> rewards -> group advantages -> clipped, KL-regularised update.

One step (the README's "How GRPO is computed here"):
  1. B = grpo.tasks_per_step training tasks, G = grpo.group_size episodes each (``rollout``);
  2. verifiers score every episode; rewards are combined with their weights;
  3. advantages are normalised within each group, over the whole batch, BEFORE any micro-batch split;
  4. reference log-probs (beta > 0) and old log-probs (num_iterations > 1) are computed without grad;
  5. num_iterations passes; each pass splits the N = B * G rows into micro-batches, accumulates gradients
     with the loss normalised by whole-batch totals (so the sum over micro-batches is the full-batch loss),
     clips the gradient norm and takes one optimizer step.
Metrics go to ``{output_dir}/metrics.jsonl``, one JSON object per step; the final policy, its processor and
the resolved config go to ``{output_dir}/final``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.advantages import group_advantages, group_stats
from mmgrpo.batch import TokenBatch
from mmgrpo.config import Config, config_to_dict, save_config
from mmgrpo.env import ChatEnv
from mmgrpo.errors import ConfigError
from mmgrpo.losses import grpo_loss
from mmgrpo.model_io import PRECISION, LoraSpec, check_precision
from mmgrpo.policy import Policy
from mmgrpo.registry import make_env, make_verifier
from mmgrpo.rollout import episode_metrics, rollout
from mmgrpo.verifier import Rewards


def build_env_factory(cfg: Config) -> Callable[[], ChatEnv]:
    """A zero-argument env factory; builds one env now so bad kwargs fail before any model loads."""
    make_env(cfg.env.name, **cfg.env.kwargs)
    return lambda: make_env(cfg.env.name, **cfg.env.kwargs)


def build_rewards(cfg: Config) -> Rewards:
    return Rewards([make_verifier(v.name, weight=v.weight, **v.kwargs) for v in cfg.verifiers])


def eval_metric(cfg: Config) -> str:
    """The verifier whose score is the accuracy: eval.metric, or the first verifier of the config."""
    names = [v.name for v in cfg.verifiers]
    metric = cfg.eval.metric or (names[0] if names else "")
    if metric not in names:
        raise ConfigError(f"eval.metric='{metric}' is not one of the configured verifiers {names}")
    return metric


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device=cuda, but torch {torch.__version__} sees no CUDA device (built for CUDA "
            f"{torch.version.cuda or 'none: a CPU-only build'}). Use model.device=cpu, or auto to take a GPU "
            "when there is one."
        )
    return device


def prepare_output_dir(path: str | Path) -> Path:
    """Create ``path`` (the run directory) and check that files can be written there, before any model
    loads; a clear ConfigError otherwise."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir '{out}' is a file, not a directory: set output_dir to a folder path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mmgrpo-write-check"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"output_dir '{out}' cannot be written: {e.strerror or e}. Choose a folder you can write to "
            "(and with free space) with --set output_dir=PATH"
        ) from None
    return out


def lora_spec(cfg: Config) -> LoraSpec | None:
    lo = cfg.model.lora
    if lo is None:
        return None
    return LoraSpec(
        r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=list(lo.target_modules), save=lo.save
    )


def load_policy(cfg: Config, model_path: str | None = None) -> Policy:
    path = model_path or cfg.require_model()
    device = resolve_device(cfg.model.device)
    check_precision(cfg.model.dtype, device)
    return Policy.from_pretrained(
        path,
        dtype=cfg.model.dtype,
        device=device,
        min_pixels=cfg.model.min_pixels,
        max_pixels=cfg.model.max_pixels,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        trust_remote_code=cfg.model.trust_remote_code,
        lora=lora_spec(cfg),
    )


def make_accelerator(*, cpu: bool, mixed_precision: str, log_with: list[str], project_dir: Path):
    """An Accelerator with this run's precision and trackers. Accelerate keeps one state per process;
    a single-process run that asks for a different precision than an earlier run of the same process
    (tests, notebooks) resets it first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    kw = dict(
        cpu=cpu, mixed_precision=mixed_precision, log_with=log_with or None, project_dir=str(project_dir)
    )
    try:
        return Accelerator(**kw)
    except ValueError:
        if PartialState().num_processes > 1:
            raise
        AcceleratorState._reset_state(reset_partial_state=True)
        return Accelerator(**kw)


class Trainer:
    """Runs GRPO for ``cfg.grpo.steps`` steps on one process (Accelerate handles device placement)."""

    def __init__(self, cfg: Config, *, policy: Policy | None = None, progress: bool = True):
        from accelerate.utils import set_seed
        from transformers import get_scheduler

        self.cfg = cfg
        self.progress = progress
        g = cfg.grpo
        # everything that can be wrong with the config fails here, before a model is loaded
        self.make_env = build_env_factory(cfg)
        self.rewards = build_rewards(cfg)
        self.metric = eval_metric(cfg)
        set_seed(cfg.seed)
        self.out = prepare_output_dir(cfg.output_dir)
        resolve_device(cfg.model.device)  # a missing GPU fails here, before the model loads
        self.policy = policy or load_policy(cfg)
        if cfg.model.freeze_vision:
            self.policy.freeze_vision()
        device = str(self.policy.device)
        self.accelerator = make_accelerator(
            cpu=device == "cpu",
            mixed_precision=PRECISION[cfg.model.dtype].replace("fp32", "no"),
            log_with=list(cfg.logging.report_to),
            project_dir=self.out,
        )
        if cfg.logging.report_to:
            self.accelerator.init_trackers(cfg.logging.project, config=flat_config(config_to_dict(cfg)))
        self.optimizer = torch.optim.AdamW(
            self.policy.param_groups(g.lr, cfg.model.vision_lr),
            lr=g.lr,
            betas=tuple(g.betas),
            weight_decay=g.weight_decay,
        )
        self.scheduler = get_scheduler(
            g.lr_schedule,
            self.optimizer,
            num_warmup_steps=g.warmup_steps,
            num_training_steps=g.steps * g.num_iterations,
        )
        self.policy.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            self.policy.model, self.optimizer, self.scheduler
        )
        self.envs = [self.make_env() for _ in range(g.episodes_per_step)]
        self.metrics_path = self.out / "metrics.jsonl"
        self.step = 0

    # ------------------------------------------------------------------------------------------ logging
    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.cfg.logging.report_to and "step" in record:
            nums = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(nums, step=int(record["step"]))

    def _report_failed_tasks(self, failed: list[tuple[int, str]]) -> None:
        """Tasks the env could not pose (reset raised) were left out of the step: log each with its seed
        and error to warnings.log, and the first few to stderr."""
        for seed, message in failed:
            line = f"mmgrpo: warning: step {self.step + 1}: env '{self.cfg.env.name}' failed to reset task seed {seed}: {message}; the task was left out"
            shown = self.__dict__.setdefault("_failed_shown", [0])
            if shown[0] < 5:
                print(line, file=sys.stderr, flush=True)
                shown[0] += 1
            with (self.out / "warnings.log").open("a") as f:
                f.write(line + "\n")

    def _warn_failing_verifiers(self, scored, n: int) -> None:
        """Say so, once per verifier, when a verifier fails on every episode of a step: its reward is then
        0 everywhere, which trains on nothing while looking like a hard task."""
        warned = self.__dict__.setdefault("_warned_verifiers", set())
        for name, failed in scored.failures.items():
            if failed >= n and name not in warned:
                warned.add(name)
                first = next((e for e in scored.errors if f"'{name}'" in e), "")
                line = (
                    f"mmgrpo: warning: verifier '{name}' failed on all {n} episodes of step {self.step + 1}; it "
                    f"scores 0 for them. First error: {first}"
                )
                print(line, file=sys.stderr, flush=True)
                with (self.out / "warnings.log").open("a") as f:
                    f.write(line + "\n")

    def save_samples(self, batch, scored, step: int) -> Path:
        """Some of this step's episodes, as text with their rewards: output_dir/samples/step-N.jsonl."""
        out = self.out / "samples" / f"step-{step}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        n = min(self.cfg.logging.samples_per_step, len(batch.trajectories))
        with out.open("w") as f:
            for i, (t, ep) in enumerate(zip(batch.trajectories[:n], batch.episodes[:n], strict=True)):
                row = {
                    "step": step,
                    "group": t.group,
                    "prompt": _prompt_text(t.messages),
                    "completion": ep.completion,
                    "reward": float(scored.total[i]),
                    **{f"reward/{k}": float(v[i]) for k, v in scored.per_verifier.items()},
                    "truncated": t.truncated,
                }
                f.write(json.dumps(row) + "\n")
        return out

    # --------------------------------------------------------------------------------------- one step
    def task_seeds(self, step: int) -> list[int]:
        B = self.cfg.grpo.tasks_per_step
        return [step * B + b for b in range(B)]

    def train_step(self) -> dict[str, Any]:
        g, policy = self.cfg.grpo, self.policy
        if g.beta > 0 and not policy.has_reference:
            policy.make_reference()  # the policy as GRPO starts (after any warm start) is the KL anchor
        t0 = time.perf_counter()
        batch = rollout(
            policy,
            self.envs,
            self.task_seeds(self.step),
            group_size=g.group_size,
            split="train",
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_turns=self.cfg.env.max_turns,
            max_episode_tokens=self.cfg.env.max_episode_tokens,
        )
        t_rollout = time.perf_counter() - t0
        self._report_failed_tasks(batch.failed_tasks)
        scored = self.rewards.score(batch.episodes)
        self._warn_failing_verifiers(scored, len(batch.episodes))
        rewards = scored.total  # (N,)
        adv = group_advantages(
            rewards,
            g.group_size,
            group_ids=batch.group_ids,
            baseline=g.baseline,
            scale=g.scale,
            eps=g.adv_eps,
        )  # (N,) over each task's G rows, whatever their order
        tokens = batch.tokens
        N = len(tokens)
        loss_mask = tokens.loss_mask  # (N, T)
        num_tokens = int(loss_mask.sum())
        # whole groups per micro-batch when they fit, so that each prompt is encoded once for its G rows
        size = g.micro_batch_size // g.group_size * g.group_size or g.micro_batch_size
        mbs = [list(range(i, min(i + size, N))) for i in range(0, N, size)]
        mb_tokens: list[TokenBatch] = [tokens.select(rows) for rows in mbs]  # padding trimmed per micro-batch

        t1 = time.perf_counter()
        ref_lp, old_lp = [], []
        with torch.no_grad():
            for mb in mb_tokens:
                ref_lp.append(
                    policy.logprobs(mb, temperature=g.temperature, reference=True) if g.beta > 0 else None
                )
                old_lp.append(
                    policy.logprobs(mb, temperature=g.temperature) if g.num_iterations > 1 else None
                )

        stats = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0}
        grad_norm = 0.0
        policy.model.train()
        for _ in range(g.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for k, (rows, mb) in enumerate(zip(mbs, mb_tokens, strict=True)):
                logp = policy.logprobs(mb, temperature=g.temperature)  # (n, t)
                out = grpo_loss(
                    logp,
                    old_lp[k],
                    ref_lp[k],
                    adv[rows].to(logp.device),
                    mb.loss_mask.to(logp.device),
                    clip_eps_low=g.clip_eps_low,
                    clip_eps_high=g.clip_eps_high,
                    beta=g.beta,
                    aggregation=g.aggregation,
                    importance=g.importance,
                    dual_clip=g.dual_clip,
                    num_sequences=N,
                    num_tokens=num_tokens,
                    max_new_tokens=g.max_new_tokens,
                )
                self.accelerator.backward(out.loss)
                share = mb.loss_mask.sum().item() / max(num_tokens, 1) / g.num_iterations
                stats["loss"] += float(out.loss.detach()) / g.num_iterations
                for key in ("kl", "clip_frac", "ratio_mean"):
                    stats[key] += float(getattr(out, key)) * share
            grad_norm = float(self.accelerator.clip_grad_norm_(policy.model.parameters(), g.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        t_train = time.perf_counter() - t1

        lengths = [t.num_policy_tokens for t in batch.trajectories]
        record: dict[str, Any] = {
            "step": self.step + 1,
            "reward": float(rewards.mean()),
            **{f"reward/{k}": float(v.mean()) for k, v in scored.per_verifier.items()},
            **group_stats(rewards, g.group_size),
            "adv_abs_mean": float(adv.abs().mean()),
            **stats,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "completion_len": sum(lengths) / len(lengths),
            "truncated_frac": sum(t.truncated for t in batch.trajectories) / N,
            "verifier_failures": sum(scored.failures.values()),
            "env_errors": sum(t.env_error is not None for t in batch.trajectories),
            "env_reset_failures": len(batch.failed_tasks),
            **(episode_metrics(batch.trajectories) if self.cfg.env.max_turns > 1 else {}),
            "rollout_time": t_rollout,
            "train_time": t_train,
            "step_time": time.perf_counter() - t0,
        }
        self.step += 1
        every = self.cfg.logging.samples_every
        if every and self.step % every == 0:
            self.save_samples(batch, scored, self.step)
        return record

    # -------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """Run all steps; returns the last step's metrics."""
        from tqdm.auto import tqdm

        g = self.cfg.grpo
        save_config(self.cfg, self.out / "config.yaml")
        record: dict[str, Any] = {}
        bar = tqdm(total=g.steps, initial=self.step, desc="grpo", unit="step", disable=not self.progress)
        while self.step < g.steps:
            record = self.train_step()
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(
                    f"step {self.step}: loss is {record['loss']}; lower grpo.lr or raise grpo.beta "
                    "(a loss that overflows usually means the policy moved too far in one step)"
                )
            if g.eval_every and self.step % g.eval_every == 0:
                record["eval_accuracy"] = self.evaluate(g.eval_episodes).accuracy
            if self.step % g.log_every == 0 or self.step == g.steps:
                self.log(record)
            if g.save_every and self.step % g.save_every == 0:
                self.save(self.out / f"checkpoint-{self.step}")
            bar.update(1)
            bar.set_postfix(
                reward=f"{record['reward']:.2f}",
                kl=f"{record['kl']:.3f}",
                zero_std=f"{record['frac_zero_std_groups']:.2f}",
            )
        bar.close()
        self.save(self.out / "final")
        if self.cfg.logging.report_to:
            self.accelerator.end_training()
        return record

    def evaluate(self, episodes: int | None = None):
        """Held-out accuracy of the current policy (eval split, settings from ``cfg.eval``)."""
        from mmgrpo.evaluate import evaluate_config

        return evaluate_config(
            self.cfg.eval,
            self.cfg.env,
            self.policy,
            self.make_env,
            self.rewards,
            self.metric,
            episodes=episodes,
            progress=self.progress,
        )

    def warm_start(self) -> float:
        """The supervised format-only cold start of ``cfg.warm_start`` (see mmgrpo.warmstart)."""
        from mmgrpo.warmstart import warm_start

        w = self.cfg.warm_start
        return warm_start(
            self.policy,
            self.make_env,
            steps=w.steps,
            lr=w.lr,
            batch_size=w.batch_size,
            template=w.target,
            low=w.random_low,
            high=w.random_high,
            seed=self.cfg.seed,
            source=w.source,
            train_vision=w.train_vision,
            progress=self.progress,
            log=self.log,
        )

    def save(self, out_dir: Path) -> None:
        save_run(self.accelerator, self.policy, self.cfg, out_dir)


def save_run(accelerator, policy: Policy, cfg: Config, out_dir: Path) -> None:
    """The model (a LoRA run: the adapter, or the merged model with model.lora.save=merged), its processor
    and the resolved config, as ``mmgrpo eval`` and ``model.path`` read them.

    Atomic: everything is written to ``<out_dir>.partial`` and renamed into place only when complete, so a
    save that fails (a full disk, a kill) never leaves an ``out_dir`` that looks like a model and is not,
    and an earlier save at ``out_dir`` survives until the new one is whole.
    """
    import shutil

    from mmgrpo.model_io import save_model

    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = accelerator.unwrap_model(policy.model)
    lo = cfg.model.lora
    try:
        save_model(model, policy.processor, partial, merged=lo is not None and lo.save == "merged")
        save_config(cfg, partial / "mmgrpo_config.yaml")
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(
            f"saving to {out_dir} failed ({e.strerror or e}); nothing was replaced"
            + (f" (the earlier save at {out_dir} is intact)" if out_dir.exists() else "")
            + ". Free some space or set output_dir elsewhere."
        ) from None
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def flat_config(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as flat dotted keys with scalar values (what trackers take as hyperparameters)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


def _prompt_text(messages: list[dict]) -> str:
    """The text of the messages before the first assistant turn (images as <image>)."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            break
        c = m["content"]
        text = c if isinstance(c, str) else "".join(p.get("text", "<image>") for p in c)
        parts.append(f"{m['role']}: {text}")
    return "\n".join(parts)
