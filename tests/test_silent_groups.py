"""Groups whose every advantage is 0 are left out of the training pass (microbatch.trained_rows) only where
that changes nothing: the same parameters after the optimizer step as with every row, on prompts with
images and on episodes with a tool's image inside the response; every row where a loss term reads them."""

from __future__ import annotations

import copy

import pytest
import torch
from test_multiturn import ScriptedPolicy

from mmgrpo.config.core import load_config
from mmgrpo.envs.zoom_count import ZoomCountEnv, tool_call_text
from mmgrpo.rollout.episodes import rollout
from mmgrpo.train import microbatch
from mmgrpo.train.trainer import Trainer

G = 4


def _trainer(model, tmp_path, *sets):
    base = [
        f"model.path={model}",
        f"output_dir={tmp_path}",
        "grpo.steps=2",
        "grpo.tasks_per_step=3",
        f"grpo.group_size={G}",
        "grpo.max_new_tokens=6",
        "grpo.micro_batch_size=8",
        "grpo.beta=0",
        "grpo.lr=1e-3",
        "warm_start.steps=0",
    ]
    return Trainer(load_config(None, [*base, *sets]))


def _grads(tr) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient as the update left it (clipped), None where it got none."""
    return {n: None if p.grad is None else p.grad.clone() for n, p in tr.policy.model.named_parameters()}


def _update_both_ways(tr, tokens, adv):
    """The gradients of one update with every row, and of the same update leaving silent groups out,
    from the same weights and optimizer state; and the second update's statistics. (Gradients, not the
    weights after AdamW: its first step divides each gradient by its own size, so a rounding-level
    gradient moves a weight by the whole learning rate.)"""
    model0 = copy.deepcopy(tr.policy.model.state_dict())
    opt0 = copy.deepcopy(tr.optimizer.state_dict())
    sched0 = copy.deepcopy(tr.scheduler.state_dict())
    out = []
    for skip in (False, True):
        tr.policy.model.load_state_dict(model0)
        tr.optimizer.load_state_dict(opt0)
        tr.scheduler.load_state_dict(sched0)
        microbatch.SKIP_SILENT_GROUPS = skip
        try:
            stats, problem = tr.update(tokens, adv, G)
        finally:
            microbatch.SKIP_SILENT_GROUPS = True
        assert problem is None
        out.append((_grads(tr), stats))
    (every, _), (skipped, stats) = out
    return every, skipped, stats


def _assert_same(every, skipped):
    assert [n for n, g in every.items() if g is None] == [n for n, g in skipped.items() if g is None]
    for name, g in every.items():
        if g is not None:
            torch.testing.assert_close(skipped[name], g, atol=1e-7, rtol=1e-4, msg=name)
    return sum(float(g.abs().sum()) for g in every.values() if g is not None)


def test_silent_groups_of_image_prompts_change_nothing(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path)
    batch, _, _ = tr.collect(G)
    tokens = batch.tokens
    assert len(tokens) == 3 * G and not tokens.vision.empty
    adv = torch.randn(len(tokens))  # (N,)
    adv[G : 2 * G] = 0.0  # the middle group is silent
    every, skipped, stats = _update_both_ways(tr, tokens, adv)
    assert _assert_same(every, skipped) > 0
    assert stats["trained_frac"] == pytest.approx(2 / 3)
    adv2 = torch.zeros(len(tokens), tokens.response_ids.shape[1])  # (N, T) turn-level advantages
    adv2[:G, :3] = 1.0  # only the first group speaks
    assert microbatch.trained_rows(tokens, adv2, G, tr.cfg.grpo, 0.0) == list(range(G))


def test_every_group_silent_keeps_one_so_adamw_moves_the_same_parameters(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path)
    batch, _, _ = tr.collect(G)
    adv = torch.zeros(len(batch.tokens))
    every, skipped, stats = _update_both_ways(tr, batch.tokens, adv)
    assert _assert_same(every, skipped) == 0  # zero gradients, on the same parameters
    assert stats["trained_frac"] == pytest.approx(1 / 3)


def test_silent_groups_with_tool_images_change_nothing(tiny_model_dir, tiny_policy, tmp_path):
    tr = _trainer(tiny_model_dir, tmp_path, "env.name=zoom_count", "env.max_turns=2")
    envs = [ZoomCountEnv() for _ in range(2 * G)]
    zoomed = ScriptedPolicy(tiny_policy, [tool_call_text("zoom", {"cell": 5}), "<answer>2</answer>"])
    first = rollout(zoomed, envs[:G], [0], group_size=G, max_new_tokens=24, max_turns=2)
    plain = ScriptedPolicy(tiny_policy, ["<answer>2</answer>"])
    second = rollout(plain, envs[G:], [1], group_size=G, max_new_tokens=24, max_turns=2)
    from mmgrpo.model.batch import TokenBatch

    tokens = TokenBatch.concat([second.tokens, first.tokens], pad_token_id=tiny_policy.pad_token_id)
    assert tokens.has_response_images
    for silent in (0, 1):  # the group that answered at once, then the one that zoomed
        adv = torch.randn(2 * G)
        adv[silent * G : silent * G + G] = 0.0
        kept = list(range((1 - silent) * G, (2 - silent) * G))
        assert microbatch.trained_rows(tokens, adv, G, tr.cfg.grpo, 0.0) == kept  # every prompt has an image
        every, skipped, stats = _update_both_ways(tr, tokens, adv)
        assert _assert_same(every, skipped) > 0
        assert stats["trained_frac"] == pytest.approx(1 / 2)


def test_a_silent_group_with_the_only_images_is_kept():
    from mmgrpo.config.sections import GRPOConfig
    from mmgrpo.model.batch import TokenBatch, VisionInputs

    N = 3 * G
    one = torch.ones(N, 4, dtype=torch.long)
    image = {"pixel_values": torch.zeros(4, 8)}
    seqs = [image if G <= r < 2 * G else {} for r in range(N)]  # only group 1's responses hold an image
    rv = VisionInputs(seqs, [int(bool(s)) for s in seqs])
    tokens = TokenBatch(one, one, one, one, one, VisionInputs.none(N), None, rv)
    adv = torch.zeros(N)
    adv[2 * G :] = 1.0  # group 2 speaks, groups 0 and 1 are silent
    assert microbatch.trained_rows(tokens, adv, G, GRPOConfig(), 0.0) == list(range(G, 3 * G))
    adv[:] = 0.0  # every group silent: group 0 (the text layers) and group 1 (the vision tower)
    assert microbatch.trained_rows(tokens, adv, G, GRPOConfig(), 0.0) == list(range(2 * G))
    text = TokenBatch(one, one, one, one, one, VisionInputs.none(N))
    assert microbatch.trained_rows(text, adv, G, GRPOConfig(), 0.0) == list(range(G))


@pytest.mark.parametrize(
    "sets, beta",
    [([], 0.04), (["grpo.entropy_coef=0.01"], 0.0), (["grpo.aggregation=bnpo"], 0.0)],
)
def test_every_row_runs_where_a_loss_term_reads_silent_rows(tiny_model_dir, tmp_path, sets, beta):
    tr = _trainer(tiny_model_dir, tmp_path, *sets)
    batch, _, _ = tr.collect(G)
    adv = torch.zeros(len(batch.tokens))
    adv[:G] = 1.0
    assert microbatch.trained_rows(batch.tokens, adv, G, tr.cfg.grpo, beta) is None
    plain = _trainer(tiny_model_dir, tmp_path / "plain").cfg.grpo  # beta 0, no bonus, sequence means
    assert microbatch.trained_rows(batch.tokens, adv, G, plain, 0.0) == list(range(G))
