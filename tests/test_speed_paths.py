"""The fast paths compute what the plain paths compute.

- Shared prefill (each prompt and image encoded once, its KV cache repeated for the G responses) against
  the naive path that copies the prompt and its image G times: the same GRPO loss and the same gradients,
  with the vision encoder trained and frozen; and how many images the vision tower encodes in each pass.
- Cached encoder features (frozen encoder: computed once per rollout) against the pixels: the same
  numbers, the reference's vision tower never runs.
- The chunked log-softmax against ``log_softmax``; the inverse-CDF sampler against the distribution.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmgrpo.envs.counting import CountingEnv
from mmgrpo.grpo.losses import grpo_loss, token_logprobs
from mmgrpo.model.batch import TokenBatch
from mmgrpo.model.engine import sample_from
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout
from mmgrpo.train import microbatch

B, G = 3, 4


def _tower_counter(model):
    """A list that gets, per vision-tower call, the number of images it encoded."""
    calls: list[int] = []
    tower = model.model.visual

    def hook(module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        calls.append(int(grid.shape[0]))

    tower.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def _naive(tok: TokenBatch) -> TokenBatch:
    """Every row with its own copy of its prompt's pixels (no sharing, no cached features)."""
    return dataclasses.replace(tok, vision=tok.row_vision().without_encoded(), prompt_index=None)


def _loss_and_grads(policy: Policy, tok: TokenBatch, adv: torch.Tensor, share: bool):
    model = policy.model
    model.zero_grad(set_to_none=True)
    logp = policy.logprobs(tok, share_prompt=share)  # (N, T)
    mask = tok.loss_mask
    loss = grpo_loss(logp, None, None, adv, mask, num_sequences=len(tok)).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("frozen", [False, True], ids=["encoder-trained", "encoder-frozen"])
def test_shared_paths_equal_the_naive_copy(tiny_model_dir, frozen):
    policy = Policy.from_pretrained(tiny_model_dir)
    if frozen:
        policy.freeze_vision()
    calls = _tower_counter(policy.model)
    torch.manual_seed(0)
    batch = rollout(
        policy, [CountingEnv() for _ in range(B * G)], list(range(B)), group_size=G, max_new_tokens=6
    )
    tok = batch.tokens
    assert calls == [B]  # generation: one call for the B distinct images
    assert tok.vision.has_encoded == frozen  # a frozen encoder's features ride with the batch
    adv = torch.linspace(-1.5, 1.5, len(tok))  # (N,)

    calls.clear()
    loss_shared, g_shared = _loss_and_grads(policy, tok, adv, share=True)
    shared_calls = list(calls)
    calls.clear()
    loss_naive, g_naive = _loss_and_grads(policy, _naive(tok), adv, share=False)
    naive_calls = list(calls)

    # the training pass: B images once (trained encoder), none at all (frozen: cached); the naive copy B*G
    assert shared_calls == ([] if frozen else [B])
    assert naive_calls == [B * G]
    assert abs(loss_shared - loss_naive) < 1e-5
    assert g_shared.keys() == g_naive.keys()
    vision_grads = [n for n in g_shared if policy.adapter.is_vision_param(n)]
    assert bool(vision_grads) != frozen  # the trained encoder gets gradients through the shared path
    for name in g_shared:
        torch.testing.assert_close(g_shared[name], g_naive[name], atol=1e-5, rtol=0, msg=name)


def test_the_reference_vision_tower_never_runs_with_a_frozen_encoder(tiny_model_dir):
    policy = Policy.from_pretrained(tiny_model_dir)
    policy.freeze_vision()
    policy.make_reference()
    ref_calls, pol_calls = _tower_counter(policy.reference), _tower_counter(policy.model)
    torch.manual_seed(0)
    tok = rollout(
        policy, [CountingEnv() for _ in range(B * G)], list(range(B)), group_size=G, max_new_tokens=6
    ).tokens
    with torch.no_grad():
        cached = policy.logprobs(tok, reference=True)
        assert ref_calls == [] and pol_calls == [B]  # the rollout's one call, nothing since
        pixels = policy.logprobs(
            dataclasses.replace(tok, vision=tok.vision.without_encoded()), reference=True
        )
    assert ref_calls == [B]
    mask = tok.loss_mask.bool()
    torch.testing.assert_close(cached[mask], pixels[mask], atol=1e-6, rtol=0)


