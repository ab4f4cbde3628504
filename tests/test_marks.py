"""The marking pretraining (mmgrpo.tiny.marks): its scenes name a kind and never ask a count, its targets
are the cells holding that kind, it reads the marks at the layer asked for, writes its curve, and a failed
check leaves the model as it was. (That it teaches the marks, and what they give counting_hard, the slow
tier's counting_hard demo checks: the demo prints the held-out check.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from mmgrpo.errors import MmgrpoError
from mmgrpo.tiny.marks import (
    COLORS,
    PHRASES,
    SHAPES_ASKED,
    MarkBatcher,
    MarkSpec,
    draw_mark_scene,
    pretrain_marks,
)
from mmgrpo.tiny.vlm import build_tiny_model


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("sees") / "model", sees=True)


def test_the_scenes_name_a_kind_with_near_misses_and_never_ask_a_count():
    assert not any("how many" in p.lower() or any(ch.isdigit() for ch in p) for p in PHRASES)
    scenes = [draw_mark_scene(random.Random(seed)) for seed in range(300)]
    for m in scenes:
        kinds = list(m.scene.objects.values())
        assert 5 <= len(kinds) <= 11 and m.kind[0] in COLORS and m.kind[1] in SHAPES_ASKED
        main = m.board_kind
        assert 1 <= kinds.count(main) <= 5
        assert any(k[1] == main[1] and k[0] != main[0] for k in kinds)  # its shape in another colour
        assert any(k[0] == main[0] and k[1] != main[1] for k in kinds)  # its colour in another shape
    asked = [list(m.scene.objects.values()).count(m.kind) for m in scenes]
    assert set(asked) == {0, 1, 2, 3, 4, 5} and 0.2 < asked.count(0) / len(asked) < 0.5


def test_targets_say_yes_exactly_on_the_cells_of_the_kind(seeing):
    from transformers import AutoProcessor

    batcher = MarkBatcher(AutoProcessor.from_pretrained(seeing))
    scenes = [draw_mark_scene(random.Random(s)) for s in range(6)]
    targets = batcher.targets(scenes)  # (6, 16)
    for m, row in zip(scenes, targets, strict=True):
        yes = {c for c, kind in m.scene.objects.items() if kind == m.kind}
        assert {c for c in range(16) if row[c] == 0} == yes
    enc = batcher.inputs(scenes)
    text = batcher.processor.tokenizer.decode(enc["input_ids"][0])
    assert text.index(scenes[0].kind[1]) < text.index("<|image_pad|>")  # the kind is named before the image


def test_marks_are_read_at_the_layer_asked_for(seeing):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(seeing)
    batcher = MarkBatcher(AutoProcessor.from_pretrained(seeing))
    enc = batcher.inputs([draw_mark_scene(random.Random(1))])
    lm = model.model.language_model
    seen = []
    lm.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        one, three = batcher.logits(model, enc, 1), batcher.logits(model, enc, 3)
        first = model.lm_head(lm.norm(seen[0]))[enc["input_ids"] == batcher.image_token_id][:, batcher.yes_no]
    assert one.shape == (1, 16, 2)
    torch.testing.assert_close(one[0], first)  # the first decoder layer's output, through the final norm
    assert not torch.allclose(one, three)


def test_a_short_run_writes_its_curve_and_a_failed_check_leaves_the_model(seeing, tmp_path):
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(seeing, copy)
    weights = (copy / "model.safetensors").read_bytes()
    with pytest.raises(MmgrpoError, match="below its check.*unchanged"):
        pretrain_marks(copy, MarkSpec(steps=2, log_every=1, check_scenes=8, min_accuracy=1.01))
    assert (copy / "model.safetensors").read_bytes() == weights and not (copy / "marks.json").exists()
    done = pretrain_marks(copy, MarkSpec(steps=2, log_every=1, check_scenes=8, min_accuracy=0.0))
    curve = [json.loads(line) for line in (copy / "marks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [0, 1, 2] and "loss" in curve[0]
    assert done["check"] == curve[-1] and json.loads((copy / "marks.json").read_text())["spec"]["layer"] == 1
    assert (copy / "model.safetensors").read_bytes() != weights


def test_marks_need_a_model_that_sees(tiny_model_dir, tmp_path):
    with pytest.raises(MmgrpoError, match="perception pretraining"):
        pretrain_marks(tiny_model_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "tiny-model", str(tmp_path / "m"), "--marks"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "give --sees too" in proc.stderr
    assert not (tmp_path / "m").exists()
