"""The ``mmgrpo`` command: train, sft, eval, probe, list, tiny-model, demo.

Uses only the public pieces (config, registry, Policy, Trainer, evaluate); every subcommand is a few
lines over them so that a script can do the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mmgrpo.errors import ConfigError, DataError, MmgrpoError

DEMO_CONFIGS = {
    "counting": "examples/counting_tiny.yaml",  # the tiny VLM learns to count red circles
    "counting_hard": "examples/counting_hard.yaml",  # ... the named kind among several, with distractors
    "tools": "examples/tools_math_tiny.yaml",  # the tiny model learns to use a calculator
    "text_math": "examples/text_math_tiny.yaml",  # the tiny text-only model learns addition
}
TEXT_ONLY_DEMOS = {"text_math"}  # built on the tiny text-only causal LM, not the tiny VLM
DEMO_CONFIG = DEMO_CONFIGS["counting"]


def _find_demo_config(task: str = "counting") -> Path:
    name = DEMO_CONFIGS[task]
    here = Path(__file__).resolve().parent.parent
    for candidate in (Path.cwd() / name, here / name):
        if candidate.is_file():
            return candidate
    raise MmgrpoError(
        f"cannot find {name} (looked in {Path.cwd()} and {here}); run the demo from the mmgrpo "
        "checkout or pass --config PATH"
    )


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmgrpo.tiny.vlm import TinyModelSpec, build_tiny_model, count_parameters

    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():  # said before the seconds of building
        raise MmgrpoError(f"'{out_dir}' is a file, not a folder: give a new folder path for the tiny model")
    try:
        if args.text_only:
            from mmgrpo.tiny.text import build_tiny_text_model

            out = build_tiny_text_model(out_dir, seed=args.seed)
        else:
            out = build_tiny_model(out_dir, TinyModelSpec(seed=args.seed))
    except OSError as exc:  # nothing is left half-written: the model was built in OUT_DIR.partial
        raise _write_error("the tiny model", out_dir, exc) from exc
    if args.text_only:
        from transformers import AutoModelForCausalLM

        n = count_parameters(AutoModelForCausalLM.from_pretrained(out))
        print(f"tiny Qwen2 causal LM ({n / 1e6:.2f}M parameters, text only) saved to {out}")
        return 0
    from transformers import AutoModelForImageTextToText

    n = count_parameters(AutoModelForImageTextToText.from_pretrained(out))
    print(f"tiny Qwen2.5-VL ({n / 1e6:.2f}M parameters) saved to {out}")
    return 0


def _write_error(what: str, path: Path, exc: OSError) -> MmgrpoError:
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


def cmd_config_reference(args: argparse.Namespace) -> int:
    from mmgrpo.config.core import config_reference

    print(config_reference(markdown=args.markdown))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from mmgrpo.registry import describe

    print(describe())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from mmgrpo.cli.run_lock import RunLock
    from mmgrpo.config.core import load_config

    cfg = load_config(args.config, args.set)
    out = Path(cfg.output_dir)
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in output_dir and --overwrite deletes it: give one")
    with RunLock(out, "mmgrpo train"):
        return _train(args, cfg, out)


def _train(args: argparse.Namespace, cfg, out: Path) -> int:
    """``mmgrpo train`` with output_dir's lock held."""
    from mmgrpo.train.checkpoint import latest_checkpoint
    from mmgrpo.train.trainer import Trainer, TrainingStopped

    resume_from = None
    if args.resume:
        resume_from = latest_checkpoint(out) if args.resume == LATEST else Path(args.resume)
        if resume_from is None:
            raise ConfigError(
                f"--resume: output_dir '{out}' holds no complete checkpoint-N to resume from (checkpoints are "
                "written every grpo.save_every steps and when a run is stopped by Ctrl-C or SIGTERM). Start a "
                "new run without --resume, or give --resume PATH."
            )
    else:
        _claim_output_dir(out, overwrite=args.overwrite)
    trainer = Trainer(cfg, progress=not args.no_progress)
    set_cpu_threads(args.threads)  # after every check of the input: a bad config is one line, alone
    stopper = _SignalStop(trainer)
    try:
        with stopper:
            if resume_from is not None:
                trainer.resume(resume_from)
                if trainer.is_main:
                    print(
                        f"mmgrpo: resumed from {resume_from} at step {trainer.step}",
                        file=sys.stderr,
                        flush=True,
                    )
            elif cfg.warm_start.steps > 0:
                trainer.warm_start()
            stopper.in_grpo = True
            record = trainer.train()
    except KeyboardInterrupt:  # during the warm start: keep what there is
        return _save_interrupted(trainer)
    except TrainingStopped as stop:
        if trainer.is_main:
            if trainer.metrics_path.exists() and stop.step > 0:
                _draw_curves(trainer)
            resume = " ".join(["mmgrpo train", args.config, *(f"--set {s}" for s in args.set), "--resume"])
            print(
                f"\nmmgrpo: stopped after step {stop.step} of {cfg.grpo.steps}; checkpoint in {stop.path}; "
                f"continue with: {resume}",
                file=sys.stderr,
                flush=True,
            )
        return 128 + stopper.signum
    if cfg.grpo.steps > 0 and trainer.is_main:  # a warm-start-only run has no GRPO curves to draw
        _draw_curves(trainer)
    if trainer.is_main:
        print(
            f"train: {cfg.grpo.steps} steps, last reward {record.get('reward', float('nan')):.3f}; "
            f"model saved to {trainer.out / 'final'}"
        )
    return 0


