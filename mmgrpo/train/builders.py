"""What a run is built from, each from its config and checked before compute: the env factory, the
rewards, the policy, the device and output folder, the Accelerator, the learning-rate schedule, and the
engines this trainer refuses (``check_engine``). ``Trainer``, ``mmgrpo sft``, ``eval`` and ``probe`` share them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.config.core import Config
from mmgrpo.env import ChatEnv
from mmgrpo.errors import ConfigError
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.io import LoraSpec, check_precision
from mmgrpo.model.policy import Policy
from mmgrpo.registry import make_env, make_verifier
from mmgrpo.verifier import Rewards


def build_env_factory(cfg: Config) -> Callable[[], ChatEnv]:
    """A zero-argument env factory; builds one env now so bad kwargs (and a tool env with too few turns
    to answer a call) fail before any model loads."""
    from mmgrpo.envs.tool_env import check_max_turns
    from mmgrpo.train.env_pool import close_envs

    env = make_env(cfg.env.name, **cfg.env.kwargs)
    try:
        check_max_turns(env, cfg.env.max_turns, f"'{cfg.env.name}'")
    finally:
        close_envs([env])  # the check's env: made and closed here
    return lambda: make_env(cfg.env.name, **cfg.env.kwargs)


def build_rewards(cfg: Config) -> Rewards:
    return Rewards([make_verifier(v.name, weight=v.weight, **v.kwargs) for v in cfg.verifiers])


def eval_metric(cfg: Config) -> str:
    """The verifier whose score is the accuracy: eval.metric, or the first verifier of the config."""
    names = [v.name for v in cfg.verifiers]
    if not names:
        raise ConfigError(
            "verifiers: [] -- GRPO scores every episode with at least one verifier; add one, e.g. "
            "`verifiers: [{name: exact_match}]` (`mmgrpo list` shows the registered ones)"
        )
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


def start_sampler(cfg: Config, out: Path, processes: int, model, processor=None):
    """The engine ``rollout.engine`` names, its process started: None for mmgrpo's own decode loop."""
    r = cfg.rollout
    if r.engine != "vllm":
        return None
    if processes > 1:
        raise ConfigError("rollout.engine=vllm under several processes: not supported yet; run one process")
    from mmgrpo.model.vllm_engine import VLLMEngine

    text = unwrap(model).config.get_text_config()

    engine = VLLMEngine(
        cfg.require_model(),
        python=r.vllm_python or None,
        dtype="float32" if cfg.model.dtype == "float32" else "bfloat16",
        max_model_len=min(
            r.vllm_max_model_len, getattr(text, "max_position_embeddings", None) or r.vllm_max_model_len
        ),
        kv_bytes=r.vllm_kv_mb * 2**20,
        seed=cfg.seed,
        log_path=out / "vllm.log",
        model=model,  # started from the weights in memory (a resumed or warm-started run's too)
        processor=processor,  # a vision-language engine loads the tokenizer and processor with the weights
    )
    engine.streams = r.vllm_streams  # multi-turn episodes as request streams (mmgrpo.rollout.schedule)
    return engine


def make_accelerator(*, cpu: bool, mixed_precision: str, log_with: list[str], project_dir: Path):
    """An Accelerator with this run's precision and trackers. Accelerate keeps one state per process;
    a single-process run that asks for a different precision than an earlier run of the same process
    (tests, notebooks) resets it first.

    The learning-rate schedule advances once per optimizer step, whatever the number of processes: by
    default accelerate's scheduler wrapper steps W times per step (it assumes each process's data loader
    batch is 1/W of an epoch's step), which would run a W-process schedule W times too fast.

    DDP runs without its buffer broadcast at each forward (``broadcast_buffers=False``): that broadcast
    is a collective, so processes whose episodes take different numbers of forwards (a training pass cut
    by response length, the batch's shared opening encoded once, a repeated image encoded once) waited on
    each other for good (the 2-process tools demo hung at step 21 before training passes were held to a
    fixed two forwards under DDP, which gave up those savings: on the zoom agent a 2-process step took
    1.4 s, one process on both cores 0.9 s). The models trained here have no buffers that training
    changes (rotary frequencies are fixed; no batch norm), so there is nothing to broadcast."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.state import AcceleratorState, PartialState

    check_trackers(log_with)
    kw = dict(
        cpu=cpu,
        mixed_precision=mixed_precision,
        log_with=log_with or None,
        project_dir=str(project_dir),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
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


def check_engine(accelerator, g, world: int) -> None:
    """Refuse, with the reason and what to use instead, the engines this trainer cannot drive correctly.

    DeepSpeed ZeRO-3 shards the parameters, so every forward is a collective and all processes would
    have to decode in lockstep; FSDP2 (model.fsdp, or accelerate's FSDP config) shards them too and is
    driven by ``mmgrpo.train.fsdp`` (sampling on gathered weights), ZeRO-3 is not. DeepSpeed (ZeRO-2)
    steps its optimizer inside each backward, so one step's rows must be one micro-batch.
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if kind == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3:
        raise ConfigError(
            "DeepSpeed ZeRO-3 shards the parameters, and mmgrpo drives sharded weights only through FSDP2: "
            "use examples/accelerate/fsdp.yaml (or model.fsdp=true under accelerate launch), DeepSpeed "
            "ZeRO-2 (deepspeed_zero2.yaml), or LoRA adapters (model.lora) with DDP."
        )
    if kind == DistributedType.DEEPSPEED:
        rows = -(-g.tasks_per_step // world) * g.group_size  # a process's episodes per step
        if g.micro_batch_size < rows:
            raise ConfigError(
                f"DeepSpeed steps its optimizer in every backward pass, so a step's {rows} episodes per "
                f"process must be one micro-batch: set grpo.micro_batch_size >= {rows}"
            )
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = rows


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
