"""The ``mmgrpo`` subcommands other than the demo: train, sft, eval, probe, plot, list, config-reference
and tiny-model, with what they share: a failed write as one line (:func:`write_error`), a Ctrl-C that says
what was kept (:class:`Interrupted`) and the demo's pictures (:func:`write_pictures`).

Uses only the public pieces (config, registry, Policy, Trainer, evaluate); every subcommand is a few
lines over them so that a script can do the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmgrpo.errors import DataError, MmgrpoError
from mmgrpo.train.run_folder import RUN_FILES, claim_output_dir, write_error  # noqa: F401  (used here too)
from mmgrpo.train.run_lock import is_launch_main_process
from mmgrpo.train.threads import set_cpu_threads


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmgrpo.tiny.vlm import TinyModelSpec, build_tiny_model

    out_dir = Path(args.out_dir)
    if args.marks and not args.sees:
        raise MmgrpoError("--marks teaches a model that sees which cells hold a kind: give --sees too")
    if args.pretrain and not args.sees:
        raise MmgrpoError("--pretrain runs the perception pretraining of --sees: give both, or neither")
    if args.sees and args.text_only:
        raise MmgrpoError(
            "--sees pretrains a vision model's perception; --text-only builds one without vision"
        )
    if out_dir.exists() and not out_dir.is_dir():  # said before the seconds of building
        raise MmgrpoError(f"'{out_dir}' is a file, not a folder: give a new folder path for the tiny model")
    try:
        if args.text_only:
            from mmgrpo.tiny.text import build_tiny_text_model

            out = build_tiny_text_model(out_dir, seed=args.seed)
        else:
            spec = TinyModelSpec(seed=args.seed)
            out = build_tiny_model(out_dir, spec, sees=args.sees, pretrain=args.pretrain, marks=args.marks)
    except OSError as exc:  # nothing is left half-written: the model was built in OUT_DIR.partial
        raise write_error("the tiny model", out_dir, exc) from exc
    except KeyboardInterrupt:  # save_whole removed OUT_DIR.partial; OUT_DIR is as it was
        before = "left as it was" if out_dir.exists() else "not created"
        raise Interrupted(
            f"mmgrpo: interrupted while building the tiny model; nothing saved ({out_dir} {before}, the "
            f"partial folder {out_dir}.partial removed)"
        ) from None
    try:
        return tiny_model_summary(args, out)
    except KeyboardInterrupt:  # the model is complete on disk: say so ("nothing saved" before)
        raise Interrupted(f"mmgrpo: interrupted; the tiny model is complete and saved in {out}") from None


def tiny_model_summary(args: argparse.Namespace, out: Path) -> int:
    """The lines ``mmgrpo tiny-model`` prints about the model it saved to ``out`` (and its curves)."""
    from mmgrpo.tiny.vlm import count_parameters

    if args.text_only:
        from transformers import AutoModelForCausalLM

        n = count_parameters(AutoModelForCausalLM.from_pretrained(out))
        print(f"tiny Qwen2 causal LM ({n / 1e6:.2f}M parameters, text only) saved to {out}")
        return 0
    from transformers import AutoModelForImageTextToText

    n = count_parameters(AutoModelForImageTextToText.from_pretrained(out))
    print(f"tiny Qwen2.5-VL ({n / 1e6:.2f}M parameters) saved to {out}")
    if args.sees:
        print(f"perception pretraining: {perception_summary(out)}")
    if args.marks:
        print(f"marking pretraining: {marks_summary(out)}")
    return 0


PERCEPTION_KEYS = ("object_acc", "color_acc", "shape_acc", "empty_acc", "loss")


def perception_summary(model_dir: Path) -> str:
    """Draw ``model_dir/perception.png`` from the pretraining's curve and say what it reached, in one line."""
    from mmgrpo.train.plots import plot_metrics

    done = json.loads((model_dir / "perception.json").read_text())
    check, spec = done["check"], done["spec"]
    picture = plot_metrics(
        model_dir / "perception.jsonl",
        model_dir / "perception.png",
        keys=PERCEPTION_KEYS,
        header=f"perception pretraining of the tiny VLM  ·  held-out cells every {spec['log_every']} steps",
    )
    how = (
        f"shipped weights of {spec['steps']} steps (run here with --pretrain: {done['seconds']:.0f} s)"
        if done.get("shipped")
        else f"{spec['steps']} steps in {done['seconds']:.0f} s"
    )
    return (
        f"{how}; held-out cells named right: {check['object_acc']:.2f} "
        f"(colour {check['color_acc']:.2f}, shape {check['shape_acc']:.2f}), empty {check['empty_acc']:.2f}; "
        f"curve {picture}"
    )


