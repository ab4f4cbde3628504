"""The lean decode step's shortcuts give the numbers of the plain computation.

- ``prefix.grouped_attention`` on the CPU is two flash-attention calls (a group's prompt, a row's own
  tokens) merged by their log-sum-exps: it must equal attention over each row's whole sequence, padding
  holes and a grid with empty cells included;
- ``LeanStep.joined`` stacks q, k, v (and gate, up) into one product per layer for a decode loop: the
  logits must equal those of the separate modules, for Qwen2.5-VL (q/k/v biases) and Qwen3 (per-head q/k
  norms), and LoRA-wrapped projections must keep their modules;
- ``LeanStep.rotations`` takes a decode loop's rotary cos / sin from one table: they must be the rotary
  embedding's own, bit for bit, in every family the lean step serves.
"""

from __future__ import annotations

import pytest
import torch

from mmgrpo.model import engine, lean
from mmgrpo.model import prefix as prefix_mod
from mmgrpo.model.batch import VisionInputs
from mmgrpo.model.prefix import SharedPrefix, grouped_attention


def _whole_row_attention(q, keys, values, own_mask, pre, group) -> torch.Tensor:
    """Attention of each row over [its group's prompt, its own tokens] in float64, masks applied."""
    rows = []
    for r in range(q.shape[0]):
        b = int(group[r])
        k = torch.cat([pre.all_keys[0][b], keys[r]], dim=-2).double()  # (Hk, P + R, D)
        v = torch.cat([pre.all_values[0][b], values[r]], dim=-2).double()
        m = torch.cat([pre.all_mask[b], own_mask[r]]).bool()  # (P + R,)
        s = torch.matmul(q[r].double(), k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (Hk, g, P + R)
        s = s.masked_fill(~m, float("-inf"))
        rows.append(torch.matmul(s.softmax(dim=-1), v))  # (Hk, g, D)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("live", [None, [0, 2, 3, 5]], ids=["full-grid", "rows-left"])
def test_merged_attention_equals_attention_over_the_whole_row(monkeypatch, dtype, tol, live):
    gen = torch.Generator().manual_seed(0)
    B, Hk, g, P, R, D = 3, 2, 2, 11, 6, 16
    keys = [torch.randn(B, Hk, P, D, generator=gen).to(dtype)]
    values = [torch.randn(B, Hk, P, D, generator=gen).to(dtype)]
    pmask = torch.ones(B, P, dtype=torch.long)
    pmask[0, :3] = 0  # left padding of a shorter prompt
    pmask[1, 7:9] = 0  # a hole (the shared opening's padding)
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    pre = SharedPrefix(keys, values, pmask, group)
    n = len(group)
    q = torch.randn(n, Hk, g, D, generator=gen).to(dtype)
    own_k = torch.randn(n, Hk, R, D, generator=gen).to(dtype)
    own_v = torch.randn(n, Hk, R, D, generator=gen).to(dtype)
    own_mask = torch.ones(n, R, dtype=torch.long)
    own_mask[1, 2] = own_mask[4, 0] = 0  # a finished turn's masked column
    if live is not None:  # episodes ended: group 1 keeps one row, group 0 none of its first
        at = torch.tensor(live)
        pre.select(at)
        group, q, own_k, own_v, own_mask = group[at], q[at], own_k[at], own_v[at], own_mask[at]
        assert not pre.grid.identity
    bias = torch.zeros(own_mask.shape, dtype=dtype).masked_fill(own_mask == 0, torch.finfo(dtype).min)
    bias = bias[:, None, None, :]  # (n, 1, 1, R)
    want = _whole_row_attention(q, own_k, own_v, own_mask, pre, group)
    got = {}
    monkeypatch.setattr(prefix_mod, "MERGED_MIN_PREFIX", 0)  # the merged form at any prompt length
    for merged in (True, False):
        monkeypatch.setattr(prefix_mod, "MERGED", merged)
        got[merged] = grouped_attention(q, own_k, own_v, bias, pre, 0, D**-0.5)
        assert got[merged].dtype == dtype and got[merged].shape == q.shape
        assert (got[merged].double() - want).abs().max() < tol
    assert (got[True].double() - got[False].double()).abs().max() < tol


def _decode_logits(policy, joined_on: bool, steps: int = 6, table: bool = False) -> list[torch.Tensor]:
    """Logits of ``steps`` lean decode steps (fixed tokens) from two prompts x G=3 sharing an opening."""
    m, ad = policy.model.eval(), policy.adapter
    gen = torch.Generator().manual_seed(1)
    vocab = m.config.get_text_config().vocab_size
    head = torch.randint(5, vocab - 5, (1, 20), generator=gen).repeat(2, 1)
    ids = torch.cat([head, torch.randint(5, vocab - 5, (2, 4), generator=gen)], dim=1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    step = lean.stepper(m, ad.uses_mrope(m))
    assert step is not None
    out = []
    with torch.no_grad():
        _, st = engine.start(m, ad, ids, mask, VisionInputs.none(2), 3, torch.device("cpu"))
        joined = step.joined() if joined_on else None
        if joined_on:
            assert joined is not None
        tokens = torch.randint(5, vocab - 5, (steps, 6), generator=gen)
        for t in tokens:
            st.mask = torch.cat([st.mask, torch.ones(6, 1, dtype=st.mask.dtype)], dim=1)
            rot = step.rotations(int(st.next_pos.min()), int(st.next_pos.max()) + steps) if table else None
            out.append(step(t, st.next_pos, st.mask, st.cache, st.prefix, joined, rot))
            st.next_pos = st.next_pos + 1
    return out


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3"])
def test_joined_projections_give_the_separate_modules_logits(tmp_path, family):
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import build_tiny_family

    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    step = lean.stepper(policy.model, policy.adapter.uses_mrope(policy.model))
    joined = step.joined()
    assert all(j.qkv is not None and j.gate_up is not None and j.o is not None for j in joined)
    if family == "qwen2.5-vl":
        assert all(j.qkv_bias is not None for j in joined)  # q, k, v carry biases there
    for a, b in zip(_decode_logits(policy, True), _decode_logits(policy, False), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava", "qwen3", "llama"])
def test_the_rotary_table_is_the_rotary_embedding_bit_for_bit(tmp_path, family):
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import build_tiny_family

    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    step = lean.stepper(policy.model, policy.adapter.uses_mrope(policy.model))
    table = step.rotations(3, 300)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 32, 33):
        pos = torch.randint(3, 301, (n,), generator=gen)
        h = step.text.embed_tokens(torch.zeros(n, dtype=torch.long))
        want, got = step._rotary(h, pos), table.at(pos)  # cos, sin (n, 1, D) each
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    # and a decode loop with the table gives the logits of one without it, exactly
    for a, b in zip(_decode_logits(policy, True, table=True), _decode_logits(policy, True), strict=True):
        assert torch.equal(a, b)


def test_the_rotary_table_is_refused_where_frequencies_follow_the_positions(tmp_path, monkeypatch):
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import build_tiny_family

    policy = Policy.from_pretrained(build_tiny_family("llama", tmp_path / "m"))
    step = lean.make_stepper(policy.model)
    monkeypatch.setattr(step.text.rotary_emb, "rope_type", "dynamic")
    assert step.rotations(0, 10) is None


def test_joined_projections_are_left_out_when_large_or_wrapped(tmp_path, monkeypatch):
    from mmgrpo.model.io import LoraSpec, apply_lora
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import build_tiny_family

    policy = Policy.from_pretrained(build_tiny_family("qwen3", tmp_path / "m"))
    step = lean.make_stepper(policy.model)
    monkeypatch.setattr(lean, "FUSE_MAX_BYTES", 0)
    assert step.joined() is None  # the copies would cost more than allowed: the modules run
    monkeypatch.undo()
    wrapped = apply_lora(policy.model, LoraSpec(r=2, alpha=4, target_modules=["q_proj", "gate_proj"]))
    with torch.no_grad():  # a LoRA update that changes the numbers
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    step = lean.make_stepper(wrapped)
    joined = step.joined()
    assert all(
        j.qkv is None and j.gate_up is None for j in joined
    )  # wrapped: never stacked from base weights
    assert all(j.o is not None for j in joined)  # o_proj is not wrapped: its own weight, no module call


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3"])
def test_a_turns_text_block_on_the_shared_prompt_equals_the_model_forward(tmp_path, family):
    """``LeanStep.block`` (a later turn's new tokens, left-padded, on the cache whose prompts are held once
    per group) gives the model's own forward over the materialised rows: the same next-token logits, and
    a cache on which the next decode step gives the same logits too."""
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import build_tiny_family

    policy = Policy.from_pretrained(build_tiny_family(family, tmp_path / "m"))
    m, ad = policy.model.eval(), policy.adapter
    step = lean.stepper(m, ad.uses_mrope(m))
    gen = torch.Generator().manual_seed(3)
    vocab = m.config.get_text_config().vocab_size
    ids = torch.cat(
        [
            torch.randint(5, vocab - 5, (1, 20), generator=gen).repeat(2, 1),
            torch.randint(5, vocab - 5, (2, 4), generator=gen),
        ],
        1,
    )
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    cpu = torch.device("cpu")
    states = []
    with torch.no_grad():
        for _ in range(2):
            _, st = engine.start(m, ad, ids, mask, VisionInputs.none(2), 3, cpu)
            for t in torch.randint(5, vocab - 5, (3, 6), generator=torch.Generator().manual_seed(4)):
                st.mask = torch.cat([st.mask, torch.ones(6, 1, dtype=st.mask.dtype)], dim=1)
                step(t, st.next_pos, st.mask, st.cache, st.prefix)
                st.next_pos = st.next_pos + 1
            st.mask[2, -2] = 0  # a column a row skipped (it had stopped)
            states.append(st)
        block = torch.randint(5, vocab - 5, (6, 5), generator=gen)
        bmask = torch.ones_like(block)
        bmask[0, :3] = bmask[4, :1] = 0  # left padding of shorter turns
        pos, after = ad.block_positions(m, block, bmask, VisionInputs.none(6), states[0].next_pos)
        full = torch.cat([states[0].mask, bmask], dim=1)
        lean_st, hf_st = states
        engine.reserve(lean_st.cache, 5)
        got = step.block(block, pos, full, lean_st.cache, lean_st.prefix, step.joined())
        cache = hf_st.prefix.materialize(hf_st.cache)
        kw = {engine.cache_kwarg(m): cache}  # `cache` in recent transformers; past_key_values goes in 5.40
        want = m(input_ids=block, attention_mask=full, position_ids=pos, use_cache=True, **kw).logits[:, -1]
        hf_st.prefix.strip(cache, hf_st.cache)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        nxt = torch.randint(5, vocab - 5, (6,), generator=gen)
        full = torch.cat([full, torch.ones(6, 1, dtype=full.dtype)], dim=1)
        after_lean = step(nxt, after, full, lean_st.cache, lean_st.prefix)
        after_hf = step(nxt, after, full, hf_st.cache, hf_st.prefix)
        torch.testing.assert_close(after_lean, after_hf, atol=1e-5, rtol=1e-5)
