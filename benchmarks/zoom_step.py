"""The zoom agent's GRPO step (examples/tools_zoom_tiny.yaml, 8 tasks x G=8) in two checkouts, side by side.

    python benchmarks/zoom_step.py --work runs/zoom_step --baseline /path/to/other/checkout
    python benchmarks/zoom_step.py --work runs/zoom_step --baseline DIR --model runs/tools_zoom_tiny/final

The step of ``mmgrpo demo --task zoom`` as it is: the real ``Trainer`` on the ``zoom_count`` env and the
demo's config (its verifiers, max_new_tokens, beta 0, 3 turns, the question alone for half the tasks
while ``bare_steps`` lasts), only ``grpo.tasks_per_step`` set to 8 and the warm start off. The model:
``--model DIR``, or by default the demo's warm start (``mmgrpo tiny-model --sees``, then ``mmgrpo train``
with ``grpo.steps=0``, both made once in ``--work``): a policy that calls the zoom tool and answers as
the demo's GRPO begins. ``--model`` with the demo's final model measures a late step, where most groups
have all-equal rewards.

Every run is a fresh subprocess with one thread that imports mmgrpo from the checkout it is given
(PYTHONPATH; this file's checkout is ``--candidate``, by default), trains ``--steps`` steps from the same
seed (the first one left out) and reports each step's rollout and training time; runs alternate
(baseline, candidate, baseline, ...) over ``--rounds`` rounds. Printed: medians per checkout and the
ratio candidate / baseline of the whole step, ``zoom_step: ratio=<x>``. Both checkouts sample the same
episodes where their samplers agree (each step's completion length is printed, to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/tools_zoom_tiny.yaml"
TAG = "ZOOM_STEP "


def worker(model: str, out: str, steps: int, seed: int) -> None:
    """One run: ``steps`` GRPO steps of the zoom demo's config on ``model``; prints one result line."""
    import torch

    torch.set_num_threads(1)
    import mmgrpo
    from mmgrpo.config import load_config
    from mmgrpo.train.trainer import Trainer

    root = Path(mmgrpo.__file__).resolve().parents[1]
    sets = [
        f"model.path={model}",
        f"output_dir={out}",
        f"seed={seed}",
        "grpo.tasks_per_step=8",
        "grpo.eval_every=0",
        "warm_start.steps=0",
        "warm_start.drill_bare_steps=0",
        "warm_start.drill_steps=0",
    ]
    trainer = Trainer(load_config(str(root / CONFIG), sets))
    records = [trainer.train_step() for _ in range(steps)]
    keys = ("rollout_time", "train_time", "step_time", "completion_len", "frac_zero_std_groups")
    rows = [{k: float(r.get(k, float("nan"))) for k in keys} for r in records]
    print(TAG + json.dumps({"mmgrpo": mmgrpo.__file__, "steps": rows}), flush=True)


def run_one(checkout: Path, model: Path, out: Path, steps: int, seed: int, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", str(model), str(out), str(steps), str(seed)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(checkout))
    line = next((x for x in done.stdout.splitlines() if x.startswith(TAG)), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"zoom_step: the {name} run failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len(TAG) :])


def warm_model(work: Path, candidate: Path) -> Path:
    """The demo's warm start, made once in ``work`` with the candidate checkout."""
    warm = work / "warm" / "final"
    if (warm / "config.json").is_file():
        return warm
    env = dict(os.environ, PYTHONPATH=str(candidate))
    sees = work / "tiny-model-sees"
    if not (sees / "config.json").is_file():
        cmd = [sys.executable, "-m", "mmgrpo", "tiny-model", str(sees), "--sees"]
        subprocess.run(cmd, env=env, check=True, cwd=str(candidate))
    cmd = [sys.executable, "-m", "mmgrpo", "train", CONFIG, "--threads", "1", "--no-progress"]
    cmd += ["--set", f"model.path={sees}", "--set", "grpo.steps=0", "--set", "grpo.bare_steps=0"]
    cmd += ["--set", f"output_dir={work / 'warm'}"]
    subprocess.run(cmd, env=env, check=True, cwd=str(candidate))
    return warm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="folder for the models and runs")
    ap.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with")
    ap.add_argument("--candidate", type=Path, default=ROOT, help="default: this file's checkout")
    ap.add_argument("--model", type=Path, help="the model to train (default: the demo's warm start)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is left out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    model = (args.model or warm_model(args.work, args.candidate)).resolve()
    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    for r in range(args.rounds):
        for name in ("baseline", "candidate"):
            checkout = args.baseline if name == "baseline" else args.candidate
            out = args.work / f"run_{name}_{r}"
            res = run_one(checkout.resolve(), model, out, args.steps, args.seed, name)
            runs[name].append(res)
            steps = res["steps"][1:]
            print(
                f"round {r} {name:9s} step {statistics.median(s['step_time'] for s in steps):.3f} s "
                f"(rollout {statistics.median(s['rollout_time'] for s in steps):.3f}, "
                f"train {statistics.median(s['train_time'] for s in steps):.3f}); "
                f"all-equal groups {statistics.mean(s['frac_zero_std_groups'] for s in steps):.2f}",
                flush=True,
            )
    med = {}
    for name, rs in runs.items():
        steps = [s for res in rs for s in res["steps"][1:]]
        med[name] = {
            k: statistics.median(s[k] for s in steps) for k in ("step_time", "rollout_time", "train_time")
        }
        print(f"{name}: {rs[0]['mmgrpo']}: " + ", ".join(f"{k} {v:.3f} s" for k, v in med[name].items()))
    for k in ("rollout_time", "train_time"):
        print(f"zoom_step: {k} ratio={med['candidate'][k] / med['baseline'][k]:.3f}")
    print(f"zoom_step: ratio={med['candidate']['step_time'] / med['baseline']['step_time']:.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(main())
