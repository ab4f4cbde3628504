"""Multi-turn rollout: token in / token out, images from the environment mid-episode, masks and log-probs.

The env here is a scripted two-turn "tool" env: the first policy turn is answered with a tool message
holding text and an image of its own size; the second ends the episode. A scripted policy (canonical
token ids of fixed texts) makes the rendered conversation exactly comparable with what the processor
renders for the whole conversation at once.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmgrpo.env import ChatEnv, image_part, system, text_part, user
from mmgrpo.grpo.losses import grpo_loss
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout

TOOLS = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


class ZoomOnceEnv(ChatEnv):
    """Prompt: an image and a question. Step 1: a tool message with text and a new image. Step 2: ends."""

    def __init__(self, with_image: bool = True, turns_before_end: int = 1) -> None:
        self.with_image = with_image
        self.turns_before_end = turns_before_end

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seed_, self.turn = seed or 0, 0
        content = [text_part("How many red circles are in the image?")]
        if self.with_image:
            content.insert(0, image_part(_image(self.seed_, (112, 112))))
        messages = [system("Use a tool when you need it."), {"role": "user", "content": content}]
        return messages, {"answer": "3", "tools": TOOLS}

    def step(self, action):
        self.turn += 1
        if self.turn > self.turns_before_end:
            return [], 1.0, True, False, {}
        parts = [text_part(f"zoomed {self.turn}")]
        if self.with_image:
            parts.append(image_part(_image(100 + self.seed_ + self.turn, (56, 84))))
        return (
            [{"role": "tool", "name": "zoom", "content": parts, "error": None}],
            0.0,
            False,
            False,
            {
                "tool_calls": 1,
                "tool_failures": {},
            },
        )


class ScriptedPolicy(Policy):
    """A Policy whose turns are fixed texts, emitted as their canonical token ids (plus end-of-turn)."""

    def __init__(self, base: Policy, script: list[str]):
        super().__init__(base.model, base.processor, device=base.device)
        self.script, self.calls = script, 0

    def generate(self, prompt_ids, prompt_mask, vision, *, num_samples=1, **kw):
        text = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        ids = self.encode_text(text) + [self.eos_token_id]
        n = prompt_ids.shape[0] * num_samples
        return [list(ids) for _ in range(n)], [True] * n


def _full_forward_logprobs(policy: Policy, messages: list[dict], tools) -> tuple[list[int], torch.Tensor]:
    """The processor's rendering of the whole conversation, and the log-prob of each token from one forward."""
    text = policy.render(messages, add_generation_prompt=False, tools=tools)
    images = [
        p["image"] for m in messages for p in m["content"] if isinstance(p, dict) and p["type"] == "image"
    ]
    enc = policy.processor(text=[text], images=images or None, return_tensors="pt")
    kw = policy._model_inputs(enc["input_ids"], enc["attention_mask"], _vision(enc), policy.model)
    with torch.no_grad():
        logits = policy.model(**kw, use_cache=False).logits[0, :-1].float()  # (L-1, V)
    ids = enc["input_ids"][0]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None]).squeeze(-1)  # (L-1,)
    return ids.tolist(), logp


def _vision(enc):
    from mmgrpo.model.batch import VisionInputs

    if "pixel_values" not in enc:
        return VisionInputs.none(1)
    return VisionInputs(
        [{k: enc[k] for k in ("pixel_values", "image_grid_thw")}], [len(enc["image_grid_thw"])]
    )


