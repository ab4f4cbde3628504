"""The GRPO loop: collect -> score -> advantages -> update, one step after another.

One step (docs/architecture.md follows it file by file):
  1. collect: B = grpo.tasks_per_step training tasks, G = grpo.group_size episodes each
     (``mmgrpo.rollout.episodes.rollout``; with dynamic sampling ``mmgrpo.train.dynamic``);
  2. score: verifiers score every episode; rewards are combined with their weights; faults are counted over
     every process (``mmgrpo.train.fault_sync``);
  3. advantages: normalised within each group, over the whole batch, BEFORE any micro-batch split
     (``mmgrpo.grpo.advantages``);
  4. update: reference log-probs (beta > 0) and old log-probs (num_iterations > 1) without grad, then
     num_iterations optimizer steps over micro-batches whose losses are normalised by whole-batch totals
     (``mmgrpo.train.microbatch``, ``mmgrpo.grpo.losses``).
Metrics go to ``{output_dir}/metrics.jsonl``, one JSON object per step (``mmgrpo.train.metrics``); the final
policy, its processor and the resolved config go to ``{output_dir}/final`` (``mmgrpo.train.saving``).
Building a run from its config is ``mmgrpo.train.builders``; checkpoints ``mmgrpo.train.checkpoint`` and
``mmgrpo.train.resume``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.config.core import Config, config_to_dict, save_config
from mmgrpo.config.sections import WarmStartConfig
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.grpo.advantages import combine_advantages, group_advantages, group_size_at
from mmgrpo.grpo.kl_control import AdaptiveKLController, FixedKLController
from mmgrpo.model.adapters import embedding_parameters
from mmgrpo.model.io import PRECISION, check_precision
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import RolloutBatch, rollout
from mmgrpo.train import batch_fit, credit, dynamic, fsdp_setup, metrics, microbatch
from mmgrpo.train.builders import (  # noqa: F401  (eval_metric, build_rewards, ... stay importable from here)
    build_env_factory,
    build_rewards,
    check_engine,
    eval_metric,
    flat_config,
    load_policy,
    make_accelerator,
    prepare_output_dir,
    resolve_device,
    start_sampler,
)
from mmgrpo.train.callbacks import Callbacks, TrainingStopped
from mmgrpo.train.checkpoint import load_checkpoint, register_model_hooks, resume_changes, save_checkpoint
from mmgrpo.train.diagnostics import Diagnostics
from mmgrpo.train.distributed import gather_objects, outside_ddp, shard, warm_start_outside_ddp
from mmgrpo.train.env_pool import EnvPool
from mmgrpo.train.epochs import with_epoch_steps
from mmgrpo.train.fault_sync import SKIPPED, account_faults, agree_finite
from mmgrpo.train.faults import FaultTracker, check_finite
from mmgrpo.train.fsdp import Lockstep, gathered
from mmgrpo.train.lr_schedule import make_scheduler
from mmgrpo.train.model_card import write_model_card
from mmgrpo.train.optim import adamw
from mmgrpo.train.resume import rebuild_lr, truncate_metrics
from mmgrpo.train.run_folder import refuse_earlier_run, trained_once
from mmgrpo.train.saving import save_run


class Trainer:
    """Runs GRPO for ``cfg.grpo.steps`` steps, on one process or on each of ``accelerate launch``'s
    (mmgrpo.train.distributed says what is split and what is reduced)."""

    def __init__(
        self, cfg: Config, *, policy: Policy | None = None, progress: bool = True, callbacks: Iterable = ()
    ):
        from accelerate.utils import set_seed

        # everything that can be wrong with the config fails here, before a model is loaded
        self.pool = EnvPool(build_env_factory(cfg))  # every env the run makes, closed by close()
        self.cfg = cfg = with_epoch_steps(cfg, self.pool.make_env)  # grpo.epochs: grpo.steps from the rows
        g = cfg.grpo
        self.make_env = self.pool.make
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
        self.sharded = fsdp_setup.wanted(cfg, self.accelerator)  # FSDP2: checked before the model loads
        self.policy = policy or load_policy(cfg, device=str(self.accelerator.device))
        batch_fit.check(cfg, self.policy, self.pool.make_env, self.accelerator.device, self.accelerator.num_processes)
        # rollout.engine=vllm: sampling in a vLLM process, weights pushed after optimizer steps
        self.policy.sampler = start_sampler(
            cfg, self.out, self.accelerator.num_processes, self.policy.model, self.policy.processor
        ) or self.policy.sampler
        self.skill_check = None  # the warm start's skill check (mmgrpo.train.warm_check), once it ran
        self.warm_start_steps = 0  # the warm start's steps, fewer than warm_start.steps when it stopped early
        if cfg.model.freeze_vision:
            self.policy.freeze_vision()
        # grpo.freeze_embeddings: out of the optimizer and of DDP's buckets; the warm start thaws them
        self.frozen_embeddings = (
            [p for p in embedding_parameters(self.policy.model) if p.requires_grad]
            if g.freeze_embeddings
            else []
        )
        for p in self.frozen_embeddings:
            p.requires_grad_(False)
        self.policy.offload_reference = cfg.model.offload_reference
        acc = self.accelerator
        self.rank, self.world, self.is_main = acc.process_index, acc.num_processes, acc.is_main_process
        check_engine(acc, g, self.world)
        self.lockstep = None  # with model.fsdp_rollout=lockstep: rollouts on the shards (mmgrpo.train.fsdp)
        if self.sharded:  # before the optimizer is built: sharding replaces the parameters
            fsdp_setup.shard_policy(cfg, acc, self.policy)
            if cfg.model.fsdp_rollout == "lockstep":
                self.lockstep = Lockstep(self.policy.model, self.policy.pad_token_id, acc)
        if g.tasks_per_step < self.world:
            raise ConfigError(
                f"grpo.tasks_per_step={g.tasks_per_step} is fewer than the {self.world} processes: each process "
                f"trains on whole tasks, so set grpo.tasks_per_step to a multiple of {self.world}"
            )
        self.progress = progress and self.is_main
        if cfg.logging.report_to:
            acc.init_trackers(cfg.logging.project, config=flat_config(config_to_dict(cfg)))
        self.optimizer = adamw(
            self.policy.param_groups(g.lr, cfg.model.vision_lr),
            lr=g.lr,
            betas=tuple(g.betas),
            weight_decay=g.weight_decay,
        )
        self.scheduler = make_scheduler(
            g.lr_schedule, self.optimizer, warmup_steps=g.warmup_steps, steps=g.steps * g.num_iterations
        )
        if self.sharded:  # sharded above (mmgrpo.train.fsdp); accelerate keeps the scheduler's state
            from accelerate.scheduler import AcceleratedScheduler

            self.scheduler = AcceleratedScheduler(self.scheduler, [], step_with_optimizer=False)
            acc.register_for_checkpointing(self.scheduler)
        else:
            self.policy.model, self.optimizer, self.scheduler = acc.prepare(
                self.policy.model, self.optimizer, self.scheduler
            )
        register_model_hooks(acc, self.policy)
        local_tasks = len(shard(list(range(g.tasks_per_step)), self.rank, self.world))
        most_G = max([g.group_size, *(G for _, G in g.group_size_schedule)])
        self.pool.open(max(local_tasks, 1) * most_G)
        self.metrics_path = self.out / "metrics.jsonl"
        self.faults = FaultTracker(
            cfg.env.name,
            self.out / "warnings.log" if self.is_main else None,
            max_failure_frac=cfg.faults.max_failure_frac,
            echo=self.is_main,
        )
        self.flat_config = flat_config(config_to_dict(cfg))
        self.diagnostics = Diagnostics(  # the troubleshooting table, checked every step (main process)
            self.out / "diagnostics.log" if self.is_main else None,
            echo=self.is_main,
            reward_max=sum(max(v.weight, 0.0) for v in cfg.verifiers) or None,
        )
        self.step = 0
        self.kl_ctl = (
            AdaptiveKLController(g.beta, g.target_kl, g.kl_horizon)
            if g.target_kl is not None
            else FixedKLController(g.beta)
        )
        self.task_cursor = 0  # the next task seed of the stream (B per step; more with dynamic sampling)
        self._last_give_up = -(10**9)
        self.drilled_full = False  # grpo.bare_steps: the drills on full prompts ran after the bare steps
        self.stop_requested = False  # set by a signal handler; the loop saves a checkpoint and stops
        self._saved_step: int | None = None  # the step this trainer last wrote a checkpoint of
        self._eval_cut_said = False  # whether the eval split's size cut eval_episodes was said
        self.callbacks = Callbacks(callbacks, active=self.is_main)  # mmgrpo.train.callbacks
        self.warm_started = False  # cfg.warm_start ran (warm_start(), or a resume: the checkpoint holds it)
        self.trained = False  # train() was called: a Trainer trains once
        self._claimed = False  # output_dir was checked for an earlier run (run_folder.earlier_run)

    @property
    def envs(self) -> list:
        """The rollout's envs, one per episode of a step (made again when used after :meth:`close`)."""
        return self.pool.open()

    def close(self) -> None:
        """Close every env this trainer made (``train`` does, however it ends; safe to call again)."""
        self.pool.close()

    # ------------------------------------------------------------------------------------------ logging
    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.cfg.logging.report_to and "step" in record:
            nums = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(nums, step=int(record["step"]))

    # --------------------------------------------------------------------------------------- one step
    def train_step(self) -> dict[str, Any]:
        """collect -> score -> advantages -> update, then one metrics record for the step."""
        g, policy, step = self.cfg.grpo, self.policy, self.step + 1
        G = self.group_size_now()
        if g.beta > 0 and not policy.has_reference:
            policy.make_reference()  # the policy as GRPO starts (after any warm start) is the KL anchor
        t0 = time.perf_counter()
        batch, scored, sampling = self.collect(G)  # rolled out and scored, faults counted
        t_rollout = time.perf_counter() - t0
        rewards = scored.total  # (N,)
        problem = self.agree_finite(check_finite(step, scored.per_verifier))
        adv = torch.zeros_like(rewards)  # (N,)
        reward_kl = None  # grpo.kl_in=reward: this process's share of the token-mean KL
        if problem is None:
            rewards = dynamic.shape_rewards(g, batch, rewards)  # (N,) overlong penalty
            if g.kl_in == "reward" and self.kl_ctl.beta > 0:
                seq_kl, reward_kl = microbatch.reward_kl(policy, self.accelerator, batch.tokens, G, g)
                rewards = rewards - self.kl_ctl.beta * seq_kl  # (N,)
            adv = credit.assign(g, batch, self.advantages(batch, scored, rewards, G), rewards, ~scored.unscored)
            problem = self.agree_finite(check_finite(step, {}, adv))
        t1 = time.perf_counter()
        if problem is None:
            stats, problem = self.update(dynamic.trained_tokens(g, batch), adv, G)
            if reward_kl is not None:
                stats["kl"] = reward_kl  # the loss ran with beta 0; this is the KL the controller follows
        if problem is not None:  # faults.nonfinite=skip: no update for this batch; counted and logged
            self.optimizer.zero_grad(set_to_none=True)
            self.faults.skipped_batch(step, problem)
            stats = dict(SKIPPED)
        lr = self.scheduler.get_last_lr()[0]
        times = (t_rollout, time.perf_counter() - t1, t0)
        record = metrics.step_record(
            self.cfg, self.accelerator, step, batch, scored, adv, stats, G=G, lr=lr, times=times
        )
        record.update(self.faults.metrics())
        record.update(sampling)
        record["beta"] = self.kl_ctl.beta
        if g.target_kl is not None and math.isfinite(record["kl"]):
            self.kl_ctl.update(record["kl"])  # the next step's beta
        self.step = step
        every = self.cfg.logging.samples_every
        if every and step % every == 0 and self.is_main:
            metrics.save_samples(self.out, batch, scored, step, self.cfg.logging.samples_per_step)
        return record

    def collect(self, G: int) -> tuple[RolloutBatch, Any, dict[str, float]]:
        """Roll out and score this process's tasks of the step, G episodes each; faults counted over every
        process. With grpo.dynamic_sampling, flat groups are replaced (mmgrpo.train.dynamic)."""
        g = self.cfg.grpo

        def one_round():
            batch = self.rollout_tasks(self.next_tasks(), G)
            scored = self.rewards.score(batch.episodes, keep_nonfinite=True)  # NaN: stop or skip, not 0
            account_faults(self.faults, self.accelerator, batch, scored, self.step + 1)
            return batch, scored

        if not g.dynamic_sampling:
            return (*one_round(), {})
        need = len(shard(list(range(g.tasks_per_step)), self.rank, self.world))
        s = dynamic.sample_varied_groups(
            one_round,
            need=need,
            max_rounds=g.max_sampling_rounds,
            accelerator=self.accelerator,
            pad_token_id=self.policy.pad_token_id,
        )
        if s.gave_up and self.is_main and (self.step - self._last_give_up >= 10):
            self._last_give_up = self.step
            self.warn(dynamic.gave_up_line(self.step + 1, s, g.tasks_per_step))
        return s.batch, s.scored, s.stats()

    def advantages(self, batch: RolloutBatch, scored, rewards: torch.Tensor, G: int) -> torch.Tensor:
        """(N,) group-normalised advantages of ``rewards`` (the verifiers' weighted sum plus any shaping);
        with grpo.reward_combination=normalize_then_sum each verifier is normalised on its own first. As in
        TRL, a verifier's None leaves the episode out of that verifier's statistics, and an episode every
        verifier skipped (``scored.unscored``) is out of its group's baseline, with advantage 0."""
        g = self.cfg.grpo
        kw = dict(baseline=g.baseline, scale=g.scale, eps=g.adv_eps)
        if g.reward_combination == "sum_then_normalize":
            return group_advantages(rewards, G, group_ids=batch.group_ids, valid=~scored.unscored, **kw)
        weights = {v.name: v.weight for v in self.rewards.verifiers}
        per = dict(scored.per_verifier)
        weighted = sum(weights[k] * per[k] for k in per)
        per["_shaping"], weights["_shaping"] = rewards - weighted, 1.0  # env reward, penalties, KL
        valid = {k: ~v for k, v in scored.skipped.items()} | {"_shaping": ~scored.unscored}
        return combine_advantages(per, weights, batch.group_ids, G, "normalize_then_sum", valid=valid, **kw)

    def update(self, tokens, adv: torch.Tensor, G: int) -> tuple[dict[str, float], str | None]:
        """num_iterations optimizer steps on this step's rows (mmgrpo.train.microbatch.update)."""
        beta = self.kl_ctl.beta if self.cfg.grpo.kl_in == "loss" else 0.0
        return microbatch.update(
            self.policy,
            self.optimizer,
            self.scheduler,
            self.accelerator,
            tokens,
            adv,
            G,
            self.cfg.grpo,
            beta=beta,
            step=self.step + 1,
        )

    def group_size_now(self) -> int:
        """G at this step: grpo.group_size, or grpo.group_size_schedule's entry for the step."""
        g = self.cfg.grpo
        return group_size_at(self.step, [tuple(x) for x in g.group_size_schedule], g.group_size)

    def next_tasks(self) -> list[int]:
        """This process's share of the next B task seeds of the stream (the stream's position moves on)."""
        B = self.cfg.grpo.tasks_per_step
        seeds = list(range(self.task_cursor, self.task_cursor + B))
        self.task_cursor += B
        return shard(seeds, self.rank, self.world)

    def bare_task(self, seed: int) -> bool:
        """Whether task ``seed`` of this step is posed bare: during grpo.bare_steps, a grpo.bare_share of
        the tasks, spread evenly over the seed stream (the golden ratio's multiples mod 1)."""
        g = self.cfg.grpo
        return self.step < g.bare_steps and (seed * 0.6180339887498949) % 1.0 < g.bare_share

    def rollout_tasks(self, seeds: list[int], G: int) -> RolloutBatch:
        """Roll out ``seeds``, G episodes each; every process learns whether any failed entirely."""
        g = self.cfg.grpo
        try:
            with self.sampling_weights(), self.policy.evaluating():  # one switch for all its passes
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
                    bare=[self.bare_task(s) for s in seeds],
                )
            error = None
        except EnvError as exc:  # every task of this process failed to reset
            batch, error = None, str(exc)
        errors = [e for e in gather_objects(self.accelerator, error) if e is not None]
        if errors:  # on every process, so that none waits for the others
            raise EnvError(f"step {self.step + 1}: {errors[0]}")
        return batch

    def sampling_weights(self):
        """The block rollouts and evaluations run in: with sharded weights (FSDP) the layers gathered for
        the whole rollout, or with model.fsdp_rollout=lockstep every process running as many forwards on
        the shards (mmgrpo.train.fsdp); otherwise nothing happens."""
        if self.lockstep is not None:
            return self.lockstep.rollout()
        return gathered(self.policy.model)

    def agree_finite(self, problem: str | None) -> str | None:
        """The first process's non-finite finding, on every process (mmgrpo.train.fault_sync)."""
        return agree_finite(self.accelerator, problem, self.cfg.faults.nonfinite)

    def warn(self, line: str) -> None:
        """A warning line on stderr and in output_dir/warnings.log (main process)."""
        print(line, file=sys.stderr, flush=True)
        with (self.out / "warnings.log").open("a") as f:
            f.write(line + "\n")

    def train(self) -> dict[str, Any]:
        """The configured warm start (unless :meth:`warm_start` ran or the run resumed), then the remaining
        GRPO steps; returns the last step's metrics. A stop request (signal) finishes the current step,
        writes a checkpoint and raises :class:`TrainingStopped`. The envs are closed when it returns or
        raises. A Trainer trains once; ``output_dir`` must not hold another run (resume it instead).
        ``mmgrpo.run`` (what ``mmgrpo train`` calls) adds the run lock, resume and the curves."""
        if self.trained:
            raise trained_once(self.step, self.cfg.grpo.steps)
        self.trained = True
        try:
            if self.cfg.warm_start.steps > 0 and not self.warm_started:
                self.warm_start()
            self.claim_output_dir()
            return self._train()
        finally:
            self.close()

    def claim_output_dir(self) -> None:
        """Before this run's first write: refuse an output_dir holding another run (a resume goes on)."""
        if not self._claimed:
            self._claimed = True
            refuse_earlier_run(self.out)

    def _train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        g = self.cfg.grpo
        if self.sharded and self.drills_at_switch and self.step <= g.bare_steps:
            raise ConfigError(
                "grpo.bare_steps: after the bare steps the warm start's drills run again on whole weights, and "
                "this run shards them (FSDP): set warm_start.drill_steps: 0 (no drills between the phases), "
                "or train on DDP"
            )
        if self.is_main:
            save_config(self.cfg, self.out / "config.yaml")
        record: dict[str, Any] = {}
        self.callbacks("on_train_begin", self)
        bar = tqdm(
            total=g.steps,
            initial=self.step,
            desc="grpo",
            unit="step",
            disable=not (self.progress and self.is_main),
        )
        while self.step < g.steps:
            if g.bare_steps and self.step == g.bare_steps and not self.drilled_full:
                self.full_prompt_drills()
            if self.agree_stop():
                bar.close()
                raise TrainingStopped(self.step, self.save_checkpoint())
            record = self.train_step()
            if self.is_main:
                self.diagnostics.observe(record)
            if g.eval_every and self.step % g.eval_every == 0:
                record["eval_accuracy"] = self.eval_accuracy(g.eval_episodes)  # every process takes part
                self.callbacks("on_evaluate", self, {k: record[k] for k in ("step", "eval_accuracy")})
            if self.step % g.log_every == 0 or self.step == g.steps:
                self.log(record)
            self.callbacks("on_step_end", self, dict(record))
            if g.save_every and self.step % g.save_every == 0:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(
                reward=f"{record['reward']:.2f}",
                kl=f"{record['kl']:.3f}",
                zero_std=f"{record['frac_zero_std_groups']:.2f}",
            )
        bar.close()
        self.save(self.out / "final", card=record)
        if self.cfg.logging.report_to:
            self.accelerator.end_training()
        self.callbacks("on_train_end", self, dict(record))
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
        self.callbacks("on_save", self, path)
        return path

    def resume(self, path: Path) -> dict[str, Any]:
        """Continue from checkpoint ``path``: weights, optimizer, scheduler, RNG states, reference, step
        and fault counters restored; metrics.jsonl cut back to the steps the checkpoint had done.

        A changed config applies from the next step (one warning line says how each change is taken):
        the learning rates, AdamW's betas and weight decay and the schedule, which the restored optimizer
        and scheduler would override, are set again from the new config (mmgrpo.train.resume.rebuild_lr; a
        changed grpo.num_iterations re-fits the schedule, said in a second line); changes that cannot apply
        (mmgrpo.train.checkpoint.FIXED_ON_RESUME, a grpo.steps below the checkpoint's step) are refused before
        anything is loaded."""
        state = load_checkpoint(self, path)
        self.warm_started = self._claimed = True  # the checkpoint's run, warm start included, goes on
        refit = rebuild_lr(self.cfg, self.optimizer, self.scheduler, state.get("config"))
        if Path(path).resolve() == (self.out / f"checkpoint-{self.step}").resolve():
            self._saved_step = self.step  # a stop before the next step need not write it again
        if self.is_main:
            line = resume_changes(state.get("config", {}), self.flat_config, self.step).warning(
                path, self.step
            )
            for said in (line, refit):
                if said:
                    print(said, file=sys.stderr, flush=True)
            truncate_metrics(self.metrics_path, self.step)
        self.accelerator.wait_for_everyone()
        return state

    def evaluate(self, episodes: int | None = None, seeds: list[int] | None = None):
        """Held-out accuracy of the current policy (eval split, settings from ``cfg.eval``), on this
        process (see :meth:`eval_accuracy` for all processes together)."""
        from mmgrpo.rollout.evaluation import evaluate_config

        return evaluate_config(
            self.cfg.eval,
            self.cfg.env,
            self.policy,
            self.pool.make_env,  # untracked: the evaluation closes the envs it makes
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
        with self.sampling_weights():  # every process enters: with sharded weights it is a collective
            if seeds:
                with outside_ddp(self.policy):
                    correct = self.evaluate(seeds=seeds).correct
        return sum(gather_objects(self.accelerator, correct)) / episodes

    def warm_start(self, w: WarmStartConfig | None = None, stage: str = "") -> float:
        """The supervised cold start of ``w`` (default ``cfg.warm_start``) and the check of the skill it was
        meant to teach (mmgrpo.train.warm_check.warm_start_and_check): WarmStartError when it is missing.
        With ``stage`` its metrics records are logged under that stage name (``<stage>``, ``<stage>_check``)."""
        from mmgrpo.train.warm_check import warm_start_and_check

        def log(record: dict) -> None:
            if stage:
                record = {
                    **record,
                    "stage": record["stage"].replace("warm_start", stage),
                    "grpo_step": self.step,
                }
            self.log(record)

        if not stage:
            self.claim_output_dir()  # before its first metrics line
        if self.sharded:
            raise ConfigError(
                "warm_start runs on whole weights, and this run shards them (FSDP): run the warm start "
                "first with `mmgrpo sft` (or a DDP run), then point model.path at its output and set "
                "warm_start.steps=0"
            )
        for p in self.frozen_embeddings:  # the warm start trains them; GRPO then leaves them as they are
            p.requires_grad_(True)
        try:
            with self.pool.scope() as make_env, warm_start_outside_ddp(self):  # envs closed at its end
                done = warm_start_and_check(
                    self.policy,
                    make_env,
                    w or self.cfg.warm_start,
                    seed=self.cfg.seed,
                    log=log,
                    progress=self.progress,
                    say=self.is_main,
                )
        except BaseException:  # an error or Ctrl-C ends the run: its envs are closed (made again if used)
            self.close()
            raise
        finally:
            for p in self.frozen_embeddings:
                p.requires_grad_(False)
        if self.frozen_embeddings and self.world > 1:
            # outside DDP's buckets, so their gradients were not averaged: every process warm-starts on the
            # same demonstrations, and the main process's copy is made everyone's, to be sure
            import torch.distributed as dist

            for p in self.frozen_embeddings:
                dist.broadcast(p.data, src=0)
        if not stage:
            self.warm_start_steps, self.skill_check, self.warm_started = done.steps, done.check, True
        return done.nll

    @property
    def drills_at_switch(self) -> bool:
        """Whether the warm start's drills may run again after ``grpo.bare_steps`` (full_prompt_drills)."""
        w = self.cfg.warm_start
        return bool(self.cfg.grpo.bare_steps and w.source == "env" and w.drill_steps)

    def full_prompt_drills(self) -> None:
        """After grpo.bare_steps: the warm start's check on full prompts, then drills only when it falls short
        (mmgrpo.train.warm_check.full_prompt_drills)."""
        from mmgrpo.train.warm_check import full_prompt_drills

        full_prompt_drills(self)

    def save(self, out_dir: Path, card: dict[str, Any] | None = None) -> None:
        """The model, processor and config to ``out_dir`` (main process; every process waits for it); with
        ``card`` (final metrics) a model card, README.md (mmgrpo.train.model_card)."""
        save_run(self.accelerator, self.policy, self.cfg, out_dir)
        if card is not None and self.is_main:
            write_model_card(Path(out_dir), self.cfg, card, warm_start_steps=self.warm_start_steps)
        self.callbacks("on_save", self, Path(out_dir))