def test_cached_features_are_not_used_where_they_would_be_wrong(tiny_model_dir):
    """A reference copied while the encoder was still training has its own vision weights: its pass must
    encode the pixels itself; so must the policy once its encoder trains again."""
    policy = Policy.from_pretrained(tiny_model_dir)
    policy.make_reference()  # encoder trainable at copy time
    policy.freeze_vision()
    ref_calls = _tower_counter(policy.reference)
    torch.manual_seed(0)
    tok = rollout(policy, [CountingEnv() for _ in range(4)], [0, 1], group_size=2, max_new_tokens=4).tokens
    assert tok.vision.has_encoded
    with torch.no_grad():
        policy.logprobs(tok, reference=True)
    assert ref_calls == [2]
    for n, p in policy.model.named_parameters():
        if policy.adapter.is_vision_param(n):
            p.requires_grad_(True)
    pol_calls = _tower_counter(policy.model)
    policy.logprobs(tok)
    assert pol_calls == [2]


def test_chunked_token_logprobs_equal_log_softmax_in_values_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11, dtype=torch.float64)
    logits[0, 0, 3] = float("-inf")  # a token of probability 0
    targets = torch.randint(0, 11, (5, 7))
    targets[0, 0] = 4
    weights = torch.randn(5, 7, dtype=torch.float64)
    results = []
    for chunk in (None, 1, 3, 1000):
        x = logits.clone().requires_grad_(True)
        if chunk is None:
            lp = torch.log_softmax(x / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        else:
            lp = token_logprobs(x, targets, 0.7, chunk=chunk)
        (lp * weights).sum().backward()
        results.append((lp.detach(), x.grad))
    for lp, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-12, rtol=0)
        torch.testing.assert_close(grad, results[0][1], atol=1e-12, rtol=0)
    assert torch.isfinite(results[1][1]).all()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: token_logprobs(t, torch.tensor([[0, 1, 2], [3, 0, 1]]), 1.3, 2), (x,)
    )


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_probabilities(monkeypatch):
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]).repeat(100_000, 1)  # (N, 5)
    freq = torch.bincount(sample_from(probs), minlength=5).double() / probs.shape[0]
    assert freq[1] == 0 and freq[4] == 0
    # binomial standard error at N = 1e5 is <= 0.0016: 5 sigma
    torch.testing.assert_close(freq, probs[0].double(), atol=0.008, rtol=0)
    # u at the very top of the cdf (rounding) cannot land on a trailing zero-probability entry
    ones = torch.ones
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: ones(*shape, **kw))
    assert sample_from(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.0, 0.8]])).tolist() == [1, 2]


