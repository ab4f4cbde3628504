"""Generation through vLLM (mmgrpo.model.vllm_engine), on vLLM's CPU build in its own environment.

These need the environment `mmgrpo vllm-env` makes, and start an engine each (15-60 s), so the default test
run skips them, saying so; `.ci/run` makes the environment and runs this file with MMGRPO_REQUIRE_VLLM=1,
where a missing environment is a failure (and of the two slow demos, the tools one; the counting one is run
by hand, see .ci/run's header). The tiny
text model (hidden 128, 4 heads of 32: a head size the CPU attention takes) is the model of the text_math
demo.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmgrpo.errors import EngineError
from mmgrpo.model.batch import TokenBatch, pad_right
from mmgrpo.model.policy import Policy
from mmgrpo.model.vllm_engine import VLLMEngine, default_venv


def _python():
    python = default_venv() / "bin" / "python"
    if os.environ.get("MMGRPO_REQUIRE_VLLM") != "1":  # each test starts an engine (15-60 s): not in the default run
        pytest.skip("the vLLM tests run with MMGRPO_REQUIRE_VLLM=1 (.ci/run's vLLM step, after `mmgrpo vllm-env`)")
    if not python.exists():
        pytest.fail(f"MMGRPO_REQUIRE_VLLM=1 and no vLLM environment at {python}: run `mmgrpo vllm-env`")
    return python


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("text") / "model")


@pytest.fixture(scope="module")
def engine_policy(text_model):
    python = _python()
    policy = Policy.from_pretrained(text_model)
    policy.sampler = VLLMEngine(text_model, python=python, max_model_len=512, seed=0)
    yield policy
    policy.sampler.close()


def _sampled_and_trained(policy: Policy, seed: int) -> tuple[float, list[list[int]]]:
    """max |sampled - trained| over 3 prompts x 4 samples, and the sampled ids."""
    from mmgrpo.envs.text_math import TextMathEnv

    env = TextMathEnv()
    ids, mask, vision = policy.encode_prompts([env.reset(seed=s)[0] for s in range(3)])
    torch.manual_seed(seed)
    comps, _, lps = policy.generate(
        ids, mask, vision, max_new_tokens=8, temperature=1.0, num_samples=4, return_logprobs=True
    )
    rows = [b for b in range(3) for _ in range(4)]
    rid, rmask = pad_right(comps, policy.pad_token_id)
    tok = TokenBatch(ids[rows], mask[rows], rid, rmask, rmask, vision, prompt_index=rows)
    with torch.no_grad():
        trained = policy.logprobs(tok)  # (N, T) mmgrpo's training pass
    gap = max((trained[i, : len(r)] - torch.tensor(r)).abs().max().item() for i, r in enumerate(lps) if r)
    return gap, comps


def test_engine_logprobs_equal_the_training_pass_before_and_after_three_updates(engine_policy):
    """Each optimizer step marks the engine stale; the next sampling pushes the weights (the tied head
    re-packed, caches reset) and the engine's log-probs are the training pass's again (1e-5)."""
    policy = engine_policy
    gap0, before = _sampled_and_trained(policy, 0)
    assert gap0 < 1e-5
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    pushes = policy.sampler.pushes
    for k in range(3):
        for p in policy.model.parameters():  # every weight moved by 0.01 (std): half the init scale (0.02)
            p.grad = torch.randn_like(p) * 0.1
        optimizer.step()
        assert policy.sampler.stale
        gap, after = _sampled_and_trained(policy, 0)
        print(f"update {k + 1}: max |engine - training pass| = {gap:.2e}")
        assert gap < 1e-5, (k, gap)
    assert policy.sampler.pushes == pushes + 3
    assert after != before  # same seed, new weights: other samples (the update reached the engine)


def test_greedy_and_stop_ids_as_the_in_process_sampler(engine_policy, text_model):
    """Greedy samples equal mmgrpo's own greedy decode, ids and stop handling alike."""
    from mmgrpo.envs.text_math import TextMathEnv

    plain = Policy.from_pretrained(text_model)
    plain.model.load_state_dict(engine_policy.model.state_dict())
    env = TextMathEnv()
    ids, mask, vision = plain.encode_prompts([env.reset(seed=s)[0] for s in range(4)])
    ours, ours_done = plain.generate(ids, mask, vision, max_new_tokens=8, temperature=0.0, num_samples=2)
    theirs, theirs_done = engine_policy.generate(
        ids, mask, vision, max_new_tokens=8, temperature=0.0, num_samples=2
    )
    assert theirs == ours and theirs_done == ours_done


