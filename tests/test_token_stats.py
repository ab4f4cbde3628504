"""Per-token statistics from logit blocks (mmgrpo.model.token_stats) equal those of the whole (N, T, V)
logits at every covered position, place nothing elsewhere, and send gradients only through covered ones."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.grpo.losses import token_entropy, token_logprobs
from mmgrpo.model.engine import LogitBlock
from mmgrpo.model.head import HiddenBlock
from mmgrpo.model.token_stats import block_stats

N, T, V = 4, 6, 11


def blocks_of(full: torch.Tensor) -> list[LogitBlock]:
    """full (N, T, V) cut as the shared path cuts it: rows (2, 0) with responses of 4 tokens, rows (1, 3)
    of 6; per pass a one-column block (token 0) and a block of the rest with one extra column."""
    blocks = []
    for rows, t in (([2, 0], 4), ([1, 3], 6)):
        idx = torch.tensor(rows)
        extra = torch.randn(len(rows), 1, V)  # the pass's last column: predicts nothing
        rest = torch.cat([full[idx, 1:t], extra], dim=1)  # (n, t, V)
        blocks += [LogitBlock(idx, full[idx, :1], 0, 1), LogitBlock(idx, rest, 1, t - 1)]
    return blocks


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_block_stats_equal_the_whole_logits_where_covered(entropy_grad):
    torch.manual_seed(0)
    full = torch.randn(N, T, V, requires_grad=True)  # (N, T, V)
    targets = torch.randint(0, V, (N, T))
    logp, ent = block_stats(blocks_of(full), targets, 0.8, with_entropy=True, entropy_grad=entropy_grad)
    covered = torch.zeros(N, T, dtype=torch.bool)
    covered[[0, 2], :4] = True
    covered[[1, 3], :] = True
    want_logp, want_ent = token_logprobs(full, targets, 0.8), token_entropy(full, 0.8)
    assert torch.allclose(logp[covered], want_logp[covered], atol=1e-6)
    assert torch.allclose(ent[covered], want_ent[covered], atol=1e-5)
    assert (logp[~covered] == 0).all() and (ent[~covered] == 0).all()
    assert ent.requires_grad == entropy_grad
    (grad,) = torch.autograd.grad(logp.sum(), full)
    (want,) = torch.autograd.grad(want_logp[covered].sum(), full)
    assert torch.allclose(grad, want, atol=1e-6)  # nothing through the uncovered or extra columns
    assert (grad[[0, 2], 4:] == 0).all()


def test_block_stats_without_entropy_and_a_whole_block():
    full = torch.randn(N, T + 1, V)  # the full path: T + 1 columns, the last predicts nothing
    targets = torch.randint(0, V, (N, T))
    logp, ent = block_stats([LogitBlock(torch.arange(N), full, 0, T)], targets)
    assert ent is None and torch.allclose(logp, token_logprobs(full[:, :T], targets), atol=1e-6)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_hidden_blocks_score_the_asked_positions_only(entropy_grad):
    """Blocks of final hidden states go through the head at the scored positions only: there the same
    log-probs, entropies and gradients (into the hidden states and the head) as the whole logits; 0
    elsewhere, and the head is handed exactly the scored positions."""
    torch.manual_seed(1)
    H = 5
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(N, T, H, requires_grad=True)  # (N, T, H): column t gives the logits of token t
    targets = torch.randint(0, V, (N, T))
    scored = torch.rand(N, T) < 0.6  # (N, T)
    scored[[0, 2], 4:] = False  # rows (2, 0) have 4 tokens
    seen = []
    head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    blocks = []
    for rows, t in (([2, 0], 4), ([1, 3], 6)):
        idx = torch.tensor(rows)
        blocks.append(LogitBlock(idx, head(hidden[idx, :1]), 0, 1))  # the prompt's last logits: token 0
        blocks.append(HiddenBlock(idx, hidden[idx, 1:], 1, t - 1, head))  # (n, T - 1, H), one column extra
    seen.clear()
    logp, ent = block_stats(
        blocks, targets, 0.8, with_entropy=True, entropy_grad=entropy_grad, scored=scored
    )
    assert sum(seen) == int(scored[:, 1:].sum())  # the head ran on the scored positions, nothing else
    full = head(hidden)  # (N, T, V)
    want_logp, want_ent = token_logprobs(full, targets, 0.8), token_entropy(full, 0.8)
    at = scored.clone()
    at[:, 0] = True
    at[[0, 2], 4:] = False  # column 0 comes whole from its logit block; past a row's length, nothing
    torch.testing.assert_close(logp[at], want_logp[at], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent[at], want_ent[at], atol=1e-5, rtol=1e-5)
    assert (logp[~at] == 0).all() and (ent[~at] == 0).all()
    assert ent.requires_grad == entropy_grad
    got = torch.autograd.grad(logp.sum(), [hidden, head.weight])
    want = torch.autograd.grad(want_logp[at].sum(), [hidden, head.weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_hidden_blocks_need_the_scored_positions():
    head = torch.nn.Linear(3, V)
    block = HiddenBlock(torch.arange(N), torch.randn(N, T, 3), 0, T, head)
    with pytest.raises(ValueError, match="scored="):
        block_stats([block], torch.randint(0, V, (N, T)))
