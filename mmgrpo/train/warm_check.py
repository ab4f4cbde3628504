"""Did the warm start teach what it was meant to? A check on held-out tasks before GRPO starts.

GRPO can only reinforce what the policy already does now and then. A warm start that leaves out the skill
its demonstrations were built to teach (the tools demo once copied 2-3 digit tool results into its answer
but not 4-digit products, so a right call never earned a reward) sends GRPO into a run that cannot
succeed, and that shows only minutes later as a flat curve. So after the warm start the skill is measured
on held-out (eval split) tasks, and a rate below ``warm_start.min_skill`` stops the run with one line that
names the skill, the rate and what to change.

- ``source: env`` with an env that has a ``skill_probe``: the probe's turns are played on held-out tasks
  (``Shown`` turns as context, the tools really run) and a task passes when greedy decoding reproduces
  every taught token (teacher-forced argmax: the same as greedy generation of those tokens, in one
  forward). tool_math's probe shows the question's operation inside the call and checks the rest of the
  call (the question's numbers copied) and the answer (the tool's result copied).
- otherwise (format or true-example targets): greedy completions of held-out prompts must have the
  target's form (``<answer>{random}</answer>`` -> ``<answer>N</answer>``, any N).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmgrpo.config.sections import WarmStartConfig
from mmgrpo.env import ChatEnv
from mmgrpo.errors import WarmStartError
from mmgrpo.model import engine
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.evaluation import distinct_episodes
from mmgrpo.train.warmstart import demonstration_batch, reset_tasks, warm_start

EVAL_SEEDS = 0  # held-out tasks: the eval split's first seeds (disjoint from the warm start's)


@dataclass
class SkillCheck:
    """What was checked, on how many held-out tasks, and how many passed."""

    skill: str
    passed: int
    n: int

    @property
    def rate(self) -> float:
        return self.passed / max(self.n, 1)

    def line(self) -> str:
        return f"{self.skill}: {self.passed}/{self.n} held-out tasks ({self.rate:.2f})"


def check_skill(
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    *,
    source: str,
    template: str,
    tasks: int,
    max_new_tokens: int = 48,
    batch_size: int = 32,
) -> SkillCheck | None:
    """Measure the warm start's skill on ``tasks`` held-out tasks; None when there is nothing to check."""
    env = make_env()
    tasks = distinct_episodes(lambda: env, tasks)  # a 4-row eval split is 4 tasks, not check_tasks of them
    if tasks < 1:
        return None
    seeds = list(range(EVAL_SEEDS, EVAL_SEEDS + tasks))
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad(), policy.autocast():
            if source == "env":
                if getattr(env, "skill_probe", None) is None or env.skill_probe(_info_of(env, 0)) is None:
                    return None
                passed = sum(
                    sum(_probe_passes(policy, env, seeds[i : i + batch_size]))
                    for i in range(0, len(seeds), batch_size)
                )
                return SkillCheck(env.skill, passed, len(seeds))
            form = target_pattern(template)
            passed = sum(
                bool(form.fullmatch(text.strip()))
                for i in range(0, len(seeds), batch_size)
                for _, text in _greedy_first_turns(policy, env, seeds[i : i + batch_size], max_new_tokens)
            )
            return SkillCheck(f"answer in the form {template!r}", passed, len(seeds))
    finally:
        policy.model.train(was_training)


def require_skill(check: SkillCheck | None, min_rate: float, *, steps: int, lr: float) -> None:
    """Raise WarmStartError (one line) when ``check`` fell short of ``min_rate``."""
    if check is None or check.rate >= min_rate:
        return
    raise WarmStartError(
        f"the warm start did not teach the skill GRPO needs: {check.line()}, below "
        f"warm_start.min_skill={min_rate:g}, so GRPO from it cannot earn a reward; train it longer or harder "
        f"(warm_start.steps={steps}, warm_start.drill_steps, warm_start.lr={lr:g}; a small model that never "
        "finds a copy in the full prompt may find it first on the question alone: warm_start.drill_bare_steps) "
        "or lower warm_start.min_skill (0: report only)"
    )


def target_pattern(template: str) -> re.Pattern[str]:
    """A regex for completions of ``template``'s form: ``{random}`` any integer, ``{answer}`` any text."""
    parts = re.split(r"(\{random\}|\{answer\})", template)
    body = "".join(
        r"-?\d+" if p == "{random}" else r".+?" if p == "{answer}" else re.escape(p) for p in parts
    )
    return re.compile(body, re.DOTALL)


def _info_of(env: ChatEnv, seed: int) -> dict:
    return reset_tasks(env, [seed], "eval")[0][2]


def _probe_passes(policy: Policy, env: ChatEnv, seeds: list[int]) -> list[bool]:
    """Per seed, whether greedy decoding reproduces its probe (every taught token the argmax)."""

    batch = demonstration_batch(policy, env, seeds, random.Random(0), split="eval", play=env.skill_probe)
    logits = engine.response_logits_full(policy.model, policy.adapter, batch, policy.device)  # (N, T, V)
    if policy.suppress_ids:
        logits[..., list(policy.suppress_ids)] = float("-inf")  # the sampler never emits these
    greedy = logits.argmax(dim=-1).cpu()  # (N, T)
    taught = batch.loss_mask.bool()  # (N, T)
    wrong = (greedy != batch.response_ids) & taught  # (N, T)
    return (~wrong.any(dim=1)).tolist()


