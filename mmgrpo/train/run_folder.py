"""A run's output folder: what a run writes there (:data:`RUN_FILES`), the refusal to train a new run into a
folder that holds one (:func:`claim_output_dir` for ``mmgrpo train`` / ``mmgrpo.run``, :func:`earlier_run`
for a ``Trainer`` used on its own), and a failed write said as one line (:func:`write_error`).

Two runs in one folder mix: the second appends its steps to the first's metrics (steps 1, 2, 1, 2), replaces
its final model and its checkpoints. A run continues in its folder only by resuming from a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmgrpo.errors import ConfigError, MmgrpoError

RUN_FILES = ("metrics.jsonl", "final", "interrupted", "curves.png", "samples", "warnings.log", "config.yaml")
"""What a run writes into its output_dir (with checkpoint-N folders)."""


def run_files(out: Path) -> list[str]:
    """The names in ``out`` that a run wrote (:data:`RUN_FILES` and checkpoint-N folders)."""
    out = Path(out)
    return [n for n in RUN_FILES if (out / n).exists()] + sorted(p.name for p in out.glob("checkpoint-*"))


def claim_output_dir(out: Path, *, overwrite: bool, resume: bool = True, how: str = "cli") -> None:
    """Refuse to train into a folder that holds a run (its final model would be replaced and its metrics
    appended to), unless ``overwrite``, which removes that run's files first. ``resume``: the command can
    resume (train can, sft cannot). ``how``: "cli" names the flags (--resume, --overwrite), "python" the
    arguments of ``mmgrpo.run`` (resume=True, overwrite=True)."""
    import shutil

    found = run_files(out)
    if not found:
        return
    if not overwrite:
        flag = {"cli": ("--resume", "--overwrite"), "python": ("resume=True", "overwrite=True")}[how]
        raise ConfigError(
            f"output_dir '{out}' already holds a run ({', '.join(found[:4])}); training there would replace "
            "its model and mix its metrics with the new run's. Pass "
            + (f"{flag[0]} to continue it from its latest checkpoint, " if resume else "")
            + f"{flag[1]} to delete it and start anew, or set another output_dir."
        )
    for name in found:
        path = Path(out) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def earlier_run(out: Path) -> list[str]:
    """What in ``out`` shows a GRPO run other than the one starting now: a final or interrupted model,
    checkpoints, or GRPO steps in metrics.jsonl (a warm start's records, written by this run's own
    ``warm_start`` or by the process that launched it, do not count)."""
    out = Path(out)
    found = [n for n in ("final", "interrupted") if (out / n).exists()]
    found += sorted(p.name for p in out.glob("checkpoint-*"))
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "stage" not in record and "step" in record:
                found.append(f"GRPO steps in {metrics.name}")
                break
    return found


def write_error(what: str, path: Path, exc: OSError) -> MmgrpoError:
    """One line for a write that failed (a full disk, a read-only or a wrong path) and what to do."""
    import errno

    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space or choose a folder on another disk"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose a folder you can write to"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        fix = "a file stands where a folder is needed (or the other way round): give another path"
    else:
        fix = "choose another path"
    # the file or folder that failed, unless it is the path itself or mmgrpo's hidden partial copy of it
    shown = exc.filename and str(exc.filename) != str(path) and ".partial" not in str(exc.filename)
    where = f" ({exc.filename})" if shown else ""
    return MmgrpoError(
        f"cannot write {what} to '{path}': {reason}{where}; {fix}. Nothing was left half-written."
    )


def refuse_earlier_run(out: Path) -> None:
    """A ConfigError when ``out`` holds another GRPO run (:func:`earlier_run`), saying how to go on."""
    if found := earlier_run(out):
        raise ConfigError(
            f"output_dir '{out}' already holds a run ({', '.join(found[:3])}): a new run there would mix its "
            "metrics with that one's and replace its model. Resume it (trainer.resume(checkpoint), or "
            "mmgrpo.run(config, resume=True)), start anew with mmgrpo.run(config, overwrite=True), or set "
            "another output_dir."
        )


def trained_once(step: int, steps: int) -> MmgrpoError:
    """The error of a second ``Trainer.train()``."""
    return MmgrpoError(
        f"this Trainer has trained already (to step {step} of {steps}): a Trainer trains once. To train on, "
        "resume its run with more steps: mmgrpo.run(config, overrides=['grpo.steps=N'], resume=True); for a "
        "new run, make a new Trainer with another output_dir."
    )
