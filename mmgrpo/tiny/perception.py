"""Perception pretraining: the tiny VLM learns to see before RL, as real VLMs do.

A freshly built tiny Qwen2.5-VL is blind in practice: its random vision encoder's features do hold each
cell's colour and shape (a linear probe on them reads both perfectly), but the language model has never
learnt to read them, and GRPO has to teach reading and the task at once. Supervised descriptions do not fix
that quickly on this model: 300 steps of "Describe the image." (each cell's object in reading order), or of
"What is in cell 7?", left the held-out loss at the blind model's level (the language model has to learn
which image token is which cell first).

What works, and what this module runs: a per-token objective. On the default scenes (112 px, a 4 x 4 board of
28-px cells) every merged vision token covers exactly one cell, so the language model's output at that
token is asked to name the cell's object: its colour word (or " none") among the colour words, and its shape
word (or " none") among the shape words: two softmaxes over those few rows of the tied output embedding.
The image token's own hidden state then carries the object's words, which later attention can match
against a question's words. Nothing else is trained: no text is generated, so a step is one forward over the
prompt. Measured on the 2-core machine: the held-out cells named right (colour and shape) go from 0.02 to
1.00 by step 20 of the default 60 steps of 32 scenes (about 20 s in all). A yes/no "Is there a blue
square?" at the answer position, tried as a third objective, stayed at chance for 200 steps.

What the scenes are, and what they are not: 0-10 objects (4 shapes x 6 colours, any mix, one per cell) on
a white board, the prompt ``Describe the image.``. No question of any RL task is asked and no count is ever
a target, so what GRPO adds on counting stays visible (the format warm start's "before" stays at chance).

Usage: ``mmgrpo tiny-model OUT --sees`` (build, then this); ``pretrain_perception(model_dir)`` in code. The
model folder gets ``perception.json`` (the settings and the held-out check) and ``perception.jsonl`` (the
curve, one record per logged step, in the layout of a run's metrics so that mmgrpo's plots read it).

Shipped weights: the default model's pretrained weights (3.8 MB) and their curve are in
``mmgrpo/tiny/assets/sees`` (:data:`SHIPPED`), so that a demo from a fresh clone does not spend the
pretraining's 20-30 s. ``mmgrpo tiny-model OUT --sees`` takes them (:func:`take_shipped`) when the settings
are the defaults; ``--pretrain`` runs the pretraining instead, which reproduces them bit for bit on the kind
of CPU that made them (one thread; the slow tier checks the sha256). Another kind of CPU rounds differently:
an AMD EPYC with AVX512 made weights within 4e-5 (relative, per tensor) of the shipped ones, the same
held-out check and a curve whose losses agree to 1e-6; the slow tier then checks that agreement instead.
A pretraining records the CPU it ran on (``"cpu"`` in ``perception.json``, see :func:`cpu_kind`); the
shipped weights predate that record. Other settings or seeds always pretrain.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmgrpo.data.shapes import BOARD_WHITE, PALETTE, SHAPES, cell_box, draw_shape
from mmgrpo.errors import MmgrpoError

PROMPT = "Describe the image."
SHIPPED = Path(__file__).resolve().parent / "assets" / "sees"
"""The default tiny model's pretrained weights (``model.safetensors``) and curve (``perception.json``,
``perception.jsonl``, whose "sha256" is the weights')."""
NONE = "none"


@dataclass(frozen=True)
class PerceptionSpec:
    """Settings of the perception pretraining (defaults: about 20 s; it runs on one CPU thread, so that the
    weights are the same bit for bit whatever the caller's thread count)."""

    steps: int = 60
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0
    max_objects: int = 10
    check_scenes: int = 64
    """Held-out scenes of the skill check (a seed stream apart from training's)."""
    log_every: int = 5
    min_accuracy: float = 0.95
    """The check fails below this per-cell accuracy (colour and shape, on occupied cells)."""


@dataclass
class Scene:
    image: Any  # PIL.Image.Image
    objects: dict[int, tuple[str, str]]
    """cell -> (colour, shape)."""


