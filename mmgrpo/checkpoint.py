"""Checkpoints that resume a run exactly: ``{output_dir}/checkpoint-N``.

A checkpoint is written by ``accelerate``'s ``save_state`` (optimizer, scheduler, loss scaler and every
RNG state: python, numpy, torch and each device, one file per process; under FSDP or DeepSpeed also the
sharded model) plus what mmgrpo adds:

  config.json, model.safetensors, tokenizer...  the policy as a loadable model folder (a LoRA run: the
                                                adapter), so ``mmgrpo eval --model checkpoint-N`` works
  reference.safetensors                         the frozen KL reference, when it is a copy (beta > 0, no LoRA)
  mmgrpo_state.json                             the step (the task stream's position: step s trains on
                                                task seeds s*B .. s*B+B-1), the fault counters, the number
                                                of processes and the flat config; written last, so a
                                                folder without it is not a checkpoint

Everything goes to ``checkpoint-N.partial`` first and is renamed into place when complete; a kill while
writing leaves the previous checkpoints untouched (a stale ``.partial`` is ignored and removed by the next
save). Only the last ``grpo.keep_checkpoints`` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mmgrpo.adapters import unwrap
from mmgrpo.errors import ConfigError

PREFIX = "checkpoint-"
STATE_FILE = "mmgrpo_state.json"
REFERENCE_FILE = "reference.safetensors"
FORMAT = 1


def checkpoint_step(path: Path) -> int | None:
    """N for a folder named checkpoint-N, else None."""
    name = Path(path).name
    if not name.startswith(PREFIX):
        return None
    tail = name[len(PREFIX) :]
    return int(tail) if tail.isdigit() else None


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run directory (those holding mmgrpo_state.json), oldest first."""
    out = Path(out_dir)
    found = [
        p
        for p in out.glob(f"{PREFIX}*")
        if p.is_dir() and checkpoint_step(p) is not None and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def read_state(path: Path) -> dict[str, Any]:
    """The mmgrpo_state.json of a checkpoint, with a clear error when ``path`` is not one."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise ConfigError(
            f"--resume {path}: no such checkpoint folder (checkpoints are output_dir/checkpoint-N)"
        )
    if not state_file.is_file():
        raise ConfigError(
            f"--resume {path}: not a complete checkpoint (no {STATE_FILE}; a save interrupted while writing "
            "leaves such a folder). Resume from an earlier checkpoint-N of the run, or pass --resume alone to "
            "take the latest complete one."
        )
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{state_file} cannot be read ({e}); resume from an earlier checkpoint") from None
    if state.get("format") != FORMAT:
        raise ConfigError(
            f"{state_file}: checkpoint format {state.get('format')}, this mmgrpo reads {FORMAT}"
        )
    return state


def register_model_hooks(accelerator, policy) -> None:
    """Make ``accelerator.save_state``/``load_state`` write and read the policy as a loadable model folder
    (``save_pretrained``; with LoRA only the adapter) instead of a bare state dict. Under FSDP and DeepSpeed
    accelerate saves the sharded model itself and the hooks see no weights."""

    def save_hook(models, weights, output_dir):
        if not weights:
            return
        if accelerator.is_main_process:
            from mmgrpo.model_io import save_model

            save_model(unwrap(models[0]), policy.processor, output_dir)
        weights.clear()

    def load_hook(models, input_dir):
        if not models:
            return
        _load_weights(unwrap(models[0]), Path(input_dir))
        models.clear()

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Put the weights saved in ``folder`` into ``model`` in place (exact: fp32 in, fp32 out)."""
    from mmgrpo.model_io import is_lora

    if is_lora(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
        return
    dtype = next(model.parameters()).dtype
    saved = type(model).from_pretrained(folder, dtype=dtype)
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {folder} does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "resume with the config that wrote it"
        )


def save_checkpoint(trainer, path: Path, keep_last: int) -> Path:
    """Write the trainer's whole state to ``path`` atomically; keep the ``keep_last`` newest checkpoints."""
    acc = trainer.accelerator
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if acc.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    acc.wait_for_everyone()
    try:
        acc.save_state(str(partial))
        if acc.is_main_process:
            ref = trainer.policy.reference
            if ref is not None:
                from safetensors.torch import save_model

                save_model(ref, str(partial / REFERENCE_FILE))
            _test_delay(trainer.step)
            state = {
                "format": FORMAT,
                "step": trainer.step,
                "task_cursor": trainer.task_cursor,
                "kl_controller": trainer.kl_ctl.state_dict(),
                "diagnostics": trainer.diagnostics.state_dict(),
                "num_processes": acc.num_processes,
                "faults": trainer.faults.state_dict(),
                "config": trainer.flat_config,
            }
            _write_synced(partial / STATE_FILE, json.dumps(state, indent=1))
    except OSError as e:
        if acc.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(
            f"writing checkpoint {path} failed ({e.strerror or e}); the earlier checkpoints are intact. Free "
            "some space or set output_dir elsewhere."
        ) from None
    acc.wait_for_everyone()
    if acc.is_main_process:
        old = path.with_name(path.name + ".old")
        if path.exists():  # the same step saved again (after a resume)
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        for stale in complete_checkpoints(path.parent)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
    acc.wait_for_everyone()
    return path


def load_checkpoint(trainer, path: Path) -> dict[str, Any]:
    """Restore the trainer from a checkpoint written by :func:`save_checkpoint`; returns its state."""
    path = Path(path)
    state = read_state(path)
    acc = trainer.accelerator
    if state["num_processes"] != acc.num_processes:
        raise ConfigError(
            f"checkpoint {path} was written by {state['num_processes']} processes, this run has "
            f"{acc.num_processes}: each process restores its own random state, so resume with "
            f"--num_processes {state['num_processes']}"
        )
    policy = trainer.policy
    acc.load_state(str(path))
    if trainer.cfg.grpo.beta > 0:
        policy.make_reference()  # a copy of the restored weights, replaced below by the saved reference
        if policy.reference is not None:
            ref_file = path / REFERENCE_FILE
            if not ref_file.is_file():
                raise ConfigError(f"checkpoint {path} holds no {REFERENCE_FILE}, but grpo.beta > 0 needs it")
            from safetensors.torch import load_model

            load_model(policy.reference, str(ref_file))
    trainer.step = int(state["step"])
    trainer.task_cursor = int(state.get("task_cursor", trainer.step * trainer.cfg.grpo.tasks_per_step))
    trainer.faults.load_state_dict(state["faults"])
    if "diagnostics" in state:
        trainer.diagnostics.load_state_dict(state["diagnostics"])
    if "kl_controller" in state:
        trainer.kl_ctl.load_state_dict(state["kl_controller"])
    return state


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose values differ between the checkpoint's flat config and this run's (output_dir and the
    number of steps aside: extending a run is a normal resume)."""
    ignore = {"output_dir", "grpo.steps"}
    keys = sorted((set(saved) | set(current)) - ignore)
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def _test_delay(step: int) -> None:
    """Fault injection for the tests: MMGRPO_TEST_CHECKPOINT_DELAY="STEP:SECONDS" holds checkpoint-STEP
    half written for SECONDS, so that a test can kill the process inside the write."""
    spec = os.environ.get("MMGRPO_TEST_CHECKPOINT_DELAY", "")
    if spec and int(spec.split(":")[0]) == step:
        time.sleep(float(spec.split(":")[1]))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
