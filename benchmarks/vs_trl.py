"""mmgrpo's GRPO step against TRL's ``GRPOTrainer``, side by side, on the same tiny VLM and the same scenes.

    python benchmarks/vs_trl.py                    # B=4 prompts, G in (4, 8, 16), 6 steps, 2 rounds
    python benchmarks/vs_trl.py --quick            # G=4, 2 steps, 1 round (the test suite runs this)
    python benchmarks/vs_trl.py --learn            # the counting recipe on both, to >= 0.95 held out
    python benchmarks/vs_trl.py --learn --learn-steps 10   # the same, cut short (a smoke test)

Needs TRL (``pip install -e ".[bench]"``). Builds the embedded tiny Qwen2.5-VL in a temporary folder
(offline) and never downloads anything.

What is matched. Both systems train the same model folder (same weights, same processor, so the same 16
image tokens per 112 x 112 scene), in fp32 on the CPU, on the ``counting`` environment's training scenes
(1-5 red circles) in the same order: step k poses the train-split task seeds kB .. kB+B-1 (mmgrpo's task
stream; TRL reads a dataset built from the same ``CountingEnv.reset`` calls, unshuffled). Same G, B,
completion length, temperature 1 (no top-p / top-k; the vision placeholder tokens never sampled), KL beta (k3 estimator against the starting model),
clip epsilon 0.2, learning rate, constant schedule without warm-up, AdamW (0.9, 0.999) without weight
decay, gradient clipping at 1.0, reward = number_match + 0.1 x format (mmgrpo's own verifiers, wrapped as
TRL reward functions), sum-then-normalise advantages with the unbiased group std and eps 1e-4 (TRL's; set
in mmgrpo with grpo.adv_eps), per-sequence-mean loss (mmgrpo ``aggregation: sequence`` = TRL
``loss_type="grpo"``), one generation and one optimizer step per B x G batch, no gradient checkpointing,
no dropout, vision encoder frozen (``--train-vision`` trains it on both). By default every completion is
forced to the full length (TRL: ``min_new_tokens``; mmgrpo: the stop tokens are suppressed when sampling,
done here from outside, on the trainer's policy), so both generate and train on exactly B x G x T tokens;
the tokens per step are reported either way. The prompt token ids of the first step are checked to be
identical on both sides.

What is measured. Every run is a fresh subprocess with one thread (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1,
torch.set_num_threads(1)): on a small shared CPU two threads make both systems bimodal. Runs alternate
(mmgrpo, TRL, mmgrpo, TRL, ...) so that machine noise hits both alike. Per step: wall time (mmgrpo: one
``Trainer.train_step()`` call; TRL: the interval between consecutive ``on_step_end`` callbacks, so that its
data loading counts as mmgrpo's scene drawing does; the first step of each run is the warm-up and left out
of the medians), tokens generated, and the images the vision encoder encoded, counted by a forward
pre-hook on the vision tower (images per call = rows of ``grid_thw``) on the policy and on the reference
copy, split by ``torch.is_grad_enabled()``: the training (loss) pass vs the no-grad passes (generation,
reference log-probs, old log-probs). Per process: the peak RSS (``ru_maxrss``; this parent never loads
torch, so that it does not raise its children's, see ``peak_rss_mb``), also taken just before the first
step; and, in processes that only import, each side's bare-import RSS: most of the RSS of a run on this
tiny model is imports (torch, torchvision, transformers; TRL adds its own), and the table says how much
the steps themselves added.

``--learn``: the demo's recipe (``examples/counting_tiny.yaml``: 16 tasks x G=8, 8 new tokens, beta 0,
lr 3e-4, vision at 3e-5) on both, from the same warm-started checkpoint (mmgrpo's format-only warm start,
run once). mmgrpo trains until its held-out accuracy (greedy, 100 eval-split scenes disjoint from the final
ones, every 25 steps) reaches 0.95 or ``--learn-steps``; TRL trains the same number of steps, saving a
checkpoint every 25 (outside its timed steps) that is scored afterwards on the same 100 scenes, so both
curves are printed; both final models are then scored by mmgrpo's evaluator on the same 200 held-out
scenes. Wall time is the sum of the
step times (evaluations excluded). TRL is given the vision learning rate through its ``optimizers``
argument (AdamW with mmgrpo's two parameter groups) and mmgrpo's micro-batch of 64 as
per_device_train_batch_size with 2 accumulation steps (the same loss: a mean over sequences). What still
differs: the random streams (so the sampled completions), TRL shuffling the rows before cutting its
micro-batches (no effect on this loss), and only mmgrpo evaluating during training (to know when to stop).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "counting_tiny.yaml"
RESULT_TAG = "VS_TRL_RESULT "
"""A worker's result is the one stdout line starting with this tag (libraries may print other lines)."""
VISION_NAMES = ("visual", "vision_tower", "vision_model")
"""Attribute names under which image-text-to-text models keep their vision encoder."""
COUNTING_KWARGS = {"max_count": 5, "shapes": ["circle"], "colors": ["red"]}
VERIFIERS = (("number_match", 1.0), ("format", 0.1))
ADV_EPS = 1e-4
"""TRL adds 1e-4 to the group std; mmgrpo is told to do the same (grpo.adv_eps)."""
SELECTION_SEED_OFFSET = 100_000
"""--learn: the periodic evaluations that decide when mmgrpo stops use eval seeds from here on, disjoint
from the final evaluation's seeds 0..199."""
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
INSTALL_HINT = 'pip install -e ".[bench]"'

MATCHED = [
    f"grpo.adv_eps={ADV_EPS}",
    "grpo.top_p=1.0",
    "grpo.top_k=0",
    "grpo.num_iterations=1",
    "grpo.weight_decay=0.0",
    "grpo.betas=[0.9, 0.999]",
    "grpo.lr_schedule=constant",
    "grpo.warmup_steps=0",
    "grpo.max_grad_norm=1.0",
    "grpo.aggregation=sequence",
    "grpo.scale=std_unbiased",
    "grpo.baseline=mean",
    "grpo.kl_estimator=k3",
    "grpo.eval_every=0",
    "grpo.save_every=0",
]
"""The mmgrpo settings that match TRL's defaults and this comparison's choices, whatever the run (the
multi-turn benchmark sets them too)."""


