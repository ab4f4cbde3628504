"""Checkpoints that resume a run exactly: ``{output_dir}/checkpoint-N``.

A checkpoint is written by ``accelerate``'s ``save_state`` (optimizer, scheduler, loss scaler and every
RNG state: python, numpy, torch and each device, one file per process; under DeepSpeed also the sharded
model) plus what mmgrpo adds (under FSDP, ``fsdp_shards/``: every process's shards of the model, the
optimizer state and the reference, by ``torch.distributed.checkpoint``, instead of the model folder):

  config.json, model.safetensors, tokenizer...  the policy as a loadable model folder (a LoRA run: the
                                                adapter), so ``mmgrpo eval --model checkpoint-N`` works
  reference.safetensors                         the frozen KL reference, when it is a copy (beta > 0, no LoRA)
  mmgrpo_state.json                             the step (the task stream's position: step s trains on
                                                task seeds s*B .. s*B+B-1), the fault counters, the number
                                                of processes and the flat config; written last, so a
                                                folder without it is not a checkpoint

Everything goes to ``checkpoint-N.partial`` first and is renamed into place when complete; a kill while
writing leaves the previous checkpoints untouched (a stale ``.partial`` is ignored and removed by the next
save). Only the last ``grpo.keep_checkpoints`` are kept. A write that fails (a full disk) removes the
``.partial`` folder and stops with one line; the earlier checkpoints stay.

On resume (:func:`load_checkpoint`) the checkpoint is checked before anything is loaded: its files must all
be there and readable (a missing or truncated one is named, with the previous complete checkpoint of the
run to resume from instead; mmgrpo does not switch to it by itself), and the config may not change what the
saved state was made for (:data:`FIXED_ON_RESUME`). Every other change applies from the next step; the
learning rate and its schedule are rebuilt from the new config by the trainer (see
:func:`resume_changes`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import ConfigError, MmgrpoError
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.io import share_file_modes
from mmgrpo.train import fsdp
from mmgrpo.train.distributed import gather_objects

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
        raise ConfigError(
            f"--resume {path}: {STATE_FILE} cannot be read ({e}).{earlier_checkpoint(path)}"
        ) from None
    if state.get("format") != FORMAT:
        raise ConfigError(
            f"{state_file}: checkpoint format {state.get('format')}, this mmgrpo reads {FORMAT}"
        )
    return state


def damaged_file(path: Path) -> str | None:
    """What is wrong with one file of a checkpoint, from its header alone (None: nothing found). Every
    ``.bin``/``.pkl``/``.pt`` file accelerate writes is a torch zip archive, whose directory sits at the
    end, so a cut file has none; a cut safetensors file no longer covers its header's tensors."""
    if not path.is_file():
        return f"{path.name} is missing"
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # SafetensorError, OSError: a cut or overwritten file
            return f"{path.name} is truncated or corrupt ({_first_line(e)})"
    elif path.suffix in (".bin", ".pkl", ".pt") and not zipfile.is_zipfile(path):
        return f"{path.name} is truncated or corrupt (not a complete torch archive)"
    return None


def checkpoint_files(
    path: Path, *, weights: str | None, reference: bool, rank: int, scaler: bool
) -> list[Path]:
    """The files :func:`load_checkpoint` reads from checkpoint ``path``, relative to it: the policy's
    weights (``weights``: "model", "adapter", "fsdp" for mmgrpo.train.fsdp's shards, or None when
    accelerate saves a sharded model itself), accelerate's optimizer, scheduler, loss scaler and this
    process's RNG states, and the KL reference copy."""
    rng = Path(f"random_states_{rank}.pkl")
    if weights == "fsdp":  # every process's shards (model, optimizer, reference) and the scheduler
        return [
            Path(fsdp.SHARDS_DIR, ".metadata"),
            Path("custom_checkpoint_0.pkl"),
            rng,
            *([Path("scaler.pt")] if scaler else []),
        ]
    files = []
    if weights == "adapter":
        files.append(Path("adapter_model.safetensors"))
    elif weights == "model":
        index = Path(path) / "model.safetensors.index.json"
        try:  # a large model is saved in shards, listed by the index
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files += [Path(s) for s in shards]
        except (OSError, ValueError, KeyError, AttributeError):
            files.append(Path("model.safetensors"))
    files += [Path("optimizer.bin"), Path("scheduler.bin"), rng]
    if scaler:
        files.append(Path("scaler.pt"))
    if reference:
        files.append(Path(REFERENCE_FILE))
    return files


