"""Every causal-LM and image-text-to-text family the installed transformers ships: the lean paths serve it
exactly, or refuse it and it runs through its own forward (mmgrpo.model.lean_gate).

A small random model of each family is built from its default config with the sizes shrunk
(``small_config``); a family whose default config does not survive the shrinking, or whose own forward
fails on a few tokens, is listed as not built (a limit of this generic shrinking, not of mmgrpo, which
loads checkpoints as they are). For every text family that builds, through mmgrpo's own paths with the tiny
Llama tokenizer: a group of samples with their log-probs, then the training pass: sampled = trained =
the model's plain forward within 1e-5 (a GRPO step's importance ratio is 1 at step 1). Families with a
``sliding_window`` get a window of 4 tokens, so every sequence runs past it. Image-text-to-text families
off the gate's list are checked to be refused before any lean code touches them (built on the meta
device: nothing of theirs runs); those on it are built small and must pass every path's probe.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from mmgrpo.errors import ConfigError
from mmgrpo.model import lean, lean_gate, lean_pass, lean_prompt
from mmgrpo.model.adapters import adapter_for
from mmgrpo.model.batch import TokenBatch, pad_right
from mmgrpo.model.policy import Policy
from mmgrpo.tiny.families import build_tiny_family

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_dim": 128,
    "depth": 2,
    "embed_dim": 64,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rotary_dim": 8,
    "n_positions": 256,
}
EXTRA_CASES = {
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "granite-multipliers": (
        "granite",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
            "attention_multiplier": 0.3,
        },
    ),
    "olmo-clip_qkv": ("olmo", {"clip_qkv": 0.05}),
    "nemotron-partial-rotary": (
        "nemotron",
        {"num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5},
    ),
}
"""Variants besides each family's default: Mistral without a window is the Llama stack (on the gate's list);
the others are the review's models that the module-name check accepted and computed wrongly."""
TOL = 1e-5


def small_config(model_type: str, vocab: int, ids: dict[str, int], extra: dict | None = None):
    """The family's default config with the sizes above, the tokenizer's vocabulary and special ids, and a
    4-token window where it has a sliding window."""
    config = AutoConfig.for_model(model_type)

    def shrink(c, text: bool) -> None:
        for k, v in SIZES.items():
            if isinstance(getattr(c, k, None), int):
                with contextlib.suppress(Exception):
                    setattr(c, k, v)
        if text and isinstance(getattr(c, "vocab_size", None), int):
            c.vocab_size = vocab
            for k, v in ids.items():
                if hasattr(c, k):
                    setattr(c, k, v)
        if getattr(c, "sliding_window", None) is not None:
            c.sliding_window = 4
        kinds, layers = getattr(c, "layer_types", None), getattr(c, "num_hidden_layers", None)
        if isinstance(kinds, list) and isinstance(layers, int) and len(kinds) > layers:
            c.layer_types = kinds[:layers]  # one kind per layer kept (older transformers do not redo it)
        for v in list(vars(c).values()):
            if hasattr(v, "to_dict") and hasattr(v, "model_type"):
                shrink(v, text)

    shrink(config, True)
    for k, v in (extra or {}).items():
        setattr(config.get_text_config(), k, v)
    return config


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny_family("llama", tmp_path_factory.mktemp("llama") / "model")
    return AutoTokenizer.from_pretrained(path)