def _greedy_first_turns(
    policy: Policy, env: ChatEnv, seeds: list[int], max_new_tokens: int
) -> list[tuple[dict, str]]:
    """Per seed, the held-out task's info and the policy's greedy first turn."""
    resets = reset_tasks(env, seeds, "eval")  # a task the env cannot pose is left out (it counts as failed)
    ids, mask, vision = policy.encode_prompts(
        [obs for _, obs, _ in resets], [info.get("tools") for _, _, info in resets]
    )
    completions, _ = policy.generate(ids, mask, vision, max_new_tokens=max_new_tokens, temperature=0.0)
    return [(info, policy.decode(c)) for (_, _, info), c in zip(resets, completions, strict=True)]


@dataclass
class WarmStarted:
    """The outcome of ``warm_start_and_check``: the last supervised loss, the steps run (fewer than
    warm_start.steps when the skill arrived early) and the final skill check (None when not checked)."""

    nll: float
    steps: int
    check: SkillCheck | None


def warm_start_and_check(
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    w: WarmStartConfig,
    *,
    seed: int,
    log: Callable[[dict], None],
    progress: bool,
    say: bool,
) -> WarmStarted:
    """The supervised cold start of ``w`` (see mmgrpo.train.warmstart), then the check of the skill it was
    meant to teach: WarmStartError when it is missing. With ``check_every`` the skill is also measured
    during the warm start, which stops once it is there. ``log`` receives the records of both; ``say``
    prints the check's line."""
    checks: list = []  # (steps so far, SkillCheck) of every check made
    steps_run = {"n": 0}

    def log_step(record: dict) -> None:
        steps_run["n"] = record["step"]
        log(record)

    def measure(step: int):
        check = check_skill(policy, make_env, source=w.source, template=w.target, tasks=w.check_tasks)
        check = main_process_says(check)  # every process stops (or fails) at the same step
        if check is not None:
            checks.append((step, check))
            log({"stage": "warm_start_check", "step": step, "rate": check.rate, "n": check.n})
        return check

    def done(step: int) -> bool:
        check = measure(step)
        return check is None or check.rate >= w.min_skill

    nll = warm_start(
        policy,
        make_env,
        steps=w.steps,
        lr=w.lr,
        batch_size=w.batch_size,
        template=w.target,
        low=w.random_low,
        high=w.random_high,
        seed=seed,
        examples=w.examples,
        random_share=w.random_share,
        source=w.source,
        train_vision=w.train_vision,
        progress=progress,
        log=log_step,
        drill_steps=w.drill_steps,
        drill_lr=w.drill_lr,
        drill_bare_steps=w.drill_bare_steps,
        bare_share=w.bare_share,
        check_every=w.check_every if w.check_tasks > 0 and w.min_skill > 0 else 0,
        done=done,
    )
    check = None
    if w.check_tasks > 0:
        # the last check, unless training went on after it (drills, then demonstrations)
        last = checks[-1] if checks and checks[-1][0] == steps_run["n"] else None
        check = last[1] if last is not None else measure(steps_run["n"])
        if check is not None:
            if say:
                print(f"warm start: {check.line()} after {steps_run['n']} steps", flush=True)
            require_skill(check, w.min_skill, steps=w.steps, lr=w.lr)
    return WarmStarted(nll, steps_run["n"], check)


def main_process_says(obj):
    """``obj`` as the main process has it, on every process of a launched run (itself otherwise): the warm
    start runs outside DDP on every process (mmgrpo.train.distributed.warm_start_outside_ddp), and a check
    read a hair apart on two GPUs must not stop one process's warm start and not the other's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_prompt_drills(trainer) -> None:
    """After grpo.bare_steps: the warm start's check on full prompts first (the bare steps never showed
    one, so the call the drills taught there may be gone); only when it falls short, the drills again,
    on full prompts only and without the demonstrations, until the check passes. Drilling a policy that
    already passes is not free: on the zoom agent they started at nll 0.003 and ran 50 steps at the
    warm start's lr with a fresh optimizer, after which seed 0 wrote no answer for 45 steps."""
    import dataclasses

    from mmgrpo.train.distributed import gather_objects, outside_ddp

    trainer.drilled_full = True
    if not trainer.drills_at_switch:
        return
    w = trainer.cfg.warm_start
    if w.check_tasks > 0 and w.min_skill > 0:
        with outside_ddp(trainer.policy):
            check = check_skill(
                trainer.policy, trainer.make_env, source=w.source, template=w.target, tasks=w.check_tasks
            )
        if check is not None:
            # the main process's finding decides on every process (they drill together or not at all)
            check = gather_objects(trainer.accelerator, check)[0]
            trainer.log(
                {
                    "stage": "full_prompt_drills_check",
                    "step": 0,
                    "rate": check.rate,
                    "n": check.n,
                    "grpo_step": trainer.step,
                }
            )
            if check.rate >= w.min_skill:
                if trainer.is_main:
                    print(
                        f"grpo: step {trainer.step}: the bare steps are done; on full prompts {check.line()}: no drills",
                        flush=True,
                    )
                return
    if trainer.is_main:
        print(f"grpo: step {trainer.step}: the bare steps are done; drills on full prompts", flush=True)
    try:
        trainer.warm_start(dataclasses.replace(w, steps=0, drill_bare_steps=0), stage="full_prompt_drills")
    except WarmStartError as exc:
        path = trainer.save_checkpoint()  # the bare steps are not lost: a resume from it drills again
        raise WarmStartError(
            f"after grpo.bare_steps, on full prompts: {exc}. The run so far is kept in {path} (its weights "
            "with the drills done): resume it with --resume and more warm_start.drill_steps (or a higher "
            "warm_start.lr), which the drills there read again"
        ) from None
