"""The tools demo's GRPO phase, timed on one or more checkouts of mmgrpo from the same warm-started model.

    python benchmarks/tools_phase.py                                   # this checkout, 60 steps, 2 rounds
    git worktree add OLD 48bbbf8                   # OLD: any empty folder, outside this checkout
    python benchmarks/tools_phase.py --checkout OLD --checkout .                   # old against new
    python benchmarks/tools_phase.py --steps 5 --rounds 1                          # a smoke test

What is timed: ``--steps`` calls of ``Trainer.train_step()`` on ``examples/tools_math_tiny.yaml`` (8 tasks x
G=8, up to 3 turns with the calculator, beta 0.02), one process with one thread, the warm start skipped
(``warm_start.steps=0``) and the model taken from one checkpoint that every run shares: the warm start of
that config, run once by ``--warm-checkout`` (default: this one) and kept in the work folder. Each run is a fresh subprocess
that imports mmgrpo from its checkout (``PYTHONPATH``) and reads that checkout's own copy of the config;
runs alternate between checkouts (A, B, A, B, ...) so that the machine's noise hits them alike. Printed per
checkout: the phase's seconds (the sum of the step times) for each round, their median, the rewards of the
last 10 steps, and the ratio of each checkout's median to the first one's, as
``tools_phase: <checkout> seconds=<s> speedup_vs_first=<x>`` lines. Each round also prints its process's
CPU time over its wall time and the machine's load average, with a warning when something else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET_LOAD = 1.3
"""The 1-minute load average above which a round is said to be disturbed: the worker alone gives about
1.0. Another process on the other core slows the worker too (shared caches and memory bandwidth): on a
2-core machine the tools phase on 31c08d1 took 77.8-80.1 s beside a profiler and 69.1 s alone."""
CONFIG = Path("examples") / "tools_math_tiny.yaml"

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[4])
from multiturn import bind_plugins  # mmgrpo.envs and .verifiers from the same checkout as mmgrpo
files = bind_plugins()
from mmgrpo import Trainer, load_config  # the public API: the same on old checkouts
config, sets, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
trainer = Trainer(load_config(config, sets), progress=False)
times, cpu, rewards = [], [], []
for _ in range(steps):
    t0, c0 = time.perf_counter(), time.process_time()
    record = trainer.train_step()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    rewards.append(float(record["reward"]))
print("RESULT " + json.dumps({"times": times, "cpu": cpu, "rewards": rewards, **files}))
"""


def env_for(checkout: Path) -> dict[str, str]:
    """One thread, mmgrpo imported from ``checkout``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
    )
    return env


def warm_start(checkout: Path, work: Path) -> Path:
    """The config's warm start, run once with ``checkout``'s mmgrpo; its saved model (reused when there)."""
    model = work / "warm" / "final"
    if (model / "config.json").is_file():
        return model
    tiny = work / "tiny-model"
    run = [sys.executable, "-m", "mmgrpo"]
    env = env_for(checkout)
    if not (tiny / "config.json").is_file():
        subprocess.run([*run, "tiny-model", str(tiny)], env=env, check=True, cwd=work)
    sets = [f"model.path={tiny}", f"output_dir={work / 'warm'}", "grpo.steps=0"]
    cmd = [*run, "train", str(checkout / CONFIG), "--threads", "1", "--overwrite", "--no-progress"]
    cmd += [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, env=env, check=True, cwd=work)
    return model


def time_phase(checkout: Path, model: Path, out: Path, steps: int, seed: int) -> dict:
    """One fresh process on ``checkout``: ``steps`` GRPO steps from ``model``; their times and rewards."""
    sets = [
        f"model.path={model}",
        f"output_dir={out}",
        "warm_start.steps=0",
        f"grpo.steps={steps}",
        f"seed={seed}",
    ]
    cmd = [
        sys.executable,
        "-c",
        WORKER,
        str(checkout / CONFIG),
        json.dumps(sets),
        str(steps),
        str(ROOT / "benchmarks"),
    ]
    res = subprocess.run(cmd, env=env_for(checkout), capture_output=True, text=True, cwd=out.parent)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode or not lines:
        raise SystemExit(f"tools_phase: the run on {checkout} failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, action="append", help="a source tree of mmgrpo (repeatable)")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps per run (the demo's 60)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-checkout", type=Path, default=ROOT, help="the checkout whose warm start is run")
    ap.add_argument("--work", type=Path, help="keep the tiny model, the warm start and the runs here")
    args = ap.parse_args(argv)
    checkouts = [c.resolve() for c in (args.checkout or [ROOT])]
    work = (args.work or Path(tempfile.mkdtemp(prefix="tools_phase_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = warm_start(args.warm_checkout.resolve(), work)
    seconds: dict[Path, list[float]] = {c: [] for c in checkouts}
    rewards: dict[Path, list[float]] = {c: [] for c in checkouts}
    for r in range(args.rounds):
        for i, c in enumerate(checkouts):
            res = time_phase(c, model, work / f"run-{i}-r{r}", args.steps, args.seed)
            seconds[c].append(sum(res["times"]))
            rewards[c] = res["rewards"]
            load = os.getloadavg()[0]  # one busy worker: about 1.0 on an otherwise idle machine
            busy = sum(res.get("cpu", [])) / max(seconds[c][-1], 1e-9)  # < 1: the worker waited for a core
            print(
                f"round {r + 1}/{args.rounds} {c} (mmgrpo {res['mmgrpo']}, envs {res['envs']}): "
                f"{seconds[c][-1]:.1f} s (cpu/wall {busy:.2f}, load {load:.2f})",
                flush=True,
            )
            if load > QUIET_LOAD:
                print(f"tools_phase: warning: load {load:.2f} > {QUIET_LOAD}: something else ran; the times "
                      "are not comparable with a quiet machine's", flush=True)
    first = statistics.median(seconds[checkouts[0]])
    for c in checkouts:
        med = statistics.median(seconds[c])
        tail = rewards[c][-10:]
        print(
            f"{c}: {args.steps} steps in {', '.join(f'{s:.1f}' for s in seconds[c])} s (median {med:.1f}); "
            f"reward of the last {len(tail)} steps {statistics.mean(tail):.3f}"
        )
    for c in checkouts:
        med = statistics.median(seconds[c])
        print(f"tools_phase: {c.name} seconds={med:.1f} speedup_vs_first={first / med:.2f}")


if __name__ == "__main__":
    main()
