"""Where the time of one counting-demo step goes: phases and the heaviest operators (torch.profiler).

    python benchmarks/profile_step.py [--steps 3] [--threads 1] [--top 15] [--set grpo.group_size=16 ...]

Builds the tiny Qwen2.5-VL in a temporary folder, runs the demo's warm start briefly (so that completions
look like the demo's), two unmeasured GRPO steps, then profiles ``--steps`` steps of
``examples/counting_tiny.yaml`` (16 tasks x G = 8, 8 new tokens, the encoder trained at vision_lr).

Prints milliseconds per step for each phase (scene drawing and prompt processing, the vision encoder,
generation, the reference pass, the policy's forward and backward, the optimizer) and the operators with
the most self time. Threads are pinned (default 1): on a busy 2-core machine two threads make step
times bimodal.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]

PHASES = [
    ("rollout (all of it)", "mmgrpo.train.trainer.Trainer.collect"),
    ("  scenes: env resets", "mmgrpo.rollout.episodes.reset_group"),
    ("  prompts: template + processor", "mmgrpo.model.policy.Policy.encode_prompts"),
    ("  generation (prefill + decode)", "mmgrpo.model.engine.generate"),
    ("update (all of it)", "mmgrpo.train.trainer.Trainer.update"),
    ("  reference pass", "reference"),
    ("  policy forward", "policy_forward"),
    ("  backward", "backward"),
    ("  optimizer step", "optimizer"),
]


def _label(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` so that each call shows in the profile as ``label``."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def instrument(trainer) -> None:
    """Label the phases of a step (the code is unchanged; its functions are wrapped)."""
    import mmgrpo.model.engine
    import mmgrpo.rollout.episodes
    import mmgrpo.train.trainer

    _label(mmgrpo.train.trainer.Trainer, "collect", "mmgrpo.train.trainer.Trainer.collect")
    _label(mmgrpo.train.trainer.Trainer, "update", "mmgrpo.train.trainer.Trainer.update")
    _label(mmgrpo.rollout.episodes, "reset_group", "mmgrpo.rollout.episodes.reset_group")
    _label(mmgrpo.model.engine, "generate", "mmgrpo.model.engine.generate")
    _label(type(trainer.policy), "encode_prompts", "mmgrpo.model.policy.Policy.encode_prompts")
    policy = trainer.policy
    logprobs = policy.logprobs

    def labelled_logprobs(batch, **kw):
        with record_function("reference" if kw.get("reference") else "policy_forward"):
            return logprobs(batch, **kw)

    policy.logprobs = labelled_logprobs
    acc = trainer.accelerator
    backward = acc.backward

    def labelled_backward(loss, **kw):
        with record_function("backward"):
            return backward(loss, **kw)

    acc.backward = labelled_backward
    _label(trainer.optimizer, "step", "optimizer")


def phase_table(prof, steps: int, wall: float) -> list[str]:
    """Milliseconds per step of each labelled phase."""
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        totals[evt.key] = evt.cpu_time_total / 1000.0  # ms over all steps
    lines = [f"{'phase':34s} {'ms/step':>9s} {'share':>7s}"]
    per_step = wall * 1000.0 / steps
    lines.append(f"{'whole step (wall clock)':34s} {per_step:9.1f} {100.0:6.1f}%")
    for title, key in PHASES:
        ms = totals.get(key, 0.0) / steps
        lines.append(f"{title:34s} {ms:9.1f} {100.0 * ms / per_step:6.1f}%")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. grpo.group_size=16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mmgrpo.config.core import load_config
    from mmgrpo.tiny.vlm import build_tiny_model
    from mmgrpo.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-model")
        sets = [f"model.path={model}", f"output_dir={Path(tmp) / 'run'}", "warm_start.steps=30", *args.set]
        trainer = Trainer(load_config(ROOT / "examples" / "counting_tiny.yaml", sets), progress=False)
        trainer.warm_start()
        for _ in range(2):
            trainer.train_step()
        instrument(trainer)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            wall = time.perf_counter() - t0
    extra = f" with {' '.join(args.set)}" if args.set else ""
    print(f"profile: {args.steps} steps of examples/counting_tiny.yaml{extra}, {args.threads} thread(s)")
    print("\n".join(phase_table(prof, args.steps, wall)))
    print()
    print(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50)
    )


if __name__ == "__main__":
    main()
