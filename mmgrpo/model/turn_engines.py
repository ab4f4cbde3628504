"""Generation behind one interface: the rollout asks for turns, an engine samples them.

A rollout opens an engine on its batch's prompts (``begin``: B prompts, G episodes each), then sends each
episode's next turn as a ``TurnRequest`` (the episode's ids after its prompt, its env turns' images, a token
budget) with ``submit`` and takes sampled turns back with ``poll`` (``TurnResult``: ids up to and including
the stop id, whether it stopped, each token's log-prob as sampled). Token ids and images in, token ids and
log-probs out; how the turn is computed is the engine's business:

- ``InProcessTurns``: mmgrpo's own decode loop in this process. It batches: the rollout sends every live
  episode's turn before polling (``batches_turns``), turn 1 encodes each prompt once for its G episodes,
  and later turns continue the key/value cache kept since (``mmgrpo.model.turns``) or, where the family
  cannot keep one, encode the episodes' whole sequences again.
- ``EngineTurns``: an engine in another process (vLLM, ``mmgrpo.model.vllm_engine``) whose requests end on
  their own: each episode is its own stream, so one episode's turn is sampled while another's tool runs
  (or, with ``rollout.vllm_streams: false``, turn by turn as the in-process engine).

``turn_engine(policy, ...)`` picks one for a policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.turns import TurnDecoder, supported


@dataclass
class TurnRequest:
    """One episode's next turn. ``response_ids``: its ids after the prompt so far (empty on turn 1);
    ``images``: the images of its env turns so far, one entry per turn that brought any; ``latest``: those
    of its newest env turn (possibly empty)."""

    row: int
    group: int
    response_ids: list[int]
    max_tokens: int
    images: list[VisionInputs] = field(default_factory=list)
    latest: VisionInputs | None = None


@dataclass
class TurnResult:
    """A sampled turn: ``ids`` up to and including the first stop id; ``finished``: whether it had one (False:
    cut at the request's max_tokens); ``logprobs`` per id as sampled, None from a sampler that gives none."""

    row: int
    ids: list[int]
    finished: bool
    logprobs: list[float] | None


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def own_sampler(policy) -> bool:
    """Whether ``policy`` samples with a ``generate`` of its own (a subclass's): no log-probs, no cache."""
    from mmgrpo.model.policy import Policy

    return getattr(policy.generate, "__func__", None) is not Policy.generate


def positions_limit(policy) -> int | None:
    """The model's positions (``max_position_embeddings``), a budget for every episode; None when unknown."""
    from mmgrpo.model.adapters import unwrap

    return getattr(unwrap(policy.model).config.get_text_config(), "max_position_embeddings", None)


def turn_engine(policy, sampling: Sampling, *, keep_cache: bool = True):
    """The engine that samples ``policy``'s turns: its ``sampler`` (an engine in another process) when it has
    one, else the in-process decode loop (``keep_cache``: continue the key/value cache across turns where the
    family can)."""
    if getattr(policy, "sampler", None) is not None and not own_sampler(policy):
        return EngineTurns(policy, sampling)
    return InProcessTurns(policy, sampling, keep_cache=keep_cache)


class InProcessTurns:
    """mmgrpo's decode loop (see the module docstring). ``poll`` samples every turn submitted since the last
    poll in one batch, rows in episode order, and returns them all."""

    batches_turns = True

    def __init__(self, policy, sampling: Sampling, *, keep_cache: bool = True) -> None:
        self.policy, self.sampling = policy, sampling
        self.own = own_sampler(policy)
        in_process = getattr(policy, "sampler", None) is None  # a subclass's generate may still call one
        self.keep_cache = keep_cache and in_process and not self.own and supported(policy)
        self.pending: list[TurnRequest] = []

    def begin(self, prompt_ids: Tensor, prompt_mask: Tensor, vision: VisionInputs, group_size: int) -> None:
        """The batch's prompts: ids and mask (B, P) left-padded, their images; G episodes per prompt."""
        self.prompt_ids, self.prompt_mask, self.vision, self.G = prompt_ids, prompt_mask, vision, group_size
        self.decoder: TurnDecoder | None = None
        self.pending = []

    def submit(self, requests: list[TurnRequest]) -> None:
        self.pending += requests

    def poll(self) -> list[TurnResult]:
        requests, self.pending = sorted(self.pending, key=lambda r: r.row), []
        if not requests:
            return []
        if not any(r.response_ids for r in requests):
            ids, finished, logprobs = self._first(requests)
        else:
            ids, finished, logprobs = self._next(requests)
        out = []
        for k, r in enumerate(requests):
            row_ids, done = ids[k], finished[k]
            if len(row_ids) > r.max_tokens:  # a row past its own budget ends there, unfinished
                row_ids, done = row_ids[: r.max_tokens], False
            lps = None if logprobs is None else logprobs[k][: len(row_ids)]
            out.append(TurnResult(r.row, row_ids, done, lps))
        return out

    def end(self) -> None:
        self.decoder, self.pending = None, []

    def _first(self, requests: list[TurnRequest]):
        """Turn 1 of every episode: each prompt encoded once, G samples of it."""
        n = self.prompt_ids.shape[0] * self.G
        if [r.row for r in requests] != list(range(n)):
            raise ValueError(
                f"turn 1 is sampled for all {n} episodes at once, got rows {[r.row for r in requests]}"
            )
        most = max(r.max_tokens for r in requests)
        if self.keep_cache:  # the cache lives on for the later turns
            self.decoder = TurnDecoder(self.policy, **vars(self.sampling))
            self.decoder.keep_logprobs = True
            ids, finished = self.decoder.first(self.prompt_ids, self.prompt_mask, self.vision, self.G, most)
            return ids, finished, self.decoder.last_logprobs
        return self._generate(self.prompt_ids, self.prompt_mask, self.vision, self.G, most)

    def _next(self, requests: list[TurnRequest]):
        """A later turn: on the kept cache when it can go on, else the episodes' whole sequences again."""
        most = max(r.max_tokens for r in requests)
        latest = [r.latest if r.latest is not None else VisionInputs.none(1) for r in requests]
        if self.decoder is not None and self.decoder.can_continue(latest):
            rows = [r.row for r in requests]
            ids, finished = self.decoder.next(rows, [r.response_ids for r in requests], latest, most)
            return ids, finished, self.decoder.last_logprobs
        self.decoder = None  # re-encoded from here on: a kept cache would miss this turn
        groups = [r.group for r in requests]
        prompts = [self.prompt_ids[g][self.prompt_mask[g].bool()].tolist() for g in groups]
        seqs = [p + r.response_ids for p, r in zip(prompts, requests, strict=True)]
        ids_k, mask_k = pad_left(seqs, self.policy.pad_token_id)  # (n, L)
        vision = VisionInputs.join(
            self.vision.select(groups),
            VisionInputs.concat_rows([VisionInputs.one_sequence(r.images) for r in requests]),
        )
        return self._generate(ids_k, mask_k, vision, 1, most)

    def _generate(self, ids: Tensor, mask: Tensor, vision: VisionInputs, G: int, max_new_tokens: int):
        kw = {} if self.own else {"return_logprobs": True}
        out = self.policy.generate(
            ids, mask, vision, max_new_tokens=max_new_tokens, num_samples=G, **vars(self.sampling), **kw
        )
        return out if kw else (*out, None)


class EngineTurns:
    """An engine in another process (``policy.sampler``, see the module docstring): each request is sampled
    on its own and comes back when it ends. The engine takes the prompt's ids with one placeholder per image
    and the images as the policy's own image features (``vllm_engine.image_inputs``)."""

    def __init__(self, policy, sampling: Sampling) -> None:
        self.policy, self.engine = policy, policy.sampler
        self.batches_turns = not getattr(self.engine, "streams", True)
        self.sampling = {
            "temperature": max(float(sampling.temperature), 0.0),
            "top_p": float(sampling.top_p),
            "top_k": int(sampling.top_k),
        }
        self.stop_ids = [int(i) for i in policy.stop_ids]

    def begin(self, prompt_ids: Tensor, prompt_mask: Tensor, vision: VisionInputs, group_size: int) -> None:
        from mmgrpo.model.vllm_engine import image_inputs

        self.engine.sync(self.policy.model)  # weights pushed when an optimizer stepped since
        self.prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        self.vision = vision
        self.group_images = image_inputs(self.policy, vision, len(self.prompts))  # once per task, not per row

    def submit(self, requests: list[TurnRequest]) -> None:
        from mmgrpo.model.vllm_engine import image_inputs, one_placeholder

        sent = []
        for r in requests:
            seq = self.prompts[r.group] + r.response_ids
            if not r.images:
                images = None if self.group_images is None else self.group_images[r.group]
            else:
                row = VisionInputs.join(self.vision.select([r.group]), VisionInputs.one_sequence(r.images))
                images = image_inputs(self.policy, row, 1)[0]
            if images is not None:
                seq = one_placeholder(seq, self.policy.image_token_id)
            sent.append(
                {
                    "id": r.row,
                    "prompt": seq,
                    "images": images,
                    "max_tokens": r.max_tokens,
                    "stop_ids": self.stop_ids,
                    **self.sampling,
                }
            )
        self.engine.submit(sent)

    def poll(self) -> list[TurnResult]:
        done, _ = self.engine.poll()
        out = []
        for row, ids, logprobs in done:
            (ids,), (finished,) = self.policy._cut_at_stop([ids])
            out.append(TurnResult(row, ids, finished, list(logprobs[: len(ids)])))
        return out

    def end(self) -> None:
        pass


def pad_left(seqs: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Left-pad lists of ids: ids (n, L) and mask (n, L)."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)  # (n, L)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)  # (n, L)
    for k, s in enumerate(seqs):
        ids[k, L - len(s) :] = torch.as_tensor(s, dtype=torch.long)
        mask[k, L - len(s) :] = 1
    return ids, mask
