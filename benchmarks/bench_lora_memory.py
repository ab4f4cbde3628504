"""Benchmark: peak memory of LoRA against full fine-tuning with a frozen reference copy, side by side.

Each variant trains the same GRPO steps (counting scenes, beta > 0 so the reference is used) in a fresh
subprocess, so that peak RSS belongs to one variant only; the variants alternate (A, B, A, B) and the
median of each is reported with the ratio LoRA / full.

    python benchmarks/bench_lora_memory.py [--size tiny|small] [--steps 3] [--repeats 2]

``tiny`` is the embedded 0.9M-parameter Qwen2.5-VL (its weights are a few MB, so process overhead
dominates); ``small`` is the same architecture at hidden size 512 x 8 layers (about 40M parameters), where
weights, gradients and AdamW states dominate as they do for real checkpoints. Built offline.
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

SIZES = {
    "tiny": {},
    "small": {
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 1408,
    },
}


def child(model_dir: str, variant: str, steps: int, out_dir: str) -> None:
    """Train ``steps`` GRPO steps with ``variant`` and print one JSON line with the peak RSS."""
    import resource

    import torch

    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    torch.set_num_threads(1)
    sets = [
        f"model.path={model_dir}",
        f"output_dir={out_dir}",
        "grpo.steps=1",
        "grpo.tasks_per_step=4",
        "grpo.group_size=4",
        "grpo.max_new_tokens=6",
        "grpo.beta=0.04",
        "warm_start.steps=0",
        "model.freeze_vision=true",
    ]
    if variant == "lora":
        sets.append("model.lora={r: 8, alpha: 16}")
    trainer = Trainer(load_config(None, sets), progress=False)
    for _ in range(steps):
        trainer.train_step()
    trainable = sum(p.numel() for p in trainer.policy.model.parameters() if p.requires_grad)
    copies = (
        0
        if trainer.policy.reference is None
        else sum(p.numel() for p in trainer.policy.reference.parameters())
    )
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes
    print(
        json.dumps({"variant": variant, "peak_rss_mb": peak_mb, "trainable": trainable, "ref_params": copies})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.steps, args.child[2])
        return

    from mmgrpo.tiny.vlm import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", TinyModelSpec(**SIZES[args.size]))
        results: dict[str, list[dict]] = {"full": [], "lora": []}
        for r in range(args.repeats):
            for variant in ("full", "lora"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(args.steps),
                    "--child",
                    str(model_dir),
                    variant,
                    str(Path(tmp) / f"{variant}-{r}"),
                ]
                out = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
                results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        full = statistics.median(x["peak_rss_mb"] for x in results["full"])
        lora = statistics.median(x["peak_rss_mb"] for x in results["lora"])
        f0, l0 = results["full"][0], results["lora"][0]
        print(f"model size: {args.size}; {args.steps} GRPO steps of 4 tasks x G=4, beta 0.04, vision frozen")
        print(
            f"full fine-tuning + reference copy: peak RSS {full:.0f} MB, trainable {f0['trainable']:,}, "
            f"reference copy {f0['ref_params']:,} parameters"
        )
        print(
            f"LoRA r=8, reference = adapter disabled: peak RSS {lora:.0f} MB, trainable {l0['trainable']:,}, "
            f"reference copy {l0['ref_params']:,} parameters"
        )
        print(f"lora_memory: size={args.size} full_mb={full:.0f} lora_mb={lora:.0f} ratio={lora / full:.2f}")


if __name__ == "__main__":
    main()
