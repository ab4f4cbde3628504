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

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mmgrpo.config.core import Config, config_to_dict, save_config
from mmgrpo.env import ChatEnv
from mmgrpo.errors import ConfigError, EnvError, NonFiniteError
from mmgrpo.grpo.advantages import group_advantages, group_stats
from mmgrpo.grpo.losses import grpo_loss
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.batch import TokenBatch
from mmgrpo.model.io import PRECISION, LoraSpec, check_precision
from mmgrpo.model.policy import Policy
from mmgrpo.registry import make_env, make_verifier
from mmgrpo.rollout.episodes import RolloutBatch, episode_metrics, rollout
from mmgrpo.rollout.sampling import (
    LENGTH_CUTS,
    concat_batches,
    concat_scored,
    longest_turn,
    overlong_penalty,
    select_rows,
    select_scored,
    zero_variance_groups,
)
from mmgrpo.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    register_model_hooks,
    resume_changes,
    save_checkpoint,
    write_failure,
)
from mmgrpo.train.diagnostics import repetition
from mmgrpo.train.distributed import gather_objects, global_counts, global_sum, reduce_records, shard
from mmgrpo.train.faults import FaultTracker, check_finite
from mmgrpo.verifier import Rewards


def build_env_factory(cfg: Config) -> Callable[[], ChatEnv]:
    """A zero-argument env factory; builds one env now so bad kwargs (and a tool env with too few turns
    to answer a call) fail before any model loads."""
    from mmgrpo.envs.tool_env import check_max_turns

    check_max_turns(make_env(cfg.env.name, **cfg.env.kwargs), cfg.env.max_turns, f"'{cfg.env.name}'")
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
        probe = out / f".mmgrpo-write-check-{os.getpid()}"
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


def load_policy(cfg: Config, model_path: str | None = None, device: str | None = None) -> Policy:
    """The policy of ``cfg`` (or the model at ``model_path``) on ``device`` (default: model.device)."""
    path = model_path or cfg.require_model()
    device = device or resolve_device(cfg.model.device)
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
    (tests, notebooks) resets it first.

    The learning-rate schedule advances once per optimizer step, whatever the number of processes: by
    default accelerate's scheduler wrapper steps W times per step (it assumes each process's data loader
    batch is 1/W of an epoch's step), which would run a W-process schedule W times too fast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    check_trackers(log_with)
    kw = dict(
        cpu=cpu,
        mixed_precision=mixed_precision,
        log_with=log_with or None,
        project_dir=str(project_dir),
        step_scheduler_with_optimizer=False,
    )
    try:
        return Accelerator(**kw)
    except ValueError:
        if PartialState().num_processes > 1:
            raise
        AcceleratorState._reset_state(reset_partial_state=True)
        return Accelerator(**kw)


TRACKER_MODULES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "comet_ml": ("comet_ml",),
}
"""The modules a tracker of logging.report_to needs (accelerate's own names), when not the tracker's name."""


def check_trackers(names: list[str]) -> None:
    """ConfigError naming the trackers of logging.report_to whose package is not installed: accelerate
    would drop them with a library warning and the run would train with no tracker."""
    import importlib.util

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    missing = [n for n in names if not any(installed(m) for m in TRACKER_MODULES.get(n, (n,)))]
    if missing:
        extra = " (or pip install -e '.[tensorboard]' from a clone)" if "tensorboard" in missing else ""
        raise ConfigError(
            f"logging.report_to lists {', '.join(missing)}, which is not installed: pip install "
            f"{' '.join(missing)}{extra}, or remove it from logging.report_to (metrics.jsonl is written "
            "either way)"
        )


def make_scheduler(name: str, optimizer, *, warmup_steps: int, steps: int):
    """The learning-rate schedule ``name`` (constant, linear, cosine) with ``warmup_steps`` of linear
    warm-up from 0, over ``steps`` optimizer steps. (transformers' "constant" ignores a warm-up; a
    constant schedule with one is its "constant_with_warmup".)"""
    from transformers import get_scheduler

    if name == "constant" and warmup_steps > 0:
        name = "constant_with_warmup"
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=steps)