@pytest.mark.parametrize("with_image", [True, False])
def test_multiturn_ids_and_logprobs_equal_one_full_forward(tiny_policy, with_image):
    policy = ScriptedPolicy(
        tiny_policy,
        ['<tool_call>\n{"name": "zoom", "arguments": {"cell": 5}}\n</tool_call>', "<answer>3</answer>"],
    )
    envs = [ZoomOnceEnv(with_image=with_image) for _ in range(4)]
    batch = rollout(policy, envs, [0, 1], group_size=2, max_new_tokens=40, max_turns=3)
    tok = batch.tokens
    assert tok.has_response_images == with_image
    logp = policy.logprobs(tok)  # (N, T) what training computes
    for i, t in enumerate(batch.trajectories):
        assert t.turns == 2 and not t.truncated and t.tool_calls == 1
        full_ids, full_logp = _full_forward_logprobs(policy, t.messages, TOOLS)
        prompt = tok.prompt_ids[i][tok.prompt_mask[i].bool()].tolist()
        ours = prompt + t.response_ids
        # the processor renders the whole conversation to exactly the ids the episode accumulated
        # (its last assistant turn ends with "<|im_end|>\n"; ours at the sampled end-of-turn token)
        assert full_ids[: len(ours)] == ours
        assert full_ids[len(ours) :] == policy.encode_text("\n")
        # per-token log-probs of every response token: training's forward equals one full forward
        T = len(t.response_ids)
        expected = full_logp[len(prompt) - 1 : len(prompt) - 1 + T]  # (T,)
        torch.testing.assert_close(logp[i, :T].float(), expected, atol=1e-5, rtol=0)
        # the images of a row are its own: the prompt's one, then one per tool turn
        if with_image:
            assert t.response_vision.images_per_seq == [1]


def test_env_tokens_are_masked_and_get_zero_gradient(tiny_policy):
    policy = ScriptedPolicy(
        tiny_policy,
        ['<tool_call>\n{"name": "zoom", "arguments": {"cell": 5}}\n</tool_call>', "<answer>3</answer>"],
    )
    envs = [ZoomOnceEnv() for _ in range(4)]
    batch = rollout(policy, envs, [0, 1], group_size=2, max_new_tokens=40, max_turns=3)
    tok = batch.tokens
    t0 = batch.trajectories[0]
    call = policy.encode_text(policy.script[0]) + [policy.eos_token_id]
    answer = policy.encode_text(policy.script[1]) + [policy.eos_token_id]
    env_len = len(t0.response_ids) - len(call) - len(answer)
    assert env_len > 16  # "\n<|im_start|>user\n<tool_response>\nzoomed 1" + the image's tokens + header
    assert t0.loss_mask == [1] * len(call) + [0] * env_len + [1] * len(answer)
    assert policy.image_token_id in t0.response_ids  # the tool's image, as placeholder tokens
    logp = policy.logprobs(tok).detach().requires_grad_(True)  # (N, T)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = grpo_loss(logp, None, None, adv, tok.loss_mask.float(), beta=0.0)
    out.loss.backward()
    grad = logp.grad  # (N, T)
    assert torch.all(grad[tok.loss_mask == 0] == 0)
    assert torch.all(grad[tok.loss_mask == 1] != 0)


def test_trained_ids_are_the_sampled_ids_across_turns(tiny_policy):
    sampled: list[list[list[int]]] = []
    real_generate = tiny_policy.generate

    def recording_generate(*args, **kw):
        # real sampling on the engine; the untrained model rarely ends a turn, so a turn that hit
        # max_new_tokens is closed with the end-of-turn token here (what the rollout gets is recorded)
        ids, done = real_generate(*args, **kw)
        ids = [x if d else x[:-1] + [tiny_policy.eos_token_id] for x, d in zip(ids, done, strict=True)]
        sampled.append([list(x) for x in ids])
        return ids, [True] * len(ids)

    torch.manual_seed(0)
    envs = [ZoomOnceEnv(turns_before_end=2) for _ in range(6)]
    tiny_policy.generate = recording_generate
    try:
        batch = rollout(tiny_policy, envs, [0, 1, 2], group_size=2, max_new_tokens=6, max_turns=3)
    finally:
        del tiny_policy.generate
    # per row, the ids the policy sampled turn after turn: turn k's rows are those that reached turn k
    trajs = batch.trajectories
    assert max(t.turns for t in trajs) == 3 and len(sampled) == 3
    per_row: list[list[int]] = [[] for _ in trajs]
    for k, turn in enumerate(sampled, start=1):
        rows = [i for i, t in enumerate(trajs) if t.turns >= k]
        for i, ids in zip(rows, turn, strict=True):
            per_row[i] += ids
    for i, t in enumerate(trajs):
        trained = [x for x, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 1]
        assert trained == per_row[i]
        row = batch.tokens.response_ids[i][batch.tokens.loss_mask[i].bool()].tolist()
        assert row == per_row[i]


