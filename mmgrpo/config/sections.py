"""The sections of a run's configuration (model, env, verifiers, grpo, warm start, sft, eval; logging, faults
and hub are in ``mmgrpo.config.services``): frozen dataclasses that check their own types and ranges in
``__post_init__``, with a docstring per field. ``mmgrpo.config.core`` assembles them into ``Config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from mmgrpo.config.types import FieldError, Section


@dataclass(frozen=True)
class LoraConfig(Section):
    r: int = 16
    """Rank of the LoRA update matrices."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input. Non-zero makes training passes differ from sampling passes (ratio != 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Last name parts of the language model's linear layers to adapt (the vision tower, its projector and
    the output head are never adapted)."""
    save: Literal["adapter", "merged"] = "adapter"
    """What the final save holds: the adapter alone (small; loads onto its base) or the merged model."""

    def _validate(self) -> None:
        self._require(self.r >= 1, "r", "must be >= 1")
        self._require(self.alpha >= 1, "alpha", "must be >= 1")
        self._require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        self._require(
            bool(self.target_modules), "target_modules", "must name at least one layer, e.g. [q_proj, v_proj]"
        )


@dataclass(frozen=True)
class ModelConfig(Section):
    path: str = ""
    """Local directory or Hugging Face hub id of the policy model. For an offline tiny model run
    `mmgrpo tiny-model runs/tiny-model` and set `model.path=runs/tiny-model`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute precision. bfloat16 / float16 keep fp32 master weights for everything trained and run the
    forward under autocast (accelerate's mixed precision); float16 adds a loss scaler and needs a GPU
    (refused on the CPU). With LoRA the frozen base weights are stored in this dtype."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run: auto picks cuda when available, else cpu."""
    min_pixels: int | None = None
    """Lower bound of the processor's image budget in pixels (null = the processor's default)."""
    max_pixels: int | None = None
    """Upper bound of the processor's image budget in pixels; fewer pixels = fewer image tokens, less memory."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% slower."""
    freeze_vision: bool = False
    """Keep the vision encoder (and its projector) fixed and train the language side only, as EasyR1's
    freeze_vision_tower. The tiny demo needs it: measured, training its randomly initialised encoder
    collapses the image features and the policy never learns to count."""
    trust_remote_code: bool = False
    """Allow the model repository to run its own Python code (only for models you trust)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of all weights, e.g. {r: 16, alpha: 32}; the KL reference is the
    same model with the adapter disabled (no second copy). null = full fine-tuning."""
    vision_lr: float | None = None
    """Learning rate of the vision tower and projector (null = grpo.lr); a small value (e.g. lr / 10) lets
    the encoder adapt without collapsing its features. Ignored when freeze_vision is on."""
    fsdp: bool = False
    """Shard the parameters, gradients and AdamW state over the processes of `accelerate launch` with
    PyTorch FSDP2 (fully_shard per decoder layer): each of W processes holds 1/W of them, so models that do
    not fit one device with DDP train. Works on CPU processes (gloo) and GPUs; accelerate's FSDP config
    (examples/accelerate/fsdp.yaml) turns it on by itself. Not with LoRA or the warm start (run `mmgrpo sft`
    first). docs/distributed.md has the memory arithmetic."""
    fsdp_rollout: Literal["gathered", "lockstep"] = "gathered"
    """How a sharded model (model.fsdp) samples episodes and evaluates. gathered: every layer gathered once
    per rollout and kept whole while it runs (the whole model's weights on each device; decoding as fast
    as on one process). lockstep: the weights stay sharded and every process runs as many forwards (one
    layer gathered at a time, at every token; slower), for models whose weights do not fit one device."""
    offload_reference: bool = False
    """Keep the KL reference copy in CPU memory and move it to the device only for its pass (once per
    step): frees its weights' device memory between passes at the cost of two host-device copies per
    step. A no-op on the CPU and with LoRA (the reference is the base model, no copy)."""

    _aliases: ClassVar[dict[str, str]] = {
        "model_name_or_path": "path",
        "torch_dtype": "dtype",
        "peft": "lora",
        "freeze_vision_tower": "freeze_vision",
    }

    def _validate(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            self._require(
                getattr(self, name) is None or getattr(self, name) >= 1, name, "must be >= 1 or null"
            )
        if self.min_pixels is not None and self.max_pixels is not None:
            self._require(self.min_pixels <= self.max_pixels, "min_pixels", "must be <= max_pixels")
        self._require(self.vision_lr is None or self.vision_lr >= 0, "vision_lr", "must be >= 0 or null")
        if self.dtype == "float16" and self.device == "cpu":
            self._require(
                False,
                "dtype",
                "float16 needs a GPU",
                "On the CPU accelerate has no loss scaler and fp16 gradients underflow or overflow; use "
                "bfloat16 (fp32 master weights, bf16 compute) or float32",
            )


@dataclass(frozen=True)
class EnvConfig(Section):
    name: str = "counting"
    """Registered environment name (`mmgrpo list` shows them; plugins add more via entry points)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment factory (checked by the environment, not here)."""
    max_turns: int = 1
    """Most assistant turns per episode; 1 = single-turn question/answer. An episode still going after
    max_turns turns (e.g. its last turn called a tool) ends as truncated. A tool env needs >= 2 (a tool's
    result is read in the next turn)."""
    max_episode_tokens: int | None = None
    """Token budget of an episode's response (policy turns and the environment's turns between them); an
    episode that would exceed it ends as truncated. None = only the model's positions limit it."""

    def _validate(self) -> None:
        self._require(bool(self.name), "name", "must name a registered environment")
        self._require(self.max_turns >= 1, "max_turns", "must be >= 1")
        if self.max_turns < 2 and (problem := _tool_env_turns_problem(self.name, self.max_turns)):
            raise FieldError("max_turns", problem)
        if self.max_episode_tokens is not None:
            self._require(self.max_episode_tokens >= 1, "max_episode_tokens", "must be >= 1 (or null)")


def _tool_env_turns_problem(name: str, max_turns: int) -> str | None:
    """Why ``max_turns`` cannot work for the env registered as ``name``, when it is a ToolEnv class (whose calls
    are answered in a next turn); None otherwise. An unknown or broken name is left to make_env to report."""
    try:
        from mmgrpo.registry import ENVS

        factory = ENVS.get(name)
    except Exception:
        return None
    from mmgrpo.envs.tool_env import ToolEnv, max_turns_problem

    if isinstance(factory, type) and issubclass(factory, ToolEnv):
        return max_turns_problem(max_turns, f"'{name}'")
    return None


@dataclass(frozen=True)
class VerifierConfig(Section):
    name: str
    """Registered verifier name, e.g. number_match, exact_match, format."""
    weight: float = 1.0
    """Weight of this verifier in the total reward (a weighted sum over verifiers)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the verifier factory (checked by the verifier, not here)."""

    def _validate(self) -> None:
        self._require(bool(self.name), "name", "must name a registered verifier")
        self._require(math.isfinite(self.weight), "weight", "must be a finite number")


@dataclass(frozen=True)
class GRPOConfig(Section):
    steps: int = 200
    """Optimizer steps of GRPO training (0 = none, e.g. a warm-start-only run)."""
    epochs: float | None = None
    """Passes over a dataset env's train split (TRL's num_train_epochs), in place of steps: the run trains
    ceil(epochs x train rows / tasks_per_step) steps (seed s plays row s mod rows). Needs a dataset env."""
    tasks_per_step: int = 16
    """B: tasks (prompts) sampled per step."""
    group_size: int = 8
    """G: episodes per task; advantages are normalised within each group of G (typical 8-16)."""
    num_iterations: int = 1
    """mu: optimisation passes over each step's rollouts (1 = on-policy, ratio 1 at the first pass)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass (gradient accumulation); changes memory use, not the update.
    Rounded down to whole groups when >= group_size, so that each prompt is encoded once per group."""
    lr: float = 3e-4
    """AdamW learning rate (tiny models need large ones; billion-parameter models about 1e-6 to 5e-6)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas [beta1, beta2]."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, towards 0 at the last step."""
    bare_steps: int = 0
    """The first this many steps roll out bare prompts (the question alone: no system prompt, tool schemas
    or images; the tools still run on the task's data; see ``bare_share``), then the rest full ones. Between
    the two the warm start's check runs on full prompts, and when it falls short its drills
    (``warm_start.drill_steps`` > 0 with ``source: env``) run again on full prompts until it passes (a
    checkpoint is written if they fail). A curriculum for a small model that finds
    a skill in a short context only: measured on the zoom agent, the count in the zoomed view was learnt on
    bare prompts and then carried to full ones, where alone it stayed at chance (README). 0 = full prompts
    throughout."""
    bare_share: float = 1.0
    """During ``bare_steps``, this share of the tasks is posed bare (chosen by task seed, evenly spread),
    the rest with full prompts; 1.0 = every task bare. Below 1 the full prompts keep the warm start's call
    and answer form alive through the bare steps, so that the switch needs no drills (measured on the zoom
    agent's seed 0: after 300 all-bare steps full prompts drew no call at all, and the drills that
    restored it left every count answered "2", where GRPO could not leave it)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm."""
    freeze_embeddings: bool = False
    """GRPO leaves the token embeddings and the output head (one matrix when they are tied) as the warm
    start left them; the warm start still trains them. On a small answer set this keeps a wrong answer
    from being switched off through its own output row: measured on counting_hard (answers 1-5), the
    answers no longer collapse onto a few counts (README)."""
    beta: float = 0.04
    """KL coefficient against the frozen reference model; 0 = no reference model (the start value when
    target_kl is set)."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """Per-token KL estimate: k1 = log-ratio, k2 = half its square, k3 = exp(-d) + d - 1 (unbiased,
    non-negative; GRPO's), low_var_kl = k3 clamped to [-10, 10] (verl's)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: a term of the loss (GRPO), or subtracted from each episode's reward before
    the group normalisation (beta x the episode's summed KL; PPO-RLHF style)."""
    target_kl: float | None = None
    """Adaptive beta: beta moves towards keeping the per-token KL near this value (PPO's controller:
    beta *= 1 + clip(kl / target - 1, -0.2, 0.2) / kl_horizon per step); null = fixed beta."""
    kl_horizon: int = 100
    """Steps over which the adaptive beta reacts."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts this x the policy's mean token entropy (aggregated like the
    policy term). The entropy is reported as a metric either way."""
    sampler_correction: Literal["tis", "off"] = "tis"
    """Each token's sampler log-prob is kept, its gap to the training pass logged (mismatch/*); "tis" weighs each
    token's policy term by min(p_train / p_sampler, sampler_cap) (TRL's vllm_importance_sampling_correction)."""
    sampler_cap: float = 2.0
    """The cap of the sampler-correction weight (mmgrpo.grpo.mismatch)."""
    reward_combination: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Several verifiers: weighted sum of rewards, then group normalisation; or each reward normalised
    within its group, then the weighted sum (a small-scale reward then counts as much as a large one)."""
    credit: Literal["episode", "discounted", "gigpo"] = "episode"
    """Multi-turn credit (mmgrpo.grpo.turn_credit): one advantage per episode (GRPO); per turn from discounted
    returns of the env's per-turn rewards; or GiGPO (episode advantage + credit_omega x the turn's advantage
    among the group's turns that saw the same state, the env's info["state"])."""
    credit_gamma: float = 0.95
    """Discount of later turns' rewards in a turn's return (credit: discounted, gigpo)."""
    credit_omega: float = 1.0
    """GiGPO: weight of the step-level advantage added to the episode-level one."""
    credit_norm: Literal["position", "group"] = "position"
    """credit: discounted: each turn normalised against the same turn of the group's episodes, or all turns."""
    clip_eps_low: float = 0.2
    """The ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """The ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """Dual clip: for negative advantages cap the ratio at this constant (about 3); null = off."""
    scale: Literal["std_unbiased", "std_biased", "none"] = "std_unbiased"
    """Advantage scaling: divide by the group's std (unbiased, n-1, or biased, n) or not at all (Dr. GRPO)."""
    baseline: Literal["mean", "rloo"] = "mean"
    """Advantage baseline: the group mean, or the mean of the other G-1 rewards (RLOO)."""
    adv_eps: float = 1e-6
    """Added to the std before dividing, so zero-variance groups give zero advantages."""
    aggregation: Literal["sequence", "token", "constant", "bnpo"] = "sequence"
    """Loss over tokens: mean per sequence then over sequences (GRPO), mean over all tokens of the step (DAPO),
    sum divided by max_new_tokens x sequences (Dr. GRPO), or the mean over each micro-batch's tokens,
    averaged over micro-batches (TRL's bnpo)."""
    importance: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or one per sequence, the geometric mean of its tokens' (GSPO)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (typical 0.7-1.0); must be > 0."""
    top_p: float = 1.0
    """Nucleus sampling threshold of the rollouts; 1 = off."""
    top_k: int = 0
    """Sample only from the k most likely tokens; 0 = off."""
    max_new_tokens: int = 16
    """Most tokens the policy generates per turn."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose G rewards are all equal (they teach nothing) and roll out
    more tasks, B at a time, until B groups with reward variance are found (or max_sampling_rounds)."""
    max_sampling_rounds: int = 3
    """With dynamic_sampling: at most this many extra rounds of B tasks per step; then the step trains on the
    groups it has and says so."""
    overlong: Literal["none", "mask", "soft_penalty"] = "none"
    """Episodes cut for length (a turn at max_new_tokens, an episode at env.max_episode_tokens; not those
    ended by env.max_turns): kept as they are, left out of the loss (mask, DAPO's overlong filtering; the
    share is logged as overlong/masked_frac), or penalised (soft_penalty: 0 while the longest turn has up
    to max_new_tokens - overlong_buffer tokens, then linearly down to -overlong_factor at max_new_tokens
    and for a cut episode)."""
    overlong_buffer: int = 0
    """C of the soft overlong penalty: the last C tokens of max_new_tokens are penalised (e.g. a quarter)."""
    overlong_factor: float = 1.0
    """Size of the soft overlong penalty at the budget."""
    group_size_schedule: list[list[int]] = field(default_factory=list)
    """[[from_step, G], ...]: G changes at those steps, e.g. [[0, 16], [100, 8]] samples more early, when
    rewards are sparse, and fewer later; empty = group_size throughout."""
    log_every: int = 1
    """Log metrics (metrics.jsonl, progress bar) every this many steps."""
    save_every: int = 0
    """Write a resumable checkpoint (output_dir/checkpoint-N: weights, optimizer, scheduler, RNG states,
    task position) every this many steps; 0 = none (the final model is always saved)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted once a newer one is complete)."""
    eval_every: int = 0
    """Run a held-out evaluation every this many steps; 0 = never during training."""
    eval_episodes: int = 64
    """Episodes per evaluation during training."""

    _aliases: ClassVar[dict[str, str]] = {  # TRL's names, for 'did you mean' hints
        "learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
        "epsilon": "clip_eps_low", "epsilon_high": "clip_eps_high", "max_steps": "steps",
        "scale_rewards": "scale", "loss_type": "aggregation", "importance_sampling_level": "importance",
        "lr_scheduler_type": "lr_schedule", "per_device_train_batch_size": "micro_batch_size",
    }  # fmt: skip

    @property
    def episodes_per_step(self) -> int:
        """Episodes rolled out per step: tasks_per_step x group_size."""
        return self.tasks_per_step * self.group_size

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is needed (beta > 0)."""
        return self.beta > 0

    def _validate(self) -> None:
        for name in (
            "tasks_per_step",
            "num_iterations",
            "micro_batch_size",
            "max_new_tokens",
            "log_every",
            "eval_episodes",
        ):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("steps", "warmup_steps", "top_k", "save_every", "eval_every", "weight_decay", "beta"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        self._require(0.0 <= self.credit_gamma <= 1.0, "credit_gamma", "must be in [0, 1]")
        self._require(self.epochs is None or self.epochs > 0, "epochs", "must be > 0 (or null: grpo.steps)")
        self._require(
            self.bare_steps == 0 or self.bare_steps < self.steps,
            "bare_steps",
            f"must be below steps ({self.steps}): the steps after it are the ones on full prompts",
        )
        self._require(0.0 < self.bare_share <= 1.0, "bare_share", "must be in (0, 1]")
        self._require(self.max_sampling_rounds >= 0, "max_sampling_rounds", "must be >= 0")
        self._require(
            self.target_kl is None or (self.target_kl > 0 and self.beta > 0),
            "target_kl",
            "must be > 0, with beta > 0 as its start value",
        )
        self._require(self.kl_horizon >= 1, "kl_horizon", "must be >= 1")
        self._require(self.entropy_coef >= 0, "entropy_coef", "must be >= 0")
        self._require(self.sampler_cap > 0, "sampler_cap", "must be > 0 (about 2)")
        self._require(
            self.overlong != "soft_penalty" or 0 < self.overlong_buffer <= self.max_new_tokens,
            "overlong_buffer",
            f"must be in 1..max_new_tokens ({self.max_new_tokens}) with overlong=soft_penalty",
        )
        steps = [x[0] for x in self.group_size_schedule if len(x) == 2]
        self._require(
            all(len(x) == 2 and x[1] >= 2 for x in self.group_size_schedule) and steps == sorted(set(steps)),
            "group_size_schedule",
            "must be [[from_step, G], ...] with increasing steps and every G >= 2, e.g. [[0, 16], [100, 8]]",
        )
        self._require(
            self.group_size >= 2,
            "group_size",
            "must be >= 2",
            "GRPO compares the samples of a task with each other, so it needs at least 2 samples per "
            "group (typical 8-16)",
        )
        self._require(
            self.temperature > 0,
            "temperature",
            "must be > 0",
            "With greedy sampling all G samples of a task are identical, every group has zero reward "
            "variance and zero advantage, and nothing is learned (typical 0.7-1.0)",
        )
        for name in ("lr", "max_grad_norm", "adv_eps"):
            self._require(getattr(self, name) > 0, name, "must be > 0")
        for name in ("clip_eps_low", "clip_eps_high"):
            self._require(0 <= getattr(self, name) < 1, name, "must be in [0, 1)")
        self._require(
            self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be > 1 (about 3) or null"
        )
        self._require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            "must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )


@dataclass(frozen=True)
class WarmStartConfig(Section):
    steps: int = 0
    """Supervised format-only cold start before GRPO (DeepSeek-R1 style): it teaches the answer format with
    random answers, so that rewards are not all zero at the start; 0 = off."""
    lr: float = 1e-3
    """Learning rate of the warm start."""
    batch_size: int = 16
    """Examples per warm-start step."""
    target: str = "<answer>{random}</answer>"
    """Completion to imitate; {random} becomes a random integer in [random_low, random_high], {answer} the
    task's true answer (a supervised cold start on true examples instead of format only)."""
    random_share: float = 0.0
    """With {answer}: this share of the rows gets a random answer in [random_low, random_high] instead of
    the true one, so that answers the few true examples never show stay likely enough to be sampled."""
    examples: int = 0
    """With {answer}: train on a fixed pool of this many tasks (cycled), e.g. a few true examples as R1's
    cold start; 0 = a new task every time."""
    random_low: int = 1
    """Smallest random answer."""
    random_high: int = 5
    """Largest random answer."""
    source: Literal["format", "env"] = "format"
    """What to imitate: "format" = ``target`` with random numbers (single-turn); "env" = the environment's
    own demonstrations (multi-turn tool envs: ``ToolEnv.demonstration``, which say what they teach; gym
    envs: ``GymChatEnv.demonstration``, a demonstration policy playing the wrapped game)."""
    train_vision: bool = False
    """Also train the vision encoder. Off by default: format-only targets carry no visual signal, and
    training the encoder on them collapses its features (measured on the tiny model)."""
    check_tasks: int = 64
    """After the warm start, measure the skill it was meant to teach on this many held-out tasks (the env's
    ``skill_probe`` for demonstrations, else the target's form under greedy decoding); 0 = no check."""
    min_skill: float = 0.5
    """Stop before GRPO (one line naming the skill and its rate) when the checked skill's rate is below
    this: GRPO cannot reinforce what the policy never does. 0 = report only."""
    drill_steps: int = 0
    """With source "env": before the demonstrations, at most this many steps on the env's skill drills
    alone (``skill_probe``: the skill the check measures), ended once the check passes (see
    ``check_every``); then ``steps`` steps of demonstrations. If the check fails after them, the drills go
    on with what is left of this budget until it passes. 0 = no drills."""
    drill_lr: float | None = None
    """Learning rate of the drills (default: ``lr``). Copying is found from a plateau, and a lower rate
    found it more reliably on the tiny model (3e-4: five task orders of five; 1e-3: one of two)."""
    drill_bare_steps: int = 0
    """With drill_steps: first this many drill steps on bare prompts (the question alone: no system prompt,
    tool schemas or images), where a small model finds a copy far sooner; then the drills on full prompts,
    which the check ends. 0 = full prompts only."""
    bare_share: float = 0.0
    """With source "env": this share of the demonstrations' rows (drawn at random) on bare prompts, so that
    the first steps of ``grpo.bare_steps``, which pose them, start from a policy that calls the tool and
    answers in form there too (measured on the zoom agent: with demonstrations on full prompts only, 36% of
    its first bare episodes called the tool, 3% on the named cell, and GRPO then dropped the call). 0 = none."""
    check_every: int = 0
    """Also measure the skill every this many steps of the drills on full prompts (else of the only
    phase) and end them once it reaches ``min_skill``; 0 = measure once, at the end."""

    @property
    def enabled(self) -> bool:
        return self.steps > 0

    def _validate(self) -> None:
        self._require(self.steps >= 0, "steps", "must be >= 0")
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(self.batch_size >= 1, "batch_size", "must be >= 1")
        self._require(self.examples >= 0, "examples", "must be >= 0")
        self._require(0 <= self.random_share <= 1, "random_share", "must be in [0, 1]")
        self._require(self.check_tasks >= 0, "check_tasks", "must be >= 0")
        self._require(self.check_every >= 0, "check_every", "must be >= 0")
        self._require(self.drill_steps >= 0, "drill_steps", "must be >= 0")
        self._require(self.drill_lr is None or self.drill_lr > 0, "drill_lr", "must be > 0")
        self._require(self.drill_bare_steps >= 0, "drill_bare_steps", "must be >= 0")
        self._require(0 <= self.bare_share <= 1, "bare_share", "must be in [0, 1]")
        self._require(
            self.bare_share == 0 or self.source == "env",
            "bare_share",
            "applies to the env's demonstrations: set source: env, or bare_share: 0",
        )
        self._require(
            self.drill_bare_steps == 0 or self.drill_steps > 0,
            "drill_bare_steps",
            "leads into the drills on full prompts: set drill_steps > 0 too",
        )
        self._require(
            self.drill_steps == 0 or self.source == "env",
            "drill_steps",
            'needs source: "env" (drills are an env\'s)',
        )
        self._require(0 <= self.min_skill <= 1, "min_skill", "must be in [0, 1]")
        self._require(
            self.random_low <= self.random_high, "random_low", f"must be <= random_high ({self.random_high})"
        )
        try:
            self.target.format(random=0, answer=0)
        except (KeyError, IndexError, ValueError):
            self._require(
                False,
                "target",
                "may only use the placeholders {random} and {answer}",
                "Write {{ and }} for braces",
            )


@dataclass(frozen=True)
class SFTConfig(Section):
    data: str = ""
    """Training rows of `mmgrpo sft` (supervised cold start): a .jsonl / .json / .parquet file, a datasets
    save_to_disk folder or a hub id ("name" or "name:split"). A row is {messages: [...]} whose last message
    is the assistant target, {messages: [...], response: "..."}, or {question, response} with optional
    image / images and system. Image paths are relative to the data file's folder (see mmgrpo.train.sft)."""
    eval_data: str = ""
    """Held-out rows in the same forms; their mean target-token loss goes to metrics.jsonl before and after
    training (and every eval_every steps). Empty = none."""
    steps: int = 0
    """Optimizer steps; 0 = as many as ``epochs`` passes over the data take (steps wins when both are set)."""
    epochs: float = 1.0
    """Passes over the training rows when ``steps`` is 0 (may be fractional, e.g. 0.5)."""
    lr: float = 1e-4
    """AdamW learning rate (tiny models need about 1e-3; billion-parameter models about 1e-5)."""
    batch_size: int = 8
    """Rows per optimizer step; the loss is the mean negative log-likelihood over their response tokens."""
    micro_batch_size: int = 0
    """Rows per forward/backward pass (gradient accumulation, same update); 0 = the whole batch at once."""
    train_vision: bool = False
    """Also train the vision encoder and projector (at model.vision_lr). Off by default, as in the warm start:
    the language side learns the task and the encoder's features are kept. Ignored with model.freeze_vision."""
    max_length: int | None = None
    """Most tokens of one example (prompt with its image tokens, plus response); longer examples are
    DROPPED, never truncated (a cut-off target would teach the model to stop mid-answer), and the count is
    reported. null = no limit."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, towards 0 at the last step."""
    log_every: int = 1
    """Write a metrics.jsonl record (stage "sft") every this many steps (and at the last step)."""
    eval_every: int = 0
    """Also compute the eval_data loss every this many steps; 0 = only at the end."""
    shuffle: bool = True
    """Shuffle the rows every epoch (seeded by ``seed``); false = file order."""

    _aliases: ClassVar[dict[str, str]] = {  # TRL's names, for 'did you mean' hints
        "dataset": "data", "train_data": "data", "eval_dataset": "eval_data", "max_steps": "steps",
        "num_train_epochs": "epochs", "learning_rate": "lr", "per_device_train_batch_size": "batch_size",
        "max_seq_length": "max_length", "lr_scheduler_type": "lr_schedule",
    }  # fmt: skip

    def _validate(self) -> None:
        for name in ("steps", "micro_batch_size", "warmup_steps", "eval_every"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("batch_size", "log_every"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("epochs", "lr", "max_grad_norm"):
            self._require(getattr(self, name) > 0, name, "must be > 0")
        self._require(math.isfinite(self.epochs), "epochs", "must be a finite number")
        self._require(self.max_length is None or self.max_length >= 2, "max_length", "must be >= 2 or null")


@dataclass(frozen=True)
class EvalConfig(Section):
    episodes: int = 200
    """Episodes per evaluation (`mmgrpo eval`), on the environment's eval split."""
    temperature: float = 0.0
    """Sampling temperature at evaluation; 0 = greedy."""
    max_new_tokens: int = 16
    """Most tokens generated per turn at evaluation."""
    batch_size: int = 64
    """Episodes generated together."""
    seed_offset: int = 0
    """Added to the task seeds, to evaluate on a different set of eval tasks."""
    metric: str = ""
    """Score verifier (empty = the first); success: the env's or verifier's stated rule, else score >= 0.5."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _validate(self) -> None:
        for name in ("episodes", "max_new_tokens", "batch_size"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(self.temperature >= 0, "temperature", "must be >= 0")