# ------------------------------------------------------------------------------------------- run spec
@dataclass(frozen=True)
class Spec:
    """One measured run's settings, shared by both systems (sent to a worker as JSON)."""

    model_dir: str
    out_dir: str
    tasks: int = 4
    """B: prompts per step."""
    group_size: int = 8
    """G: completions per prompt."""
    steps: int = 6
    max_new_tokens: int = 16
    beta: float = 0.04
    lr: float = 1e-5
    vision_lr: float | None = None
    """Learning rate of the vision encoder when it trains (None: lr)."""
    freeze_vision: bool = True
    freeze_embeddings: bool = False
    """GRPO leaves the token embeddings and the output head as they are (mmgrpo: grpo.freeze_embeddings; TRL:
    the same parameters get requires_grad False). --learn takes it from the recipe."""
    equal_lengths: bool = True
    """Force every completion to max_new_tokens (no stop token sampled)."""
    micro_batch_size: int = 0
    """Rows per forward/backward pass; 0 = all B x G at once."""
    clip_eps: float = 0.2
    temperature: float = 1.0
    seed: int = 0
    config: str | None = None
    """A YAML config mmgrpo starts from (--learn: the recipe); None = mmgrpo's defaults."""
    eval_every: int = 0
    """--learn (mmgrpo): evaluate every this many steps and stop at target_accuracy; 0 = never."""
    eval_episodes: int = 100
    target_accuracy: float = 0.95

    @property
    def rows(self) -> int:
        """N = B x G completions per step."""
        return self.tasks * self.group_size

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.rows