def test_a_dead_engine_is_one_clear_error(text_model):
    engine = VLLMEngine(text_model, python=_python(), max_model_len=256, seed=0)
    engine.proc.kill()
    engine.proc.wait()
    with pytest.raises(EngineError, match=r"the vLLM engine process exited \(code -9\).*Its log: "):
        engine.generate([[1, 2, 3]], n=1, max_tokens=2, temperature=1.0, top_p=1.0, top_k=0, stop_ids=[])
    engine.close()


def test_a_grpo_run_with_rollout_engine_vllm(text_model, tmp_path):
    """Two GRPO steps sampled by vLLM: the weights reach it after each step, the sampler's log-probs are
    the training pass's (mismatch/max_abs < 1e-5), the run saves its model."""
    _python()
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    sets = [
        f"model.path={text_model}",
        f"output_dir={tmp_path / 'run'}",
        "env.name=text_math",
        "model.freeze_vision=false",
        "rollout.engine=vllm",
        "rollout.vllm_max_model_len=512",
        "grpo.steps=2",
        "grpo.tasks_per_step=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=8",
        "warm_start.steps=0",
    ]
    trainer = Trainer(load_config(None, sets), progress=False)
    record = trainer.train()
    assert trainer.policy.sampler.pushes >= 2
    assert record["mismatch/max_abs"] < 1e-5
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert (tmp_path / "run" / "vllm.log").exists()
    trainer.policy.sampler.close()