def checkpoint_problems(path: Path, files: list[Path]) -> list[str]:
    """What is wrong with the ``files`` (relative, as named by :func:`checkpoint_files`) in checkpoint
    ``path``."""
    return [p for p in (damaged_file(Path(path) / f) for f in files) if p]


def earlier_checkpoint(path: Path, files: list[Path] | None = None) -> str:
    """A sentence naming the newest complete checkpoint of ``path``'s run older than ``path`` (whose
    ``files`` check out, when given) to resume from instead, or saying there is none."""
    path = Path(path)
    step = checkpoint_step(path)
    for c in reversed(complete_checkpoints(path.parent)):
        c_step = checkpoint_step(c)
        if c.resolve() == path.resolve() or (step is not None and c_step is not None and c_step >= step):
            continue
        if files is not None and checkpoint_problems(c, files):
            continue
        return f" The previous complete checkpoint is {c} (step {c_step}): resume from it with --resume {c}"
    return f" {path.parent} holds no earlier complete checkpoint to resume from."


def register_model_hooks(accelerator, policy) -> None:
    """Make ``accelerator.save_state``/``load_state`` write and read the policy as a loadable model folder
    (``save_pretrained``; with LoRA only the adapter) instead of a bare state dict. Under FSDP and DeepSpeed
    accelerate saves the sharded model itself and the hooks see no weights."""

    def save_hook(models, weights, output_dir):
        if not weights:
            return
        if accelerator.is_main_process:
            from mmgrpo.model.io import save_model

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
    from mmgrpo.model.io import is_lora

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
    """Write the trainer's whole state to ``path`` atomically; keep the ``keep_last`` newest checkpoints.
    A failed write (a full disk) removes the partial folder and raises one ConfigError on every process,
    naming the checkpoint that is still intact."""
    acc = trainer.accelerator
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if acc.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    acc.wait_for_everyone()
    failure = None
    try:
        acc.save_state(str(partial))
        sharded = getattr(trainer, "sharded", False)
        if sharded:  # every process writes its shards of the model, optimizer and reference
            fsdp.save_sharded(partial, trainer.policy.model, trainer.optimizer, trainer.policy.reference)
        if acc.is_main_process:
            ref = None if sharded else trainer.policy.reference
            if ref is not None:
                from safetensors.torch import save_model

                save_model(ref, str(partial / REFERENCE_FILE))
                share_file_modes(partial)  # safetensors >= 0.8 writes 0600 (safetensors#782)
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
    except Exception as e:
        failure = write_failure(e, partial)
        if failure is None:
            raise
    failures = [f for f in gather_objects(acc, failure) if f]
    if failures:  # every process stops here, together
        if acc.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        kept = latest_checkpoint(path.parent)
        raise ConfigError(
            f"writing checkpoint {path} failed ({failures[0]}); the run stops at step {trainer.step} and "
            + (f"{kept} (step {checkpoint_step(kept)}) is intact" if kept else "no earlier checkpoint exists")
            + ". Free some space (or move output_dir to a larger disk), then continue with --resume."
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


def write_failure(e: BaseException, where: Path) -> str | None:
    """The reason of a failed write, for one line, or None when ``e`` is not a write failure. A full disk
    raises OSError from Python's own writes, SafetensorError ("I/O error: No space left on device") from
    safetensors and a RuntimeError that never names the disk ("unexpected pos 576 vs 534") from
    ``torch.save``: hence the space left on ``where``'s disk in the reason."""
    if isinstance(e, OSError):
        reason = e.strerror or str(e)
    elif isinstance(e, RuntimeError) or type(e).__name__ == "SafetensorError":
        reason = f"{type(e).__name__}: {_first_line(e)}"
    else:
        return None
    free = free_space(where)
    return reason + (f"; {free} left on that disk" if free else "")


def free_space(path: Path) -> str | None:
    """The free space of the disk holding ``path`` (or its nearest existing parent), as text."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    return f"{free / 1e9:.1f} GB" if free >= 1e9 else f"{free / 1e6:.0f} MB"


def load_checkpoint(trainer, path: Path) -> dict[str, Any]:
    """Restore the trainer from a checkpoint written by :func:`save_checkpoint`; returns its state.

    Checked first, before anything is loaded: the number of processes, the config changes that cannot
    apply on resume (:func:`resume_changes`), a grpo.steps below the checkpoint's step
    (:func:`steps_done_refusal`) and every file (:func:`damaged_file`); a failure names the
    checkpoint, what is wrong and the previous complete checkpoint of the run."""
    from accelerate.utils import DistributedType

    path = Path(path)
    state = read_state(path)
    acc = trainer.accelerator
    if state["num_processes"] != acc.num_processes:
        raise ConfigError(
            f"checkpoint {path} was written by {state['num_processes']} processes, this run has "
            f"{acc.num_processes}: each process restores its own random state, so resume with "
            f"--num_processes {state['num_processes']}"
        )
    refused = resume_changes(state.get("config", {}), trainer.flat_config).refused
    if refused:
        raise ConfigError(f"--resume {path}: {'; '.join(refused)}")
    too_few = steps_done_refusal(path, int(state["step"]), trainer.cfg.grpo.steps)
    if too_few:
        raise ConfigError(too_few)
    policy = trainer.policy
    ours = getattr(trainer, "sharded", False)  # sharded by mmgrpo.train.fsdp: its own shard files
    sharded = ours or acc.distributed_type == DistributedType.DEEPSPEED
    files = checkpoint_files(
        path,
        weights="fsdp" if ours else None if sharded else ("adapter" if policy.lora else "model"),
        reference=trainer.cfg.grpo.beta > 0 and not policy.lora and not ours,
        rank=acc.process_index,
        scaler=acc.scaler is not None,
    )
    problems = checkpoint_problems(path, files)
    if problems:
        raise ConfigError(
            f"--resume {path}: the checkpoint is damaged ({'; '.join(problems)}).{earlier_checkpoint(path, files)}"
        )
    try:
        acc.load_state(str(path))
        if ours:  # the reference was made (sharded) at start; its saved shards replace it
            fsdp.load_sharded(path, policy.model, trainer.optimizer, policy.reference)
        elif trainer.cfg.grpo.beta > 0:
            policy.make_reference()  # a copy of the restored weights, replaced below by the saved reference
            if policy.reference is not None:
                from safetensors.torch import load_model

                load_model(policy.reference, str(path / REFERENCE_FILE))
    except Exception as e:  # what the header checks cannot see: a checkpoint of another model, bad data
        what = str(e) if isinstance(e, MmgrpoError) else f"{type(e).__name__}: {_first_line(e)}"
        raise ConfigError(
            f"--resume {path}: the checkpoint cannot be loaded into this run ({what}).{earlier_checkpoint(path, files)}"
        ) from e
    trainer.step = int(state["step"])
    trainer.task_cursor = int(state.get("task_cursor", trainer.step * trainer.cfg.grpo.tasks_per_step))
    trainer.faults.load_state_dict(state["faults"])
    if "diagnostics" in state:
        trainer.diagnostics.load_state_dict(state["diagnostics"])
    if "kl_controller" in state and trainer.cfg.grpo.target_kl is not None:
        trainer.kl_ctl.load_state_dict(state["kl_controller"])  # an adapted beta; a fixed one is config
    return state


# ------------------------------------------------------------------------------- config changes on resume
FIXED_ON_RESUME = {
    "model.path": "the checkpoint continues the model it was trained from",
    "model.lora.r": "the saved adapter has this rank",
    "model.lora.alpha": "the saved adapter was trained at this scale",
    "model.lora.target_modules": "the saved adapter holds these layers",
    "model.freeze_vision": "the saved optimizer state covers exactly the parameters that were trained",
    "grpo.freeze_embeddings": "the saved optimizer state covers exactly the parameters that were trained",
}
"""Config keys a resumed run refuses to change, and why (the saved state was made for the old value).
Also refused: ``model.lora`` switched on or off, ``model.dtype`` to or from float16 (the fp16 loss
scaler's state), and ``grpo.beta`` from 0 to > 0 without LoRA (the checkpoint holds no KL reference)."""

REBUILT_ON_RESUME = (
    "grpo.lr",
    "model.vision_lr",
    "grpo.lr_schedule",
    "grpo.warmup_steps",
    "grpo.betas",
    "grpo.weight_decay",
    "grpo.num_iterations",
    "grpo.steps",  # compared only with a linear or cosine schedule, whose end it moves
)
"""Keys the restored optimizer and scheduler state would override: the trainer sets them again from the
new config after loading (``mmgrpo.train.resume.rebuild_lr``); Adam's moments stay."""

NO_EFFECT_ON_TRAINING = (
    "grpo.save_every",
    "grpo.keep_checkpoints",
    "grpo.log_every",
    "logging.",
    "hub.",
    "model.lora.save",
)
"""Keys (or prefixes) that change what is written, not what is trained."""

NOT_USED_ON_RESUME = ("warm_start.", "sft.")
"""Sections a resumed run never reads (the warm start ran before GRPO's first step; warm_start is read
again by the drills after ``grpo.bare_steps``, so it is unused only when the checkpoint is past them)."""


@dataclass
class ResumeChanges:
    """The config keys that changed since a checkpoint was written, by what resuming does with them."""

    rebuilt: list[str] = field(default_factory=list)  # optimizer settings and schedule, set again
    applied: list[str] = field(default_factory=list)  # read from the config each step
    no_effect: list[str] = field(default_factory=list)  # bookkeeping only
    not_used: list[str] = field(default_factory=list)  # sections a resumed run never reads
    refused: list[str] = field(default_factory=list)  # full sentences: why, and what to do

    def warning(self, path: Path, step: int) -> str | None:
        """One line saying what each change does, or None when nothing changed."""
        parts = []
        if self.rebuilt:
            parts.append(
                f"Applied from step {step + 1}, with the learning rate, AdamW's settings and the schedule rebuilt "
                f"from the new config at the schedule's saved position (AdamW's moments kept): "
                f"{'; '.join(self.rebuilt)}."
            )
        if self.applied:
            parts.append(f"Applied from step {step + 1}: {'; '.join(self.applied)}.")
        if self.no_effect:
            parts.append(f"No effect on training: {'; '.join(self.no_effect)}.")
        if self.not_used:
            parts.append(f"Not used when resuming: {'; '.join(self.not_used)}.")
        if not parts:
            return None
        differ = [c.split(" ")[0] for c in self.rebuilt + self.applied]
        if differ:
            parts.append(
                f"Steps {step + 1}+ differ from an uninterrupted run (of either config) because of {', '.join(differ)}."
            )
        else:
            parts.append("Training continues exactly as it would have.")
        return f"mmgrpo: warning: resuming {path} (step {step}) with a changed config. " + " ".join(parts)


def resume_changes(saved: dict[str, Any], current: dict[str, Any], step: int | None = None) -> ResumeChanges:
    """How each difference between the checkpoint's flat config and this run's is taken on resume
    (output_dir aside; grpo.steps only where it moves the end of a linear or cosine schedule: extending
    a run is a normal resume). With the checkpoint's ``step`` at or before ``grpo.bare_steps``, the
    warm_start section is applied, not unused: the drills at the switch to full prompts read it."""
    out = ResumeChanges()
    drills_ahead = step is not None and step <= int(current.get("grpo.bare_steps") or 0)
    keys = sorted((set(saved) | set(current)) - {"output_dir", "grpo.steps"})
    if current.get("grpo.lr_schedule", "constant") != "constant":
        keys.append("grpo.steps")
    was_lora, is_lora = "model.lora" not in saved, "model.lora" not in current  # no LoRA: one key, null
    if was_lora != is_lora:
        out.refused.append(
            f"model.lora was {'on' if was_lora else 'off'} in the checkpoint's run and is "
            f"{'on' if is_lora else 'off'} now, and LoRA cannot be switched on or off in a run (the checkpoint "
            f"holds {'a LoRA adapter' if was_lora else 'full weights'}). Resume with the run's model.lora "
            f"setting{'' if was_lora else ' (--set model.lora=null)'}, or start a new run from these weights "
            "(model.path=that checkpoint)"
        )
    for key in keys:
        old, new = saved.get(key), current.get(key)
        if old == new or key == "model.lora" or (key.startswith("model.lora.") and was_lora != is_lora):
            continue  # a switched LoRA is said once, above
        if key == "model.path" and _same_model_path(old, new):
            continue
        line = f"{key} {_show(old)} -> {_show(new)}"
        why = _refusal(key, old, new, current)
        if why:
            out.refused.append(
                f"{key} changed ({_show(old)} -> {_show(new)}) and cannot change on resume: {why}. Resume with "
                f"--set {key}={_show(old)}, or start a new run from these weights (model.path=that checkpoint)"
            )
        elif key in REBUILT_ON_RESUME:
            out.rebuilt.append(line)
        elif key.startswith("warm_start.") and drills_ahead:
            out.applied.append(line + " (at the drills after grpo.bare_steps)")
        elif key.startswith(NOT_USED_ON_RESUME):
            out.not_used.append(line)
        elif key.startswith(NO_EFFECT_ON_TRAINING):
            out.no_effect.append(line)
        elif key == "grpo.beta" and current.get("grpo.target_kl") not in (None, "null"):
            out.no_effect.append(line + " (the adaptive KL controller continues from its saved beta)")
        else:
            out.applied.append(line)
    return out


def steps_done_refusal(path: Path, done: int, steps: int) -> str | None:
    """The error of a resume from checkpoint ``path`` (at step ``done``) with grpo.steps=``steps`` fewer than
    that, else None. Without it the run trained no step, logged no reward ("last reward nan") and exited 0,
    writing the checkpoint's weights as final/."""
    if done <= steps:
        return None
    path = Path(path)
    earlier = [c for c in complete_checkpoints(path.parent) if (checkpoint_step(c) or 0) <= steps]
    return (
        f"--resume {path}: the checkpoint has done {done} steps and grpo.steps is {steps}: a run cannot end "
        f"before the steps it has done. Resume with --set grpo.steps={done} or more"
        + (
            f", or resume from {earlier[-1]} (step {checkpoint_step(earlier[-1])}) to end at step {steps}"
            if earlier
            else ""
        )
    )


def _refusal(key: str, old: Any, new: Any, current: dict[str, Any]) -> str | None:
    """Why changing ``key`` from ``old`` to ``new`` cannot apply to a resumed run (None: it can)."""
    if key in FIXED_ON_RESUME:
        return FIXED_ON_RESUME[key]
    if key == "model.dtype" and "float16" in (old, new):
        return "the fp16 loss scaler's state is saved by fp16 runs only"
    if key == "grpo.beta" and not old and new and "model.lora" in current:  # without LoRA
        return "the run had no KL term, so the checkpoint holds no copy of the KL reference"
    return None


def _same_model_path(old: Any, new: Any) -> bool:
    """Whether two model.path values name the same model: equal, the same folder, or a folder that moved
    (the old path no longer exists, the new one does)."""
    if not isinstance(old, str) or not isinstance(new, str):
        return False
    a, b = Path(old).expanduser(), Path(new).expanduser()
    if a.is_dir() and b.is_dir():
        return a.resolve() == b.resolve()
    return not a.exists() and b.is_dir()


def _show(value: Any) -> str:
    """A flat config value as it would be written after --set."""
    if isinstance(value, bool):
        return str(value).lower()
    return "''" if value == "" else "null" if value is None else str(value)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


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
