"""Episode-level vs turn-level credit (grpo.credit) on the bare FrozenLake, side by side (issue 55).

    python benchmarks/credit_frozenlake.py --work runs/credit                 # 3 seeds x (episode, gigpo)
    python benchmarks/credit_frozenlake.py --work runs/credit --steps 30      # ... on 30 GRPO steps each
    python benchmarks/credit_frozenlake.py --work runs/credit --plot-only     # draw what is there

Per seed: one warm start (examples/frozenlake_bare_tiny.yaml's, ``grpo.steps=0``) and its held-out success
(200 held-out maps), then from that same model GRPO with each credit scheme on the same budget (the
example's, which is ``mmgrpo demo --task frozenlake``'s, or ``--steps N``) and the held-out success after.
Every command is an ordinary ``mmgrpo train`` / ``mmgrpo eval`` with one thread, run one after another.
The picture: the sampled training reward per step (each seed thin, their mean thick) and the held-out
success before and after.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "frozenlake_bare_tiny.yaml"
COLOURS = {"episode": (70, 110, 200), "gigpo": (220, 110, 40), "discounted": (60, 160, 90)}


def mmgrpo(*args: str, log: Path) -> None:
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, "-m", "mmgrpo", *args, "--threads", "1", "--no-progress"],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed: see {log}")


def accuracy(log: Path) -> float | None:
    found = re.search(r"^accuracy: ([0-9.]+)", log.read_text(), re.M) if log.exists() else None
    return float(found.group(1)) if found else None


def run(work: Path, seeds: list[int], schemes: list[str], steps: list[str]) -> None:
    """``steps``: ``["--set", "grpo.steps=N"]`` or nothing (the example's)."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-text-model"
    if not model.exists():
        mmgrpo("tiny-model", "--text-only", str(model), log=work / "tiny.log")
    for s in seeds:
        warm = work / f"warm{s}"
        if not (warm / "final").exists():
            mmgrpo(
                "train",
                str(CONFIG),
                "--set",
                f"model.path={model}",
                "--set",
                f"seed={s}",
                "--set",
                "grpo.steps=0",
                "--set",
                f"output_dir={warm}",
                log=work / f"warm{s}.log",
            )
        if accuracy(work / f"eval_warm{s}.log") is None:
            mmgrpo(
                "eval",
                str(CONFIG),
                "--model",
                str(warm / "final"),
                "--set",
                f"seed={s}",
                log=work / f"eval_warm{s}.log",
            )
        for c in schemes:
            out = work / f"{c}{s}"
            if not (out / "final").exists():
                mmgrpo(
                    "train",
                    str(CONFIG),
                    "--set",
                    f"model.path={warm / 'final'}",
                    "--set",
                    "warm_start.steps=0",
                    "--set",
                    f"seed={s}",
                    "--set",
                    f"grpo.credit={c}",
                    *steps,
                    "--set",
                    f"output_dir={out}",
                    log=work / f"{c}{s}.log",
                )
            if accuracy(work / f"eval_{c}{s}.log") is None:
                mmgrpo(
                    "eval",
                    str(CONFIG),
                    "--model",
                    str(out / "final"),
                    "--set",
                    f"seed={s}",
                    log=work / f"eval_{c}{s}.log",
                )


def results(work: Path, seeds: list[int], schemes: list[str]) -> dict:
    """{"warm": {seed: acc}, scheme: {seed: (acc, [reward per step], {step: held-out success})}} for what
    is there (the held-out success during training: grpo.eval_every, grpo.eval_episodes maps)."""
    out: dict = {"warm": {s: accuracy(work / f"eval_warm{s}.log") for s in seeds}}
    for c in schemes:
        out[c] = {}
        for s in seeds:
            path = work / f"{c}{s}" / "metrics.jsonl"
            if path.exists():
                rows = [json.loads(x) for x in path.read_text().splitlines()]
                rewards = [r["reward"] for r in rows if "stage" not in r and "reward" in r]
                evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
                out[c][s] = (accuracy(work / f"eval_{c}{s}.log"), rewards, evals)
    return out


def budget(steps: list[str]) -> str:
    """The GRPO budget, as the picture's title states it."""
    from mmgrpo.config.core import load_config

    g = load_config(CONFIG, steps[1:]).grpo
    return f"{g.steps} GRPO steps of {g.tasks_per_step} maps x G={g.group_size}"


def draw(res: dict, schemes: list[str], out: Path, steps: list[str]) -> Path:
    W, H, pad = 1400, 560, 70
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text(
        (pad, 15),
        f"bare FrozenLake 4x4, tiny text model: episode-level vs turn-level credit (same warm start, {budget(steps)})",
        fill="black",
    )
    # left: sampled training reward per step
    x0, x1, y0, y1 = pad, W // 2 - 30, 60, H - pad
    d.rectangle((x0, y0, x1, y1), outline=(160, 160, 160))
    d.text(
        (x0, y1 + 10),
        "GRPO step  ->   training reward (sampled, T=1): each seed thin, mean thick; "
        "dots: held-out success during training (mean of seeds)",
        fill="black",
    )
    steps = max((len(r) for c in schemes for _, r, _ in res[c].values()), default=1)
    for c in schemes:
        curves = [r for _, r, _ in res[c].values() if r]
        for r in curves:
            pts = [(x0 + (x1 - x0) * i / max(steps - 1, 1), y1 - (y1 - y0) * v) for i, v in enumerate(r)]
            d.line(pts, fill=tuple(int(v + (255 - v) * 0.6) for v in COLOURS[c]), width=1)
        if curves:
            n = min(len(r) for r in curves)
            mean = [sum(r[i] for r in curves) / len(curves) for i in range(n)]
            k = 5  # a centred moving average over 5 steps
            smooth = [
                sum(mean[max(0, i - k // 2) : i + k // 2 + 1])
                / len(mean[max(0, i - k // 2) : i + k // 2 + 1])
                for i in range(n)
            ]
            pts = [(x0 + (x1 - x0) * i / max(steps - 1, 1), y1 - (y1 - y0) * v) for i, v in enumerate(smooth)]
            d.line(pts, fill=COLOURS[c], width=4)
        evals = [e for _, _, e in res[c].values() if e]  # held-out success during training: dots
        at = sorted(set.intersection(*(set(e) for e in evals))) if evals else []
        pts = [
            (x0 + (x1 - x0) * (k - 1) / max(steps - 1, 1), y1 - (y1 - y0) * sum(e[k] for e in evals) / len(evals))
            for k in at
        ]
        if len(pts) > 1:
            d.line(pts, fill=COLOURS[c], width=2)
        for x, y in pts:
            d.ellipse((x - 6, y - 6, x + 6, y + 6), outline=COLOURS[c], fill="white", width=3)
    for v in (0.0, 0.5, 1.0):
        d.text((x0 - 30, y1 - (y1 - y0) * v - 6), f"{v:.1f}", fill="black")
    # right: held-out success, warm start then each scheme, per seed
    x0 = W // 2 + 30
    x1 = W - pad
    d.rectangle((x0, y0, x1, y1), outline=(160, 160, 160))
    d.text(
        (x0, y1 + 10),
        "held-out success (200 maps): warm start (grey), then each scheme; one group per seed",
        fill="black",
    )
    seeds = sorted(res["warm"])
    group = (x1 - x0) / max(len(seeds), 1)
    bar = group / (len(schemes) + 2)
    for j, s in enumerate(seeds):
        bars = [("warm", (150, 150, 150), res["warm"].get(s))] + [
            (c, COLOURS[c], res[c].get(s, (None,))[0]) for c in schemes
        ]
        for k, (_name, colour, acc) in enumerate(bars):
            if acc is None:
                continue
            bx = x0 + j * group + (k + 0.5) * bar
            d.rectangle((bx, y1 - (y1 - y0) * acc, bx + bar * 0.9, y1), fill=colour)
            d.text((bx, y1 - (y1 - y0) * acc - 14), f"{acc:.3f}", fill="black")
        d.text((x0 + j * group + bar, y0 + 6), f"seed {s}", fill="black")
    for k, c in enumerate(schemes):
        d.rectangle((pad + 10 + 160 * k, 38, pad + 30 + 160 * k, 50), fill=COLOURS[c])
        d.text((pad + 36 + 160 * k, 38), f"grpo.credit={c}", fill="black")
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("runs/credit"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--schemes", nargs="+", default=["episode", "gigpo"])
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the example's)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "credit_frozenlake.png")
    args = ap.parse_args()
    steps = ["--set", f"grpo.steps={args.steps}"] if args.steps else []
    if not args.plot_only:
        run(args.work, args.seeds, args.schemes, steps)
    res = results(args.work, args.seeds, args.schemes)
    for s in args.seeds:
        parts = [f"warm {res['warm'].get(s)}"] + [f"{c} {res[c].get(s, (None,))[0]}" for c in args.schemes]
        print(f"credit: seed {s}: held-out " + ", ".join(parts))
    print(f"credit: picture {draw(res, args.schemes, args.out, steps)}")


if __name__ == "__main__":
    main()