def test_a_lora_model_samples_from_its_merged_weights_after_updates(text_model):
    """With LoRA the engine serves W + B A * scale, computed aside each push (the trained model is not merged
    in place): the samples carry the training pass's log-probs (1e-5) before and after 3 updates of the
    adapters, and the base weights are bit-identical afterwards."""
    from mmgrpo.model.io import LoraSpec

    policy = Policy.from_pretrained(text_model, lora=LoraSpec(r=4, alpha=8))
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    policy.sampler = VLLMEngine(None, python=_python(), max_model_len=512, seed=0, model=policy.model)
    try:
        trainable = [p for p in policy.model.parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        for k in range(4):
            gap, _ = _sampled_and_trained(policy, k)
            print(f"LoRA, after {k} updates: max |engine - training pass| = {gap:.2e}")
            assert gap < 1e-5, (k, gap)
            for p in trainable:  # B starts at zero: after the first step the adapters change the function
                p.grad = torch.randn_like(p) * 0.5
            optimizer.step()
        assert policy.sampler.pushes == 4
        after = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
        assert all(torch.equal(base[k], after[k]) for k in base)
    finally:
        policy.sampler.close()


def _vlm_gap(policy: Policy, messages: list, tools: list | None = None, seed: int = 0) -> float:
    """max |engine - training pass| over the prompts' 4 samples each (12 new tokens at temperature 1)."""
    ids, mask, vision = policy.encode_prompts(messages, tools)
    torch.manual_seed(seed)
    comps, _, lps = policy.generate(
        ids, mask, vision, max_new_tokens=12, temperature=1.0, num_samples=4, return_logprobs=True
    )
    rows = [b for b in range(len(messages)) for _ in range(4)]
    rid, rmask = pad_right(comps, policy.pad_token_id)
    tok = TokenBatch(ids[rows], mask[rows], rid, rmask, rmask, vision, prompt_index=rows)
    with torch.no_grad():
        trained = policy.logprobs(tok)  # (N, T)
    return max((trained[i, : len(r)] - torch.tensor(r)).abs().max().item() for i, r in enumerate(lps) if r)


def test_the_tiny_vlm_samples_text_and_image_prompts_exactly_before_and_after_updates(tiny_model_dir):
    """The tiny Qwen2.5-VL in vLLM: images go in as the policy's own image features (one placeholder per image,
    expanded by the engine from the grid), so the samples of a counting prompt, a tool-calling prompt and a
    batch mixing both carry the training pass's log-probs (1e-5), also after 3 updates of every weight, the
    vision tower's included."""
    from mmgrpo.registry import make_env

    policy = Policy.from_pretrained(tiny_model_dir)
    policy.sampler = VLLMEngine(
        None, python=_python(), max_model_len=1024, seed=0, model=policy.model, processor=policy.processor
    )
    try:
        assert policy.sampler.images
        tools_env, counting = make_env("tool_math"), make_env("counting")
        tool_resets = [tools_env.reset(seed=s) for s in range(2)]
        images = [counting.reset(seed=s)[0] for s in range(3)]
        assert _vlm_gap(policy, [o for o, _ in tool_resets], [i.get("tools") for _, i in tool_resets]) < 1e-5
        mixed = [images[0], tool_resets[0][0], images[1]]
        assert _vlm_gap(policy, mixed, [None, tool_resets[0][1].get("tools"), None]) < 1e-5
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
        for k in range(4):
            gap = _vlm_gap(policy, images, seed=k)
            print(f"after {k} updates: max |engine - training pass| with images = {gap:.2e}")
            assert gap < 1e-5, (k, gap)
            for p in policy.model.parameters():  # every weight moved by 0.01 (std)
                p.grad = torch.randn_like(p) * 0.1
            optimizer.step()
        assert policy.sampler.pushes == 4  # the first sampling pushed too (the engine may hold older weights)
    finally:
        policy.sampler.close()


def test_episodes_as_request_streams_equal_turns_at_a_time(tiny_model_dir):
    """Three-turn episodes whose env answers with a new image each turn (tests/test_multiturn.py's env),
    through vLLM: greedy, each episode as its own request stream gives the same ids as every live episode
    advancing one turn at a time; sampled, the streams' log-probs are the training pass's (1e-5) on every
    policy token, the env's tokens masked out."""
    from mmgrpo.rollout.episodes import rollout
    from tests.test_multiturn import ZoomOnceEnv

    policy = Policy.from_pretrained(tiny_model_dir)
    policy.sampler = VLLMEngine(
        None, python=_python(), max_model_len=2048, seed=0, model=policy.model, processor=policy.processor
    )
    # the random model would not stop within a turn: every third id stops one, so turns end after a few
    # tokens (of varied lengths) and every episode takes its three turns
    vocab = policy.model.config.get_text_config().vocab_size
    policy.stop_ids = sorted(set(policy.stop_ids) | set(range(0, vocab, 3)))

    def run(streams: bool, temperature: float):
        policy.sampler.streams = streams
        envs = [ZoomOnceEnv(turns_before_end=2) for _ in range(6)]
        kw = dict(group_size=2, max_turns=3, max_new_tokens=6, temperature=temperature)
        return rollout(policy, envs, [0, 1, 2], **kw)

    try:
        together, streams = run(False, 0.0), run(True, 0.0)
        assert [t.turns for t in streams.trajectories] == [3] * 6
        assert [t.response_ids for t in streams.trajectories] == [
            t.response_ids for t in together.trajectories
        ]
        assert [t.loss_mask for t in streams.trajectories] == [t.loss_mask for t in together.trajectories]
        sampled = run(True, 1.0)
        tokens = sampled.tokens
        assert tokens.has_response_images
        with torch.no_grad():
            trained = policy.logprobs(tokens)  # (N, T)
        on_policy = tokens.loss_mask.bool()
        gap = (trained - tokens.sampled_logp)[on_policy].abs().max().item()
        print(f"streams, 3 turns with images: max |engine - training pass| = {gap:.2e}")
        assert gap < 1e-5
        assert torch.isnan(tokens.sampled_logp[tokens.response_mask.bool() & ~on_policy]).all()
    finally:
        policy.sampler.close()


@pytest.mark.slow
def test_the_tools_demo_learns_through_vllm(tmp_path, capsys):
    """`mmgrpo demo --task tools --set rollout.engine=vllm`: the calculator agent learns as with mmgrpo's own
    engine (seed 0 here: 0.000 -> 0.995, 60 GRPO steps in 98 s beside another job)."""
    _python()
    from tests.test_demo import run_demo

    summary = run_demo("tools", tmp_path, capsys, ["--set", "rollout.engine=vllm"])
    assert summary["before"] <= 0.30 and summary["after"] >= 0.80, summary
    assert summary["tool_use_after"]["env/right_call"] - summary["tool_use_before"]["env/right_call"] >= 0.5


@pytest.mark.slow
def test_the_counting_demo_learns_through_vllm(tmp_path, capsys):
    """`mmgrpo demo --task counting --set rollout.engine=vllm`: the tiny VLM learns to count with every sample
    drawn by vLLM from the policy's own image features, as with mmgrpo's own engine."""
    _python()
    from tests.test_demo import run_demo

    summary = run_demo("counting", tmp_path, capsys, ["--set", "rollout.engine=vllm"])
    assert summary["after"] >= 0.95 and summary["after"] - summary["before"] >= 0.50, summary
