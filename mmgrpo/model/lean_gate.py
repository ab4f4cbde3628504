"""The gate of the lean paths: which models they may serve, and the numeric check each path passes first.

The lean paths (``lean``: decode step and later-turn block; ``lean_pass``: training pass; ``lean_prompt``:
prompt encoding) call a model's modules directly instead of its forward. That is only right for a model
whose forward does nothing beyond what they reproduce, and a module layout does not say so: Granite scales
embeddings, residuals and logits, ERNIE 4.5 and Helium rotate interleaved pairs, OLMo clips q/k/v,
Nemotron rotates part of each head, Mistral v0.1 and Starcoder2 attend a sliding window; each has the
Llama-style children the lean step looks for. So a model gets a lean path only when

1. its model type and its text model's type are on an explicit list (``MODEL_TYPES``, ``TEXT_TYPES``),
   each covered by tests/test_model_families_all.py, and its config sets nothing the lean paths ignore
   (``refusal``); and
2. at first use, that path's numbers on a short probe (``Probe``: two rows of a few tokens) equal the
   model's own forward over the same tokens (``agrees``: log-probs within ``tolerance``).

Everything else runs through the model's own forward: slower on the CPU, never a different function. A
refusal or a failed check is said once per model and path, in one line.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from mmgrpo.model.adapters import unwrap

log = logging.getLogger("mmgrpo")

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"})
"""Model types (``config.model_type``) whose forward, on text, is its text model's forward then the LM
head, nothing else (read in the transformers sources of each)."""
TEXT_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"}
)
"""Text model types whose decoder layers the lean paths reproduce: RMS norms, q/k/v/o projections (q/k
norms per head: Qwen3), rotary embedding over whole heads in halves, a gated MLP, no multipliers."""

PROBE_TOKENS = 12
"""Tokens per probe row: a prompt of ``PROBE_TOKENS - 4`` then a decode step, a block and more steps."""


def refusal(model) -> str | None:
    """Why the lean paths must not serve ``model`` (None: they may, subject to the numeric check)."""
    return refusal_of_config(bare(model).config)


def refusal_of_config(config) -> str | None:
    """``refusal`` read from a model's config alone."""
    text = config.get_text_config()
    kind, text_kind = getattr(config, "model_type", None), getattr(text, "model_type", None)
    if kind not in MODEL_TYPES or text_kind not in TEXT_TYPES:
        shown = kind if kind == text_kind else f"{kind} (text: {text_kind})"
        return f"model type {shown} is not on the list the lean paths reproduce"
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
        return "some layers attend a sliding window"
    if (
        getattr(text, "sliding_window", None) is not None
        and getattr(text, "use_sliding_window", None) is not False
    ):
        return f"sliding-window attention (window {text.sliding_window})"
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "clip_qkv"):
        if getattr(text, key, None):
            return f"config sets {key}"
    if getattr(text, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "the rotary embedding covers part of each head"
    return None


def bare(model):
    """The Hugging Face model under Accelerate / DDP and PEFT wrappers."""
    m = unwrap(model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m


class Probe:
    """A few tokens (N, T) and the model's own forward over them: ``logprobs`` (N, T, V), float32."""

    def __init__(self, model) -> None:
        m = unwrap(model)
        config = bare(model).config
        text = config.get_text_config()
        special = {
            v
            for c in (config, text)
            for k, v in vars(c).items()
            if isinstance(v, int) and (k.endswith("token_id") or k.endswith("token_index"))
        }
        usable = [i for i in range(3, min(text.vocab_size, 259)) if i not in special]
        N, T = 2, PROBE_TOKENS
        picks = [(7 * j + 3 * (j // T)) % len(usable) for j in range(N * T)]
        device = next(m.parameters()).device
        self.ids = torch.tensor([usable[p] for p in picks], device=device).view(N, T)  # (N, T)
        self.prompt = T - 4  # P: prompt columns
        self._model = weakref.ref(m)
        with quiet(model):
            out = m(input_ids=self.ids, attention_mask=torch.ones_like(self.ids))
        self.logprobs = out.logits.float().log_softmax(-1)  # (N, T, V)

    def prefill(self, length: int):
        """The model's own cache of the first ``length`` columns of every row."""
        m, ids = self._model(), self.ids[:, :length]
        with quiet(m):
            out = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        return out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.x

    def positions(self, first: int, last: int, mrope: bool) -> Tensor:
        """Positions first..last-1 of every row: (N, W), or (3, N, W) with M-RoPE."""
        pos = torch.arange(first, last, device=self.ids.device).expand(self.ids.shape[0], -1)  # (N, W)
        return pos.unsqueeze(0).expand(3, -1, -1) if mrope else pos


class quiet:
    """No graph and eval mode (no dropout) while a probe runs; the model's mode restored after. Autocast is
    left as the caller has it: a path is checked in the precision it will run in."""

    def __init__(self, model) -> None:
        self.model = unwrap(model)

    def __enter__(self):
        self.training = self.model.training
        self.model.train(False)
        self.grad = torch.no_grad()
        self.grad.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.grad.__exit__(*exc)
        self.model.train(self.training)


def tolerance(model) -> float:
    """The largest log-prob difference a fast path may show against the forward: float32 summation order
    moves a tiny model's log-probs by about 1e-6; half-precision weights or bf16 autocast (the precision the
    path runs in) by a few 1e-3."""
    first = next(unwrap(model).parameters())
    half = first.dtype not in (torch.float32, torch.float64)
    device = first.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (torch.bfloat16, torch.float16):
        half = True
    return 5e-2 if half else 1e-4


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe(model) -> Probe:
    """A probe of the model as its weights are now (never kept: training changes what the forward gives)."""
    return Probe(model)


def agrees(model, path: str, run: Callable[[Probe], list[tuple[Tensor, Tensor]]] | None) -> bool:
    """Whether ``path`` (a name for the line) may serve ``model``: ``run(probe)`` returns pairs of its
    logits (..., V) and the forward's log-probs at the same places (None: the path has nothing to run for
    this model's layout); decided once per model and path. A
    refused model or a disagreement is said in one line, and the path is then left out."""
    key = bare(model)
    verdicts = _VERDICTS.setdefault(key, {})
    if path not in verdicts:
        verdicts[path] = _judge(model, path, run)
    return verdicts[path]


def _judge(model, path: str, run) -> bool:
    why = refusal(model)
    if why is None and run is None:
        why = f"the {bare(model).config.model_type} layers are not the layout the lean paths reproduce"
    if why is not None:
        _say_once(model, f"mmgrpo: {why}: the model's own forward runs (exact, slower on the CPU)")
        return False
    p = probe(model)
    try:
        with quiet(model):
            gap = max((got.float().log_softmax(-1) - want).abs().max().item() for got, want in run(p))
    except Exception as e:  # a layout it cannot run: the same answer as a disagreement
        gap, detail = float("inf"), f"{type(e).__name__}: {e}"
    else:
        detail = f"log-probs {gap:.1e} apart"
    if not gap <= tolerance(model):
        kind = bare(model).config.model_type
        _say_once(
            model,
            f"mmgrpo: the lean {path} differs from the {kind} forward ({detail}): the model's own forward runs",
        )
        return False
    return True


_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _say_once(model, line: str) -> None:
    said = _SAID.setdefault(bare(model), set())
    if line not in said:
        said.add(line)
        log.warning(line)


def verdicts(model) -> dict[str, bool]:
    """The paths judged so far for ``model`` and their verdicts (for tests and diagnostics)."""
    return dict(_VERDICTS.get(bare(model), {}))