def draw_scene(rng: random.Random, image_size: int = 112, grid: int = 4, max_objects: int = 10) -> Scene:
    """A white board of ``grid x grid`` cells holding 0..max_objects objects of random kinds, one per cell."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), BOARD_WHITE)
    draw = ImageDraw.Draw(image)
    objects: dict[int, tuple[str, str]] = {}
    for cell in sorted(rng.sample(range(grid * grid), rng.randint(0, max_objects))):
        kind = (rng.choice(list(PALETTE)), rng.choice(SHAPES))
        draw_shape(draw, cell_box(cell, image_size, grid, 0.7), kind[1], PALETTE[kind[0]])
        objects[cell] = kind
    return Scene(image, objects)


def word_ids(tokenizer, words: Sequence[str]) -> list[int]:
    """The first token of `` word`` (as it follows a space in text) for each word; they must differ."""
    ids = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in words]
    if len(set(ids)) != len(ids):
        raise MmgrpoError(f"the tokenizer gives two of {list(words)} the same first token; pick other words")
    return ids


class PerceptionBatcher:
    """Scenes -> model inputs, and the per-cell targets of the image tokens."""

    def __init__(self, processor, grid: int = 4) -> None:
        self.processor = processor
        self.grid = grid
        tok = processor.tokenizer
        self.colors = [*PALETTE, NONE]
        self.shapes = [*SHAPES, NONE]
        self.color_ids = word_ids(tok, self.colors)  # (C,)
        self.shape_ids = word_ids(tok, self.shapes)  # (S,)
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")

    def inputs(self, scenes: Sequence[Scene]) -> dict[str, Any]:
        """The chat prompts: each scene's image, then PROMPT."""
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
        text = self.processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
        enc = self.processor(
            text=[text] * len(scenes), images=[s.image for s in scenes], return_tensors="pt", padding=True
        )
        cells = int((enc["input_ids"][0] == self.image_token_id).sum())
        if cells != self.grid * self.grid:
            raise MmgrpoError(
                f"perception pretraining needs one image token per board cell ({self.grid * self.grid}); "
                f"this processor gives {cells} per scene: keep the tiny model's min/max pixels at 28 * 28 * 16"
            )
        return dict(enc)

    def targets(self, scenes: Sequence[Scene]):
        """Class indices of the colour and the shape per image token, (B, cells) each (NONE: an empty cell)."""
        import torch

        cells = self.grid * self.grid
        color = [[self.colors.index(s.objects.get(c, (NONE, NONE))[0]) for c in range(cells)] for s in scenes]
        shape = [[self.shapes.index(s.objects.get(c, (NONE, NONE))[1]) for c in range(cells)] for s in scenes]
        return torch.tensor(color), torch.tensor(shape)

    def logits(self, model, enc: dict[str, Any]):
        """The language model's logits at each image token restricted to the colour words (B, cells, C) and
        to the shape words (B, cells, S)."""
        logits = model(**enc).logits  # (B, L, V)
        at_cells = logits[enc["input_ids"] == self.image_token_id].view(
            len(enc["input_ids"]), -1, logits.shape[-1]
        )
        return at_cells[..., self.color_ids].float(), at_cells[..., self.shape_ids].float()


def perception_loss(logits, targets):
    """Sum of the mean cross-entropies of the two per-cell classifications (colour, shape)."""
    import torch.nn.functional as F

    return sum(F.cross_entropy(lg.flatten(0, -2), t.flatten()) for lg, t in zip(logits, targets, strict=True))


def cell_accuracy(logits, targets, none_color: int) -> dict[str, float]:
    """Accuracy on occupied cells (colour, shape, both) and on empty cells (both say none)."""
    (cl, sl), (color, shape) = logits, targets
    pc, ps = cl.argmax(-1), sl.argmax(-1)  # (B, cells)
    occupied = color != none_color
    both = (pc == color) & (ps == shape)
    return {
        "color_acc": float((pc == color)[occupied].float().mean()),
        "shape_acc": float((ps == shape)[occupied].float().mean()),
        "object_acc": float(both[occupied].float().mean()),
        "empty_acc": float(both[~occupied].float().mean()),
    }


def check_scenes(spec: PerceptionSpec) -> list[Scene]:
    rng = random.Random(1_000_003 + spec.seed)  # apart from training's stream (seed)
    return [draw_scene(rng, max_objects=spec.max_objects) for _ in range(spec.check_scenes)]


def perception_check(model, batcher: PerceptionBatcher, scenes: Sequence[Scene]) -> dict[str, float]:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = cell_accuracy(
            batcher.logits(model, batcher.inputs(scenes)), batcher.targets(scenes), batcher.colors.index(NONE)
        )
    model.train(was_training)
    return out


