"""The KV cache kept across turns (mmgrpo.model.turns): the same episodes as encoding every turn again, and
sampled log-probs equal to what training computes, on text and on images that arrive mid-episode."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.model import turns
from mmgrpo.rollout.episodes import rollout
from tests.test_multiturn import ZoomOnceEnv


def _rollout(policy, envs, seeds, kv: bool, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return rollout(
        policy, envs, seeds, group_size=4, max_new_tokens=8, temperature=1.0, max_turns=3, kv_across_turns=kv, **kw
    )


def record_turns(monkeypatch) -> list[tuple[list[int], list[list[float]], list[list[int]]]]:
    """From now on every turn's decode is recorded: (its rows, their sampled log-probs, their new ids)."""
    record: list = []
    decode = turns.TurnDecoder._decode

    def recording(self, logits, max_new_tokens):
        self.keep_logprobs = True
        out = decode(self, logits, max_new_tokens)
        record.append((list(self.rows), self.last_logprobs, out[0]))
        return out

    monkeypatch.setattr(turns.TurnDecoder, "_decode", recording)
    return record


def per_episode(record, part: int = 1) -> dict[int, list]:
    """The recorded turns' ``part`` (1: log-probs, 2: ids) joined per episode, in turn order."""
    out: dict[int, list] = {}
    for turn in record:
        for e, x in zip(turn[0], turn[part], strict=True):
            out.setdefault(e, []).extend(x)
    return out


@pytest.fixture
def ragged_stops(tiny_policy):
    """Stop ids that a random model samples often, so rows end their turns at different lengths."""
    old = list(tiny_policy.stop_ids)
    vocab = tiny_policy.model.config.get_text_config().vocab_size
    tiny_policy.stop_ids = sorted(set(old) | set(range(40, vocab, 3)))
    yield tiny_policy
    tiny_policy.stop_ids = old


@pytest.mark.parametrize("with_image", [False, True])
def test_kept_cache_gives_the_episodes_of_encoding_every_turn(ragged_stops, with_image):
    policy = ragged_stops
    seeds = [3, 8]
    runs = []
    for kv in (True, False):
        envs = [ZoomOnceEnv(with_image=with_image, turns_before_end=1 + i % 2) for i in range(8)]  # 2 or 3 turns
        runs.append(_rollout(policy, envs, seeds, kv))
    kept, again = runs
    assert [t.response_ids for t in kept.trajectories] == [t.response_ids for t in again.trajectories]
    assert [t.loss_mask for t in kept.trajectories] == [t.loss_mask for t in again.trajectories]
    assert max(t.turns for t in kept.trajectories) == 3  # episodes really went on for three turns
    assert len({sum(t.loss_mask) for t in kept.trajectories}) > 1  # ragged: turns of different lengths
    assert len({t.turns for t in kept.trajectories}) > 1  # rows leave the cache at different turns


@pytest.mark.parametrize("with_image", [False, True])
def test_sampled_ids_and_logprobs_on_the_kept_cache_are_what_training_reads(tiny_policy, ragged_stops, with_image, monkeypatch):
    policy = tiny_policy
    record = record_turns(monkeypatch)
    envs = [ZoomOnceEnv(with_image=with_image, turns_before_end=2) for _ in range(8)]
    batch = _rollout(policy, envs, [5, 6], True)
    assert len(record) >= 2  # the first turn and at least one turn on the kept cache
    assert_sampled_is_trained(policy, batch, record)


def assert_sampled_is_trained(policy, batch, record) -> None:
    """Each episode's sampled ids and log-probs (``record``, every turn) are the ids training reads and the
    log-probs of one full forward per row (1e-5)."""
    sampled, sampled_ids = per_episode(record), per_episode(record, 2)
    with torch.no_grad():
        trained = policy.logprobs(batch.tokens, share_prompt=False)  # (N, T) one full forward per row
    for i, t in enumerate(batch.trajectories):
        where = [k for k, m in enumerate(t.loss_mask) if m]
        assert [t.response_ids[k] for k in where] == sampled_ids[i]  # trained ids = sampled ids
        got = trained[i, where]
        assert len(where) == len(sampled[i])
        assert torch.allclose(got, torch.tensor(sampled[i]), atol=1e-5), (i, got, sampled[i])