class TrainingStopped(Exception):
    """Raised by :meth:`Trainer.train` after a stop was requested (SIGINT/SIGTERM) and the checkpoint
    ``path`` of ``step`` was written."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"stopped after step {step}; checkpoint {path}")
        self.step, self.path = step, path


class Trainer:
    """Runs GRPO for ``cfg.grpo.steps`` steps, on one process or on each of ``accelerate launch``'s
    (mmgrpo.train.distributed says what is split and what is reduced)."""

    def __init__(self, cfg: Config, *, policy: Policy | None = None, progress: bool = True):
        from accelerate.utils import set_seed

        self.cfg = cfg
        g = cfg.grpo
        # everything that can be wrong with the config fails here, before a model is loaded
        self.make_env = build_env_factory(cfg)
        self.rewards = build_rewards(cfg)
        self.metric = eval_metric(cfg)
        self.out = prepare_output_dir(cfg.output_dir)
        device = resolve_device(cfg.model.device)  # a missing GPU fails here, before the model loads
        check_precision(cfg.model.dtype, device)
        # the accelerator first: under `accelerate launch` it joins the process group (on the CPU too)
        self.accelerator = make_accelerator(
            cpu=device == "cpu",
            mixed_precision=PRECISION[cfg.model.dtype].replace("fp32", "no"),
            log_with=list(cfg.logging.report_to),
            project_dir=self.out,
        )
        set_seed(cfg.seed + self.accelerator.process_index)  # each process samples its own episodes
        self.policy = policy or load_policy(cfg, device=str(self.accelerator.device))
        self.skill_check = None  # the warm start's skill check (mmgrpo.train.warm_check), once it ran
        self.warm_start_steps = 0  # the warm start's steps, fewer than warm_start.steps when it stopped early
        if cfg.model.freeze_vision:
            self.policy.freeze_vision()
        self.policy.offload_reference = cfg.model.offload_reference
        acc = self.accelerator
        self.rank, self.world, self.is_main = acc.process_index, acc.num_processes, acc.is_main_process
        check_engine(acc, g, self.world)
        if g.tasks_per_step < self.world:
            raise ConfigError(
                f"grpo.tasks_per_step={g.tasks_per_step} is fewer than the {self.world} processes: each process "
                f"trains on whole tasks, so set grpo.tasks_per_step to a multiple of {self.world}"
            )
        self.progress = progress and self.is_main
        if cfg.logging.report_to:
            acc.init_trackers(cfg.logging.project, config=flat_config(config_to_dict(cfg)))
        self.optimizer = torch.optim.AdamW(
            self.policy.param_groups(g.lr, cfg.model.vision_lr),
            lr=g.lr,
            betas=tuple(g.betas),
            weight_decay=g.weight_decay,
        )
        self.scheduler = make_scheduler(
            g.lr_schedule, self.optimizer, warmup_steps=g.warmup_steps, steps=g.steps * g.num_iterations
        )
        self.policy.model, self.optimizer, self.scheduler = acc.prepare(
            self.policy.model, self.optimizer, self.scheduler
        )
        register_model_hooks(acc, self.policy)
        local_tasks = len(shard(list(range(g.tasks_per_step)), self.rank, self.world))
        most_G = max([g.group_size, *(G for _, G in g.group_size_schedule)])
        self.envs = [self.make_env() for _ in range(max(local_tasks, 1) * most_G)]
        self.metrics_path = self.out / "metrics.jsonl"
        self.faults = FaultTracker(
            cfg.env.name,
            self.out / "warnings.log" if self.is_main else None,
            max_failure_frac=cfg.faults.max_failure_frac,
            echo=self.is_main,
        )
        self.flat_config = flat_config(config_to_dict(cfg))
        from mmgrpo.train.diagnostics import Diagnostics

        self.diagnostics = Diagnostics(  # the troubleshooting table, checked every step (main process)
            self.out / "diagnostics.log" if self.is_main else None,
            echo=self.is_main,
            reward_max=sum(max(v.weight, 0.0) for v in cfg.verifiers) or None,
        )
        self.step = 0
        from mmgrpo.grpo.kl_control import AdaptiveKLController, FixedKLController

        self.kl_ctl = (
            AdaptiveKLController(g.beta, g.target_kl, g.kl_horizon)
            if g.target_kl is not None
            else FixedKLController(g.beta)
        )
        self.task_cursor = 0  # the next task seed of the stream (B per step; more with dynamic sampling)
        self._last_give_up = -(10**9)
        self.stop_requested = False  # set by a signal handler; the loop saves a checkpoint and stops
        self._saved_step: int | None = None  # the step this trainer last wrote a checkpoint of
        self._eval_cut_said = False  # whether the eval split's size cut eval_episodes was said

    # ------------------------------------------------------------------------------------------ logging
    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.cfg.logging.report_to and "step" in record:
            nums = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(nums, step=int(record["step"]))

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
                    "seed": t.seed,
                    "prompt": _prompt_text(t.messages),
                    "completion": ep.completion,
                    "reward": float(scored.total[i]),
                    **{f"reward/{k}": float(v[i]) for k, v in scored.per_verifier.items()},
                    "truncated": t.truncated,
                }
                f.write(json.dumps(row) + "\n")
        return out

    # --------------------------------------------------------------------------------------- one step
    def train_step(self) -> dict[str, Any]:
        """collect -> score -> advantages -> update, then one metrics record for the step."""
        g, policy = self.cfg.grpo, self.policy
        G = self.group_size_now()
        if g.beta > 0 and not policy.has_reference:
            policy.make_reference()  # the policy as GRPO starts (after any warm start) is the KL anchor
        t0 = time.perf_counter()
        batch, scored, sampling = self.collect(G)
        t_rollout = time.perf_counter() - t0
        rewards = scored.total  # (N,)
        problem = self.agree_finite(check_finite(self.step + 1, scored.per_verifier))
        adv = torch.zeros_like(rewards)  # (N,)
        reward_kl = None  # grpo.kl_in=reward: this process's share of the token-mean KL
        if problem is None:
            rewards = self.shape_rewards(batch, rewards)  # (N,) overlong penalty
            if g.kl_in == "reward" and self.kl_ctl.beta > 0:
                seq_kl, reward_kl = self.reward_kl(batch.tokens, G)  # (N,), float
                rewards = rewards - self.kl_ctl.beta * seq_kl  # (N,)
            adv = self.advantages(batch, scored, rewards, G)  # (N,)
            problem = self.agree_finite(check_finite(self.step + 1, {}, adv))
        t1 = time.perf_counter()
        if problem is None:
            stats, problem = self.update(self.trained_tokens(batch), adv, G)
            if reward_kl is not None:
                stats["kl"] = reward_kl  # the loss ran with beta 0; this is the KL the controller follows
        if problem is not None:
            stats = self.skip_batch(problem)
        record = self.step_record(batch, scored, adv, stats, G, t_rollout, time.perf_counter() - t1, t0)
        record.update(sampling)
        record["beta"] = self.kl_ctl.beta
        if g.target_kl is not None and math.isfinite(record["kl"]):
            self.kl_ctl.update(record["kl"])  # the next step's beta
        self.step += 1
        every = self.cfg.logging.samples_every
        if every and self.step % every == 0 and self.is_main:
            self.save_samples(batch, scored, self.step)
        return record

    def advantages(self, batch: RolloutBatch, scored, rewards: torch.Tensor, G: int) -> torch.Tensor:
        """(N,) group-normalised advantages of ``rewards`` (the verifiers' weighted sum plus any shaping);
        with grpo.reward_combination=normalize_then_sum each verifier is normalised on its own first."""
        from mmgrpo.grpo.advantages import combine_advantages

        g = self.cfg.grpo
        kw = dict(baseline=g.baseline, scale=g.scale, eps=g.adv_eps)
        if g.reward_combination == "sum_then_normalize":
            return group_advantages(rewards, G, group_ids=batch.group_ids, **kw)
        weights = {v.name: v.weight for v in self.rewards.verifiers}
        per = dict(scored.per_verifier)
        weighted = sum(weights[k] * per[k] for k in per)
        per["_shaping"], weights["_shaping"] = rewards - weighted, 1.0  # env reward, penalties, KL
        return combine_advantages(per, weights, batch.group_ids, G, "normalize_then_sum", **kw)

    def group_size_now(self) -> int:
        """G at this step: grpo.group_size, or grpo.group_size_schedule's entry for the step."""
        from mmgrpo.grpo.advantages import group_size_at

        g = self.cfg.grpo
        return group_size_at(self.step, [tuple(x) for x in g.group_size_schedule], g.group_size)

    def next_tasks(self) -> list[int]:
        """This process's share of the next B task seeds of the stream (the stream's position moves on)."""
        B = self.cfg.grpo.tasks_per_step
        seeds = list(range(self.task_cursor, self.task_cursor + B))
        self.task_cursor += B
        return shard(seeds, self.rank, self.world)

    def collect(self, G: int) -> tuple[RolloutBatch, Any, dict[str, float]]:
        """Roll out and score this process's tasks of the step, G episodes each. With
        grpo.dynamic_sampling, groups whose rewards are all equal are dropped and more tasks are rolled
        out (B at a time) until this process has its share of groups with variance, or the bound is hit
        (mmgrpo.rollout.sampling)."""
        g = self.cfg.grpo

        def one_round():
            batch = self.rollout_tasks(self.next_tasks(), G)
            scored = self.rewards.score(batch.episodes, keep_nonfinite=True)  # NaN: stop or skip, not 0
            self.account_faults(batch, scored)
            return batch, scored

        if not g.dynamic_sampling:
            return (*one_round(), {})
        need = len(shard(list(range(g.tasks_per_step)), self.rank, self.world))
        kept: list[tuple[RolloutBatch, Any]] = []
        have = dropped = rounds = 0
        while True:
            batch, scored = one_round()
            rounds += 1
            flat = zero_variance_groups(scored.total, batch.group_ids)
            rows = [i for i, gid in enumerate(batch.group_ids) if gid not in flat]
            dropped += len(flat)
            if rows:
                kept.append((select_rows(batch, rows), select_scored(scored, rows)))
                have += len(set(batch.group_ids[i] for i in rows))
            done = all(gather_objects(self.accelerator, have >= need))
            if done or rounds > g.max_sampling_rounds:
                break
        if kept:
            batch = concat_batches([b for b, _ in kept], self.policy.pad_token_id)
            scored = concat_scored([s for _, s in kept])
            first = list(dict.fromkeys(batch.group_ids))[:need]  # at most this process's share
            rows = [i for i, gid in enumerate(batch.group_ids) if gid in set(first)]
            batch, scored = select_rows(batch, rows), select_scored(scored, rows)
        gave_up = have < need
        if gave_up and self.is_main and (self.step - self._last_give_up >= 10):
            self._last_give_up = self.step
            line = (
                f"mmgrpo: warning: step {self.step + 1}: dynamic sampling gave up after {rounds} rounds of "
                f"{g.tasks_per_step} tasks: {have} of the {need} groups needed have reward variance, training "
                "on those. Raise grpo.max_sampling_rounds, make the reward finer, or warm-start the model."
            )
            print(line, file=sys.stderr, flush=True)
            with (self.out / "warnings.log").open("a") as f:
                f.write(line + "\n")
        stats = {
            "dynamic/rounds": rounds,
            "dynamic/dropped_groups": dropped,
            "dynamic/kept_groups": min(have, need),
            "dynamic/gave_up": int(gave_up),
        }
        return batch, scored, stats

    def shape_rewards(self, batch: RolloutBatch, rewards: torch.Tensor) -> torch.Tensor:
        """Rewards (N,) after grpo.overlong=soft_penalty (DAPO), before group normalisation."""
        g = self.cfg.grpo
        if g.overlong != "soft_penalty":
            return rewards
        # max_new_tokens bounds each turn: the longest turn is what nears it (single-turn: the response)
        lengths = torch.tensor([longest_turn(t.loss_mask) for t in batch.trajectories])  # (N,)
        cut = torch.tensor([t.truncation in LENGTH_CUTS for t in batch.trajectories])  # (N,)
        return rewards + overlong_penalty(
            lengths, cut, g.max_new_tokens, g.overlong_buffer, g.overlong_factor
        )

    def trained_tokens(self, batch: RolloutBatch) -> TokenBatch:
        """The batch's tokens; with grpo.overlong=mask, episodes cut for length leave the loss (DAPO's
        overlong filtering); those ended by max_turns or the env stay."""
        if self.cfg.grpo.overlong != "mask":
            return batch.tokens
        cut = torch.tensor([t.truncation in LENGTH_CUTS for t in batch.trajectories])  # (N,)
        tokens = batch.tokens
        mask = tokens.loss_mask * (~cut).long()[:, None]  # (N, T)
        return dataclasses.replace(tokens, loss_mask=mask)

    def rollout_tasks(self, seeds: list[int], G: int) -> RolloutBatch:
        """Roll out ``seeds``, G episodes each; every process learns whether any failed entirely."""
        g = self.cfg.grpo
        try:
            batch = rollout(
                self.policy,
                self.envs,
                seeds,
                group_size=G,
                split="train",
                max_new_tokens=g.max_new_tokens,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                max_turns=self.cfg.env.max_turns,
                max_episode_tokens=self.cfg.env.max_episode_tokens,
            )
            error = None
        except EnvError as exc:  # every task of this process failed to reset
            batch, error = None, str(exc)
        errors = [e for e in gather_objects(self.accelerator, error) if e is not None]
        if errors:  # on every process, so that none waits for the others
            raise EnvError(f"step {self.step + 1}: {errors[0]}")
        return batch

    def account_faults(self, batch: RolloutBatch, scored) -> None:
        """Count failed resets, failed env steps and verifier failures over all processes; stop past
        faults.max_failure_frac."""
        step = self.step + 1
        local = {
            "reset": batch.failed_tasks,
            "tasks": len(batch.failed_tasks) + len(set(batch.group_ids)),
            "step": [(t.seed, t.env_error) for t in batch.trajectories if t.env_error is not None],
            "episodes": len(batch.trajectories),
            "vfail": scored.failures,
            "verrors": scored.errors,
        }
        parts = gather_objects(self.accelerator, local)
        f = self.faults
        f.env_reset_failures(step, [x for p in parts for x in p["reset"]], sum(p["tasks"] for p in parts))
        f.env_step_failures(step, [x for p in parts for x in p["step"]], sum(p["episodes"] for p in parts))
        vfail: dict[str, int] = {}
        for p in parts:
            for name, n in p["vfail"].items():
                vfail[name] = vfail.get(name, 0) + n
        f.verifier_failures(
            step, vfail, [e for p in parts for e in p["verrors"]], sum(p["episodes"] for p in parts)
        )

    def agree_finite(self, problem: str | None) -> str | None:
        """The first process's non-finite finding, on every process (they must all skip or all stop)."""
        found = [p for p in gather_objects(self.accelerator, problem) if p is not None]
        if found and self.cfg.faults.nonfinite == "stop":
            raise NonFiniteError(
                f"{found[0]}. Fix the verifier, or set faults.nonfinite=skip to skip such batches"
            )
        return found[0] if found else None

    def skip_batch(self, problem: str) -> dict[str, float]:
        """faults.nonfinite=skip: no update for this batch; counted and logged."""
        self.optimizer.zero_grad(set_to_none=True)
        self.faults.skipped_batch(self.step + 1, problem)
        nan = float("nan")
        return {"loss": nan, "kl": nan, "clip_frac": nan, "ratio_mean": nan, "grad_norm": nan, "skipped": 1}

    def micro_batches(self, tokens: TokenBatch, G: int) -> tuple[list[list[int]], list[TokenBatch]]:
        """Rows per micro-batch, whole groups when they fit (each prompt is then encoded once for its G
        rows), and their tokens with padding trimmed per micro-batch."""
        size = self.cfg.grpo.micro_batch_size // G * G or self.cfg.grpo.micro_batch_size
        order = list(range(len(tokens)))
        if len(tokens) > size and size % G == 0 and self.cfg.grpo.aggregation != "bnpo":
            order = by_length(tokens, G)  # whole groups, shortest first: less padding per micro-batch
        mbs = [order[i : i + size] for i in range(0, len(order), size)]
        return mbs, [tokens.select(rows) for rows in mbs]

    def reward_kl(self, tokens: TokenBatch, G: int) -> tuple[torch.Tensor, float]:
        """grpo.kl_in=reward: each episode's KL to the reference, summed over its policy tokens, (N,); and
        this process's share of the step's token-mean KL (its KL sum over the global token count: the
        shares sum to the mean over every process, the quantity the loss reports as ``kl`` with kl_in=loss
        and the one ``target_kl`` is compared with)."""
        from mmgrpo.grpo.kl_control import sequence_kl

        g, policy = self.cfg.grpo, self.policy
        kl = torch.zeros(len(tokens), dtype=torch.float64)  # (N,)
        with torch.no_grad(), policy.reference_on_device():
            for rows, mb in zip(*self.micro_batches(tokens, G), strict=True):
                now = policy.logprobs(mb, temperature=g.temperature)  # (n, t)
                ref = policy.logprobs(mb, temperature=g.temperature, reference=True)  # (n, t)
                mask = mb.loss_mask.to(now.device)
                kl[rows] = sequence_kl(now, ref, mask, g.kl_estimator).double().cpu()  # (n,)
        num_tokens = int(global_counts(self.accelerator, int(tokens.loss_mask.sum()))[:, 0].sum())
        return kl.float(), float(kl.sum()) / max(num_tokens, 1)

    def update(self, tokens: TokenBatch, adv: torch.Tensor, G: int) -> tuple[dict[str, float], str | None]:
        """num_iterations optimizer steps on this step's rows; the loss is normalised by the global
        token and sequence counts. Returns the loss statistics and, when the loss is not finite, what
        went wrong (no optimizer step is taken then)."""
        g, policy, acc = self.cfg.grpo, self.policy, self.accelerator
        N_local = len(tokens)
        loss_mask = tokens.loss_mask  # (n, T)
        mbs, mb_tokens = self.micro_batches(tokens, G)
        beta = self.kl_ctl.beta if g.kl_in == "loss" else 0.0
        counts = global_counts(acc, N_local, int(loss_mask.sum()), len(mbs))  # (W, 3)
        N, num_tokens = int(counts[:, 0].sum()), int(counts[:, 1].sum())
        n_mb = int(counts[:, 2].max())  # every process runs as many backward passes (DDP syncs on the last)

        ref_lp, old_lp = [], []
        with torch.no_grad(), policy.reference_on_device():
            for mb in mb_tokens:
                ref_lp.append(
                    policy.logprobs(mb, temperature=g.temperature, reference=True) if beta > 0 else None
                )
                old_lp.append(
                    policy.logprobs(mb, temperature=g.temperature) if g.num_iterations > 1 else None
                )

        stats = {
            "loss": 0.0,
            "kl": 0.0,
            "clip_frac": 0.0,
            "ratio_mean": 0.0,
            "entropy": 0.0,
            "grad_norm": 0.0,
        }
        # bnpo: each micro-batch is a token mean; their average over the real micro-batches of every
        # process (not the zero-weight passes that pad a process with fewer up to n_mb)
        n_means = int(counts[:, 2].sum()) if g.aggregation == "bnpo" else 1
        policy.model.train()
        for _ in range(g.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for k in range(n_mb):
                real = k < len(mbs)
                rows, mb = (mbs[k], mb_tokens[k]) if real else (mbs[0], mb_tokens[0])
                sync = contextlib.nullcontext() if k == n_mb - 1 else acc.no_sync(policy.model)
                with sync:
                    logp, entropy = policy.logprobs(
                        mb, temperature=g.temperature, with_entropy=True, entropy_grad=g.entropy_coef > 0
                    )  # (n, t), (n, t)
                    if not real:  # a process with fewer micro-batches joins the others' gradient sync
                        acc.backward(logp.sum() * 0.0)
                        continue
                    out = grpo_loss(
                        logp,
                        old_lp[k],
                        ref_lp[k],
                        adv[rows].to(logp.device),
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
                    )
                    # DDP averages gradients over the W processes; x W makes that the global-batch gradient
                    acc.backward(out.loss * self.world if self.world > 1 else out.loss)
                share = mb.loss_mask.sum().item() / max(num_tokens, 1) / g.num_iterations
                loss_sum += float(out.loss.detach())
                stats["loss"] += float(out.loss.detach()) / g.num_iterations
                for key in ("kl", "clip_frac", "ratio_mean", "entropy"):
                    stats[key] += float(getattr(out, key)) * share
            total = global_sum(acc, float(loss_sum))
            if not math.isfinite(total):
                return stats, (
                    f"step {self.step + 1}: the loss is {total} (rewards and advantages were finite); "
                    "likely a learning rate too high for this model (lower grpo.lr) or a reward of huge "
                    "magnitude"
                )
            norm = acc.clip_grad_norm_(policy.model.parameters(), g.max_grad_norm)
            stats["grad_norm"] = float(norm) if norm is not None else float("nan")  # DeepSpeed clips itself
            self.optimizer.step()
            self.scheduler.step()
        return stats, None

    def step_record(self, batch, scored, adv, stats, G: int, t_rollout: float, t_train: float, t0: float):
        """The step's metrics over all processes (mmgrpo.train.distributed.reduce_records)."""
        rewards = scored.total
        N = len(batch.trajectories)
        lengths = [t.num_policy_tokens for t in batch.trajectories]
        record: dict[str, Any] = {
            "step": self.step + 1,
            "reward": float(rewards.mean()),
            **{f"reward/{k}": float(v.mean()) for k, v in scored.per_verifier.items()},
            **(
                group_stats(rewards, G)
                if bool(torch.isfinite(rewards).all())
                else {"reward_std_within_group": float("nan"), "frac_zero_std_groups": float("nan")}
            ),
            "adv_abs_mean": float(adv.abs().mean()),
            **stats,
            "lr": self.scheduler.get_last_lr()[0],
            "completion_len": sum(lengths) / len(lengths),
            "repetition": repetition([t.completion for t in batch.trajectories]),
            "truncated_frac": sum(t.truncated for t in batch.trajectories) / N,
            **(
                {"overlong/masked_frac": sum(t.truncation in LENGTH_CUTS for t in batch.trajectories) / N}
                if self.cfg.grpo.overlong == "mask"
                else {}
            ),
            "verifier_failures": sum(scored.failures.values()),
            "env_errors": sum(t.env_error is not None for t in batch.trajectories),
            "env_reset_failures": len(batch.failed_tasks),
            "num_episodes": N,
            "group_size": G,
            "rollout_time": t_rollout,
            "train_time": t_train,
            "step_time": time.perf_counter() - t0,
        }
        record = reduce_records(gather_objects(self.accelerator, record))
        if self.cfg.env.max_turns > 1:
            record.update(all_episode_metrics(self.accelerator, batch.trajectories))
        return {**record, **self.faults.metrics()}

    # -------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """Run the remaining steps; returns the last step's metrics. A stop request (signal) finishes the
        current step, writes a checkpoint and raises :class:`TrainingStopped`."""
        from tqdm.auto import tqdm

        g = self.cfg.grpo
        if self.is_main:
            save_config(self.cfg, self.out / "config.yaml")
        record: dict[str, Any] = {}
        bar = tqdm(
            total=g.steps,
            initial=self.step,
            desc="grpo",
            unit="step",
            disable=not (self.progress and self.is_main),
        )
        while self.step < g.steps:
            if self.agree_stop():
                bar.close()
                raise TrainingStopped(self.step, self.save_checkpoint())
            record = self.train_step()
            if self.is_main:
                self.diagnostics.observe(record)
            if g.eval_every and self.step % g.eval_every == 0:
                record["eval_accuracy"] = self.eval_accuracy(g.eval_episodes)  # every process takes part
            if self.step % g.log_every == 0 or self.step == g.steps:
                self.log(record)
            if g.save_every and self.step % g.save_every == 0:
                self.save_checkpoint()
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

    def agree_stop(self) -> bool:
        """Whether any process was asked to stop (all processes must stop at the same step)."""
        return any(gather_objects(self.accelerator, self.stop_requested))

    def save_checkpoint(self) -> Path:
        """output_dir/checkpoint-{step}: everything needed to continue this run exactly (mmgrpo.train.checkpoint).
        Written once per step by this trainer (a stop right after a periodic save does not write it again);
        a checkpoint-{step} left by an earlier process (a resume from an older checkpoint) is replaced."""
        path = self.out / f"checkpoint-{self.step}"
        if self._saved_step == self.step and path.is_dir():
            return path
        save_checkpoint(self, path, keep_last=self.cfg.grpo.keep_checkpoints)
        self._saved_step = self.step
        return path

    def resume(self, path: Path) -> dict[str, Any]:
        """Continue from checkpoint ``path``: weights, optimizer, scheduler, RNG states, reference, step
        and fault counters restored; metrics.jsonl cut back to the steps the checkpoint had done.

        A changed config applies from the next step (one warning line says how each change is taken):
        the learning rates, AdamW's betas and weight decay and the schedule, which the restored optimizer
        and scheduler would override, are set again from the new config (:meth:`rebuild_lr`); changes that
        cannot apply (mmgrpo.train.checkpoint.FIXED_ON_RESUME) are refused before anything is loaded."""
        state = load_checkpoint(self, path)
        self.rebuild_lr()
        if Path(path).resolve() == (self.out / f"checkpoint-{self.step}").resolve():
            self._saved_step = self.step  # a stop before the next step need not write it again
        if self.is_main:
            line = resume_changes(state.get("config", {}), self.flat_config).warning(path, self.step)
            if line:
                print(line, file=sys.stderr, flush=True)
            truncate_metrics(self.metrics_path, self.step)
        self.accelerator.wait_for_everyone()
        return state

    def rebuild_lr(self) -> None:
        """Set each parameter group's learning rate (the vision group's from model.vision_lr), AdamW's
        betas and weight decay, and the learning-rate schedule from this run's config, at the position the
        restored schedule had reached (the optimizer steps taken). AdamW's moments stay as restored. With
        an unchanged config this reproduces the restored values exactly (lr = initial_lr * factor(n), the
        schedule's own formula)."""
        from torch.optim.lr_scheduler import LambdaLR

        g, vision_lr = self.cfg.grpo, self.cfg.model.vision_lr
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper
        wrapper = self.scheduler
        done = wrapper.scheduler.last_epoch  # optimizer steps taken (a skipped batch takes none)
        for group in optimizer.param_groups:
            lr = vision_lr if group.get("name") == "vision" and vision_lr is not None else g.lr
            group.update(lr=lr, initial_lr=lr, betas=tuple(g.betas), weight_decay=g.weight_decay)
        factors = make_scheduler(  # the new schedule's factor per optimizer step
            g.lr_schedule, optimizer, warmup_steps=g.warmup_steps, steps=g.steps * g.num_iterations
        ).lr_lambdas
        wrapper.scheduler = LambdaLR(optimizer, factors, last_epoch=done - 1)  # constructing steps it to done

    def evaluate(self, episodes: int | None = None, seeds: list[int] | None = None):
        """Held-out accuracy of the current policy (eval split, settings from ``cfg.eval``), on this
        process (see :meth:`eval_accuracy` for all processes together)."""
        from mmgrpo.rollout.evaluation import evaluate_config

        return evaluate_config(
            self.cfg.eval,
            self.cfg.env,
            self.policy,
            self.make_env,
            self.rewards,
            self.metric,
            episodes=episodes,
            progress=self.progress,
            seeds=seeds,
        )

    def eval_accuracy(self, episodes: int) -> float:
        """Held-out accuracy during training, on every process: each evaluates its share of the
        ``episodes`` seeds (round robin) and the correct counts are summed.

        Each process generates with its own module, outside DDP: a DDP forward after a training step
        broadcasts buffers, a collective that a process not evaluating never joins (the run hung), and
        processes run different numbers of forwards. The weights are equal on every process after a step.
        """
        from mmgrpo.rollout.evaluation import distinct_episodes

        e = self.cfg.eval
        # the envs this trainer already holds know their split's size: no env is built per evaluation
        episodes = distinct_episodes(
            lambda: self.envs[0], episodes, warn=self.is_main and not self._eval_cut_said
        )
        self._eval_cut_said = True  # said once
        seeds = shard(list(range(e.seed_offset, e.seed_offset + episodes)), self.rank, self.world)
        correct = 0
        if seeds:
            with outside_ddp(self.policy):
                correct = self.evaluate(seeds=seeds).correct
        return sum(gather_objects(self.accelerator, correct)) / episodes

    def warm_start(self) -> float:
        """The supervised cold start of ``cfg.warm_start`` (see mmgrpo.train.warmstart), then the check of the
        skill it was meant to teach (mmgrpo.train.warm_check): WarmStartError when it is missing. With
        ``check_every`` the skill is also measured during the warm start, which stops once it is there."""
        from mmgrpo.train.warm_check import check_skill, require_skill
        from mmgrpo.train.warmstart import warm_start

        w = self.cfg.warm_start
        checks: list = []  # (steps so far, SkillCheck) of every check made
        steps_run = {"n": 0}

        def log(record: dict) -> None:
            steps_run["n"] = record["step"]
            self.log(record)

        def measure(step: int):
            check = check_skill(
                self.policy, self.make_env, source=w.source, template=w.target, tasks=w.check_tasks
            )
            if check is not None:
                checks.append((step, check))
                self.log({"stage": "warm_start_check", "step": step, "rate": check.rate, "n": check.n})
            return check

        def done(step: int) -> bool:
            check = measure(step)
            return check is None or check.rate >= w.min_skill

        nll = warm_start(
            self.policy,
            self.make_env,
            steps=w.steps,
            lr=w.lr,
            batch_size=w.batch_size,
            template=w.target,
            low=w.random_low,
            high=w.random_high,
            seed=self.cfg.seed,
            examples=w.examples,
            random_share=w.random_share,
            source=w.source,
            train_vision=w.train_vision,
            progress=self.progress,
            log=log,
            drill_steps=w.drill_steps,
            drill_lr=w.drill_lr,
            check_every=w.check_every if w.check_tasks > 0 and w.min_skill > 0 else 0,
            done=done,
        )
        self.warm_start_steps = steps_run["n"]
        if w.check_tasks > 0:
            # the last check, unless training went on after it (drills, then demonstrations)
            last = checks[-1] if checks and checks[-1][0] == steps_run["n"] else None
            check = last[1] if last is not None else measure(steps_run["n"])
            self.skill_check = check
            if check is not None:
                if self.is_main:
                    print(f"warm start: {check.line()} after {self.warm_start_steps} steps", flush=True)
                require_skill(check, w.min_skill, steps=w.steps, lr=w.lr)
        return nll

    def save(self, out_dir: Path) -> None:
        """The model, processor and config to ``out_dir`` (main process; every process waits for it)."""
        save_run(self.accelerator, self.policy, self.cfg, out_dir)


def all_episode_metrics(accelerator, trajectories: list) -> dict[str, float]:
    """``episode_metrics`` over the episodes of every process at once, the same on each: exact, where
    reducing each process's means would not be (a tool failure kind one process never saw counts as 0 for
    its episodes, not as missing; an env metric is averaged over the episodes that reported it)."""
    parts = gather_objects(accelerator, episode_counters(trajectories))
    return episode_metrics([c for part in parts for c in part])


def episode_counters(trajectories: list) -> list[SimpleNamespace]:
    """What ``episode_metrics`` reads of each episode, small enough to gather from every process."""
    return [
        SimpleNamespace(
            turns=t.turns,
            tool_calls=t.tool_calls,
            tool_failures=dict(t.tool_failures),
            truncation=t.truncation,
            env_metrics=dict(t.env_metrics),
        )
        for t in trajectories
    ]


@contextlib.contextmanager
def outside_ddp(policy: Policy):
    """The policy's forwards run on the bare module inside the block (no DDP collectives)."""
    wrapped = policy.model
    policy.model = unwrap(wrapped)
    try:
        yield
    finally:
        policy.model = wrapped


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


def check_engine(accelerator, g, world: int) -> None:
    """Refuse, with the reason and what to use instead, the engines this trainer cannot drive correctly.

    Sharded parameters (FSDP, DeepSpeed ZeRO-3) make every forward pass a collective, so all processes
    would have to decode in lockstep (the same number of tokens and turns); the sampler does not do that
    yet, and the frozen reference copy would be a copy of a shard. DeepSpeed (ZeRO-2) steps its optimizer
    inside each backward, so one step's rows must be one micro-batch.
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = kind == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3
    if kind == DistributedType.FSDP or zero3:
        name = "FSDP" if kind == DistributedType.FSDP else "DeepSpeed ZeRO-3"
        raise ConfigError(
            f"{name} shards the parameters, and mmgrpo's sampler cannot decode in lockstep across processes "
            "yet. Use DDP (examples/accelerate/ddp_multi_gpu.yaml) or DeepSpeed ZeRO-2 "
            "(deepspeed_zero2.yaml); for a model too large for them, train LoRA adapters (model.lora) with DDP."
        )
    if kind == DistributedType.DEEPSPEED:
        rows = -(-g.tasks_per_step // world) * g.group_size  # a process's episodes per step
        if g.micro_batch_size < rows:
            raise ConfigError(
                f"DeepSpeed steps its optimizer in every backward pass, so a step's {rows} episodes per "
                f"process must be one micro-batch: set grpo.micro_batch_size >= {rows}"
            )
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = rows


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the GRPO lines of steps after ``step`` (done again after a resume), atomically; warm-start
    lines stay."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if "stage" in rec or int(rec.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def save_run(accelerator, policy: Policy, cfg: Config, out_dir: Path) -> None:
    """The model (a LoRA run: the adapter, or the merged model with model.lora.save=merged), its processor
    and the resolved config, as ``mmgrpo eval`` and ``model.path`` read them. The main process writes;
    under FSDP or DeepSpeed every process first takes part in gathering the full weights.

    Atomic: everything is written to ``<out_dir>.partial`` and renamed into place only when complete, so a
    save that fails (a full disk, a kill) never leaves an ``out_dir`` that looks like a model and is not,
    and an earlier save at ``out_dir`` survives until the new one is whole. When the write fails, the model
    is written to a rescue folder in the temporary directory ($TMPDIR) instead, so that the trained
    weights are not lost with the process, and one ConfigError says where (or that the copy failed too, and
    which checkpoint of the run is the latest).
    """
    from accelerate.utils import DistributedType

    state_dict = None
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        state_dict = accelerator.get_state_dict(policy.model)  # a collective: every process calls it
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    out_dir = Path(out_dir)
    model = accelerator.unwrap_model(policy.model)
    try:
        _write_model_folder(model, policy.processor, cfg, out_dir, state_dict)
    except Exception as e:
        reason = write_failure(e, out_dir)
        if reason is None:
            raise
        error = ConfigError(_save_failed(model, policy.processor, cfg, out_dir, state_dict, reason))
        accelerator.wait_for_everyone()  # the other processes go on; this one stops with the error
        raise error from None
    accelerator.wait_for_everyone()


def _write_model_folder(model, processor, cfg: Config, out_dir: Path, state_dict=None) -> None:
    """The model folder of :func:`save_run` at ``out_dir``, through ``<out_dir>.partial`` (removed when
    the write fails) and a rename."""
    import shutil

    from mmgrpo.model.io import save_model

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    lo = cfg.model.lora
    try:
        save_model(
            model, processor, partial, merged=lo is not None and lo.save == "merged", state_dict=state_dict
        )
        save_config(cfg, partial / "mmgrpo_config.yaml")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _save_failed(model, processor, cfg: Config, out_dir: Path, state_dict, reason: str) -> str:
    """After the save to ``out_dir`` failed: write the model to a rescue folder in the temporary
    directory and return the one-line error that says where (or what is left when that fails too)."""
    import tempfile

    head = f"saving {out_dir} failed ({reason}); nothing there was replaced" + (
        f" (the earlier save at {out_dir} is intact)" if out_dir.exists() else ""
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rescue = Path(tempfile.gettempdir()) / f"mmgrpo-rescue-{out_dir.parent.name}-{out_dir.name}-{stamp}"
    try:
        _write_model_folder(model, processor, cfg, rescue, state_dict)
    except Exception as e:
        why = write_failure(e, rescue) or f"{type(e).__name__}: {e}"
        kept = latest_checkpoint(out_dir.parent)
        return f"{head}, and a copy to {rescue} failed too ({why}). " + (
            f"The latest checkpoint is {kept}: free some space, then resume from it with --resume {kept}."
            if kept
            else "The trained weights are lost: free some space and run again (grpo.save_every keeps "
            "checkpoints during a run)."
        )
    move = f"replace {out_dir} with it" if out_dir.exists() else f"move it there (mv {rescue} {out_dir})"
    return (
        f"{head}. The trained model was saved to {rescue} instead: once there is space, {move}, or use it "
        f"where it is (mmgrpo eval --model {rescue}, or as model.path)."
    )


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
