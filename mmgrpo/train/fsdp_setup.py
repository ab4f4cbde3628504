"""Whether a run shards its weights with FSDP2, the checks of that setting, and the sharding of the
policy and its KL reference at start (the mechanics are ``mmgrpo.train.fsdp``)."""

from __future__ import annotations

import copy
import warnings

from mmgrpo.config.core import Config
from mmgrpo.errors import ConfigError
from mmgrpo.model.policy import Policy
from mmgrpo.train import fsdp


def wanted(cfg: Config, accelerator) -> bool:
    """True under ``model.fsdp`` or accelerate's FSDP config (``distributed_type: FSDP``); checked here."""
    from accelerate.utils import DistributedType

    by_accelerate = accelerator.distributed_type == DistributedType.FSDP
    if not (cfg.model.fsdp or by_accelerate):
        return False
    where = "accelerate's FSDP config" if by_accelerate and not cfg.model.fsdp else "model.fsdp=true"
    world, g = accelerator.num_processes, cfg.grpo
    if by_accelerate:
        version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 2)
        if version != 2:
            raise ConfigError(
                f"accelerate's FSDP config asks for fsdp_version {version}; mmgrpo drives FSDP2 only: set "
                "fsdp_version: 2 in the accelerate config (examples/accelerate/fsdp.yaml)"
            )
    if not fsdp.available():
        raise ConfigError(
            f"{where}: this torch has no FSDP2 (it needs torch.distributed and "
            "torch.distributed.fsdp.fully_shard): install torch==2.14.1, or set model.fsdp=false"
        )
    if world < 2 and not _joined_process_group():
        raise ConfigError(
            f"{where}: FSDP shards the weights over processes, and this run has {world}: start it with "
            "`accelerate launch --num_processes N -m mmgrpo train ...` (N >= 2), or set model.fsdp=false"
        )
    if world < 2:  # launched (accelerate launch / torchrun) on one process: a check of the setup
        warnings.warn(
            f"{where} on 1 process: FSDP runs (units, collectives, sharded checkpoints) but shards nothing, "
            "so each process holds the whole model; launch N >= 2 processes to divide its memory",
            stacklevel=2,
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            f"{where} with model.lora: LoRA adapters are small, so shard nothing; train them with DDP "
            "(set model.fsdp=false, or use examples/accelerate/ddp_multi_gpu.yaml)"
        )
    if cfg.model.offload_reference:
        raise ConfigError(
            f"{where} with model.offload_reference: the reference is sharded like the policy; set "
            "model.offload_reference=false (accelerate's fsdp_offload_params moves shards to the CPU)"
        )
    if cfg.warm_start.steps > 0:
        raise ConfigError(
            f"{where} with warm_start.steps={cfg.warm_start.steps}: the warm start trains whole weights on "
            "each process; run it first (`mmgrpo sft`, or `mmgrpo train` without FSDP and grpo.steps=0), "
            "then point model.path at its output and set warm_start.steps=0"
        )
    if g.tasks_per_step % world:
        raise ConfigError(
            f"{where}: every process must run as many episodes (each forward is a collective), so "
            f"grpo.tasks_per_step={g.tasks_per_step} must be a multiple of the {world} processes"
        )
    return True


def _joined_process_group() -> bool:
    """True when this process was started by a launcher and joined a process group (of any size)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def shard_policy(cfg: Config, accelerator, policy: Policy) -> None:
    """Shard the policy's model in place and, when the loss has a KL term (grpo.beta > 0), make its
    reference: a frozen copy of the weights as they are now, sharded the same way. The copy is made
    before sharding, so each process holds a whole copy only for that moment."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)  # accelerate's FSDP config, on GPUs
    mp, offload = getattr(plugin, "mixed_precision_policy", None), getattr(plugin, "cpu_offload", None)
    kw = {
        "mp_policy": mp if isinstance(mp, MixedPrecisionPolicy) else None,
        "offload_policy": offload if isinstance(offload, CPUOffloadPolicy) else None,
    }
    model, is_vision = policy.model, policy.adapter.is_vision_param
    reference = None
    if cfg.grpo.beta > 0 or cfg.grpo.target_kl is not None:
        reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        reference.eval()
    fsdp.shard(model, is_vision, **kw)
    if reference is not None:
        policy.reference = fsdp.shard(reference, is_vision, **kw)
        policy._reference_vision_frozen = policy.vision_frozen
    policy.lockstep = True
