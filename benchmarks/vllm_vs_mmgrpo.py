"""Generation through vLLM against mmgrpo's own decode loop on this CPU, side by side, so users know which to pick.

    python benchmarks/vllm_vs_mmgrpo.py generate            # tokens/s at a 0.1B-parameter Qwen2 shape
    python benchmarks/vllm_vs_mmgrpo.py tools-step MODEL    # the tools demo's GRPO step, MODEL = a tools run's final/

``generate``: a random-weight Qwen2 causal LM of about 0.1B parameters (hidden 768, 12 layers, 12 heads of 64,
4 key/value heads, MLP 2048; the tiny tokenizer's 830 ids), 4 prompts of 64 tokens x G = 8 samples x 64 new
tokens at temperature 1, no stop: mmgrpo's loop (``Policy.generate``) and vLLM's CPU build
(``rollout.engine: vllm``, ``mmgrpo.model.vllm_engine``), each measured ``--rounds`` times, alternated; the
medians' tokens per second and their ratio.

``tools-step``: ``--steps`` GRPO steps of ``examples/tools_math_tiny.yaml`` (or ``--config``) on a model that
has learnt the tools task (two-turn episodes), once per variant, alternated twice: mmgrpo's engine, vLLM with
every live episode advancing one turn at a time, and vLLM with each episode its own request stream
(``rollout.vllm_streams``); the median step time, its rollout part, and the ratios,
and a picture of the three (``$MMGRPO_BENCH_PNG``, default ``vllm_vs_mmgrpo_step.png``). One trainer process and one thread for mmgrpo (OMP_NUM_THREADS=1); vLLM's engine process adds its
own (VLLM_CPU_OMP_THREADS_BIND=nobind), so it has the machine's second core where mmgrpo has none: the figure
is what a user of a 2-core machine gets, not a per-core comparison.

Needs the vLLM environment (``mmgrpo vllm-env``). Prints one line per figure, ``vllm_vs_mmgrpo: ...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def build_0p1b(out: Path) -> Path:
    """A random Qwen2 causal LM of about 0.1B parameters with the tiny text model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from mmgrpo.tiny.text import build_tiny_text_model

    tiny = build_tiny_text_model(out / "tiny")
    tok = AutoTokenizer.from_pretrained(tiny)
    base = Qwen2Config.from_pretrained(tiny)
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = out / "qwen2-0.1b"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    print(
        f"vllm_vs_mmgrpo: model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
        flush=True,
    )
    return path


def generate(rounds: int) -> None:
    from mmgrpo.model.batch import VisionInputs
    from mmgrpo.model.policy import Policy
    from mmgrpo.model.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_0p1b(Path(tmp))
        policy = Policy.from_pretrained(path)
        policy.stop_ids = []  # every row runs the full length in both
        engine = VLLMEngine(path, max_model_len=512, seed=0, model=policy.model)
        B, G, P, T = 4, 8, 64, 64
        ids = torch.randint(10, 800, (B, P))
        mask = torch.ones_like(ids)
        times = {"mmgrpo": [], "vllm": []}
        for r in range(rounds + 1):  # the first round of each warms up
            for name in ("mmgrpo", "vllm"):
                policy.sampler = engine if name == "vllm" else None
                t = time.perf_counter()
                comps, _ = policy.generate(ids, mask, VisionInputs.none(B), max_new_tokens=T, num_samples=G)
                dt = time.perf_counter() - t
                assert sum(len(c) for c in comps) == B * G * T
                if r:
                    times[name].append(dt)
        engine.close()
    tps = {k: B * G * T / statistics.median(v) for k, v in times.items()}
    print(
        f"vllm_vs_mmgrpo: generate 0.1B B={B} G={G} prompt={P} new={T}: mmgrpo {tps['mmgrpo']:.0f} tok/s, "
        f"vllm {tps['vllm']:.0f} tok/s, vllm/mmgrpo {tps['vllm'] / tps['mmgrpo']:.2f} (medians of {rounds})",
        flush=True,
    )


VARIANTS = {  # name: the --set lines that pick it
    "mmgrpo": ["rollout.engine=mmgrpo"],
    "vllm-turns": ["rollout.engine=vllm", "rollout.vllm_streams=false"],
    "vllm-streams": ["rollout.engine=vllm", "rollout.vllm_streams=true"],
}