# ------------------------------------------------------------------------------------------ measuring
def pin_threads() -> None:
    """One compute thread (the environment variables are set by the parent before torch loads)."""
    import torch

    os.environ.update(THREAD_ENV)
    torch.set_num_threads(1)


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss is in KiB on Linux).

    On Linux a child's ru_maxrss starts at its parent's peak RSS at the time of the spawn (the kernel
    carries the old memory map's high-water mark across exec), so the parent of the workers never loads
    torch: its peak stays near 20 MB, below every worker's. ``vm_hwm_mb`` is the cross-check."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vm_hwm_mb() -> float | None:
    """The peak RSS of this process's own memory map since exec (Linux ``VmHWM``), in MB; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def memory() -> dict[str, float | None]:
    """This process's peak RSS, both ways (MB)."""
    return {"peak_rss_mb": peak_rss_mb(), "vm_hwm_mb": vm_hwm_mb()}


def find_vision_tower(model) -> Any | None:
    """The outermost submodule named like a vision encoder (Qwen2.5-VL: ``model.visual``), or None."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_NAMES:
            return module
    return None


class VisionCounter:
    """Counts the images a vision encoder encodes, split into grad-enabled and no-grad calls.

    A forward pre-hook (with kwargs) on the vision tower reads the rows of ``grid_thw`` (one per image for
    the Qwen-VL family; other families: the first dimension of the pixel tensor). The hook is a plain
    function, so a ``copy.deepcopy`` of a hooked model (mmgrpo's reference copy) keeps counting here;
    ``install`` skips a tower that already carries it.
    """

    def __init__(self) -> None:
        self.grad = 0
        self.no_grad = 0

    def install(self, model) -> bool:
        """Hook ``model``'s vision tower; False when it has none or is already hooked."""
        import torch

        tower = find_vision_tower(model)
        if tower is None or any(
            getattr(h, "_vs_trl_counter", None) is self for h in tower._forward_pre_hooks.values()
        ):
            return False

        def count_images(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            pixels = kwargs.get("hidden_states", kwargs.get("pixel_values", args[0] if args else None))
            n = int(grid.shape[0]) if grid is not None else int(pixels.shape[0])
            if torch.is_grad_enabled():
                self.grad += n
            else:
                self.no_grad += n

        count_images._vs_trl_counter = self  # type: ignore[attr-defined]
        tower.register_forward_pre_hook(count_images, with_kwargs=True)
        return True

    def snapshot(self) -> tuple[int, int]:
        return self.grad, self.no_grad

    def since(self, before: tuple[int, int]) -> dict[str, int]:
        """Images encoded since ``before`` (a snapshot), by grad mode."""
        return {"grad": self.grad - before[0], "no_grad": self.no_grad - before[1]}


def digest(rows: Sequence[Sequence[int]]) -> str:
    """A short hash of token id rows (to compare the two systems' prompts without shipping them)."""
    return hashlib.sha1(json.dumps([list(map(int, r)) for r in rows]).encode()).hexdigest()[:12]


def train_scene_messages(seeds: Sequence[int]) -> list[tuple[list[dict], dict]]:
    """The counting env's (messages, info) of these train-split task seeds, as mmgrpo's rollout resets it."""
    from mmgrpo.envs.counting import CountingEnv

    env = CountingEnv(**COUNTING_KWARGS)
    return [env.reset(seed=s, options={"split": "train"}) for s in seeds]


# --------------------------------------------------------------------------------------- mmgrpo side
def mmgrpo_overrides(spec: Spec) -> list[str]:
    """mmgrpo config overrides (``--set`` form) for ``spec``: the settings both systems share."""
    vision_lr = "null" if spec.vision_lr is None else spec.vision_lr
    return [
        f"model.path={spec.model_dir}",
        "model.device=cpu",
        "model.dtype=float32",
        f"model.freeze_vision={str(spec.freeze_vision).lower()}",
        f"model.vision_lr={vision_lr}",
        f"grpo.freeze_embeddings={str(spec.freeze_embeddings).lower()}",
        f"output_dir={spec.out_dir}",
        f"seed={spec.seed}",
        "env.name=counting",
        f"env.kwargs={json.dumps(COUNTING_KWARGS)}",
        "verifiers=" + json.dumps([{"name": n, "weight": w} for n, w in VERIFIERS]),
        "warm_start.steps=0",
        f"grpo.steps={spec.steps}",
        f"grpo.tasks_per_step={spec.tasks}",
        f"grpo.group_size={spec.group_size}",
        f"grpo.micro_batch_size={spec.micro}",
        f"grpo.max_new_tokens={spec.max_new_tokens}",
        f"grpo.beta={spec.beta}",
        f"grpo.lr={spec.lr}",
        f"grpo.temperature={spec.temperature}",
        f"grpo.clip_eps_low={spec.clip_eps}",
        f"grpo.clip_eps_high={spec.clip_eps}",
        *MATCHED,
    ]


def make_mmgrpo_trainer(spec: Spec):
    """mmgrpo's real Trainer for ``spec`` (on ``spec.config`` when given, else mmgrpo's defaults)."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    return Trainer(load_config(spec.config, mmgrpo_overrides(spec)), progress=False)


def suppress_stop_tokens(policy) -> None:
    """Never sample a stop token, so that every completion runs to max_new_tokens (what TRL's
    ``min_new_tokens`` does). mmgrpo has no setting for it; its sampler masks ``adapter.suppress_ids``."""
    adapter = policy.adapter
    adapter.suppress_ids = sorted(set(adapter.suppress_ids) | set(policy.stop_ids))


def mmgrpo_prompt_ids(trainer, seeds: Sequence[int]) -> list[list[int]]:
    """The prompt token ids mmgrpo's policy encodes for these train seeds (padding removed)."""
    ids, mask, _ = trainer.policy.encode_prompts([m for m, _ in train_scene_messages(seeds)])
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


def run_mmgrpo(spec: Spec) -> dict[str, Any]:
    """Time ``spec.steps`` calls of ``Trainer.train_step()``; what the vision tower encoded per step."""
    trainer = make_mmgrpo_trainer(spec)
    policy = trainer.policy
    if spec.beta > 0 and not policy.has_reference:
        policy.make_reference()  # what the first train_step does; done here so that its tower is hooked
    counter = VisionCounter()
    counter.install(policy.model)
    if policy.reference is not None:
        counter.install(policy.reference)
    if spec.equal_lengths:
        suppress_stop_tokens(policy)
    setup_rss = peak_rss_mb()  # imports, model, reference copy, envs: everything before the first step
    steps = []
    for _ in range(spec.steps):
        before = counter.snapshot()
        t0 = time.perf_counter()
        record = trainer.train_step()
        seconds = time.perf_counter() - t0
        steps.append(
            {
                "seconds": seconds,
                "tokens": round(record["completion_len"] * record["num_episodes"]),
                "vision": counter.since(before),
                "reward": record["reward"],
            }
        )
    prompts = mmgrpo_prompt_ids(trainer, range(spec.tasks))
    return {
        "system": "mmgrpo",
        "steps": steps,
        "setup_rss_mb": setup_rss,
        **memory(),
        "prompt_digest": digest(prompts),
        "prompt_tokens": len(prompts[0]),
    }


def held_out_accuracy(trainer, episodes: int, seed_offset: int = 0) -> float:
    """``trainer.evaluate(episodes).accuracy`` on the eval-split seeds from ``seed_offset`` on (the same
    evaluator and settings; only the seeds move)."""
    from mmgrpo.rollout.evaluation import evaluate_config

    eval_cfg = dataclasses.replace(trainer.cfg.eval, seed_offset=seed_offset)
    cfg = trainer.cfg
    result = evaluate_config(
        eval_cfg,
        cfg.env,
        trainer.policy,
        trainer.make_env,
        trainer.rewards,
        trainer.metric,
        episodes=episodes,
    )
    return result.accuracy


def learn_mmgrpo(spec: Spec) -> dict[str, Any]:
    """--learn: train until the selection accuracy reaches the target (or spec.steps); save the model."""
    trainer = make_mmgrpo_trainer(spec)
    train_s = eval_s = 0.0
    curve: list[tuple[int, float]] = []
    reached = None
    while trainer.step < spec.steps:
        t0 = time.perf_counter()
        trainer.train_step()
        train_s += time.perf_counter() - t0
        if spec.eval_every and trainer.step % spec.eval_every == 0:
            t1 = time.perf_counter()
            accuracy = held_out_accuracy(trainer, spec.eval_episodes, SELECTION_SEED_OFFSET)
            eval_s += time.perf_counter() - t1
            curve.append((trainer.step, accuracy))
            if accuracy >= spec.target_accuracy:
                reached = trainer.step
                break
    final = Path(spec.out_dir) / "final"
    trainer.save(final)
    return {
        "system": "mmgrpo",
        "steps_done": trainer.step,
        "reached_at": reached,
        "train_seconds": train_s,
        "eval_seconds": eval_s,
        "curve": curve,
        "final_dir": str(final),
        **memory(),
    }


# ------------------------------------------------------------------------------------------ TRL side
def require_trl() -> None:
    """Exit with the install command when TRL is missing."""
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "vs_trl: TRL is not installed. This benchmark runs TRL's GRPOTrainer side by side with mmgrpo; "
            f"install it (from the repository root) with:  {INSTALL_HINT}"
        )


def counting_dataset(num_prompts: int):
    """TRL's training rows: the counting scenes of train seeds 0..num_prompts-1, in order. ``prompt`` is
    the system and user text (TRL puts the ``image`` before the user text, where mmgrpo's env has it)."""
    from datasets import Dataset

    from mmgrpo.env import message_images, message_text

    rows: dict[str, list] = {"prompt": [], "image": [], "answer": [], "seed": []}
    for seed, (messages, info) in enumerate(train_scene_messages(range(num_prompts))):
        rows["prompt"].append([{"role": m["role"], "content": message_text(m)} for m in messages])
        rows["image"].append(message_images(messages)[0])
        rows["answer"].append(info["answer"])
        rows["seed"].append(seed)
    return Dataset.from_dict(rows)


class RewardLog:
    """What TRL's reward functions saw per generation: the task seeds, in order, and the tokens."""

    def __init__(self) -> None:
        self.seeds: list[list[int]] = []
        self.tokens: list[int] = []


def trl_reward_funcs(log: RewardLog) -> list[Callable[..., list[float]]]:
    """mmgrpo's number_match and format verifiers as TRL reward functions (weights go to GRPOConfig)."""
    from mmgrpo.registry import make_verifier
    from mmgrpo.verifier import Episode

    def text(completion) -> str:
        content = completion[-1]["content"] if isinstance(completion, list) else completion
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content)
        return content

    funcs = []
    for i, (name, weight) in enumerate(VERIFIERS):
        verifier = make_verifier(name, weight=weight)

        def reward(completions, answer, seed, completion_ids, _v=verifier, _first=i == 0, **kwargs):
            if _first:
                log.seeds.append([int(s) for s in seed])
                log.tokens.append(sum(len(c) for c in completion_ids))
            episodes = [
                Episode(completion=text(c), task={"answer": a})
                for c, a in zip(completions, answer, strict=True)
            ]
            return _v.score(episodes)

        reward.__name__ = name
        funcs.append(reward)
    return funcs


def trl_args(spec: Spec, log_dir: str, suppress_ids: Sequence[int]):
    """GRPOConfig matching mmgrpo's step: one generation of B x G and one optimizer step per step, never
    sampling the tokens mmgrpo never samples (``suppress_ids``: the vision placeholders; TRL alone would
    suppress the image token only)."""
    from trl import GRPOConfig

    if spec.rows % spec.micro:
        raise ValueError(f"B x G = {spec.rows} must be a multiple of the micro-batch {spec.micro}")
    generation_kwargs: dict[str, Any] = {"suppress_tokens": list(suppress_ids)}
    if spec.equal_lengths:
        generation_kwargs["min_new_tokens"] = spec.max_new_tokens
    return GRPOConfig(
        output_dir=log_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=spec.seed,
        max_steps=spec.steps,
        per_device_train_batch_size=spec.micro,
        gradient_accumulation_steps=spec.rows // spec.micro,  # steps_per_generation follows it
        num_generations=spec.group_size,
        max_completion_length=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=1.0,
        top_k=0,
        generation_kwargs=generation_kwargs,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=spec.beta,
        epsilon=spec.clip_eps,
        epsilon_high=spec.clip_eps,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=[w for _, w in VERIFIERS],
        shuffle_dataset=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        use_vllm=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def load_trl_model(spec: Spec):
    """The policy, loaded as TRL would (fp32), with the vision encoder frozen by mmgrpo's rule when asked."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmgrpo.model.adapters import adapter_for, embedding_parameters

    model = AutoModelForImageTextToText.from_pretrained(spec.model_dir, dtype=torch.float32)
    if spec.freeze_vision:
        adapter = adapter_for(model)
        for name, p in model.named_parameters():
            if adapter.is_vision_param(name):
                p.requires_grad_(False)
    if spec.freeze_embeddings:  # the parameters mmgrpo's grpo.freeze_embeddings leaves out
        for p in embedding_parameters(model):
            p.requires_grad_(False)
    return model


def trl_optimizers(model, spec: Spec) -> tuple[Any, Any]:
    """(None, None) = TRL's own AdamW; with a vision_lr, AdamW with mmgrpo's two parameter groups (of the
    parameters that train: frozen ones are left out, as mmgrpo leaves them out)."""
    if spec.freeze_vision or spec.vision_lr is None:
        return None, None
    import torch

    from mmgrpo.model.adapters import adapter_for

    adapter = adapter_for(model)
    lang, vis = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (vis if adapter.is_vision_param(name) else lang).append(p)
    groups = [{"params": lang, "lr": spec.lr}, {"params": vis, "lr": spec.vision_lr}]
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.999), weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def make_step_timer(counter: VisionCounter, after_step: Callable[[int, dict], None] | None = None):
    """A TrainerCallback recording each optimizer step's wall time and vision-encoder images; then it calls
    ``after_step(step, callback_kwargs)`` (e.g. to save a checkpoint), outside the timed interval."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Step k's time: from the end of step k-1 (its start, for the first) to the end of step k."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.last_end: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()
            self.before = counter.snapshot()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            start = self.begin if self.last_end is None else self.last_end
            self.steps.append(
                {
                    "seconds": end - start,
                    "compute_seconds": end - self.begin,
                    "vision": counter.since(self.before),
                }
            )
            if after_step is not None:
                after_step(state.global_step, kwargs)
            self.last_end = time.perf_counter()

    return StepTimer()


def trl_prompt_ids(trainer, dataset, count: int) -> list[list[int]] | None:
    """The prompt token ids TRL builds for the first ``count`` rows (its own tokenizing step), or None
    when its private API has moved."""
    from trl.data_utils import prepare_multimodal_messages

    try:
        prompts = [
            prepare_multimodal_messages(r["prompt"], images=[r["image"]])
            for r in dataset.select(range(count))
        ]
        ids, _, _ = trainer._tokenize_prompts(prompts)
        return [list(map(int, r)) for r in ids]
    except (AttributeError, TypeError, ValueError):
        return None


def build_trl_trainer(
    spec: Spec, counter: VisionCounter, log: RewardLog, after_step: Callable[[int, dict], None] | None = None
):
    """GRPOTrainer on the counting dataset, its vision towers hooked; returns (trainer, timer, dataset)."""
    from trl import GRPOTrainer

    from mmgrpo.model.adapters import adapter_for

    dataset = counting_dataset(spec.steps * spec.tasks)
    model = load_trl_model(spec)
    timer = make_step_timer(counter, after_step)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward_funcs(log),
        args=trl_args(spec, str(Path(spec.out_dir) / "trl"), adapter_for(model).suppress_ids),
        train_dataset=dataset,
        callbacks=[timer],
        optimizers=trl_optimizers(model, spec),
    )
    counter.install(trainer.model)
    if getattr(trainer, "ref_model", None) is not None:
        counter.install(trainer.ref_model)
    return trainer, timer, dataset


def run_trl(spec: Spec) -> dict[str, Any]:
    """Train ``spec.steps`` TRL steps; per step its time, tokens and vision-encoder images."""
    counter, log = VisionCounter(), RewardLog()
    trainer, timer, dataset = build_trl_trainer(spec, counter, log)
    setup_rss = peak_rss_mb()  # imports, model, reference model, dataset: everything before the first step
    trainer.train()
    steps = [dict(s, tokens=t) for s, t in zip(timer.steps, log.tokens, strict=False)]
    expected = [
        [s for s in range(k * spec.tasks, (k + 1) * spec.tasks) for _ in range(spec.group_size)]
        for k in range(len(log.seeds))
    ]
    prompts = trl_prompt_ids(trainer, dataset, spec.tasks)
    return {
        "system": "trl",
        "steps": steps,
        "setup_rss_mb": setup_rss,
        **memory(),
        "same_scenes": log.seeds == expected,
        "prompt_digest": digest(prompts) if prompts else None,
        "prompt_tokens": len(prompts[0]) if prompts else None,
    }


def learn_trl(spec: Spec) -> dict[str, Any]:
    """--learn: ``spec.steps`` TRL steps of the recipe; the model saved for mmgrpo's evaluator, and every
    ``spec.eval_every`` steps a checkpoint (saved outside the timed steps), evaluated afterwards."""
    counter, log = VisionCounter(), RewardLog()
    checkpoints: list[tuple[int, str]] = []

    def save_checkpoint(step: int, kw: dict) -> None:
        if spec.eval_every and step % spec.eval_every == 0:
            folder = Path(spec.out_dir) / "checkpoints" / f"step-{step}"
            kw["model"].save_pretrained(folder)
            kw["processing_class"].save_pretrained(folder)
            checkpoints.append((step, str(folder)))

    trainer, timer, _ = build_trl_trainer(spec, counter, log, save_checkpoint)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    final = Path(spec.out_dir) / "final"
    trainer.save_model(str(final))
    return {
        "system": "trl",
        "steps_done": len(timer.steps),
        "train_seconds": sum(s["seconds"] for s in timer.steps),
        "train_wall_seconds": wall,
        "final_dir": str(final),
        "checkpoints": checkpoints,
        **memory(),
    }


# ----------------------------------------------------------------------------------- other workers
def prepare_learn(spec: Spec) -> dict[str, Any]:
    """--learn: build the tiny model, run mmgrpo's warm start once and save it where both systems start."""
    from mmgrpo.config.core import load_config
    from mmgrpo.tiny.vlm import build_tiny_model
    from mmgrpo.train.trainer import Trainer

    out = Path(spec.out_dir)
    tiny = build_tiny_model(out / "tiny-model")
    trainer = Trainer(
        load_config(spec.config, [f"model.path={tiny}", f"output_dir={out / 'warm-run'}"]), progress=False
    )
    t0 = time.perf_counter()
    trainer.warm_start()
    seconds = time.perf_counter() - t0
    warm = out / "warm"
    trainer.save(warm)
    return {"warm_dir": str(warm), "warm_seconds": seconds, "accuracy": trainer.evaluate(200).accuracy}


def evaluate_models(spec: Spec, jobs: Sequence[dict[str, Any]]) -> list[float]:
    """mmgrpo's held-out accuracy (its evaluator, the recipe's eval settings: greedy) of each job's
    ``folder`` on ``episodes`` eval-split scenes from seed ``seed_offset`` on (0: ``Trainer.evaluate``)."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    scores = []
    for i, job in enumerate(jobs):
        sets = [f"model.path={job['folder']}", f"output_dir={Path(spec.out_dir) / f'eval-{i}'}"]
        trainer = Trainer(load_config(spec.config, sets), progress=False)
        scores.append(held_out_accuracy(trainer, job["episodes"], job["seed_offset"]))
    return scores


def build_model(spec: Spec) -> dict[str, Any]:
    """The embedded tiny Qwen2.5-VL, built into ``spec.model_dir``."""
    from transformers.utils import logging as hf_logging

    from mmgrpo.tiny.vlm import build_tiny_model

    hf_logging.disable_progress_bar()
    return {"model_dir": str(build_tiny_model(spec.model_dir))}


def import_rss(what: str) -> dict[str, Any]:
    """Peak RSS of a process that only imports one side's modules."""
    if what == "mmgrpo":
        import mmgrpo.train.trainer  # noqa: F401
    elif what == "trl":
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    else:  # what the TRL worker imports: TRL plus mmgrpo's env, verifiers and adapters
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401

        import mmgrpo.envs.counting  # noqa: F401
        import mmgrpo.model.adapters  # noqa: F401
        import mmgrpo.registry  # noqa: F401
    return memory()


def worker(kind: str, spec: Spec, extra: dict[str, Any]) -> dict[str, Any]:
    """Run one job in this (fresh, single-threaded) process."""
    if kind.startswith("import-"):
        return import_rss(kind.removeprefix("import-"))
    pin_threads()
    if kind in ("trl", "learn-trl"):
        import transformers

        transformers.logging.set_verbosity_error()
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "mmgrpo": lambda: run_mmgrpo(spec),
        "trl": lambda: run_trl(spec),
        "build": lambda: build_model(spec),
        "prepare": lambda: prepare_learn(spec),
        "learn-mmgrpo": lambda: learn_mmgrpo(spec),
        "learn-trl": lambda: learn_trl(spec),
        "evaluate": lambda: {"accuracy": evaluate_models(spec, extra["jobs"])},
    }
    return jobs[kind]()


