"""What a model must do for mmgrpo to train it as the function it computes, checked once when it is loaded.

GRPO samples a response token by token on a KV cache, then scores the whole sequence in one pass, and
trains on the ratio of the two. That is only right when (1) the model is causal: a position's logits do
not read later tokens (BERT-style "LM heads" with ``is_decoder=False`` attend both ways); (2) its forward
returns a cache; and (3) mmgrpo's sampler, on the model's own cache (prompt encoded once, the cache
repeated per sample, rows selected as episodes end), gives the log-probs of one plain forward over the
same tokens. State-space and hybrid models whose caches carry more than keys and values (Mamba, Falcon-H1,
MiniMax's linear attention, ...) can fail (3). A model that fails any of them is refused with one line
naming what failed, before any training: never trained as a function it does not compute.

The check runs on a few tokens (``lean_gate.Probe``), without a graph or dropout, in the policy's autocast,
and leaves the random state as it was.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import DynamicCache

from mmgrpo.errors import ConfigError
from mmgrpo.model import engine, lean_gate
from mmgrpo.model.adapters import unwrap
from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.prefix import PLAIN_LAYERS

SAMPLED_TOKENS = 4
"""Tokens each probe row samples for check (3)."""


def check(model, adapter, precision=None) -> None:
    """Raise ``ConfigError`` naming what failed when ``model`` is not one mmgrpo can train exactly; under
    ``precision`` (an autocast context: the one every forward of the policy runs in), or as the caller has it."""
    kind = getattr(lean_gate.bare(model).config, "model_type", type(model).__name__)
    device = next(unwrap(model).parameters()).device
    # the probe's samples leave every random state as it was, the GPU's too
    devices = [device] if device.type == "cuda" else []
    with (
        precision or contextlib.nullcontext(),
        lean_gate.quiet(model),
        torch.random.fork_rng(devices=devices),
    ):
        p = lean_gate.probe(model)
        ids, P = p.ids, p.prompt  # (N, T)
        tol = lean_gate.tolerance(model)
        changed = ids.clone()
        changed[:, -1] = ids[:, 0]
        out = unwrap(model)(input_ids=changed, attention_mask=torch.ones_like(changed), use_cache=True)
        earlier = out.logits.float().log_softmax(-1)[:, :-1]  # (N, T - 1, V)
        if (earlier - p.logprobs[:, :-1]).abs().max().item() > tol:
            raise ConfigError(
                f"model type '{kind}' is not causal: its logits at a position change with a later token "
                "(an encoder's LM head attends both ways). GRPO needs a decoder: set is_decoder=True in its "
                "config if it has one, or choose a causal LM."
            )
        cache = out["cache"] if "cache" in out else getattr(out, "past_key_values", None)
        if cache is None:
            raise ConfigError(
                f"model type '{kind}' returns no KV cache from its forward, which mmgrpo's sampler decodes on; "
                "choose a model whose forward takes use_cache=True."
            )
        odd = sorted({type(x).__name__ for x in getattr(cache, "layers", []) if type(x) not in PLAIN_LAYERS})
        if getattr(cache, "layers", None) and type(cache) is not DynamicCache:
            odd.insert(0, type(cache).__name__)  # a subclass: the model keeps more in it than its layers
        if odd:
            raise ConfigError(
                f"model type '{kind}' keeps state besides keys and values in its cache ({', '.join(odd)}: "
                "state-space, linear or compressed attention), which mmgrpo's shared-prompt sampler and training "
                "pass cannot repeat or select per row. This model type is not supported."
            )
        torch.manual_seed(0)
        vocab = p.logprobs.shape[-1]
        stops = list(range(0, vocab, 2))  # about half the tokens end a row: rows end at different steps
        try:
            new, lps = engine.generate(
                model,
                adapter,
                ids[:, :P],
                torch.ones_like(ids[:, :P]),
                VisionInputs.none(len(ids)),
                G=2,
                max_new_tokens=SAMPLED_TOKENS,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                stop_ids=stops,
                pad_token_id=int(ids[0, 0]),
                device=ids.device,
                return_logprobs=True,
            )  # (2N, S) each
            rows = torch.arange(len(ids), device=ids.device).repeat_interleave(2)  # (2N,)
            gap = 0.0
            for r in range(len(rows)):  # each row up to its stop token, through one plain forward
                row = new[r].tolist()
                end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
                full = torch.cat([ids[rows[r], :P], new[r, :end].to(ids.device)])[None]  # (1, P + end)
                logits = unwrap(model)(input_ids=full, attention_mask=torch.ones_like(full)).logits.float()
                plain = logits[0, P - 1 : -1].log_softmax(-1).gather(-1, full[0, P:, None])[:, 0]  # (end,)
                gap = max(gap, (plain - lps[r, :end].to(plain.device).float()).abs().max().item())
        except Exception as e:
            detail = f"it fails ({type(e).__name__}: {str(e)[:120]})"
        else:
            detail = f"its sampled log-probs are {gap:.1e} from one forward over the same tokens"
            if gap <= tol:
                return
    raise ConfigError(
        f"model type '{kind}': mmgrpo's sampler on the model's own cache does not reproduce its forward ({detail}); "
        "its cache holds state mmgrpo cannot repeat or select per row (state-space, hybrid or compressed "
        "attention). This model type is not supported."
    )