def slow_tools(latency: float) -> str:
    """Register ``tool_math_slow``: the tools demo's env whose every step waits ``latency`` seconds first, as a
    tool served by another machine would; returns the env's name."""
    from mmgrpo.envs.tool_math import ToolMathEnv
    from mmgrpo.registry import register_env

    class SlowTools(ToolMathEnv):
        def step(self, action):
            time.sleep(latency)
            return super().step(action)

    register_env("tool_math_slow", SlowTools, overwrite=True)
    return "tool_math_slow"


def tools_step(model: str, steps: int, config: str, extra: list[str], latency: float = 0.0) -> None:
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    if latency > 0:
        extra = [*extra, f"env.name={slow_tools(latency)}"]

    root = Path(__file__).resolve().parents[1]
    results: dict[str, list] = {name: [] for name in VARIANTS}
    for _ in range(2):
        for name, picks in VARIANTS.items():
            with tempfile.TemporaryDirectory() as tmp:
                sets = [
                    f"model.path={model}",
                    f"output_dir={tmp}/run",
                    *picks,
                    "warm_start.steps=0",
                    f"grpo.steps={steps}",
                    "grpo.eval_every=0",
                    *extra,
                ]
                trainer = Trainer(load_config(root / "examples" / config, sets), progress=False)
                for _ in range(steps):
                    record = trainer.train_step()
                    results[name].append((record["step_time"], record["rollout_time"], record["reward"]))
                if trainer.policy.sampler is not None:
                    trainer.policy.sampler.close()
    med = {
        k: (statistics.median(s for s, _, _ in v), statistics.median(r for _, r, _ in v))
        for k, v in results.items()
    }
    base = med["mmgrpo"][0]
    parts = [f"{k} {s:.2f} s (rollout {r:.2f} s, {s / base:.2f}x)" for k, (s, r) in med.items()]
    turns, streams = med["vllm-turns"][1], med["vllm-streams"][1]
    png = Path(os.environ.get("MMGRPO_BENCH_PNG", "vllm_vs_mmgrpo_step.png"))
    slow = f", each env step {latency:.2f} s slower" if latency > 0 else ""
    draw_steps(med, f"GRPO step of {config}{slow}, medians of 2 x {steps} steps (this CPU)", png)
    print(
        f"vllm_vs_mmgrpo: GRPO step of {config}{slow} ({steps} steps x 2 runs each, medians): "
        + ", ".join(parts)
        + f"; rollout with streams / turns at a time {streams / turns:.2f}",
        flush=True,
    )


def draw_steps(medians: dict[str, tuple[float, float]], title: str, out: Path) -> Path:
    """A bar per variant: its median GRPO step (seconds), the rollout part dark, the rest light."""
    from PIL import Image, ImageDraw

    width, row, left = 760, 46, 150
    img = Image.new("RGB", (width, 70 + row * len(medians)), "white")
    draw = ImageDraw.Draw(img)
    draw.text((12, 10), title, fill="black")
    scale = (width - left - 120) / max(s for s, _ in medians.values())
    for k, (name, (step, rollout)) in enumerate(medians.items()):
        y = 40 + k * row
        draw.text((12, y + 10), name, fill="black")
        draw.rectangle([left, y, left + step * scale, y + 30], fill=(170, 196, 230))
        draw.rectangle([left, y, left + rollout * scale, y + 30], fill=(40, 90, 160))
        draw.text((left + step * scale + 8, y + 10), f"{step:.2f} s (rollout {rollout:.2f} s)", fill="black")
    draw.text(
        (12, 46 + row * len(medians)), "dark: rollout (sampling and env steps); light: the rest", fill="gray"
    )
    img.save(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--rounds", type=int, default=3)
    t = sub.add_parser("tools-step")
    t.add_argument("model", help="a tools run's final model (e.g. runs/demo/run/final)")
    t.add_argument("--steps", type=int, default=8)
    t.add_argument(
        "--config", default="tools_math_tiny.yaml", help="under examples/ (tools_lookup_tiny.yaml: HTTP)"
    )
    t.add_argument("--set", action="append", default=[], help="more KEY=VALUE for every variant")
    t.add_argument(
        "--tool-latency", type=float, default=0.0, help="seconds each env step waits (a remote tool)"
    )
    args = p.parse_args()
    if args.what == "generate":
        generate(args.rounds)
    else:
        tools_step(args.model, args.steps, args.config, args.set, args.tool_latency)


if __name__ == "__main__":
    main()
