"""``mmgrpo demo``: build a tiny model, warm-start it, train it with GRPO and evaluate it before and after
(the tasks in :data:`DEMO_CONFIGS`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mmgrpo.cli.commands import Interrupted, marks_summary, perception_summary, write_error, write_pictures
from mmgrpo.errors import MmgrpoError
from mmgrpo.train.threads import set_cpu_threads

DEMO_CONFIGS = {
    "counting": "examples/counting_tiny.yaml",  # the tiny VLM learns to count red circles
    "counting_hard": "examples/counting_hard.yaml",  # ... the named kind among several, with distractors
    "tools": "examples/tools_math_tiny.yaml",  # the tiny model learns to use a calculator
    "tools_lookup": "examples/tools_lookup_tiny.yaml",  # ... to look a price up over HTTP, then multiply
    "text_math": "examples/text_math_tiny.yaml",  # the tiny text-only model learns addition
    "zoom": "examples/tools_zoom_tiny.yaml",  # the tiny VLM learns to count dots in the cell it zooms on
    "frozenlake": "examples/frozenlake_bare_tiny.yaml",  # the tiny text model walks round the holes, no hint
}
TEXT_ONLY_DEMOS = {"text_math", "frozenlake"}  # built on the tiny text-only causal LM, not the tiny VLM
# on the tiny VLM after its perception pretraining (tiny-model --sees)
SEEING_DEMOS = {"counting", "counting_hard", "zoom"}
MARKING_DEMOS = {"counting_hard"}  # ... and then taught which cells hold a kind named before the image
DEMO_CONFIG = DEMO_CONFIGS["counting"]


def _find_demo_config(task: str = "counting") -> Path:
    name = DEMO_CONFIGS[task]
    here = Path(__file__).resolve().parents[2]  # the checkout: mmgrpo/cli/demo.py -> .
    for candidate in (Path.cwd() / name, here / name):
        if candidate.is_file():
            return candidate
    raise MmgrpoError(
        f"cannot find {name} (looked in {Path.cwd()} and {here}); run the demo from the mmgrpo "
        "checkout or pass --config PATH"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    import contextlib

    from mmgrpo.train.run_lock import RunLock

    out = Path(args.out)
    with RunLock(out, "mmgrpo demo", what="--out"), contextlib.ExitStack() as locks:
        try:
            return _demo(args, out, locks)
        except KeyboardInterrupt:
            raise Interrupted(_demo_kept(out)) from None


def _demo_kept(out: Path) -> str:
    """The line for a demo stopped by Ctrl-C: which of its models are on disk (each is saved whole)."""
    from mmgrpo.tiny.vlm import is_model_dir

    models = (("tiny-model", "the tiny model"), ("tiny-model-sees", "the tiny model that sees"))
    models += (("tiny-text-model", "the tiny text model"),)
    models += (("warm-started", "the warm-started model"),)
    kept = [f"{what} in {out / name}" for name, what in models if is_model_dir(out / name)]
    if not kept:
        return "mmgrpo: demo interrupted; nothing saved"
    return f"mmgrpo: demo interrupted; the run is not saved; kept {' and '.join(kept)} (a new demo reuses it)"


def _demo(args: argparse.Namespace, out: Path, locks) -> int:
    """``mmgrpo demo`` with the lock of ``--out`` held; ``locks`` (an ExitStack) takes the run folder's."""
    from mmgrpo.cli.processes import choose_processes, launch
    from mmgrpo.config.core import load_config
    from mmgrpo.tiny.vlm import build_tiny_model, is_model_dir
    from mmgrpo.train.run_folder import claim_output_dir
    from mmgrpo.train.run_lock import RunLock
    from mmgrpo.train.trainer import Trainer, load_policy

    t0 = time.perf_counter()
    set_cpu_threads(args.threads)
    text_only = args.task in TEXT_ONLY_DEMOS and not args.config
    sees = args.task in SEEING_DEMOS and not args.config
    marks = sees and args.task in MARKING_DEMOS
    name = "tiny-text-model" if text_only else "tiny-model-marks" if marks else "tiny-model-sees" if sees else "tiny-model"
    model_dir = out / name
    if not is_model_dir(model_dir):
        try:
            if text_only:
                from mmgrpo.tiny.text import build_tiny_text_model

                build_tiny_text_model(model_dir)
            else:
                build_tiny_model(model_dir, sees=sees, marks=marks)
        except OSError as exc:
            raise write_error("the tiny model", model_dir, exc) from exc
        what = "text-only Qwen2" if text_only else "Qwen2.5-VL"
        print(f"demo: built the tiny {what} in {model_dir}", flush=True)
        if sees:
            print(f"demo: perception pretraining: {perception_summary(model_dir)}", flush=True)
        if marks:
            print(f"demo: marking pretraining: {marks_summary(model_dir)}", flush=True)
    config = Path(args.config) if args.config else _find_demo_config(args.task)
    overrides = [f"model.path={model_dir}", f"output_dir={out / 'run'}", *args.set]
    cfg = load_config(config, overrides)
    run_dir = Path(cfg.output_dir)
    if run_dir.resolve() != out.resolve():  # the run's folder is locked too (it may be outside --out)
        locks.enter_context(RunLock(run_dir, "mmgrpo demo"))
    claim_output_dir(run_dir, overwrite=True)  # a fresh demo run: the last demo's run files go
    trainer = Trainer(cfg, progress=not args.no_progress)
    processes = choose_processes(args.processes, str(trainer.policy.device))
    if cfg.rollout.engine == "vllm" and args.processes == "auto":
        processes = 1  # the vLLM engine's process takes the other core
    _threads_for_alone_stages(args.threads, processes)
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
    t_grpo = time.perf_counter()
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
    grpo_seconds = time.perf_counter() - t_grpo  # with the processes' start and the final save
    after = trainer.evaluate()
    summary = {
        "base": base.accuracy,
        "before": before.accuracy,
        "after": after.accuracy,
        "n": n,
        "processes": processes,
        "seconds": time.perf_counter() - t0,
        "grpo_seconds": grpo_seconds,
        "tool_use_before": before.episode_metrics,
        "tool_use_after": after.episode_metrics,
        "answers_before": before.answers,
        "answers_after": after.answers,
    }
    (run_dir / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    from mmgrpo.rollout.answers import answer_table_lines
    from mmgrpo.rollout.evaluation import write_transcripts

    pictures = write_pictures(trainer, after, run_dir)
    print("demo: pictures " + ", ".join(str(p) for p in pictures), flush=True)
    if after.answers:  # tasks with a few short answers: which ones the model gives, per true answer
        print("demo: held-out answers after GRPO (the true answer: the model's, most given first)")
        for line in answer_table_lines(after.answers):
            print(f"demo:   {line}", flush=True)
    if (folder := write_transcripts(after, run_dir)) is not None:
        print(f"demo: held-out transcripts in {folder}" + _tool_use(after), flush=True)
    print(
        f"demo: {cfg.grpo.steps} GRPO steps in {grpo_seconds:.0f} s, the whole demo in {summary['seconds']:.0f} s "
        f"(model, warm start, evaluations); run directory {run_dir}",
        flush=True,
    )
    print(f"demo: accuracy before={before.accuracy:.3f} after={after.accuracy:.3f} (n={n})", flush=True)
    return 0


def _threads_for_alone_stages(requested: int | None, processes: int) -> None:
    """The stages this process runs alone (the warm start, the evaluations) use the cores that GRPO's
    ``processes`` will use, one thread each: measured on 2 idle cores, the zoom demo's warm-start steps ran
    about 25% faster on 2 threads than on 1. Only when neither ``--threads`` nor OMP_NUM_THREADS says
    otherwise."""
    import torch

    from mmgrpo.train.threads import cpu_cores, user_set_threads

    if processes < 2 or user_set_threads(requested) or torch.cuda.is_available():
        return
    n = min(processes, cpu_cores())
    if n > torch.get_num_threads():
        torch.set_num_threads(n)
        said = f"demo: warm start and evaluations on {n} threads (the cores of GRPO's {processes} processes)"
        print(said, flush=True)


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
