"""The head at the scored positions only (mmgrpo.model.head): which models may take it, and what a model
that may not does instead."""

from __future__ import annotations

import torch

from mmgrpo.model.head import final_hidden, plain_head
from mmgrpo.model.policy import Policy
from mmgrpo.tiny.families import build_tiny_family


def test_plain_head_only_for_known_types_without_softcapping(tmp_path):
    path = build_tiny_family("qwen3", tmp_path / "m")
    policy = Policy.from_pretrained(path)
    model = policy.model
    assert plain_head(model) is model.get_output_embeddings()
    model.config.final_logit_softcapping = 30.0  # a transformation after the head: the full pass stays
    assert plain_head(model) is None
    model.config.final_logit_softcapping = None
    model.config.model_type = "someone_elses_lm"  # a family not read: the full pass stays
    assert plain_head(model) is None


def test_final_hidden_gives_what_the_head_turns_into_the_models_logits(tmp_path):
    path = build_tiny_family("qwen3", tmp_path / "m")
    model = Policy.from_pretrained(path).model
    ids = torch.randint(3, 100, (2, 7))
    head = plain_head(model)
    hidden = final_hidden(model, head, input_ids=ids)  # (2, 7, H)
    assert hidden.shape[:2] == (2, 7)
    torch.testing.assert_close(head(hidden), model(input_ids=ids).logits, atol=1e-6, rtol=1e-6)


def test_a_model_without_a_plain_head_scores_every_position(tmp_path):
    """policy.logprobs(scored=...) on a model whose head is not plain: the full pass, every position's
    log-prob (none left at 0), the same numbers as without ``scored``."""
    path = build_tiny_family("qwen3", tmp_path / "m")
    policy = Policy.from_pretrained(path)
    policy.model.config.model_type = "someone_elses_lm"
    from mmgrpo.envs.text_math import TextMathEnv
    from mmgrpo.rollout.episodes import rollout

    torch.manual_seed(0)
    tok = rollout(policy, [TextMathEnv() for _ in range(4)], [0, 1], group_size=2, max_new_tokens=5).tokens
    scored = tok.loss_mask.bool() & (torch.rand(tok.loss_mask.shape) < 0.5)
    with torch.no_grad():
        a, b = policy.logprobs(tok), policy.logprobs(tok, scored=scored)
    m = tok.response_mask.bool()
    torch.testing.assert_close(b[m], a[m])
    assert (b[m] != 0).all()
