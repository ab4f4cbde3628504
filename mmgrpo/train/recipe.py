"""The training recipe, one for the command and for Python: ``mmgrpo train CONFIG`` is
``mmgrpo.run(CONFIG, overrides)`` (the CLI calls :func:`run`), so the two cannot drift.

    import mmgrpo
    result = mmgrpo.run("examples/counting_tiny.yaml", ["model.path=runs/tiny-model-sees"])
    result.metrics["reward"], result.final        # the last step's metrics, output_dir/final

What it does, in order: load and check the config (a file, a dict or a Config, with ``key=value``
overrides); with ``hub.push``, check the hub token; take output_dir's run lock (``mmgrpo.train.run_lock``:
a second run into the folder stops at once); refuse a folder that holds a run unless ``resume`` (continue
from its latest checkpoint, or a given one) or ``overwrite`` (delete it first); build the Trainer; set the
CPU threads (``mmgrpo.train.threads``); run the configured warm start (not on a resume), then the GRPO
steps, with SIGINT/SIGTERM finishing the step and writing a checkpoint (:class:`SignalStop`); draw
curves.png; push to the hub when asked. The final model folder holds a model card (README.md).

A stop by signal or callback raises ``TrainingStopped`` (its ``step``, its checkpoint ``path``) after the
curves are drawn; Ctrl-C during the warm start saves the model so far to output_dir/interrupted and raises
``WarmStartInterrupted`` (a KeyboardInterrupt).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgrpo.config.core import Config, load_config
from mmgrpo.errors import ConfigError
from mmgrpo.train.callbacks import TrainingStopped, WarmStartInterrupted
from mmgrpo.train.run_folder import claim_output_dir, write_error

LATEST = "latest"


@dataclass
class RunResult:
    """What :func:`run` returns: the last step's ``metrics`` (empty for a warm-start-only run), the
    ``step`` reached, the run's ``output_dir``, its ``final`` model folder (None when nothing was
    trained), the hub URL when pushed, and the ``trainer`` (its policy, ``evaluate()``, ...)."""

    metrics: dict[str, Any]
    step: int
    output_dir: Path
    final: Path | None
    trainer: Any
    hub_url: str | None = None


def run(
    config: str | Path | dict[str, Any] | Config | None,
    overrides: Sequence[str] = (),
    *,
    callbacks: Iterable[Any] = (),
    resume: bool | str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = None,
    _cli: bool = False,
) -> RunResult:
    """Train as ``mmgrpo train`` does (see the module docstring).

    ``config``: a YAML path, a dict of the same keys, a Config or None (the defaults); ``overrides``:
    ``"key.sub=value"`` strings as ``--set``; ``callbacks``: :class:`mmgrpo.TrainerCallback` objects;
    ``resume``: True (or "latest") continues the run in output_dir from its latest checkpoint, a path from
    that checkpoint; ``overwrite``: delete the run already in output_dir first; ``progress``: the progress
    bars; ``threads``: torch CPU threads (default as the CLI's: OMP_NUM_THREADS, else a few per core)."""
    from mmgrpo.train.hub import check_hub_access
    from mmgrpo.train.run_lock import RunLock

    cfg = load_config(config, overrides)
    if resume and overwrite:
        both = "--resume and --overwrite" if _cli else "resume and overwrite"
        raise ConfigError(
            f"{both}: resume continues the run in output_dir and overwrite deletes it: give one"
        )
    check_hub_access(cfg)
    out = Path(cfg.output_dir)
    with RunLock(out, "mmgrpo train" if _cli else "mmgrpo.run"):
        return _run(cfg, out, callbacks, resume, overwrite, progress, threads, _cli)


def _run(cfg: Config, out: Path, callbacks, resume, overwrite, progress, threads, cli) -> RunResult:
    """:func:`run` with output_dir's lock held."""
    from mmgrpo.train.checkpoint import latest_checkpoint
    from mmgrpo.train.hub import push_to_hub
    from mmgrpo.train.resume import finished_run
    from mmgrpo.train.threads import set_cpu_threads
    from mmgrpo.train.trainer import Trainer

    resume_from = None
    if resume:
        resume_from = latest_checkpoint(out) if resume is True or resume == LATEST else Path(resume)
        if resume_from is None:
            flag, path = ("--resume", "--resume PATH") if cli else ("resume=True", "resume=PATH")
            raise ConfigError(
                f"{flag}: output_dir '{out}' holds no complete checkpoint-N to resume from (checkpoints are "
                "written every grpo.save_every steps and when a run is stopped by Ctrl-C or SIGTERM). Start a "
                f"new run without {flag.split('=')[0]}, or give {path}."
            )
    else:
        claim_output_dir(out, overwrite=overwrite, how="cli" if cli else "python")
    trainer = Trainer(cfg, progress=progress, callbacks=callbacks)
    set_cpu_threads(threads)  # after every check of the input: a bad config is one line, alone
    stopper = SignalStop(trainer)
    try:
        with stopper:
            if resume_from is not None:
                trainer.resume(resume_from)
                if trainer.is_main:
                    say(f"mmgrpo: resumed from {resume_from} at step {trainer.step}")
            elif cfg.warm_start.steps > 0:
                trainer.warm_start()
            done = finished_run(trainer) if resume_from is not None else None
            if done is not None:  # all of grpo.steps done already: say so, write nothing
                return RunResult(done, trainer.step, trainer.out, trainer.out / "final", trainer)
            stopper.in_grpo = True
            record = trainer.train()
    except KeyboardInterrupt:  # during the warm start: keep what there is
        if stopper.in_grpo:
            raise
        raise WarmStartInterrupted(save_interrupted(trainer)) from None
    except TrainingStopped as stop:
        stop.signum, stop.steps = stopper.signum, trainer.cfg.grpo.steps
        if trainer.is_main and trainer.metrics_path.exists() and stop.step > 0:
            draw_curves(trainer)
        raise
    final, url = None, None
    if trainer.cfg.grpo.steps > 0:
        final = trainer.out / "final"
        if trainer.is_main:  # a warm-start-only run has no GRPO curves to draw
            draw_curves(trainer)
            if cfg.hub.push:
                url = push_to_hub(trainer.cfg, final)
                say(f"mmgrpo: pushed {final} to {url}")
    return RunResult(record, trainer.step, trainer.out, final, trainer, url)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def draw_curves(trainer) -> None:
    """curves.png at the end of a run; the model is saved by then, so a failed write is one warning line."""
    from mmgrpo.train.plots import plot_metrics

    path = trainer.out / "curves.png"
    try:
        plot_metrics(trainer.metrics_path, path)
    except OSError as exc:
        say(f"mmgrpo: warning: {write_error('the learning curves', path, exc)}")


class SignalStop:
    """SIGINT/SIGTERM during GRPO: finish the current step, write a checkpoint, stop (TrainingStopped).
    During the warm start: stop at once (KeyboardInterrupt) and keep the model so far. A second signal
    exits at once. Outside the main thread (signals cannot be caught there) it does nothing."""

    def __init__(self, trainer):
        self.trainer, self.in_grpo, self.signum, self.previous = trainer, False, 0, {}

    def handle(self, signum, frame):
        import os
        import signal

        if self.signum:  # the second signal
            say(f"\nmmgrpo: {signal.Signals(signum).name} again: exiting now")
            os._exit(128 + signum)
        self.signum = signum
        if not self.in_grpo:
            raise KeyboardInterrupt
        self.trainer.stop_requested = True
        if self.trainer.is_main:
            say(
                f"\nmmgrpo: {signal.Signals(signum).name}: finishing step {self.trainer.step + 1}, then saving a "
                "checkpoint (send it again to exit at once)"
            )

    def __enter__(self):
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self.handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


def save_interrupted(trainer) -> Path:
    """Ctrl-C or SIGTERM during the warm start: keep the model so far and say where."""
    where = trainer.out / "interrupted"
    trainer.save(where)
    say(f"\nmmgrpo: interrupted during the warm start; the model so far is in {where} (use it as model.path)")
    return where
