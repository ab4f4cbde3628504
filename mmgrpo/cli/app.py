"""The ``mmgrpo`` command line: the parser (:func:`build_parser`) and :func:`main`, which runs one
subcommand (from :mod:`mmgrpo.cli.commands` and :mod:`mmgrpo.cli.demo`) and turns an input error or a
Ctrl-C into one line.
"""

from __future__ import annotations

import argparse
import sys

from mmgrpo.cli.commands import (
    LATEST,
    Interrupted,
    cmd_config_reference,
    cmd_eval,
    cmd_list,
    cmd_plot,
    cmd_probe,
    cmd_sft,
    cmd_tiny_model,
    cmd_train,
    library_bars_off,
)
from mmgrpo.cli.demo import DEMO_CONFIGS, cmd_demo
from mmgrpo.cli.vllm_env import cmd_vllm_env
from mmgrpo.errors import MmgrpoError


def version() -> str:
    """The installed distribution's version (``mmgrpo.__version__`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("mmgrpo")
    except PackageNotFoundError:
        from mmgrpo import __version__

        return __version__


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

    sp = sub.add_parser(
        "eval", help="mean score and success rate on held-out episodes; writes eval.json next to the model"
    )
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

    sp = sub.add_parser("vllm-env", help="make (once) or check the environment rollout.engine=vllm runs vLLM in")
    sp.add_argument("--path", default=None, help="the venv folder (default: $MMGRPO_VLLM_VENV or ~/.cache/mmgrpo/vllm)")
    sp.add_argument("--check", action="store_true", help="only check an existing one; make nothing")
    sp.set_defaults(fn=cmd_vllm_env)

    sp = sub.add_parser("config-reference", help="every config key with its type, default and meaning")
    sp.add_argument("--markdown", action="store_true", help="as the markdown table of docs/config.md")
    sp.set_defaults(fn=cmd_config_reference)

    sp = sub.add_parser("tiny-model", help="build the tiny offline Qwen2.5-VL")
    sp.add_argument("out_dir")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--text-only", action="store_true", help="a tiny Qwen2 causal LM instead (no vision)")
    sp.add_argument(
        "--sees",
        action="store_true",
        help="a model that sees: the shipped result of its perception pretraining (each cell's colour and "
        "shape; no RL task's questions), or the pretraining itself for other seeds",
    )
    sp.add_argument(
        "--pretrain",
        action="store_true",
        help="with --sees: run the perception pretraining here (20-30 s) instead of taking the shipped "
        "weights, which it reproduces bit for bit",
    )
    sp.add_argument(
        "--marks",
        action="store_true",
        help="with --sees: then teach it which cells hold a kind named before the image (about a minute; "
        "what counting_hard needs)",
    )
    sp.set_defaults(fn=cmd_tiny_model)

    sp = sub.add_parser("demo", help="build the tiny model, train it to count, evaluate before and after")
    sp.add_argument("--out", default="runs/demo", help="where the model and the run go")
    sp.add_argument(
        "--task",
        choices=sorted(DEMO_CONFIGS),
        default="counting",
        help="counting: a VLM learns to count; counting_hard: to count one named kind among others; tools: "
        "a model learns to use a calculator (multi-turn); tools_lookup: to look a price up over HTTP, then "
        "multiply (two tools, a cost per call); text_math: a text-only model learns addition; "
        "frozenlake: a text-only model learns to cross a FrozenLake map it has not seen (the bare grid)",
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


def main(argv: list[str] | None = None) -> int:
    """Run one command. An input error prints one line (``mmgrpo: error: ...``) and exits 2; Ctrl-C outside
    training's own handling prints one line (what was kept) and exits 130; ``--debug`` (anywhere on the
    command line) or MMGRPO_DEBUG=1 shows the traceback instead."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MMGRPO_DEBUG") == "1"
    parser = build_parser()
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    if extra:
        pairs = [a for a in extra if "=" in a and not a.startswith("-")]
        hint = (
            f"; --set takes one KEY=VALUE each: write --set {' --set '.join(pairs)}"
            if pairs and "--set" in argv
            else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if hasattr(args, "no_progress") or args.command == "tiny-model":
        from mmgrpo.train.progress import bars_wanted

        if not bars_wanted(True):  # stderr not a terminal: no \r frames in the log (mmgrpo.train.progress)
            args.progress_lines = not getattr(args, "no_progress", True)  # GRPO: a whole line now and then
            args.no_progress = True
    if getattr(args, "no_progress", False):
        library_bars_off()
    try:
        code = args.fn(args)
    except MmgrpoError as exc:
        if debug:
            raise
        from mmgrpo.train.distributed import said_by_main_only, tell_launcher

        tell_launcher(f"mmgrpo: error: {exc}")  # torchrun's summary names it as the root cause
        if not said_by_main_only(exc):  # under accelerate launch: once, not once per process
            print(f"mmgrpo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if debug:
            raise
        line = str(exc) if isinstance(exc, Interrupted) else "mmgrpo: interrupted; nothing saved"
        print(f"\n{line}", file=sys.stderr, flush=True)
        return 130
    if code == 0 and "torch.distributed" in sys.modules:  # a process of `accelerate launch`: leave its group
        from mmgrpo.train.distributed import leave_process_group

        leave_process_group(code)  # in a launched process: exits here
    return code


if __name__ == "__main__":
    sys.exit(main())
