"""Write a supervised counting dataset for `mmgrpo sft`: scenes of the `counting` env with their answers.

    python examples/make_counting_sft.py runs/counting-sft --n 200 [--eval-n 50]

Writes OUT_DIR/train.jsonl (and OUT_DIR/eval.jsonl with --eval-n) and the PNG images under OUT_DIR/images/.
Each row is in the question form of mmgrpo.train.sft:

    {"system": "Count the objects ...", "question": "How many red circles are in the image?",
     "image": "images/train-000000.png", "response": "<answer>3</answer>", "answer": "3"}

(image paths are relative to the JSONL file; `answer` is ignored by sft and kept for reading). The scenes
are those of CountingEnv with the kwargs of examples/counting_tiny.yaml (red circles, 1 to 5), so the
prompt is token for token what GRPO sees. Training rows are the env's train split from seed --start
(default 1,000,000, away from the seeds GRPO trains on, which start at 0); eval rows are its eval split
from the same seed, which `mmgrpo eval` (seeds from 0) does not reach with its default episode count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmgrpo.envs.counting import CountingEnv

DEFAULT_KWARGS = {"max_count": 5, "shapes": ["circle"], "colors": ["red"]}
"""The env kwargs of examples/counting_tiny.yaml."""


def write_split(env: CountingEnv, out_dir: Path, split: str, n: int, start: int) -> Path:
    """n rows of ``split`` from seed ``start`` as out_dir/{split}.jsonl, images in out_dir/images/."""
    images = out_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    with path.open("w") as f:
        for i in range(n):
            task = env.make_task(start + i, split)
            system, user = task.messages
            image = next(p["image"] for p in user["content"] if p["type"] == "image")
            question = next(p["text"] for p in user["content"] if p["type"] == "text")
            name = f"images/{split}-{i:06d}.png"
            image.save(out_dir / name)
            row = {
                "system": system["content"][0]["text"],
                "question": question,
                "image": name,
                "response": env.reference_completion(task.info),
                "answer": task.info["answer"],
            }
            f.write(json.dumps(row) + "\n")
    return path


def make_counting_sft(
    out_dir: str | Path, n: int = 200, eval_n: int = 0, start: int = 1_000_000, **env_kwargs
) -> list[Path]:
    """Write the dataset; returns the JSONL paths written (train, then eval if eval_n > 0)."""
    out = Path(out_dir)
    env = CountingEnv(**{**DEFAULT_KWARGS, **env_kwargs})
    paths = [write_split(env, out, "train", n, start)]
    if eval_n > 0:
        paths.append(write_split(env, out, "eval", eval_n, start))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for train.jsonl (and eval.jsonl) and images/")
    p.add_argument("--n", type=int, default=200, help="training rows (default 200)")
    p.add_argument("--eval-n", type=int, default=0, help="held-out rows in eval.jsonl (default none)")
    p.add_argument("--start", type=int, default=1_000_000, help="first scene seed")
    p.add_argument("--max-count", type=int, default=DEFAULT_KWARGS["max_count"], help="largest count")
    args = p.parse_args()
    for path in make_counting_sft(args.out_dir, args.n, args.eval_n, args.start, max_count=args.max_count):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