def test_max_turns_and_token_budget_truncate(tiny_policy):
    policy = ScriptedPolicy(
        tiny_policy, ['<tool_call>\n{"name": "zoom", "arguments": {"cell": 1}}\n</tool_call>']
    )
    envs = [ZoomOnceEnv(with_image=False, turns_before_end=99) for _ in range(2)]
    batch = rollout(policy, envs, [0], group_size=2, max_new_tokens=40, max_turns=3)
    assert all(t.truncated and t.truncation == "max_turns" and t.turns == 3 for t in batch.trajectories)
    assert all(t.tool_calls == 3 for t in batch.trajectories)
    policy.calls = 0
    batch = rollout(policy, envs, [0], group_size=2, max_new_tokens=40, max_turns=5, max_episode_tokens=60)
    for t in batch.trajectories:
        assert t.truncated and t.truncation == "token_budget" and len(t.response_ids) <= 60


def test_shared_prefill_equals_full_forward_on_multiturn_text(tiny_policy):
    policy = ScriptedPolicy(
        tiny_policy,
        ['<tool_call>\n{"name": "zoom", "arguments": {"cell": 2}}\n</tool_call>', "<answer>4</answer>"],
    )
    envs = [ZoomOnceEnv(with_image=False) for _ in range(6)]
    batch = rollout(policy, envs, [0, 1, 2], group_size=2, max_new_tokens=40, max_turns=2)
    shared = policy.logprobs(batch.tokens)
    full = policy.logprobs(batch.tokens, share_prompt=False)
    mask = batch.tokens.response_mask.bool()
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=0)


def test_tool_calls_of_all_episodes_in_a_turn_run_at_once(tiny_policy):
    import threading
    import time

    from mmgrpo.env import Task
    from mmgrpo.envs.tool_env import ToolEnv

    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def wait(seconds: float) -> str:
        """Wait, then say so.

        Args:
            seconds: how long
        """
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(seconds)
        with lock:
            state["now"] -= 1
        return "done"

    class WaitEnv(ToolEnv):
        def __init__(self):
            super().__init__([wait], timeout_s=5.0)

        def make_task(self, seed, split):
            return Task([system("Call wait."), user("Go.")], {"answer": "1"})

    policy = ScriptedPolicy(
        tiny_policy,
        ['<tool_call>\n{"name": "wait", "arguments": {"seconds": 0.3}}\n</tool_call>', "<answer>1</answer>"],
    )
    envs = [WaitEnv() for _ in range(8)]
    batch = rollout(policy, envs, [0, 1], group_size=4, max_new_tokens=40, max_turns=2)
    assert all(t.tool_calls == 1 and not t.tool_failures for t in batch.trajectories)
    assert state["most"] == 8  # every episode's call was in flight at the same time


def test_a_template_that_rewrites_earlier_turns_is_refused_with_its_name(tiny_policy):
    import copy

    from mmgrpo.errors import DataError
    from mmgrpo.tiny.vlm import CHAT_TEMPLATE

    processor = copy.deepcopy(tiny_policy.processor)
    processor.chat_template = "turns: {{ messages | length }}\n" + CHAT_TEMPLATE  # changes with every turn
    policy = Policy(tiny_policy.model, processor)
    history = [user("Go."), {"role": "assistant", "content": [text_part("<tool_call>{}</tool_call>")]}]
    new = [{"role": "tool", "name": "zoom", "content": [text_part("done")]}]
    with pytest.raises(DataError, match="does not render a conversation as a prefix extension") as err:
        policy.encode_continuation(history, new)
    assert policy.name_or_path in str(err.value) and "differ at character 7" in str(err.value)
    ids, vision = tiny_policy.encode_continuation(history, new)  # the tiny model's own template is fine
    assert tiny_policy.tokenizer.decode(ids).startswith("\n<|im_start|>user\n<tool_response>\ndone")
    assert vision.empty