def marks_summary(model_dir: Path) -> str:
    """Draw ``model_dir/marks.png`` from the marking pretraining's curve and say what it reached."""
    from mmgrpo.train.plots import plot_metrics

    done = json.loads((model_dir / "marks.json").read_text())
    check, spec = done["check"], done["spec"]
    picture = plot_metrics(
        model_dir / "marks.jsonl",
        model_dir / "marks.png",
        keys=("mark_acc", "board_acc", "object_acc", "loss"),
        header=f"marking pretraining (layer {spec['layer']})  ·  held-out boards every {spec['log_every']} steps",
    )
    return (
        f"{spec['steps']} steps in {done['seconds']:.0f} s; held-out cells marked right {check['mark_acc']:.3f} "
        f"(whole boards {check['board_acc']:.2f}), still named right {check['object_acc']:.2f}; curve {picture}"
    )


def library_bars_off() -> None:
    """``--no-progress`` covers the libraries' bars too: transformers' "Loading weights" / "Writing model
    shards" and the hub's downloads (each printed one per load or save of a checkpoint)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cmd_config_reference(args: argparse.Namespace) -> int:
    from mmgrpo.config.core import config_reference

    print(config_reference(markdown=args.markdown))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from mmgrpo.registry import describe

    print(describe())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``mmgrpo train``: :func:`mmgrpo.run` (the same recipe as Python's), its outcome said in a line."""
    from mmgrpo.train.callbacks import TrainingStopped, WarmStartInterrupted
    from mmgrpo.train.progress import ProgressLines
    from mmgrpo.train.recipe import LATEST, run

    resume = args.resume if args.resume != LATEST else True
    try:
        result = run(
            args.config,
            args.set,
            resume=resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            threads=args.threads,
            callbacks=[ProgressLines()] if getattr(args, "progress_lines", False) else (),
            _cli=True,
        )
    except WarmStartInterrupted:  # the recipe kept the model so far and said where
        return 130
    except TrainingStopped as stop:
        if is_launch_main_process():
            again = " ".join(["mmgrpo train", args.config, *(f"--set {s}" for s in args.set), "--resume"])
            print(
                f"\nmmgrpo: stopped after step {stop.step} of {stop.steps}; checkpoint in {stop.path}; continue with: "
                f"{again}",
                file=sys.stderr,
                flush=True,
            )
        return 128 + stop.signum
    trainer = result.trainer
    if trainer.is_main:
        last = result.metrics.get("reward", float("nan"))
        print(
            f"train: {trainer.cfg.grpo.steps} steps, last reward {last:.3f}; model saved to {trainer.out / 'final'}"
        )
    return 0


LATEST = "latest"


def cmd_sft(args: argparse.Namespace) -> int:
    import shlex

    from mmgrpo.config.core import load_config
    from mmgrpo.train.run_lock import RunLock
    from mmgrpo.train.sft import SftInterrupted, run_sft

    cfg = load_config(args.config, args.set)
    out = Path(cfg.output_dir)
    with RunLock(out, "mmgrpo sft"):
        # like train: an earlier run's final/ is not replaced unless --overwrite
        claim_output_dir(out, overwrite=args.overwrite, resume=False)
        set_cpu_threads(args.threads)
        try:
            summary = run_sft(cfg, progress=not args.no_progress)
        except SftInterrupted as stop:  # the model so far was saved: say where
            raise Interrupted(f"mmgrpo: {stop} (use it as model.path)") from None
        except KeyboardInterrupt:  # before the first step: nothing trained
            metrics = out / "metrics.jsonl"
            so_far = f"; its metrics so far are in {metrics}" if metrics.exists() else ""
            raise Interrupted(f"mmgrpo: sft interrupted before its first step; no model saved{so_far}") from None
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
    from mmgrpo.rollout.answers import answer_table_lines
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
    if result.answers:
        print("  answers given (the true answer: the model's answers, most given first):")
        for line in answer_table_lines(result.answers):
            print(f"    {line}")
    print(f"score: {result.score:.3f} (mean of {result.metric})")
    print(f"success: {result.success:.3f} ({result.success_rule})")
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
        raise write_error("the learning curves", out, exc) from exc
    print(f"wrote {path}")
    return 0


def write_pictures(trainer, result, run_dir: Path) -> list[Path]:
    """Learning curves (a run of at least one GRPO step), and what the model saw and said on the first
    held-out episodes."""
    from mmgrpo.env import message_images
    from mmgrpo.train.plots import answer_grid, plot_metrics, sample_grid

    paths = (
        [plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png")] if trainer.cfg.grpo.steps else []
    )
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
    if result.answers:
        paths.append(answer_grid(result.answers, run_dir / "answers.png", "held-out answers after GRPO"))
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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the line that says what was kept (``main`` prints it and exits 130)."""