def pretrain_perception(
    model_dir: str | Path,
    spec: PerceptionSpec | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Pretrain the tiny VLM in ``model_dir`` in place (all of it, vision encoder included); return the check.

    Raises MmgrpoError when the held-out check stays below ``spec.min_accuracy`` (the folder is then left as
    it was: the weights are written only after the check passes)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    spec = spec or PerceptionSpec()
    model_dir = Path(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    batcher = PerceptionBatcher(processor)
    held_out = check_scenes(spec)
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
                    record = {"step": step, **perception_check(model, batcher, held_out)}
                    records.append(record)
                    if progress:
                        progress(step, record)
                if step == spec.steps:
                    break
                for group in optimizer.param_groups:
                    group["lr"] = spec.lr * lr_scale(step, spec.steps, spec.warmup_steps)
                scenes = [draw_scene(rng, max_objects=spec.max_objects) for _ in range(spec.batch_size)]
                loss = perception_loss(batcher.logits(model, batcher.inputs(scenes)), batcher.targets(scenes))
                optimizer_step(model, optimizer, loss)
                records[-1].setdefault("loss", float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    final = records[-1]
    seconds = time.perf_counter() - start
    if min(final["object_acc"], final["empty_acc"]) < spec.min_accuracy:
        raise MmgrpoError(
            f"perception pretraining ended below its check: held-out object accuracy {final['object_acc']:.2f}, "
            f"empty cells {final['empty_acc']:.2f} (needs {spec.min_accuracy}) after {spec.steps} steps; "
            f"the model in {model_dir} is unchanged. Raise steps or lower lr"
        )
    model.save_pretrained(model_dir)
    summary = {
        "spec": asdict(spec),
        "seconds": round(seconds, 1),
        "check": final,
        "prompt": PROMPT,
        "colors": list(PALETTE),
        "shapes": list(SHAPES),
        "cpu": cpu_kind(),
    }
    write_curve(model_dir, "perception", summary, records)
    return summary


def lr_scale(step: int, steps: int, warmup_steps: int) -> float:
    """The pretrainings' schedule: a linear warmup over ``warmup_steps``, times a cosine from 1 to 0."""
    return min(1.0, (step + 1) / warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / steps))


def optimizer_step(model, optimizer, loss) -> None:
    """One step of the pretrainings: gradients of ``loss``, clipped to norm 1."""
    import torch

    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def write_curve(model_dir: Path, name: str, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """``NAME.json`` (settings, check) and ``NAME.jsonl`` (the curve, in a run's metrics layout)."""
    (model_dir / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(model_dir / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def cpu_kind() -> str:
    """The CPU's model name and the kernels torch picks on it (e.g. ``AMD EPYC (AVX512)``): what decides the
    rounding of a one-thread pretraining, so two machines of one kind make the same weights bit for bit."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def file_sha256(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_fits(tiny_spec: dict[str, Any], spec: PerceptionSpec | None = None) -> bool:
    """Whether :data:`SHIPPED` holds the pretrained weights of the tiny model of ``tiny_spec`` (a
    TinyModelSpec as a dict) under perception settings ``spec``: the defaults of both, recorded there."""
    try:
        done = json.loads((SHIPPED / "perception.json").read_text())
    except (OSError, ValueError):
        return False
    return done.get("tiny_spec") == tiny_spec and done.get("spec") == asdict(spec or PerceptionSpec())


def take_shipped(model_dir: str | Path) -> dict[str, Any]:
    """Put :data:`SHIPPED`'s weights into the freshly built tiny model in ``model_dir`` and save it as
    :func:`pretrain_perception` does (the same files, the same bytes); returns the shipped summary.
    MmgrpoError when the weights written are not the recorded ones (a damaged checkout)."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = Path(model_dir)
    done = json.loads((SHIPPED / "perception.json").read_text())
    shutil.copyfile(SHIPPED / "model.safetensors", model_dir / "model.safetensors")
    # loaded and saved as pretrain_perception's last step does: its config.json, its weight file
    AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).save_pretrained(model_dir)
    digest = file_sha256(model_dir / "model.safetensors")
    if digest != done["sha256"]:
        raise MmgrpoError(
            f"the shipped weights in {SHIPPED} do not give the recorded model (sha256 {digest[:12]}..., "
            f"recorded {done['sha256'][:12]}...): restore that folder from git, or build with "
            "`mmgrpo tiny-model OUT --sees --pretrain`"
        )
    summary = {**done, "shipped": True}
    (model_dir / "perception.json").write_text(json.dumps(summary, indent=2) + "\n")
    (model_dir / "perception.jsonl").write_text((SHIPPED / "perception.jsonl").read_text())
    return summary
