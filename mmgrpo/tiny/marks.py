"""Marking pretraining: the tiny VLM that sees learns, early in its language model, which cells hold a
kind named before the image. What counting one named kind among distractors (``counting_hard``) needs.

The perception pretraining (``mmgrpo.tiny.perception``) teaches each image token to name its cell's object
at the language model's last layer. Counting one named kind among near misses then asks the answer's
position to pick, by attention, the cells whose colour and shape both match the question's words, and to
turn how many it picked into a digit; on the 4-layer tiny model GRPO did not find that (0.175 -> 0.39 after
800 steps), and even taught the true counts the model reached only 0.45 in 600 steps (0.58 in 1500).

Here the kind is named before the image ("Find the blue squares.", four phrasings) and each image token is
asked, at the output of the language model's layer ``layer`` (default 1 of 4, through the final norm and
the tied output embedding), whether its cell holds that kind (" yes" / " no"). With the question before
the image (``CountingEnv(question_first=True)``) each cell's token then marks itself in the first layer,
and the later layers only have to add the marks up. The depth matters (measured, counting_hard with its
question first, the true counts taught for 600 steps): marks at layer 1 -> 0.775 held out; at layer 2 ->
0.455, as without marks. The describe objective runs every other step, so the cells' names stay
(checked).

What the scenes are, and what they are not: 112-px boards of 4 x 4 cells holding 1-5 objects of one kind
and 4-6 of others, a near miss of each sort among them (its shape in another colour, its colour in another
shape), of 3 shapes x 4 colours, from a random stream of their own; the kind asked about is that kind half
the time, else any kind. Which cells hold a kind is
the only target: no question of an RL task is asked and no count is ever a target, so counting_hard's
format warm start still leaves it at chance (0.175).

Usage: ``mmgrpo tiny-model OUT --sees --marks`` (``mmgrpo demo --task counting_hard`` builds it);
``pretrain_marks(model_dir)`` in code, on a model that sees. The folder gets ``marks.json`` (settings,
check) and ``marks.jsonl`` (the curve, in a run's metrics layout). One CPU thread: the same weights bit
for bit on one kind of CPU.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmgrpo.data.shapes import BOARD_WHITE, PALETTE, cell_box, draw_shape
from mmgrpo.errors import MmgrpoError
from mmgrpo.tiny.perception import (
    NONE,
    PerceptionBatcher,
    PerceptionSpec,
    Scene,
    cell_accuracy,
    check_scenes,
    cpu_kind,
    draw_scene,
    lr_scale,
    optimizer_step,
    perception_loss,
    word_ids,
    write_curve,
)

PHRASES = ("Find the {color} {shape}s.", "Where are the {color} {shape}s?", "Mark the {color} {shape}s.", "Look for {color} {shape}s.")
"""How the kind is named before the image (none of them is counting_hard's question)."""

COLORS = ("red", "green", "blue", "yellow")
SHAPES_ASKED = ("circle", "square", "triangle")
"""The kinds of the boards (those of counting_hard's scenes; the cells' names cover all of ``PALETTE`` x
``SHAPES``). With the perception pretraining's 6 colours x 4 shapes and 0-5 objects of the kind asked about
instead, the marks were as good (held-out cells 1.000) but GRPO on counting_hard then reached 0.355."""


@dataclass(frozen=True)
class MarkSpec:
    """Settings of the marking pretraining (defaults: about a minute on one thread)."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 20
    layer: int = 1
    """The language-model layer whose output marks the cells (1: after the first of the tiny model's 4)."""
    describe_every: int = 2
    """Every this many steps the perception objective runs too (16 scenes), so the cells keep their names."""
    seed: int = 0
    check_scenes: int = 64
    log_every: int = 25
    min_accuracy: float = 0.95
    """The check fails below this share of held-out cells marked right, or of cells still named right."""


@dataclass
class MarkScene:
    scene: Scene
    kind: tuple[str, str]
    """The kind asked about: (colour, shape)."""
    phrase: str
    board_kind: tuple[str, str]
    """The kind the board holds 1-5 of, with its near misses."""


def draw_mark_scene(
    rng: random.Random,
    colors: Sequence[str] = COLORS,
    shapes: Sequence[str] = SHAPES_ASKED,
    image_size: int = 112,
    grid: int = 4,
) -> MarkScene:
    """A board with 1-5 objects of one kind and 4-6 of other kinds, among them a near miss of each sort
    (the kind's shape in another colour, its colour in another shape); half the time that kind is the one
    asked about, else any kind of ``colors`` x ``shapes`` (often absent, or one of the others)."""
    from PIL import Image, ImageDraw

    kind = (rng.choice(colors), rng.choice(shapes))
    kinds = [(c, s) for c in colors for s in shapes]
    near = [[k for k in kinds if k[1] == kind[1] and k != kind], [k for k in kinds if k[0] == kind[0] and k != kind]]
    others = [rng.choice(near[0]), rng.choice(near[1])]
    others += [rng.choice([k for k in kinds if k != kind]) for _ in range(rng.randint(4, 6) - 2)]
    layout = [kind] * rng.randint(1, 5) + others
    image = Image.new("RGB", (image_size, image_size), BOARD_WHITE)
    draw = ImageDraw.Draw(image)
    objects: dict[int, tuple[str, str]] = {}
    for cell, (color, shape) in zip(rng.sample(range(grid * grid), len(layout)), layout, strict=True):
        draw_shape(draw, cell_box(cell, image_size, grid, 0.7), shape, PALETTE[color])
        objects[cell] = (color, shape)
    asked = kind if rng.random() < 0.5 else rng.choice(kinds)
    return MarkScene(Scene(image, objects), asked, rng.choice(PHRASES), kind)


class MarkBatcher:
    """Mark scenes -> model inputs (the phrase, then the image) and the per-cell yes / no targets."""

    def __init__(self, processor, grid: int = 4) -> None:
        self.processor, self.grid = processor, grid
        self.yes_no = word_ids(processor.tokenizer, ["yes", "no"])
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def inputs(self, scenes: Sequence[MarkScene]) -> dict[str, Any]:
        texts = []
        for s in scenes:
            ask = s.phrase.format(color=s.kind[0], shape=s.kind[1])
            message = [{"role": "user", "content": [{"type": "text", "text": ask}, {"type": "image"}]}]
            texts.append(self.processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False))
        enc = self.processor(text=texts, images=[s.scene.image for s in scenes], return_tensors="pt", padding=True)
        return dict(enc)

    def targets(self, scenes: Sequence[MarkScene]):
        """(B, cells): 0 (" yes") where the cell holds the kind asked about, else 1 (" no")."""
        import torch

        cells = self.grid * self.grid
        return torch.tensor([[0 if s.scene.objects.get(c) == s.kind else 1 for c in range(cells)] for s in scenes])

    def logits(self, model, enc: dict[str, Any], layer: int):
        """The yes / no logits (B, cells, 2) read at each image token from the output of ``layer``."""
        out = model(**enc, output_hidden_states=True)
        hidden = out.hidden_states[layer]  # (B, L, H): [0] is the embeddings, [i] layer i's output
        logits = model.lm_head(model.model.language_model.norm(hidden))  # (B, L, V)
        at_cells = logits[enc["input_ids"] == self.image_token_id].view(len(hidden), -1, logits.shape[-1])
        return at_cells[..., self.yes_no].float()  # (B, cells, 2)


def mark_check(model, batcher: MarkBatcher, describe: PerceptionBatcher, scenes, named, layer: int) -> dict:
    """Held-out cells marked right (and whole boards), and cells still named right (perception's check)."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        right = batcher.logits(model, batcher.inputs(scenes), layer).argmax(-1) == batcher.targets(scenes)
        names = cell_accuracy(
            describe.logits(model, describe.inputs(named)), describe.targets(named), describe.colors.index(NONE)
        )
    model.train(was_training)
    return {
        "mark_acc": float(right.float().mean()),
        "board_acc": float(right.all(-1).float().mean()),
        "object_acc": names["object_acc"],
        "empty_acc": names["empty_acc"],
    }


def pretrain_marks(
    model_dir: str | Path, spec: MarkSpec | None = None, progress: Callable[[int, dict], None] | None = None
) -> dict[str, Any]:
    """Give the tiny VLM in ``model_dir`` (one that sees) the marking pretraining, in place; return the check.
    Raises MmgrpoError when the held-out check ends below ``spec.min_accuracy`` (the folder is then left as
    it was)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText, AutoProcessor

    spec = spec or MarkSpec()
    model_dir = Path(model_dir)
    if not (model_dir / "perception.json").exists():
        raise MmgrpoError(
            f"{model_dir} has not had the perception pretraining: build it with `mmgrpo tiny-model DIR --sees "
            "--marks` (the marks are read from the cells' names, which that pretraining teaches)"
        )
    processor = AutoProcessor.from_pretrained(model_dir)
    batcher, describe = MarkBatcher(processor), PerceptionBatcher(processor)
    check_rng = random.Random(2_000_003 + spec.seed)  # apart from training's stream
    held_out = [draw_mark_scene(check_rng) for _ in range(spec.check_scenes)]
    named = check_scenes(PerceptionSpec(seed=spec.seed, check_scenes=spec.check_scenes))
    rng = random.Random(spec.seed)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights bit for bit whatever the caller's thread count
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
            for step in range(spec.steps + 1):
                if step % spec.log_every == 0 or step == spec.steps:
                    records.append({"step": step, **mark_check(model, batcher, describe, held_out, named, spec.layer)})
                    if progress:
                        progress(step, records[-1])
                if step == spec.steps:
                    break
                for group in optimizer.param_groups:
                    group["lr"] = spec.lr * lr_scale(step, spec.steps, spec.warmup_steps)
                scenes = [draw_mark_scene(rng) for _ in range(spec.batch_size)]
                logits = batcher.logits(model, batcher.inputs(scenes), spec.layer)  # (B, cells, 2)
                loss = F.cross_entropy(logits.flatten(0, 1), batcher.targets(scenes).flatten())
                if step % spec.describe_every == 0:
                    boards = [draw_scene(rng) for _ in range(spec.batch_size // 2)]
                    loss = loss + perception_loss(describe.logits(model, describe.inputs(boards)), describe.targets(boards))
                optimizer_step(model, optimizer, loss)
                records[-1].setdefault("loss", float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    final = records[-1]
    if min(final["mark_acc"], final["object_acc"], final["empty_acc"]) < spec.min_accuracy:
        raise MmgrpoError(
            f"marking pretraining ended below its check: held-out cells marked right {final['mark_acc']:.2f}, "
            f"named right {final['object_acc']:.2f}, empty {final['empty_acc']:.2f} (needs {spec.min_accuracy}) "
            f"after {spec.steps} steps; the model in {model_dir} is unchanged. Raise steps or lower lr"
        )
    model.eval()
    model.save_pretrained(model_dir)
    summary = {
        "spec": asdict(spec),
        "seconds": round(time.perf_counter() - start, 1),
        "check": final,
        "phrases": list(PHRASES),
        "cpu": cpu_kind(),
    }
    write_curve(model_dir, "marks", summary, records)
    return summary