def test_length_sorted_micro_batches_give_the_one_batch_gradient(tiny_model_dir, tmp_path):
    """Micro-batches are cut from groups sorted by length (less padding); the gradient is the one of a
    single micro-batch over all rows, as the loss normalisers are whole-batch totals."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    sets = [
        f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "env.name=counting",
        "verifiers=[{name: number_match}]",
        "grpo.tasks_per_step=4",
        "grpo.group_size=2",
        "grpo.micro_batch_size=2",
        "grpo.beta=0.04",
        "grpo.max_new_tokens=6",
    ]
    trainer = Trainer(load_config(None, sets), progress=False)
    trainer.policy.make_reference()
    torch.manual_seed(0)
    tokens = trainer.rollout_tasks(list(range(4)), 2).tokens
    mbs, _ = microbatch.micro_batches(tokens, 2, trainer.cfg.grpo)
    lengths = [int(tokens.prompt_mask[r].sum(1).max() + tokens.response_mask[r].sum(1).max()) for r in mbs]
    assert lengths == sorted(lengths) and sorted(r for m in mbs for r in m) == list(range(8))
    trainer.optimizer.step = lambda: None  # keep the weights: compare the gradients themselves
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3])
    grads = []
    for size in (2, 8):
        trainer.cfg = dataclasses.replace(
            trainer.cfg, grpo=dataclasses.replace(trainer.cfg.grpo, micro_batch_size=size)
        )
        stats, problem = trainer.update(tokens, adv, 2)
        assert problem is None
        grads.append([p.grad.clone() for p in trainer.policy.model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_patch_embedding_as_a_product_equals_the_convolution(tiny_model_dir):
    """Qwen-VL's Conv3d patch embedding (kernel = stride = the patch) becomes a matrix product with the
    same values and gradients; the reference copy's embedding uses the copy's own weights."""
    from transformers import AutoModelForImageTextToText

    plain = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    policy = Policy.from_pretrained(tiny_model_dir)
    conv, fast = plain.model.visual.patch_embed, policy.model.model.visual.patch_embed
    assert fast.forward.__func__.__name__ == "_patch_embed_as_linear"
    x = torch.randn(64, conv.proj.weight[0].numel())
    a, b = conv(x), fast(x)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    ga = torch.autograd.grad(a.square().sum(), conv.proj.weight)[0]
    gb = torch.autograd.grad(b.square().sum(), fast.proj.weight)[0]
    torch.testing.assert_close(gb, ga, atol=1e-4, rtol=1e-4)
    policy.make_reference()
    with torch.no_grad():
        fast.proj.weight.add_(1.0)  # the policy moves on; the reference must not follow
    torch.testing.assert_close(policy.reference.model.visual.patch_embed(x), a, atol=1e-5, rtol=1e-5)


def test_a_group_draws_its_scene_once(monkeypatch):
    """The G envs of a group share the task the first one built (make_task is pure), with the same
    generator state a reset(seed) leaves."""
    from mmgrpo.rollout.episodes import reset_group

    made = []
    original = CountingEnv.make_task
    monkeypatch.setattr(
        CountingEnv, "make_task", lambda self, seed, split: made.append(seed) or original(self, seed, split)
    )
    envs = [CountingEnv() for _ in range(4)]
    obs, info = reset_group(envs, 7, "train")
    assert made == [7]
    fresh = CountingEnv()
    fresh_obs, fresh_info = fresh.reset(seed=7, options={"split": "train"})
    assert info == fresh_info and len(made) == 2
    draw = fresh.np_random.integers(0, 10**9)
    for env in envs:
        assert env.np_random.integers(0, 10**9) == draw  # as if reset(seed=7)
        assert env.step("<answer>3</answer>")[4] == fresh_info


def test_length_chunks_finds_the_least_padded_cut():
    """The passes ``engine.length_chunks`` cuts cost no more than any cut into at most 4 passes of the
    sorted rows (brute force over every cut), hold every row once, and the docstring's example holds."""
    import itertools
    import random

    from mmgrpo.model.engine import length_chunks

    def cost(passes, lengths, overhead):
        return sum(len(p) * max(max(lengths[i] for i in p), 1) + overhead for p in passes)

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        lengths = [rng.choice([rng.randint(0, 12), rng.randint(30, 40), 7]) for _ in range(n)]
        overhead = rng.choice([0, 5, 40])
        order = sorted(range(n), key=lambda i: (lengths[i], i))
        brute = min(
            cost([order[a:b] for a, b in zip((0, *cut), (*cut, n), strict=True)], lengths, overhead)
            for k in range(4)
            for cut in itertools.combinations(range(1, n), k)
        )
        got = length_chunks(lengths, overhead=overhead)
        assert sorted(i for p in got for i in p) == list(range(n)) and 1 <= len(got) <= 4
        assert cost(got, lengths, overhead) == brute
    assert [len(p) for p in length_chunks([50] * 20 + [150])] == [20, 1]
    assert len(length_chunks([50] * 21)) == 1


def test_take_rows_gradient_equals_index_select_on_strided_gradients():
    """``prefix.take_rows`` (a group's prompt cache taken per row) sums the rows' gradients like
    ``index_select``'s own backward, also for the strided gradients attention sends back."""
    from mmgrpo.model.prefix import take_rows

    torch.manual_seed(0)
    x = torch.randn(4, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([0, 0, 3, 1, 1, 1, 3, 2, 0])
    grad = torch.randn(9, 9, 2, 8, dtype=torch.float64).transpose(1, 2)  # (9, 2, 9, 8), not contiguous
    (mine,) = torch.autograd.grad(take_rows(x, rows), x, grad)
    (plain,) = torch.autograd.grad(x.index_select(0, rows), x, grad)
    assert torch.equal(take_rows(x, rows), x.index_select(0, rows))
    torch.testing.assert_close(mine, plain, rtol=0, atol=1e-12)
    assert mine[2].abs().sum() > 0 and torch.equal(mine[2], grad[7])  # row 2 taken once: its gradient as is
    with torch.no_grad():
        assert take_rows(x, rows).grad_fn is None
