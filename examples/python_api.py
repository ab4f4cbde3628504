"""The Python API in one script (docs/python_api.md): a TRL-style GRPO run of the tiny text model on sums,
with a callback printing each step, then the same run continued through ``mmgrpo.run``, the recipe of
``mmgrpo train``.

    python examples/python_api.py                 # builds runs/tiny-text-model when missing; 20 steps
    python examples/python_api.py --steps 2       # a quick look (tests/test_python_api_example.py runs it)

The tiny model is random weights: the point is the API, not the learning (``mmgrpo demo --task text_math``
shows the learning, with a warm start).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mmgrpo


def correct(prompts, completions, answer, **kwargs):
    """TRL's reward function signature: 1 when the <answer> tag holds the row's answer."""
    return [float(mmgrpo.extract_tag(c) == a) for c, a in zip(completions, answer, strict=True)]


def brevity(prompts, completions, **kwargs):
    """A shaping reward that differs within groups even for random weights: shorter is better."""
    return [-len(c) / 100 for c in completions]


class PrintStep(mmgrpo.TrainerCallback):
    def on_step_end(self, trainer, metrics):
        print(
            f"step {metrics['step']}: reward {metrics['reward']:.3f} (correct {metrics['reward/correct']:.2f})"
        )

    def on_save(self, trainer, path):
        print(f"saved {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/tiny-text-model", help="a model folder or hub id")
    ap.add_argument("--out", default="runs/python_api", help="the run's output_dir")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if not Path(args.model).is_dir() and args.model == "runs/tiny-text-model":
        from mmgrpo.tiny.text import build_tiny_text_model

        build_tiny_text_model(args.model)

    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(5) for b in range(5)]
    grpo = mmgrpo.GRPO(
        model=args.model,
        reward_funcs=[correct, brevity],
        reward_weights=[1.0, 0.1],
        train_dataset=rows,
        output_dir=args.out,
        max_steps=args.steps,
        num_generations=4,
        tasks_per_step=4,
        max_completion_length=12,
        save_every=args.steps,  # a checkpoint at the last step, for the resume below
        callbacks=[PrintStep()],
    )
    result = grpo.train(overwrite=True)  # overwrite: an earlier run of this script in the same folder
    print(
        f"GRPO: {result.step} steps, last reward {result.metrics['reward']:.3f}; model and card in {result.final}"
    )

    # the same run is an ordinary mmgrpo run: its config.yaml trains on with the recipe of `mmgrpo train`
    more = mmgrpo.run(
        Path(args.out) / "config.yaml", [f"grpo.steps={args.steps + 1}"], resume=True, callbacks=[PrintStep()]
    )
    print(f"resumed: {more.step} steps in {more.output_dir}")


if __name__ == "__main__":
    main()
