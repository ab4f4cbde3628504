"""The language-model head at the positions that are scored, not at every position of a pass.

A training or reference pass needs log-probs only where the loss reads them (``TokenBatch.loss_mask``).
On a multi-turn episode a large share of the response is not the policy's: a tool's result and the
template around it (45% of the response tokens of the tools demo), plus each pass's padding (12%). The
head (hidden -> vocabulary) and the log-softmax over the vocabulary at those positions, and their
backward, are work whose result is thrown away. Here the model runs as usual, but its head is handed no
positions; the final hidden states are kept and only the scored ones go through the head afterwards
(``mmgrpo.model.token_stats``).

That is exact only where the model's logits are its head's output as they are: the families below, when
their config asks for no soft-capping or scaling after the head. Any other model keeps the full pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from mmgrpo.model.adapters import unwrap

PLAIN_HEAD_TYPES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "llava",
        "idefics3",
        "smolvlm",
        "gemma3",
        "qwen2",
        "qwen3",
        "llama",
        "mistral",
    }
)
"""Model types whose forward returns ``lm_head(hidden)`` unchanged, unless their config sets one of
``AFTER_HEAD`` (read in the transformers sources these tiny families are built from)."""

AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config keys of a transformation applied to the head's output (soft-capping, a scale): set, the head
alone would not give the model's logits."""


@dataclass
class HiddenBlock:
    """Final hidden states of some rows over a run of response columns: ``head(hidden[:, j])`` are the
    logits predicting response token ``start + j`` of each row in ``rows``, for j < ``width``."""

    rows: Tensor  # (n,) long: the rows of the batch
    hidden: Tensor  # (n, c, H), c >= width
    start: int
    width: int
    head: Callable[[Tensor], Tensor]  # (K, H) -> (K, V)


@dataclass
class SpanBlock:
    """Logits (or final hidden states) over runs of response columns that start at a column of each row's
    own, and may serve several rows: source i's numbers are those of every batch row in
    ``members[owner == i]`` (a span of response tokens that those rows share, run once for all of them:
    ``mmgrpo.model.shared_spans``). ``values[i, j]`` predicts response token ``starts[i] + j`` of those
    rows, for j < ``widths[i]``; the targets are read from batch row ``src_rows[i]``."""

    src_rows: Tensor  # (n,) long: a batch row of each source (its targets over the span)
    values: Tensor  # (n, c, V) logits, or (n, c, H) final hidden states when ``head`` is given
    starts: Tensor  # (n,) long: the response column that column 0 predicts
    widths: Tensor  # (n,) long: how many columns predict a response token
    members: Tensor  # (m,) long: the batch rows given the sources' numbers
    owner: Tensor  # (m,) long: each member's source
    head: Callable[[Tensor], Tensor] | None = None  # (K, H) -> (K, V), for hidden states


def plain_head(model) -> nn.Module | None:
    """``model``'s output embedding when its logits are exactly that layer's output, else None."""
    m = unwrap(model)
    config = getattr(m, "config", None)
    if config is None or getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    for c in (config, getattr(config, "text_config", None)):
        if c is not None and any(getattr(c, key, None) not in (None, 1, 1.0) for key in AFTER_HEAD):
            return None
    head = m.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def final_hidden(model, head: nn.Module, **kwargs) -> Tensor:
    """``model(**kwargs)``'s final hidden states at the columns its head would have scored, (n, c, H); the
    head is given none of them (it returns (n, 0, V))."""
    seen: list[Tensor] = []

    def take(_module, args):
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])  # (n, 0, H)

    handle = head.register_forward_pre_hook(take)
    try:
        model(**kwargs)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"expected the model's head to run once in a forward, it ran {len(seen)} times")
    return seen[0]