def test_a_tool_message_seen_again_is_tokenized_once(tiny_policy, monkeypatch):
    """The G rows of a group often get the same tool message (the zoom agent's rows zoom on the same cell):
    the processor runs once for it; another image, or other text, is tokenized again."""
    policy = Policy(tiny_policy.model, tiny_policy.processor)
    calls = []
    real = policy._tokenize
    monkeypatch.setattr(policy, "_tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    history = [user("Look."), {"role": "assistant", "content": [text_part("<tool_call>{}</tool_call>")]}]

    def zoomed(colour, text="cell 5"):  # a new PIL image each time, as each episode's tool returns
        parts = [image_part(Image.new("RGB", (56, 56), colour)), text_part(text)]
        return [{"role": "tool", "name": "zoom", "content": parts}]

    first, v1 = policy.encode_continuation(history, zoomed("red"))
    again, v2 = policy.encode_continuation(history, zoomed("red"))
    assert len(calls) == 1 and again == first and v2.images_per_seq == v1.images_per_seq == [1]
    assert all(v2.seqs[0][k] is v1.seqs[0][k] for k in v1.seqs[0])  # the same pixels, shared
    blue, _ = policy.encode_continuation(history, zoomed("blue"))
    other, _ = policy.encode_continuation(history, zoomed("red", "cell 6"))
    assert len(calls) == 3 and blue == first and other != first  # same placeholders; other text
    fresh = Policy(tiny_policy.model, tiny_policy.processor)  # no cache: the same ids and pixels
    ids, vision = fresh.encode_continuation(history, zoomed("red"))
    assert ids == first and torch.equal(vision.seqs[0]["pixel_values"], v1.seqs[0]["pixel_values"])


def test_a_tool_image_repeated_in_a_group_is_encoded_once_same_logprobs_and_gradients(
    tiny_model_dir, monkeypatch
):
    """The G rows of a group that get the same tool image hold the same pixels (tokenized once), and the
    training pass encodes them once: its log-probs and every gradient equal those of the pass that
    encodes each row's copy (the encoder trains here; 1e-6). (With the rows' shared response run once,
    ``mmgrpo.model.shared_spans``, the view is inside that span: turned off here, compared at the end.)"""
    from mmgrpo.model import shared_spans

    monkeypatch.setattr(shared_spans, "SHARE_SPANS", False)
    base = Policy.from_pretrained(tiny_model_dir)
    policy = ScriptedPolicy(
        base, ['<tool_call>\n{"name": "zoom", "arguments": {"cell": 5}}\n</tool_call>', "<answer>3</answer>"]
    )
    batch = rollout(
        policy, [ZoomOnceEnv() for _ in range(4)], [0, 1], group_size=2, max_new_tokens=40, max_turns=3
    )
    tok = batch.tokens
    seqs = tok.response_vision.seqs
    assert (
        seqs[0]["pixel_values"] is seqs[1]["pixel_values"]
        and seqs[2]["pixel_values"] is seqs[3]["pixel_values"]
    )
    assert not torch.equal(seqs[0]["pixel_values"], seqs[2]["pixel_values"])  # two groups, two images
    visual = policy.model.model.visual
    assert any(p.requires_grad for p in visual.parameters())
    images = []
    visual.register_forward_hook(
        lambda m, args, kw, out: images.append(len(kw["grid_thw"])), with_kwargs=True
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None]

    def pass_and_grads():
        images.clear()
        policy.model.zero_grad()
        logp = policy.logprobs(tok)  # (N, T)
        (logp * adv * tok.loss_mask).sum().backward()
        return logp.detach(), {
            n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None
        }

    once, grads_once = pass_and_grads()
    assert images == [2, 2]  # the prompts' two images, then the two distinct tool images (4 rows)
    monkeypatch.setattr(policy.adapter, "encode_repeats", lambda model, vision, device, dtype: vision)
    each, grads_each = pass_and_grads()
    assert images == [2, 4]  # each row's copy
    torch.testing.assert_close(once, each, atol=1e-6, rtol=0)
    assert grads_once.keys() == grads_each.keys() and any("visual" in n for n in grads_once)
    for name, g in grads_once.items():
        torch.testing.assert_close(g, grads_each[name], atol=1e-6, rtol=1e-5, msg=name)
    monkeypatch.setattr(shared_spans, "SHARE_SPANS", True)  # each group's call and view as one span
    assert shared_spans.plan(tok, 2, policy.adapter) is not None
    spans, grads_spans = pass_and_grads()
    assert images == [2, 2]  # the prompts' images, then one view per span
    on = tok.loss_mask.bool()
    torch.testing.assert_close(spans[on], each[on], atol=1e-5, rtol=0)
    for name, g in grads_spans.items():
        torch.testing.assert_close(g, grads_each[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_runaway_sandboxed_program_is_an_observation_and_the_step_goes_on(tiny_policy):
    from mmgrpo.env import Task
    from mmgrpo.envs.tool_env import ToolEnv
    from mmgrpo.toolbox import make_tool
    from mmgrpo.tools.runner import tool_call_text

    class CodeEnv(ToolEnv):
        def __init__(self):
            super().__init__([make_tool("python", cpu_seconds=1, wall_seconds=2)], timeout_s=10.0)

        def make_task(self, seed, split):
            return Task([system("Run code."), user("Loop.")], {"answer": "1"})

    policy = ScriptedPolicy(
        tiny_policy,
        [tool_call_text("python", {"code": "while True:\n    pass"}), "<answer>1</answer>"],
    )
    batch = rollout(policy, [CodeEnv() for _ in range(2)], [0], group_size=2, max_new_tokens=60, max_turns=2)
    for t in batch.trajectories:
        tool_text = "".join(p["text"] for p in t.messages[3]["content"] if p["type"] == "text")
        assert t.messages[3]["role"] == "tool" and "limit" in tool_text.lower()  # the model is told
        assert t.turns == 2 and t.completion == "<answer>1</answer>"
    logp = policy.logprobs(batch.tokens)  # (N, T) and the update goes on
    out = grpo_loss(logp, None, None, torch.tensor([1.0, -1.0]), batch.tokens.loss_mask.float())
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_zoom_rows_on_the_model_that_sees_equal_one_full_forward(tmp_path):
    """The zoom agent's rows (a 336-px image in the prompt, the zoom call, the zoomed cell as a new image,
    the answer) on the tiny model that sees (a trained encoder, so image features move the logits): the
    training pass, with each group's prompt encoded once, gives the log-probs of one forward over the
    processor's rendering of the whole conversation."""
    import dataclasses
    import random

    from mmgrpo.env import assistant
    from mmgrpo.registry import make_env
    from mmgrpo.tiny.vlm import build_tiny_model
    from mmgrpo.train.warmstart import demonstration_batch, encode_turn

    policy = Policy.from_pretrained(str(build_tiny_model(tmp_path / "sees", sees=True)), device="cpu")
    env = make_env("zoom_count", max_count=4, tools=["zoom"])
    seeds = [10_000_000, 10_000_000, 10_000_001, 10_000_001]  # two groups of two rows
    batch = demonstration_batch(policy, env, seeds, random.Random(0), play=env.skill_probe)
    batch = dataclasses.replace(batch, prompt_index=[0, 0, 2, 2])
    assert batch.shared_prompt_runs() == 2 and batch.has_response_images
    with torch.no_grad():
        logp = policy.logprobs(batch)  # (N, T)
    for i, seed in enumerate(seeds):
        messages, info = env.reset(seed=seed, options={"split": "train"})
        call, answer = env.skill_probe(info)
        call_text = encode_turn(policy, call)[0]
        obs, *_ = env.step(call_text)
        history = [*messages, assistant(call_text), *obs, assistant(encode_turn(policy, answer)[0])]
        full_ids, full_logp = _full_forward_logprobs(policy, history, info["tools"])
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        T = int(batch.response_mask[i].sum())
        assert full_ids[: len(prompt) + T] == prompt + batch.response_ids[i, :T].tolist()
        expected = full_logp[len(prompt) - 1 : len(prompt) - 1 + T]  # (T,)
        torch.testing.assert_close(logp[i, :T], expected, atol=1e-5, rtol=0)
