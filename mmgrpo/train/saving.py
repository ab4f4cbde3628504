"""The run's final model folder: ``save_run`` writes the model (or LoRA adapter), its processor and the
resolved config atomically (through ``<out_dir>.partial`` and a rename), and on a failed write rescues the
weights to the temporary directory with one error line saying where.
"""

from __future__ import annotations

import time
from pathlib import Path

from mmgrpo.config.core import Config, save_config
from mmgrpo.errors import ConfigError
from mmgrpo.model.policy import Policy
from mmgrpo.train.checkpoint import latest_checkpoint, write_failure


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

    from mmgrpo.train import fsdp

    state_dict = None
    if fsdp.is_sharded(policy.model):  # sharded by mmgrpo.train.fsdp (model.fsdp or accelerate's config)
        state_dict = fsdp.full_state_dict(policy.model)  # a collective: every process calls it
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        state_dict = accelerator.get_state_dict(policy.model)  # a collective: every process calls it
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    out_dir = Path(out_dir)
    model = accelerator.unwrap_model(policy.model)
    try:
        write_model_folder(model, policy.processor, cfg, out_dir, state_dict)
    except Exception as e:
        reason = write_failure(e, out_dir)
        if reason is None:
            raise
        error = ConfigError(rescue_failed_save(model, policy.processor, cfg, out_dir, state_dict, reason))
        accelerator.wait_for_everyone()  # the other processes go on; this one stops with the error
        raise error from None
    accelerator.wait_for_everyone()


def write_model_folder(model, processor, cfg: Config, out_dir: Path, state_dict=None) -> None:
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


def rescue_failed_save(model, processor, cfg: Config, out_dir: Path, state_dict, reason: str) -> str:
    """After the save to ``out_dir`` failed: write the model to a rescue folder in the temporary
    directory and return the one-line error that says where (or what is left when that fails too)."""
    import tempfile

    head = f"saving {out_dir} failed ({reason}); nothing there was replaced" + (
        f" (the earlier save at {out_dir} is intact)" if out_dir.exists() else ""
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rescue = Path(tempfile.gettempdir()) / f"mmgrpo-rescue-{out_dir.parent.name}-{out_dir.name}-{stamp}"
    try:
        write_model_folder(model, processor, cfg, rescue, state_dict)
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