def _special_ids(tok) -> dict[str, int]:
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _build(model_type: str, tok, extra=None):
    """A small random causal LM of the family whose own forward runs on a few tokens, or the reason not."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            config = small_config(model_type, len(tok), _special_ids(tok), extra)
            if hasattr(config, "vision_config"):
                return None, "an image-text family (the other test)"
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]))
        return model, None
    except Exception as e:  # the generic shrinking does not fit this family
        return None, f"{type(e).__name__}: {str(e)[:80]}"


def _grpo_step_ratios(policy: Policy) -> tuple[float, float]:
    """max |sampled - trained| and max |trained - plain forward| over a group of 2 prompts x 2 samples."""
    obs = [[{"role": "user", "content": "what is 12 plus 30 ? answer with the number"}]] * 2
    ids, mask, vision = policy.encode_prompts(obs)
    torch.manual_seed(0)
    comps, _, lps = policy.generate(
        ids, mask, vision, max_new_tokens=6, temperature=1.0, num_samples=2, return_logprobs=True
    )
    rows = [0, 0, 1, 1]
    rid, rmask = pad_right(comps, policy.pad_token_id)
    tok = TokenBatch(ids[rows], mask[rows], rid, rmask, rmask, vision, prompt_index=rows)
    with torch.no_grad():
        trained = policy.logprobs(tok)  # (N, T)
        full, fmask = torch.cat([ids[rows], rid], 1), torch.cat([mask[rows], rmask], 1)
        pos = (fmask.cumsum(1) - 1).clamp(min=0)
        logits = policy.model(input_ids=full, attention_mask=fmask, position_ids=pos).logits.float()
        P = ids.shape[1]
        plain = logits[:, P - 1 : -1].log_softmax(-1).gather(-1, rid[..., None])[..., 0]  # (N, T)
    sampled_gap = max(
        (trained[i, : len(r)] - torch.tensor(r)).abs().max().item() for i, r in enumerate(lps) if r
    )
    plain_gap = max(
        (trained[i, : len(r)] - plain[i, : len(r)]).abs().max().item() for i, r in enumerate(lps) if r
    )
    return sampled_gap, plain_gap


def test_every_causal_lm_family_is_exact_or_refused(tokenizer, caplog):
    cases = {mt: (mt, None) for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} | EXTRA_CASES
    served, refused, not_built, rejected, wrong = [], [], {}, {}, []
    caplog.set_level(logging.WARNING, logger="mmgrpo")
    for name, (model_type, extra) in cases.items():
        model, why = _build(model_type, tokenizer, extra)
        if model is None:
            not_built[name] = why
            continue
        caplog.clear()
        try:
            policy = Policy(model, tokenizer)
            mrope = policy.adapter.uses_mrope(policy.model)
            step = lean.stepper(policy.model, mrope)
            passes = lean_pass.for_model(policy.model, policy.adapter)
            encoder = lean_prompt.for_model(policy.model, policy.adapter)
            sampled_gap, plain_gap = _grpo_step_ratios(policy)
        except ConfigError as e:  # refused at load, in one line that says why (mmgrpo.model.model_check)
            rejected[name] = str(e)
            continue
        except Exception as e:
            wrong.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            continue
        listed = lean_gate.refusal(policy.model) is None
        if step is not None:
            served.append(name)
            if not (listed and passes is not None and encoder is not None):
                wrong.append(f"{name}: a lean step for a model the gate does not list, or a path left out")
            if not all(lean_gate.verdicts(policy.model).values()):
                wrong.append(f"{name}: served although a probe disagreed: {lean_gate.verdicts(policy.model)}")
        else:
            refused.append(name)
            lines = [r.getMessage() for r in caplog.records if r.name == "mmgrpo"]
            if len(lines) != 1 or "own forward runs" not in lines[0]:
                wrong.append(f"{name}: refused without its one line (said: {lines})")
        if not (sampled_gap <= TOL and plain_gap <= TOL):
            wrong.append(f"{name}: sampled-trained {sampled_gap:.1e}, trained-forward {plain_gap:.1e}")
    print(f"\nserved by the lean paths ({len(served)}): {', '.join(served)}")
    print(f"refused, own forward ({len(refused)}): {', '.join(refused)}")
    print(f"rejected at load with one line ({len(rejected)}): {', '.join(rejected)}")
    print(f"not built by the generic shrinking ({len(not_built)}): {', '.join(sorted(not_built))}")
    assert not wrong, "\n".join(wrong)
    assert {"llama", "mistral-no-window", "qwen2", "qwen3"} <= set(served)
    review = (
        "granite-multipliers",
        "ernie4_5",
        "helium",
        "olmo-clip_qkv",
        "nemotron-partial-rotary",
        "mistral",
        "starcoder2",
    )
    for must in review:
        assert must in refused, (must, not_built.get(must))
    assert {"bert", "mamba", "openai-gpt"} <= set(rejected)  # both ways, a state-space cache, no cache
    assert len(served) + len(refused) >= 80  # most of the installed families run here


def test_every_image_text_family_is_refused_before_lean_code_or_served_exactly(tmp_path):
    served, refused, wrong = [], [], []
    for model_type in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception as e:
            wrong.append(f"{model_type}: no default config ({type(e).__name__})")
            continue
        if lean_gate.refusal_of_config(config) is None:
            continue  # on the list: the tiny families below
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForImageTextToText.from_config(config)
        except Exception:
            refused.append(model_type)  # not even constructible here; the gate refuses it by config alone
            continue
        if lean.stepper(model) is not None:
            wrong.append(f"{model_type}: a lean path for a model off the list")
        with contextlib.suppress(ConfigError):  # no adapter: mmgrpo refuses to load it, in one clear line
            if lean_pass.for_model(model, adapter_for(model)) is not None:
                wrong.append(f"{model_type}: a lean pass for a model off the list")
        refused.append(model_type)
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava"):
        policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / family.replace(".", "")))
        assert lean_prompt.for_model(policy.model, policy.adapter) is not None, family
        verdicts = lean_gate.verdicts(policy.model)
        assert verdicts == {"decode step": True, "training pass": True, "prompt encoding": True}, family
        served.append(family)
    print(f"\nserved ({len(served)}): {', '.join(served)}; refused ({len(refused)}): {', '.join(refused)}")
    assert not wrong, "\n".join(wrong)
    assert len(refused) >= 60