LATEST = "latest"


def _draw_curves(trainer) -> None:
    """curves.png at the end of a run; the model is saved by then, so a failed write is one warning line."""
    from mmgrpo.train.plots import plot_metrics

    path = trainer.out / "curves.png"
    try:
        plot_metrics(trainer.metrics_path, path)
    except OSError as exc:
        warning = _write_error("the learning curves", path, exc)
        print(f"mmgrpo: warning: {warning}", file=sys.stderr, flush=True)


class _SignalStop:
    """SIGINT/SIGTERM during GRPO: finish the current step, write a checkpoint, stop (exit 128 + signal).
    During the warm start: stop at once and keep the model so far. A second signal exits at once."""

    def __init__(self, trainer):
        self.trainer, self.in_grpo, self.signum, self.previous = trainer, False, 0, {}

    def handle(self, signum, frame):
        import os
        import signal

        if self.signum:  # the second signal
            print(f"\nmmgrpo: {signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        if not self.in_grpo:
            raise KeyboardInterrupt
        self.trainer.stop_requested = True
        if self.trainer.is_main:
            print(
                f"\nmmgrpo: {signal.Signals(signum).name}: finishing step {self.trainer.step + 1}, then saving a "
                "checkpoint (send it again to exit at once)",
                file=sys.stderr,
                flush=True,
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


def _save_interrupted(trainer) -> int:
    """Ctrl-C or SIGTERM during the warm start: keep the model and the curves so far, say where, exit 130."""
    where = trainer.out / "interrupted"
    trainer.save(where)
    print(
        f"\nmmgrpo: interrupted during the warm start; the model so far is in {where} (use it as model.path)",
        file=sys.stderr,
        flush=True,
    )
    return 130


RUN_FILES = ("metrics.jsonl", "final", "interrupted", "curves.png", "samples", "warnings.log", "config.yaml")
"""What a run writes into its output_dir (with checkpoint-N folders)."""


def _claim_output_dir(out: Path, *, overwrite: bool, resume: bool = True) -> None:
    """Refuse to train into a folder that holds a run (its final model would be replaced and its metrics
    appended to), unless ``--overwrite``, which removes that run's files first. ``resume``: the command
    has --resume (train does, sft does not)."""
    import shutil

    found = [n for n in RUN_FILES if (out / n).exists()] + sorted(p.name for p in out.glob("checkpoint-*"))
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir '{out}' already holds a run ({', '.join(found[:4])}); training there would replace "
            "its model and mix its metrics with the new run's. Pass "
            + ("--resume to continue it from its latest checkpoint, " if resume else "")
            + "--overwrite to delete it and start anew, or set another output_dir."
        )
    for name in found:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def cmd_sft(args: argparse.Namespace) -> int:
    import shlex

    from mmgrpo.cli.run_lock import RunLock
    from mmgrpo.config.core import load_config
    from mmgrpo.train.sft import run_sft

    cfg = load_config(args.config, args.set)
    out = Path(cfg.output_dir)
    with RunLock(out, "mmgrpo sft"):
        # like train: an earlier run's final/ is not replaced unless --overwrite
        _claim_output_dir(out, overwrite=args.overwrite, resume=False)
        set_cpu_threads(args.threads)
        try:
            summary = run_sft(cfg, progress=not args.no_progress)
        except KeyboardInterrupt:
            metrics = out / "metrics.jsonl"
            so_far = f"; its metrics so far are in {metrics}" if metrics.exists() else ""
            raise _Interrupted(f"mmgrpo: sft interrupted; no model saved{so_far}") from None
    final = summary["final"]
    dropped = f" ({summary['dropped']} over-long rows dropped)" if summary["dropped"] else ""
    held = f", eval loss {summary['eval_loss']:.3f}" if "eval_loss" in summary else ""
    print(
        f"sft: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
        f"{held}, saved to {final}{dropped}"
    )
    # GRPO from the SFT model, in its own run directory (its final save would replace this one's)
    keep = [s for s in args.set if not s.startswith(("sft.", "model.path=", "output_dir="))]
    sets = [*keep, f"model.path={final}", f"output_dir={Path(cfg.output_dir) / 'grpo'}"]
    print(
        "next: mmgrpo train "
        + " ".join([shlex.quote(args.config), *(f"--set {shlex.quote(s)}" for s in sets)])
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from mmgrpo.config.core import load_config
    from mmgrpo.rollout.evaluation import evaluate_config, write_eval, write_transcripts
    from mmgrpo.train.trainer import build_env_factory, build_rewards, eval_metric, load_policy

    cfg = load_config(args.config, args.set)
    make_env, rewards, metric = build_env_factory(cfg), build_rewards(cfg), eval_metric(cfg)
    policy = load_policy(cfg, args.model)
    set_cpu_threads(args.threads)  # after the input checks (the model folder too): a bad input is one line
    result = evaluate_config(
        cfg.eval, cfg.env, policy, make_env, rewards, metric, episodes=args.n, progress=not args.no_progress
    )
    for name, v in result.per_verifier.items():
        print(f"  {name}: {v:.3f}")
    for name, v in result.episode_metrics.items():
        print(f"  {name}: {v:.3f}")
    accuracy = f"accuracy: {result.accuracy:.3f} (n={result.n})"  # the last line, whatever happens next
    # next to the model; a hub id has no folder here, so the run directory takes it
    where = args.model if Path(args.model).is_dir() else cfg.output_dir
    try:
        path, folder = write_eval(result, where), write_transcripts(result, where)
    except OSError as e:
        print(accuracy, flush=True)
        print(
            f"mmgrpo: error: could not write eval.json into {where} ({e.strerror or e}); the accuracy above "
            "is the result. To keep it in a file, copy the model to a folder you can write to and evaluate "
            "that one.",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {path}")
    if folder is not None:
        print(f"wrote {len(result.transcripts)} transcripts to {folder}")
    print(accuracy)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from mmgrpo.train.plots import plot_metrics

    run = Path(args.run_dir)
    if not (run / "metrics.jsonl").is_file():
        what = "does not exist" if not run.exists() else "holds no metrics.jsonl"
        raise DataError(
            f"{run} {what}: give the output_dir of a run (`mmgrpo train` writes metrics.jsonl there)"
        )
    out = Path(args.out) if args.out else run / "curves.png"
    try:
        path = plot_metrics(run / "metrics.jsonl", out)
    except OSError as exc:
        raise _write_error("the learning curves", out, exc) from exc
    print(f"wrote {path}")
    return 0


def _write_pictures(trainer, result, run_dir: Path) -> list[Path]:
    """Learning curves, and what the model saw and said on the first held-out episodes."""
    from mmgrpo.env import message_images
    from mmgrpo.train.plots import plot_metrics, sample_grid

    paths = [plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png")]
    env = trainer.make_env()
    images, captions, correct = [], [], []
    for s in result.samples[:16]:
        messages, _ = env.reset(seed=s["seed"], options={"split": "eval"})
        shown = message_images(messages)
        if not shown:
            continue
        images.append(shown[0])
        captions.append(f"answer {s['answer']} | model {s['completion']}")
        correct.append(s["score"] >= 0.5)
    if images:
        paths.append(sample_grid(images, captions, correct, run_dir / "samples.png", columns=8))
    return paths


def cmd_probe(args: argparse.Namespace) -> int:
    """Sample only (no update): the reward distribution and within-group variance GRPO will see."""
    from mmgrpo.config.core import load_config
    from mmgrpo.env import message_text
    from mmgrpo.grpo.advantages import group_stats
    from mmgrpo.rollout.episodes import rollout
    from mmgrpo.train.diagnostics import verdict
    from mmgrpo.train.trainer import build_env_factory, build_rewards, load_policy

    cfg = load_config(args.config, args.set)
    g = cfg.grpo
    make_env, rewards = build_env_factory(cfg), build_rewards(cfg)
    policy = load_policy(cfg, args.model)
    set_cpu_threads(args.threads)  # after the input checks (the model folder too): a bad input is one line
    envs = [make_env() for _ in range(g.episodes_per_step)]
    totals, zero, formats = [], [], []
    for step in range(args.steps):
        seeds = [step * g.tasks_per_step + b for b in range(g.tasks_per_step)]
        batch = rollout(
            policy,
            envs,
            seeds,
            group_size=g.group_size,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_turns=cfg.env.max_turns,
            max_episode_tokens=cfg.env.max_episode_tokens,
        )
        scored = rewards.score(batch.episodes)
        totals += scored.total.tolist()
        formats += scored.per_verifier["format"].tolist() if "format" in scored.per_verifier else []
        zero.append(group_stats(scored.total, g.group_size)["frac_zero_std_groups"])
        if step == 0:
            for t in batch.trajectories[: min(4, len(batch.trajectories))]:
                turns = [message_text(m) for m in t.messages if m["role"] in ("assistant", "tool")]
                shown = (
                    " | ".join(turns) if t.turns > 1 else t.completion
                )  # multi-turn: calls and results too
                print(f"  answer={t.task.get('answer')!r} completion={shown!r}")
    hist: dict[float, int] = {}
    for r in totals:
        hist[round(r, 2)] = hist.get(round(r, 2), 0) + 1
    print("reward histogram: " + ", ".join(f"{k:g}: {v}" for k, v in sorted(hist.items())))
    frac = sum(zero) / len(zero)
    print(f"mean reward {sum(totals) / len(totals):.3f}; fraction of zero-variance groups {frac:.2f}")
    G = g.group_size
    groups = [totals[i : i + G] for i in range(0, len(totals), G)]
    fmt = sum(formats) / len(formats) if formats else None
    reward_max = sum(max(v.weight, 0.0) for v in cfg.verifiers) or None
    _, why = verdict(groups, fmt, reward_max=reward_max)
    print(f"verdict: {why}")  # "can learn: ..." or "cannot learn yet: ..."
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import contextlib

    from mmgrpo.cli.run_lock import RunLock

    out = Path(args.out)
    with RunLock(out, "mmgrpo demo", what="--out"), contextlib.ExitStack() as locks:
        try:
            return _demo(args, out, locks)
        except KeyboardInterrupt:
            raise _Interrupted(_demo_kept(out)) from None


def _demo_kept(out: Path) -> str:
    """The line for a demo stopped by Ctrl-C: which of its models are on disk (each is saved whole)."""
    from mmgrpo.tiny.vlm import is_model_dir

    models = (("tiny-model", "the tiny model"), ("tiny-text-model", "the tiny text model"))
    models += (("warm-started", "the warm-started model"),)
    kept = [f"{what} in {out / name}" for name, what in models if is_model_dir(out / name)]
    if not kept:
        return "mmgrpo: demo interrupted; nothing saved"
    return f"mmgrpo: demo interrupted; the run is not saved; kept {' and '.join(kept)} (a new demo reuses it)"


def _demo(args: argparse.Namespace, out: Path, locks) -> int:
    """``mmgrpo demo`` with the lock of ``--out`` held; ``locks`` (an ExitStack) takes the run folder's."""
    from mmgrpo.cli.processes import choose_processes, launch
    from mmgrpo.cli.run_lock import RunLock
    from mmgrpo.config.core import load_config
    from mmgrpo.tiny.vlm import build_tiny_model, is_model_dir
    from mmgrpo.train.trainer import Trainer, load_policy

    t0 = time.perf_counter()
    set_cpu_threads(args.threads)
    text_only = args.task in TEXT_ONLY_DEMOS and not args.config
    model_dir = out / ("tiny-text-model" if text_only else "tiny-model")
    if not is_model_dir(model_dir):
        try:
            if text_only:
                from mmgrpo.tiny.text import build_tiny_text_model

                build_tiny_text_model(model_dir)
            else:
                build_tiny_model(model_dir)
        except OSError as exc:
            raise _write_error("the tiny model", model_dir, exc) from exc
        what = "text-only Qwen2" if text_only else "Qwen2.5-VL"
        print(f"demo: built the tiny {what} in {model_dir}", flush=True)
    config = Path(args.config) if args.config else _find_demo_config(args.task)
    overrides = [f"model.path={model_dir}", f"output_dir={out / 'run'}", *args.set]
    cfg = load_config(config, overrides)
    run_dir = Path(cfg.output_dir)
    if run_dir.resolve() != out.resolve():  # the run's folder is locked too (it may be outside --out)
        locks.enter_context(RunLock(run_dir, "mmgrpo demo"))
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()  # a fresh demo run, not an append to the last one
    trainer = Trainer(cfg, progress=not args.no_progress)
    n = cfg.eval.episodes
    base = trainer.evaluate()
    print(f"demo: freshly built model accuracy={base.accuracy:.3f} (n={n})", flush=True)
    if cfg.warm_start.steps > 0:
        trainer.warm_start()
    before = trainer.evaluate()
    w = cfg.warm_start
    what = (
        "demonstrations"
        if w.source == "env"
        else f"true-example ({w.examples or 'all'} tasks)"
        if "{answer}" in w.target
        else "format-only"
    )
    print(
        f"demo: after the {what} warm start ({trainer.warm_start_steps} steps) accuracy={before.accuracy:.3f} "
        f"(format {before.per_verifier.get('format', float('nan')):.3f})" + _tool_use(before),
        flush=True,
    )
    processes = choose_processes(args.processes, str(trainer.policy.device))
    if processes > 1:
        # GRPO on every core: save the warm-started model, train it on N processes (data parallel), then
        # evaluate their final model here
        warm = out / "warm-started"
        trainer.save(warm)
        print(f"demo: GRPO on {processes} processes (one per core, data parallel)", flush=True)
        grpo = [*overrides, f"model.path={warm}", "warm_start.steps=0"]
        launch(config, grpo, processes, progress=not args.no_progress)
        trainer.policy = load_policy(cfg, model_path=str(run_dir / "final"))
    else:
        trainer.train()
    after = trainer.evaluate()
    summary = {
        "base": base.accuracy,
        "before": before.accuracy,
        "after": after.accuracy,
        "n": n,
        "processes": processes,
        "seconds": time.perf_counter() - t0,
        "tool_use_before": before.episode_metrics,
        "tool_use_after": after.episode_metrics,
    }
    (run_dir / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    pictures = _write_pictures(trainer, after, run_dir)
    print("demo: pictures " + ", ".join(str(p) for p in pictures), flush=True)
    from mmgrpo.rollout.evaluation import write_transcripts

    if (folder := write_transcripts(after, run_dir)) is not None:
        print(f"demo: held-out transcripts in {folder}" + _tool_use(after), flush=True)
    print(
        f"demo: {cfg.grpo.steps} GRPO steps in {summary['seconds']:.0f} s; run directory {run_dir}",
        flush=True,
    )
    print(f"demo: accuracy before={before.accuracy:.3f} after={after.accuracy:.3f} (n={n})", flush=True)
    return 0


def _tool_use(result) -> str:
    """ "; tool use: ..." for multi-turn results, "" otherwise."""
    m = result.episode_metrics
    if not m:
        return ""
    env = "".join(f" {k}={v:.2f}" for k, v in m.items() if k.startswith("env/"))
    return (
        f"; tool use: used_frac={m['tools/used_frac']:.2f} calls/ep={m['tool_calls']:.2f} "
        f"failures/ep={m['tools/failures']:.2f} turns/ep={m['turns']:.2f}{env}"
    )


def version() -> str:
    """The installed distribution's version (``mmgrpo.__version__`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("mmgrpo")
    except PackageNotFoundError:
        from mmgrpo import __version__

        return __version__


def cpu_cores() -> int:
    """Physical cores this process may use: its CPU affinity, less hyperthread siblings, within a cgroup
    CPU quota (a container's --cpus)."""
    import os

    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        logical = os.cpu_count() or 1
    cores = logical
    try:
        import psutil  # a dependency of accelerate

        physical, total = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        if physical and total and physical < total:
            cores = max(1, logical * physical // total)
    except ImportError:
        pass
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def default_cpu_threads(cores: int, processes: int = 1) -> int:
    """Torch threads for a CPU run: half of each process's share of the cores, at least 1, at most 4.

    Not all of them: an OpenMP thread spins while it waits for its siblings, so on a machine where other
    work holds some cores every operator waits for the slowest thread. Measured on a 2-core machine under
    a CI job's load, the counting demo's GRPO step took 1.0-1.5 s with one thread and 3.7-15.5 s with
    torch's default of two; the tiny models gain little from more threads even on an idle machine.
    """
    return max(1, min(4, cores // (2 * max(1, processes))))


_THREADS_SAID = False


def set_cpu_threads(requested: int | None) -> None:
    """``--threads N``, else OMP_NUM_THREADS (torch reads it), else on a machine without a GPU
    :func:`default_cpu_threads`, said once per process on stderr. Called when a command's input is
    checked and its work (a model) starts."""
    import os

    global _THREADS_SAID

    if requested is None and (os.environ.get("OMP_NUM_THREADS") or "").strip():
        return
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
        return
    if torch.cuda.is_available():  # the model runs on the GPU: torch's default is fine for the rest
        return
    cores, processes = cpu_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    n = default_cpu_threads(cores, processes)
    torch.set_num_threads(n)
    if n != cores and not _THREADS_SAID:
        _THREADS_SAID = True
        print(
            f"mmgrpo: {n} CPU thread{'s' * (n > 1)} ({cores} cores; --threads N or OMP_NUM_THREADS=N to change)",
            file=sys.stderr,
            flush=True,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmgrpo",
        description="GRPO for vision-language and text models.",
        epilog="--debug (anywhere): show the traceback of an error instead of its one-line message",
    )
    p.add_argument("--version", action="version", version=f"mmgrpo {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_threads(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--threads",
            type=_positive,
            default=None,
            metavar="N",
            help="torch CPU threads (default: OMP_NUM_THREADS, else half the cores, at most 4; see README)",
        )

    def with_config(sp: argparse.ArgumentParser) -> None:
        with_threads(sp)
        sp.add_argument("config", help="YAML config file")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set grpo.lr=1e-4 (repeatable)",
        )
        sp.add_argument("--no-progress", action="store_true", help="no progress bars")

    sp = sub.add_parser("train", help="train with GRPO")
    with_config(sp)
    sp.add_argument(
        "--overwrite", action="store_true", help="delete the run already in output_dir and train anew"
    )
    sp.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        default=None,
        metavar="PATH",
        help="continue the run in output_dir from its latest checkpoint, or from checkpoint PATH",
    )
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("sft", help="supervised fine-tuning on (messages -> response) rows (sft.data)")
    with_config(sp)
    sp.add_argument(
        "--overwrite", action="store_true", help="delete the run already in output_dir and train anew"
    )
    sp.set_defaults(fn=cmd_sft)

    sp = sub.add_parser("eval", help="accuracy on held-out episodes; writes eval.json next to the model")
    with_config(sp)
    sp.add_argument("--model", required=True, help="model directory (e.g. runs/x/final) or hub id")
    sp.add_argument("-n", type=_positive, default=None, help="episodes (default: eval.episodes)")
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("probe", help="sample without training: reward distribution and group variance")
    with_config(sp)
    sp.add_argument("--model", default=None, help="model directory (default: model.path)")
    sp.add_argument("--steps", type=_positive, default=2, help="sampling steps (>= 1)")
    sp.set_defaults(fn=cmd_probe)

    sp = sub.add_parser("plot", help="draw a run's learning curves (metrics.jsonl) to a PNG")
    sp.add_argument("run_dir", help="run directory holding metrics.jsonl")
    sp.add_argument("--out", default=None, help="default: RUN_DIR/curves.png")
    sp.set_defaults(fn=cmd_plot)

    sp = sub.add_parser("list", help="registered environments and verifiers")
    sp.set_defaults(fn=cmd_list)

    sp = sub.add_parser("config-reference", help="every config key with its type, default and meaning")
    sp.add_argument("--markdown", action="store_true", help="as the markdown table of docs/config.md")
    sp.set_defaults(fn=cmd_config_reference)

    sp = sub.add_parser("tiny-model", help="build the tiny offline Qwen2.5-VL")
    sp.add_argument("out_dir")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--text-only", action="store_true", help="a tiny Qwen2 causal LM instead (no vision)")
    sp.set_defaults(fn=cmd_tiny_model)

    sp = sub.add_parser("demo", help="build the tiny model, train it to count, evaluate before and after")
    sp.add_argument("--out", default="runs/demo", help="where the model and the run go")
    sp.add_argument(
        "--task",
        choices=sorted(DEMO_CONFIGS),
        default="counting",
        help="counting: a VLM learns to count; counting_hard: to count one named kind among others; tools: "
        "a model learns to use a calculator (multi-turn); text_math: a text-only model learns addition",
    )
    sp.add_argument("--config", default=None, help="default: the task's config under examples/")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.add_argument(
        "--processes",
        default="auto",
        help="GRPO on this many local processes, data parallel (auto: one per CPU core, at most 2; 1 on "
        "a GPU; 1 trains in this process)",
    )
    sp.add_argument("--no-progress", action="store_true")
    with_threads(sp)
    sp.set_defaults(fn=cmd_demo)
    return p


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the line that says what was kept (``main`` prints it and exits 130)."""


def main(argv: list[str] | None = None) -> int:
    """Run one command. An input error prints one line (``mmgrpo: error: ...``) and exits 2; Ctrl-C outside
    training's own handling prints one line (what was kept) and exits 130; ``--debug`` (anywhere on the
    command line) or MMGRPO_DEBUG=1 shows the traceback instead."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MMGRPO_DEBUG") == "1"
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        return args.fn(args)
    except MmgrpoError as exc:
        if debug:
            raise
        print(f"mmgrpo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if debug:
            raise
        line = str(exc) if isinstance(exc, _Interrupted) else "mmgrpo: interrupted; nothing saved"
        print(f"\n{line}", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