# ------------------------------------------------------------------------------------------- parent
def worker_env() -> dict[str, str]:
    """A worker's environment: one thread, offline (no hub, no datasets), TRL's experimental notices off."""
    return dict(
        os.environ,
        **THREAD_ENV,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
    )


def spawn(kind: str, spec: Spec, timeout: float, **extra: Any) -> dict[str, Any]:
    """Run a worker in a fresh subprocess with one thread; its result line, parsed."""
    env = worker_env()
    payload = json.dumps({"spec": asdict(spec), "extra": extra})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--payload", payload]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-40:])
    raise RuntimeError(f"vs_trl: the {kind} worker failed (exit {proc.returncode}):\n{tail}")


def measured(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that count: all but the first (warm-up) when there are several."""
    return steps[1:] if len(steps) > 1 else steps


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system at one G over its rounds: medians of the measured steps, the largest peak RSS."""
    steps = [s for r in runs for s in measured(r["steps"])]
    times = [s["seconds"] for s in steps]
    tokens = [s["tokens"] for s in steps]
    out = {
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "vm_hwm_mb": max((r.get("vm_hwm_mb") or 0.0) for r in runs) or None,
        "setup_rss_mb": max(r["setup_rss_mb"] for r in runs),
        "tokens_per_step": statistics.median(tokens),
        "vision_grad": statistics.median(s["vision"]["grad"] for s in steps),
        "vision_no_grad": statistics.median(s["vision"]["no_grad"] for s in steps),
        "prompt_digest": runs[0].get("prompt_digest"),
        "prompt_tokens": runs[0].get("prompt_tokens"),
    }
    if "same_scenes" in runs[0]:
        out["same_scenes"] = all(r["same_scenes"] for r in runs)
    if "compute_seconds" in steps[0]:
        out["median_compute_s"] = statistics.median(s["compute_seconds"] for s in steps)
    return out


def bench_spec(args: argparse.Namespace, model_dir: Path, work: Path, G: int, tag: str) -> Spec:
    return Spec(
        model_dir=str(model_dir),
        out_dir=str(work / tag),
        tasks=args.tasks,
        group_size=G,
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        beta=args.beta,
        lr=args.lr,
        freeze_vision=args.freeze_vision is not False,
        equal_lengths=args.equal_lengths,
    )


def run_benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Alternating runs of both systems for each G; their summaries and the bare-import RSS."""
    model_dir = work / "tiny-model"  # built in a worker: this process never loads torch (see peak_rss_mb)
    spawn("build", Spec(model_dir=str(model_dir), out_dir=str(work)), args.timeout)
    results: dict[str, Any] = {"per_G": {}, "imports": {}}
    for G in args.group_sizes:
        runs: dict[str, list] = {"mmgrpo": [], "trl": []}
        for r in range(args.rounds):
            for system in ("mmgrpo", "trl"):
                spec = bench_spec(args, model_dir, work, G, f"{system}-G{G}-r{r}")
                runs[system].append(spawn(system, spec, args.timeout))
                print(f"  G={G} round {r + 1}/{args.rounds} {system}: done", flush=True)
        results["per_G"][G] = {k: summarize(v) for k, v in runs.items()}
    if not args.quick:
        spec = bench_spec(args, model_dir, work, args.group_sizes[0], "imports")
        for what in ("mmgrpo", "trl", "trl-side"):
            results["imports"][what] = spawn(f"import-{what}", spec, args.timeout)["peak_rss_mb"]
    return results


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pair(a: float, b: float) -> str:
    """Two counts as ``a / b``."""
    return f"{a:g} / {b:g}"


def print_benchmark(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The comparison table, the scaling table, then one ``vs_trl:`` line per G (the last lines)."""
    vision = "frozen" if args.freeze_vision is not False else "trained"
    per_G = results["per_G"]
    print()
    print(
        f"mmgrpo vs TRL GRPOTrainer: B={args.tasks} prompts x G, {args.max_new_tokens} new tokens"
        f"{' (forced: no stop token)' if args.equal_lengths else ''}, beta {args.beta}, lr {args.lr}, "
        f"vision encoder {vision}, fp32, CPU"
    )
    print(
        f"threads pinned: 1 per run (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, torch.set_num_threads(1)); each "
        f"run a fresh subprocess; {args.rounds} round(s) alternating mmgrpo/TRL; {args.steps} steps per run, "
        "the first left out of the medians"
    )
    print()
    print("vision images per step: encoded in the training (grad) pass / in no-grad passes (generation,")
    print("reference, old log-probs); each cell mmgrpo / TRL. tokens: generated per step, mmgrpo / TRL.")
    head = (
        f"{'G':>3} {'N':>4} | {'step s mmgrpo':>13} {'TRL':>7} {'ratio':>6} | {'RSS MB mmgrpo':>13} {'TRL':>6} "
        f"{'ratio':>6} | {'vision grad':>11} | {'vision no-grad':>14} | {'tokens':>11}"
    )
    print(head)
    print("-" * len(head))
    for G, s in per_G.items():
        m, t = s["mmgrpo"], s["trl"]
        print(
            f"{G:>3} {args.tasks * G:>4} | {m['median_step_s']:>13.3f} {t['median_step_s']:>7.3f} "
            f"{ratio(m['median_step_s'], t['median_step_s']):>6.2f} | {m['peak_rss_mb']:>13.0f} "
            f"{t['peak_rss_mb']:>6.0f} {ratio(m['peak_rss_mb'], t['peak_rss_mb']):>6.2f} | "
            f"{pair(m['vision_grad'], t['vision_grad']):>11} | {pair(m['vision_no_grad'], t['vision_no_grad']):>14} | "
            f"{pair(m['tokens_per_step'], t['tokens_per_step']):>11}"
        )
    print_checks(per_G)
    print_per_token(args, per_G)
    print_scaling(args, per_G)
    print_rss_breakdown(per_G, results["imports"])
    print()
    for G, s in per_G.items():
        m, t = s["mmgrpo"], s["trl"]
        print(
            f"vs_trl: G={G} step_ratio={ratio(m['median_step_s'], t['median_step_s']):.2f} "
            f"rss_ratio={ratio(m['peak_rss_mb'], t['peak_rss_mb']):.2f} "
            f"vision_calls_mmgrpo={m['vision_grad']:g} vision_calls_trl={t['vision_grad']:g}"
        )


def print_rss_breakdown(per_G: dict[int, Any], imports: dict[str, float]) -> None:
    """Peak RSS split into what the imports, the setup (model, reference, data) and the steps take."""
    print("\npeak RSS breakdown (MB): a process that only imports each side's modules; the peak before the")
    print("first step (imports, model, reference, environments or dataset); the peak; what the steps added")
    print(
        f"{'G':>3} {'system':<7} | {'bare import':>11} | {'after setup':>11} | {'peak':>6} | {'steps added':>11}"
    )
    base = {"mmgrpo": imports.get("mmgrpo"), "trl": imports.get("trl-side")}
    for G, s in per_G.items():
        for system, label in (("mmgrpo", "mmgrpo"), ("trl", "TRL")):
            r = s[system]
            bare = f"{base[system]:.0f}" if base[system] else "-"
            print(
                f"{G:>3} {label:<7} | {bare:>11} | {r['setup_rss_mb']:>11.0f} | {r['peak_rss_mb']:>6.0f} | "
                f"{r['peak_rss_mb'] - r['setup_rss_mb']:>+11.0f}"
            )
    if imports:
        print(
            f"(bare imports: `import mmgrpo.train.trainer` {imports['mmgrpo']:.0f} MB; `from trl import GRPOTrainer` "
            f"{imports['trl']:.0f} MB; with the mmgrpo env and verifiers the TRL side uses {imports['trl-side']:.0f} MB)"
        )


def print_checks(per_G: dict[int, Any]) -> None:
    """Whether both saw the same prompts (token ids of step 1) and the same scenes in the same order."""
    same_ids = all(s["mmgrpo"]["prompt_digest"] == s["trl"]["prompt_digest"] for s in per_G.values())
    same_scenes = all(s["trl"].get("same_scenes", False) for s in per_G.values())
    first = next(iter(per_G.values()))
    hwm = [(s[k]["peak_rss_mb"], s[k]["vm_hwm_mb"]) for s in per_G.values() for k in ("mmgrpo", "trl")]
    rss_ok = all(h is None or abs(r - h) <= 0.05 * h for r, h in hwm)
    print(
        f"checks: peak RSS (ru_maxrss) agrees with each process's own VmHWM within 5%: {'yes' if rss_ok else 'NO'} "
        f"(this parent process: {peak_rss_mb():.0f} MB, the floor of every worker's ru_maxrss)"
    )
    print(
        f"checks: prompt token ids identical on both sides: {'yes' if same_ids else 'NO'} "
        f"({first['mmgrpo']['prompt_tokens']} tokens each); TRL's reward functions saw task seeds kB..kB+B-1 "
        f"(G times each) at step k, as mmgrpo's task stream: {'yes' if same_scenes else 'NO'}"
    )


def print_per_token(args: argparse.Namespace, per_G: dict[int, Any]) -> None:
    """Step time per generated token, when the completion lengths differ between the systems."""
    if all(s["mmgrpo"]["tokens_per_step"] == s["trl"]["tokens_per_step"] for s in per_G.values()):
        return
    print("\ncompletion lengths differ; step time per generated token (ms):")
    for G, s in per_G.items():
        m, t = s["mmgrpo"], s["trl"]
        mm = 1000 * m["median_step_s"] / max(m["tokens_per_step"], 1)
        tt = 1000 * t["median_step_s"] / max(t["tokens_per_step"], 1)
        print(f"  G={G}: mmgrpo {mm:.2f}  TRL {tt:.2f}  ratio {ratio(mm, tt):.2f}")


def print_scaling(args: argparse.Namespace, per_G: dict[int, Any]) -> None:
    """Step time against G for each system (and per completion), relative to the smallest G."""
    Gs = list(per_G)
    print(f"\nscaling with G (B={args.tasks}):")
    print(f"{'G':>3} | {'mmgrpo s':>9} {'x':>5} {'ms/compl':>9} | {'TRL s':>8} {'x':>5} {'ms/compl':>9}")
    base = per_G[Gs[0]]
    for G in Gs:
        m, t = per_G[G]["mmgrpo"]["median_step_s"], per_G[G]["trl"]["median_step_s"]
        n = args.tasks * G
        print(
            f"{G:>3} | {m:>9.3f} {ratio(m, base['mmgrpo']['median_step_s']):>5.2f} {1000 * m / n:>9.1f} | "
            f"{t:>8.3f} {ratio(t, base['trl']['median_step_s']):>5.2f} {1000 * t / n:>9.1f}"
        )


# ---------------------------------------------------------------------------------------- --learn
def recipe_spec(args: argparse.Namespace, model_dir: str, out_dir: Path, steps: int) -> Spec:
    """The counting recipe's GRPO settings, read from examples/counting_tiny.yaml."""
    from mmgrpo.config.core import load_config

    cfg = load_config(RECIPE)
    g, m = cfg.grpo, cfg.model
    freeze = m.freeze_vision if args.freeze_vision is None else args.freeze_vision
    return Spec(
        model_dir=model_dir,
        out_dir=str(out_dir),
        tasks=g.tasks_per_step,
        group_size=g.group_size,
        steps=steps,
        max_new_tokens=g.max_new_tokens,
        beta=g.beta,
        lr=g.lr,
        vision_lr=m.vision_lr,
        freeze_vision=freeze,
        freeze_embeddings=g.freeze_embeddings,
        equal_lengths=False,
        micro_batch_size=min(g.micro_batch_size, g.episodes_per_step),
        clip_eps=g.clip_eps_low,
        temperature=g.temperature,
        seed=cfg.seed,
        config=str(RECIPE),
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        target_accuracy=args.target_accuracy,
    )


def run_learn(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Warm start once; mmgrpo to the target; TRL for as many steps; both scored on 200 held-out scenes."""
    base = recipe_spec(args, "", work, args.learn_steps)
    prep = spawn("prepare", dataclasses.replace(base, out_dir=str(work / "prepare")), args.timeout)
    print(f"  warm start: {prep['warm_seconds']:.0f} s, held-out accuracy {prep['accuracy']:.3f}", flush=True)
    spec = dataclasses.replace(base, model_dir=prep["warm_dir"])
    mm = spawn("learn-mmgrpo", dataclasses.replace(spec, out_dir=str(work / "mmgrpo")), args.learn_timeout)
    print(f"  mmgrpo: {mm['steps_done']} steps, {mm['train_seconds']:.0f} s; curve {mm['curve']}", flush=True)
    trl_spec = dataclasses.replace(spec, out_dir=str(work / "trl"), steps=mm["steps_done"])
    tr = spawn("learn-trl", trl_spec, args.learn_timeout)
    print(f"  TRL: {tr['steps_done']} steps, {tr['train_seconds']:.0f} s", flush=True)
    final = [{"folder": r["final_dir"], "episodes": args.final_episodes, "seed_offset": 0} for r in (mm, tr)]
    selection = [
        {"folder": folder, "episodes": spec.eval_episodes, "seed_offset": SELECTION_SEED_OFFSET}
        for _, folder in tr["checkpoints"]
    ]
    scores = spawn("evaluate", spec, args.timeout, jobs=final + selection)["accuracy"]
    tr["curve"] = [(step, a) for (step, _), a in zip(tr["checkpoints"], scores[2:], strict=True)]
    accuracy = {"mmgrpo": scores[0], "trl": scores[1]}
    return {"spec": asdict(spec), "prepare": prep, "mmgrpo": mm, "trl": tr, "accuracy": accuracy}


def print_learn(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """The learning table, both selection curves, and the ``vs_trl_learn:`` line (the last line)."""
    spec, mm, tr = res["spec"], res["mmgrpo"], res["trl"]
    a_mm, a_tr = res["accuracy"]["mmgrpo"], res["accuracy"]["trl"]
    vision = "frozen" if spec["freeze_vision"] else f"trained at {spec['vision_lr']}"
    stop = (
        f"selection accuracy >= {spec['target_accuracy']}"
        if mm["reached_at"]
        else f"--learn-steps; target {spec['target_accuracy']} not reached"
    )
    print()
    print(
        f"counting recipe ({RECIPE.name}): B={spec['tasks']} x G={spec['group_size']}, "
        f"{spec['max_new_tokens']} new tokens, beta {spec['beta']}, lr {spec['lr']}, vision {vision}; both from "
        f"the same warm start (held-out accuracy {res['prepare']['accuracy']:.3f}); 1 thread each"
    )
    print(
        f"mmgrpo stopped at step {mm['steps_done']} ({stop}); TRL ran as many steps. Selection accuracy: "
        f"{spec['eval_episodes']} eval scenes from seed {SELECTION_SEED_OFFSET} every {spec['eval_every']} steps "
        f"(mmgrpo during training, {mm['eval_seconds']:.0f} s, not counted; TRL on checkpoints saved outside its "
        f"timed steps). Held-out accuracy: mmgrpo's evaluator, greedy, eval seeds 0..{args.final_episodes - 1}. "
        "Wall time: the sum of the step times."
    )
    for name, run in (("mmgrpo", mm), ("TRL", tr)):
        curve = "  ".join(f"{step}:{acc:.2f}" for step, acc in run["curve"]) or "-"
        print(f"  selection curve {name:<6} {curve}")
    head = f"{'system':<7} | {'steps':>5} | {'held-out acc':>12} | {'wall s':>8} | {'ratio':>5}"
    print(head)
    print("-" * len(head))
    time_ratio = ratio(mm["train_seconds"], tr["train_seconds"])
    print(
        f"{'mmgrpo':<7} | {mm['steps_done']:>5} | {a_mm:>12.3f} | {mm['train_seconds']:>8.1f} | {time_ratio:>5.2f}"
    )
    print(f"{'TRL':<7} | {tr['steps_done']:>5} | {a_tr:>12.3f} | {tr['train_seconds']:>8.1f} | {1.0:>5.2f}")
    print(
        f"\nvs_trl_learn: steps={mm['steps_done']} acc_mmgrpo={a_mm:.3f} acc_trl={a_tr:.3f} "
        f"time_ratio={time_ratio:.2f}"
    )


# -------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --work must not be taken for the hidden --worker
    )
    ap.add_argument("--quick", action="store_true", help="G=4, 2 steps, 1 round (the test suite's run)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (mmgrpo, TRL) per G")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16], metavar="G")
    ap.add_argument("--tasks", type=int, default=4, help="B: prompts per step")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-5)
    vis = ap.add_mutually_exclusive_group()
    vis.add_argument(
        "--freeze-vision",
        dest="freeze_vision",
        action="store_true",
        default=None,
        help="keep the vision encoder fixed (the default of the step benchmark)",
    )
    vis.add_argument(
        "--train-vision",
        dest="freeze_vision",
        action="store_false",
        help="train the vision encoder too (--learn: the recipe's default, at its vision_lr)",
    )
    ap.add_argument(
        "--natural-lengths",
        dest="equal_lengths",
        action="store_false",
        help="let completions stop at a sampled stop token (default: all run to --max-new-tokens)",
    )
    ap.add_argument("--learn", action="store_true", help="the counting recipe on both, to held-out accuracy")
    ap.add_argument("--learn-steps", type=int, default=400, help="--learn: most mmgrpo steps")
    ap.add_argument("--eval-every", type=int, default=25, help="--learn: mmgrpo's selection evaluations")
    ap.add_argument("--eval-episodes", type=int, default=100)
    ap.add_argument("--final-episodes", type=int, default=200)
    ap.add_argument("--target-accuracy", type=float, default=0.95)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark worker")
    ap.add_argument(
        "--learn-timeout", type=float, default=6 * 3600, help="seconds per --learn training worker"
    )
    ap.add_argument("--json", type=Path, help="also write every number to this file")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--payload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.group_sizes = 2, 1, [4]
    return args


def worker_main(args: argparse.Namespace) -> None:
    payload = json.loads(args.payload)
    result = worker(args.worker, Spec(**payload["spec"]), payload["extra"])
    print(RESULT_TAG + json.dumps(result), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    require_trl()
    work = args.keep or Path(tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        if args.learn:
            results = run_learn(args, work)
            print_learn(args, results)
        else:
            results = run_benchmark(args, work)
            print_benchmark(args, results)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"(total {time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