@pytest.mark.parametrize("with_image", [False, True])
def test_new_tokens_run_in_blocks_of_similar_length_with_the_same_episodes(ragged_stops, with_image, monkeypatch):
    """A later turn's new tokens run in several blocks of rows (``engine.length_chunks``, here forced to
    cut wherever lengths differ): the episodes equal one block's and encoding every turn again, and the
    sampled log-probs equal training's full forward per row."""
    from mmgrpo.model import engine

    policy = ragged_stops
    real = engine.length_chunks
    blocks: list[int] = []

    def run(chunks, kv=True):
        monkeypatch.setattr(engine, "length_chunks", chunks)
        envs = [ZoomOnceEnv(with_image=with_image, turns_before_end=1 + i % 2) for i in range(8)]
        return _rollout(policy, envs, [3, 8], kv)

    one = run(lambda lengths, **kw: [list(range(len(lengths)))])
    again = run(real, kv=False)
    record = record_turns(monkeypatch)
    cut = run(lambda lengths, **kw: blocks.append(len(real(lengths, overhead=0))) or real(lengths, overhead=0))
    assert max(blocks) >= 2  # later turns really ran in several blocks
    for other in (one, again):
        assert [t.response_ids for t in cut.trajectories] == [t.response_ids for t in other.trajectories]
        assert [t.loss_mask for t in cut.trajectories] == [t.loss_mask for t in other.trajectories]
    sampled = per_episode(record)
    monkeypatch.setattr(engine, "length_chunks", real)
    with torch.no_grad():
        trained = policy.logprobs(cut.tokens, share_prompt=False)  # (N, T) one full forward per row
    for i, t in enumerate(cut.trajectories):
        where = [k for k, m in enumerate(t.loss_mask) if m]
        assert torch.allclose(trained[i, where], torch.tensor(sampled[i]), atol=1e-5), i


def test_a_family_without_a_continuable_cache_falls_back(ragged_stops, monkeypatch):
    monkeypatch.setattr(type(ragged_stops.adapter), "continues_cache", False)
    assert not turns.supported(ragged_stops)
    made = []
    monkeypatch.setattr(turns.TurnDecoder, "first", lambda *a, **k: made.append(1))
    runs = []
    for kv in (True, False):
        envs = [ZoomOnceEnv(with_image=False, turns_before_end=2) for _ in range(8)]
        runs.append(_rollout(ragged_stops, envs, [1, 2], kv))
    assert not made
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]
    assert max(t.turns for t in runs[0].trajectories) == 3


def test_the_lean_decode_step_samples_what_the_model_forward_samples(ragged_stops, monkeypatch):
    from mmgrpo.model import engine, lean

    assert lean.stepper(ragged_stops.model) is not None  # the tiny Qwen2.5-VL decodes through it
    runs = []
    for on in (True, False):
        monkeypatch.setattr(engine, "LEAN_DECODE", on)
        envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(8)]
        runs.append(_rollout(ragged_stops, envs, [4, 9], True))
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]


def test_text_blocks_through_the_lean_step_sample_what_the_model_forward_samples(ragged_stops, monkeypatch):
    """With ``turns.LEAN_BLOCKS`` (and the merged attention) on, a later turn's text block runs through
    ``LeanStep.block``: the episodes are those of encoding every turn again, token for token."""
    from mmgrpo.model import lean, prefix

    monkeypatch.setattr(turns, "LEAN_BLOCKS", True)
    monkeypatch.setattr(prefix, "MERGED", True)
    monkeypatch.setattr(prefix, "MERGED_MIN_PREFIX", 0)  # the merged form at these short prompts too
    blocks = []
    real = lean.LeanStep.block
    monkeypatch.setattr(lean.LeanStep, "block", lambda self, *a, **k: blocks.append(1) or real(self, *a, **k))
    runs = []
    for kv in (True, False):
        envs = [ZoomOnceEnv(with_image=False, turns_before_end=1 + i % 2) for i in range(8)]
        runs.append(_rollout(ragged_stops, envs, [3, 8], kv))
    assert blocks  # the kept cache took its turns' blocks through the lean step
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]
    assert max(t.turns for t in runs[0].trajectories) >= 2


def test_the_lean_step_is_used_where_the_layout_is_known(tmp_path):
    """The lean step takes the Llama-style stacks of the tiny families and refuses the others (which then
    decode through the model's own forward); it is chosen by layout, never by family name."""
    from mmgrpo.model import lean
    from mmgrpo.model.policy import Policy
    from mmgrpo.tiny.families import FAMILIES, build_tiny_family

    lean_families = {
        f
        for f in FAMILIES
        if lean.make_stepper(Policy.from_pretrained(build_tiny_family(f, tmp_path / f.replace(".", "_"))).model)
    }
    assert lean_families >= {"qwen2-vl", "qwen2.5-vl", "qwen3", "llama"}
    assert not lean_families & {"gemma3", "idefics3"}


def test_the_common_opening_of_a_batch_is_encoded_once_with_the_same_numbers(ragged_stops, monkeypatch):
    """Prompts that begin alike (system message, tools block) share one encoding of that opening: the
    training log-probs and gradients equal those of prompts encoded whole."""
    from mmgrpo.model import system_prefix

    policy = ragged_stops
    envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(8)]
    tok = _rollout(policy, envs, [2, 7], True).tokens
    ids, mask = tok.prompt_ids[::4], tok.prompt_mask[::4]
    stop = set(policy.adapter.suppress_ids) | {policy.adapter.image_token_id}
    assert system_prefix.common_prefix(ids, mask, stop) >= system_prefix.MIN_SHARED
    used = []
    real = system_prefix.encode_prompts
    monkeypatch.setattr(system_prefix, "encode_prompts", lambda *a: used.append(1) or real(*a))
    results = []
    for min_shared in (system_prefix.MIN_SHARED, 10**6):  # shared opening; every prompt whole
        monkeypatch.setattr(system_prefix, "MIN_SHARED", min_shared)
        policy.model.zero_grad()
        lp = policy.logprobs(tok)  # (N, T)
        m = tok.loss_mask.bool()
        torch.where(m, lp, 0.0).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
        results.append((lp[m].detach(), grad))
    assert used
    (lp_shared, g_shared), (lp_whole, g_whole) = results
    torch.testing.assert_close(lp_shared, lp_whole, atol=1e-5, rtol=0)
    assert (g_shared - g_whole).norm() / g_whole.norm() < 1e-5


def test_the_reference_encodes_the_shared_opening_once_while_its_weights_stay(
    ragged_stops, tiny_model_dir, monkeypatch
):
    """The frozen KL reference encodes the batch's common opening once and takes it from memory at later
    passes (same log-probs); a change to its weights (a copy into them) makes it encode the opening again."""
    from mmgrpo.model import lean_prompt, system_prefix
    from mmgrpo.model.policy import Policy

    envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(8)]
    tok = _rollout(ragged_stops, envs, [2, 7], True).tokens
    policy = Policy.from_pretrained(tiny_model_dir)
    policy.make_reference()
    assert lean_prompt.for_model(policy.reference, policy.adapter) is not None  # the gate's probe runs now
    calls = []  # the reference's forwards and its lean prompt encodings (mmgrpo.model.lean_prompt)
    policy.reference.register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    encode = lean_prompt.PromptEncoder.__call__

    def counted(self, *args):
        if self.model is policy.reference:
            calls.append(1)
        return encode(self, *args)

    monkeypatch.setattr(lean_prompt.PromptEncoder, "__call__", counted)

    def ref_pass():
        calls.clear()
        with torch.no_grad():
            return policy.logprobs(tok, reference=True), len(calls)

    first, n_first = ref_pass()
    again, n_again = ref_pass()
    assert policy.reference in system_prefix._OPENINGS
    assert n_again == n_first - 1 and torch.equal(first, again)  # the opening's forward was skipped
    with torch.no_grad():
        next(policy.reference.parameters()).mul_(1.5)  # new weights, in place
    changed, n_changed = ref_pass()
    assert n_changed == n_first and not torch.allclose(changed, first)
    system_prefix._OPENINGS.clear()
    fresh, _ = ref_pass()
    assert torch.equal(changed, fresh)
    with torch.no_grad():
        policy.logprobs(tok)  # the policy trains: its opening is never kept
    assert policy.model not in system_prefix._OPENINGS


def test_setting_finished_rows_aside_changes_no_episode(ragged_stops, monkeypatch):
    """A decode loop goes on with the rows still sampling once half have stopped; the episodes, and the
    kept cache the next turns continue, are the same as when every row runs to the end."""
    from mmgrpo.model import engine

    runs, parked = [], []
    real = engine.set_aside
    monkeypatch.setattr(engine, "set_aside", lambda state, rows: parked.append(len(rows)) or real(state, rows))
    for park in (True, False):  # every row draws its random number each step, set aside or not
        monkeypatch.setattr(engine, "PARK", park)
        envs = [ZoomOnceEnv(with_image=True, turns_before_end=1 + i % 2) for i in range(16)]
        torch.manual_seed(3)
        runs.append(rollout(ragged_stops, envs, [11, 12, 13, 14], group_size=4, max_new_tokens=8, max_turns=3))
    assert parked  # rows were set aside in the first run
    assert [t.response_ids for t in runs[0].trajectories] == [t.response_ids for t in runs[1].trajectories]
    assert max(t.turns for t in runs[0].trajectories) == 3
