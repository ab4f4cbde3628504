"""The warm start's skill check: what it measures, that it counts greedy reproductions, and that a warm start
too short to teach its skill stops the run with one line naming the skill and the rate."""

from __future__ import annotations

import random
import re

import pytest
import torch

from mmgrpo.env import Shown
from mmgrpo.envs.tool_math import ToolMathEnv
from mmgrpo.errors import ConfigError, WarmStartError
from mmgrpo.tools.runner import tool_call_text
from mmgrpo.train.warm_check import SkillCheck, _probe_passes, require_skill, target_pattern


def test_target_pattern_accepts_the_form_with_any_number():
    form = target_pattern("<answer>{random}</answer>")
    assert form.fullmatch("<answer>3</answer>") and form.fullmatch("<answer>-12</answer>")
    assert (
        not form.fullmatch("<answer></answer>")
        and not form.fullmatch("3")
        and not form.fullmatch("<answer>x</answer>")
    )
    assert target_pattern("Answer: {answer}.").fullmatch("Answer: blue.")


def test_copy_drills_hide_only_the_operator_of_the_right_call(tiny_policy):
    """A drill is the right call with its operator shown (loss 0) and everything else taught: the
    question's numbers copied into the call, the tool's result copied into the answer."""
    from mmgrpo.train.warmstart import demonstration_batch

    env = ToolMathEnv(demo_copy_prob=1.0)
    _, info = env.reset(seed=3)
    turns = env.demonstration(info, random.Random(0))
    head, op, tail = turns[0]
    assert (
        isinstance(op, Shown)
        and op.text == " *"
        and head + op.text + tail
        == tool_call_text("calculator", {"expression": f"{info['a']} * {info['b']}"})
    )
    assert turns[1] == f"<answer>{info['a'] * info['b']}</answer>"
    batch = demonstration_batch(tiny_policy, env, [3], random.Random(0))
    n = int(batch.response_mask[0].sum())
    ids, mask = batch.response_ids[0][:n].tolist(), batch.loss_mask[0][:n].tolist()
    runs = [mask[0]] + [m for k, m in enumerate(mask[1:], 1) if m != mask[k - 1]]
    assert runs == [1, 0, 1, 0, 1]  # call head, operator, call tail (and end of turn), tool turn, answer
    hidden = [t for t, m in zip(ids, mask, strict=True) if m == 0]
    first_gap = mask.index(0)
    assert tiny_policy.tokenizer.decode(ids[first_gap : first_gap + mask[first_gap:].index(1)]) == " *"
    taught = tiny_policy.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 1])
    assert f"{info['a']}" in taught and f" {info['b']}" in taught
    assert f"<answer>{info['a'] * info['b']}</answer>" in taught
    assert "<tool_response>" in tiny_policy.tokenizer.decode(hidden)


def test_probe_counts_rows_whose_taught_tokens_are_all_greedy(tiny_policy, monkeypatch):
    """With logits that put the maximum on the right token everywhere every probe passes; moving the
    maximum off the right token at one taught position of row 0 fails exactly that row."""
    from mmgrpo.model import engine

    env = ToolMathEnv()
    spoil = {"on": False}

    def forced(model, adapter, batch, device):
        N, T = batch.response_ids.shape
        logits = torch.zeros(N, T, len(tiny_policy.tokenizer))  # (N, T, V)
        logits.scatter_(-1, batch.response_ids[..., None], 1.0)
        if spoil["on"]:
            t = int(batch.loss_mask[0].nonzero()[1])  # the second taught token of row 0
            logits[0, t, batch.response_ids[0, t]] = -1.0
        return logits

    monkeypatch.setattr(engine, "response_logits_full", forced)
    assert _probe_passes(tiny_policy, env, [0, 1, 2]) == [True, True, True]
    spoil["on"] = True
    assert _probe_passes(tiny_policy, env, [0, 1, 2]) == [False, True, True]


def test_require_skill_names_the_skill_the_rate_and_the_fix():
    check = SkillCheck("copy the calculator's result into the answer", 3, 64)
    with pytest.raises(WarmStartError) as err:
        require_skill(check, 0.8, steps=5, lr=1e-3)
    msg = str(err.value)
    assert "\n" not in msg
    assert "copy the calculator's result into the answer: 3/64" in msg and "(0.05)" in msg
    assert "warm_start.steps=5" in msg and "warm_start.min_skill=0.8" in msg
    assert "warm_start.drill_bare_steps" in msg
    require_skill(check, 0.04, steps=5, lr=1e-3)  # enough: no error
    require_skill(None, 0.9, steps=5, lr=1e-3)  # nothing to check: no error


def test_a_too_short_warm_start_stops_before_grpo_with_one_line(tiny_model_dir, tmp_path, capsys):
    from mmgrpo.cli.app import main

    out = tmp_path / "run"
    sets = [
        f"model.path={tiny_model_dir}",
        f"output_dir={out}",
        "warm_start.drill_steps=3",
        "warm_start.steps=3",
        "warm_start.batch_size=4",
        "warm_start.check_tasks=16",
        "warm_start.min_skill=0.8",
        "grpo.steps=1",
    ]
    code = main(
        ["train", "examples/tools_math_tiny.yaml", *(x for s in sets for x in ("--set", s)), "--no-progress"]
    )
    assert code == 2
    err = [  # the one line of the failure (beside the CLI's note of its CPU threads)
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("mmgrpo:") and "CPU thread" not in line
    ]
    assert len(err) == 1, err
    assert err[0].startswith("mmgrpo: error: the warm start did not teach the skill GRPO needs: ")
    rate = re.search(re.escape(ToolMathEnv.skill) + r": (\d+)/16 held-out tasks \((\d\.\d\d)\)", err[0])
    assert rate is not None and int(rate.group(1)) < 13, err[0]  # below min_skill 0.8 of 16
    assert not (out / "final").exists()  # no GRPO ran


def warm_start_until_step_4(
    policy, make_env, passes=lambda step: step >= 4, **settings
) -> tuple[list[dict], list[int]]:
    """``warm_start`` with small settings and a skill check that passes from step 4 on (or when ``passes``
    says so); returns the logged records and the steps the check was asked at."""
    from mmgrpo.train.warmstart import warm_start

    logged, asked = [], []

    def done(step: int) -> bool:
        asked.append(step)
        return passes(step)

    warm_start(
        policy,
        make_env,
        lr=1e-3,
        batch_size=2,
        low=1,
        high=5,
        seed=0,
        progress=False,
        log=logged.append,
        done=done,
        **settings,
    )
    return logged, asked


def test_warm_start_ends_at_the_first_check_that_passes(tiny_model_dir):
    from mmgrpo.model.policy import Policy
    from mmgrpo.registry import make_env

    policy = Policy.from_pretrained(tiny_model_dir)
    logged, asked = warm_start_until_step_4(
        policy, lambda: make_env("counting"), steps=10, template="<answer>{random}</answer>", check_every=2
    )
    assert asked == [2, 4] and [r["step"] for r in logged] == [1, 2, 3, 4]


def test_demonstrations_share_their_common_prompt_prefix_with_equal_loss_and_gradients(tiny_policy):
    """A tool task's system prompt and schemas are most of each demonstration: the warm start encodes them
    once (the shared-prompt path) and gets the loss and gradients of the row-by-row layout."""
    import mmgrpo.train.warmstart as ws
    from mmgrpo.train.sft import masked_nll

    env = ToolMathEnv()
    seeds = [10_000_000 + k for k in range(6)]
    shared = ws.demonstration_batch(tiny_policy, env, seeds, random.Random(0))
    full = ws.demonstration_batch(tiny_policy, env, seeds, random.Random(0), share_prefix=False)
    assert shared.prompt_index == [0] * 6 and shared.prompt_ids.shape[1] > 200
    assert shared.prompt_ids.shape[1] < full.prompt_ids.shape[1]
    assert int(shared.loss_mask.sum()) == int(full.loss_mask.sum())
    params = [p for p in tiny_policy.language_parameters() if p.requires_grad]
    losses, grads = [], []
    for batch in (full, shared):
        loss = masked_nll(tiny_policy.logprobs(batch), batch.loss_mask)
        grads.append(torch.autograd.grad(loss, params))
        losses.append(float(loss.detach()))
    assert abs(losses[0] - losses[1]) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True)) < 1e-5


def test_bare_prompt_keeps_the_question_text_alone():
    from mmgrpo.env import image_part, system, text_part, user
    from mmgrpo.envs.zoom_count import ZoomCountEnv
    from mmgrpo.train.warmstart import bare_prompt

    messages, info = ZoomCountEnv().reset(seed=3)
    question = f"How many red dots are in cell {info['cell']}? Use zoom to look closer."
    assert bare_prompt(messages) == [user(question)]
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    two = [system("s"), user("first"), user(text_part("a "), image_part(image), text_part("b"))]
    assert bare_prompt(two) == [user("a b")]  # the last user message, its text parts joined
    with pytest.raises(ConfigError, match="grpo.bare_steps.*has none: set both to 0"):
        bare_prompt([system("s")])


def test_bare_drills_play_the_same_turns_on_the_question_alone(tiny_policy):
    """A bare drill row is the full one with the prompt cut to the question: the same taught call (same
    ids, same loss mask), the tool still run on the task's image (its result follows the call)."""
    from mmgrpo.envs.zoom_count import ZoomCountEnv
    from mmgrpo.train.warmstart import demonstration_batch

    env = ZoomCountEnv()
    seeds = [0, 1, 2]
    full = demonstration_batch(tiny_policy, env, seeds, random.Random(0), play=env.skill_probe)
    bare = demonstration_batch(tiny_policy, env, seeds, random.Random(0), play=env.skill_probe, bare=True)
    tok = tiny_policy.tokenizer
    for i, seed in enumerate(seeds):
        _, info = env.reset(seed=seed)
        full_prompt = tok.decode(full.prompt_ids[i][full.prompt_mask[i].bool()])
        bare_prompt_text = tok.decode(bare.prompt_ids[i][bare.prompt_mask[i].bool()])
        assert (
            "<tools>" in full_prompt
            and tiny_policy.tokenizer.decode([tiny_policy.image_token_id]) in full_prompt
        )
        assert "<tools>" not in bare_prompt_text and "system" not in bare_prompt_text
        assert f"in cell {info['cell']}?" in bare_prompt_text
        assert tiny_policy.image_token_id not in bare.prompt_ids[i].tolist()
        n = int(full.loss_mask[i].sum())
        taught = full.response_ids[i][full.loss_mask[i].bool()]
        assert torch.equal(taught, bare.response_ids[i][bare.loss_mask[i].bool()]) and len(taught) == n
        assert f'"cell": {info["cell"]}' in tok.decode(taught)
    assert bare.has_response_images  # the zoomed cell came back after the call


def test_bare_rows_are_chosen_per_seed(tiny_policy):
    """``bare`` as a list (warm_start.bare_share): only the rows it marks lose their system prompt, tool
    schemas and image."""
    from mmgrpo.envs.zoom_count import ZoomCountEnv
    from mmgrpo.train.warmstart import demonstration_batch

    env = ZoomCountEnv(demo_cell="named", call_prob=1.0)
    batch = demonstration_batch(tiny_policy, env, [0, 1, 2], random.Random(0), bare=[True, False, True])
    image = tiny_policy.image_token_id
    in_prompt = [image in batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() for i in range(3)]
    assert in_prompt == [False, True, False]
    with pytest.raises(ValueError):
        demonstration_batch(tiny_policy, env, [0, 1], random.Random(0), bare=[True])


def test_bare_share_needs_the_env_demonstrations():
    from mmgrpo.config.core import load_config

    with pytest.raises(ConfigError, match=r"warm_start.bare_share.*set source: env"):
        load_config(None, ["warm_start.bare_share=0.5"])
    with pytest.raises(ConfigError, match=r"warm_start.bare_share.*must be in \[0, 1\]"):
        load_config(None, ["warm_start.source=env", "warm_start.bare_share=2"])


def test_bare_drills_come_first_and_the_check_ends_only_the_full_ones(tiny_model_dir, monkeypatch):
    from mmgrpo.model.policy import Policy
    from mmgrpo.train import warmstart

    policy = Policy.from_pretrained(tiny_model_dir)
    made = []
    real = warmstart.demonstration_batch

    def spy(*args, bare=False, play=None, **kw):
        made.append("bare" if bare else "drill" if play is not None else "demo")
        return real(*args, bare=bare, play=play, **kw)

    monkeypatch.setattr(warmstart, "demonstration_batch", spy)
    logged, asked = warm_start_until_step_4(
        policy,
        ToolMathEnv,
        steps=2,
        template="",
        source="env",
        drill_steps=10,
        drill_bare_steps=3,
        check_every=1,
    )
    assert made == ["bare"] * 3 + ["drill"] + ["demo"] * 2  # bare, then full until the check passes at 4
    assert (
        asked == [4, 6]  # 6: after the demonstrations (the final check; passing, no drills again)
        and [r["phase"] for r in logged] == ["drills, bare prompts"] * 3 + ["drills"] + ["demonstrations"] * 2
    )


@pytest.mark.parametrize("after_demos", [True, False])
def test_drills_resume_when_the_demonstrations_wore_the_skill_down(tiny_model_dir, monkeypatch, after_demos):
    """The check passes after the drills (step 4); after the demonstrations (step 6) it fails or passes.
    Failing, the drills go on with what is left of drill_steps until it passes again (step 8)."""
    from mmgrpo.model.policy import Policy
    from mmgrpo.train import warmstart

    policy = Policy.from_pretrained(tiny_model_dir)
    made = []
    real = warmstart.demonstration_batch

    def spy(*args, bare=False, play=None, **kw):
        made.append("drill" if play is not None else "demo")
        return real(*args, bare=bare, play=play, **kw)

    monkeypatch.setattr(warmstart, "demonstration_batch", spy)
    logged, asked = warm_start_until_step_4(
        policy,
        ToolMathEnv,
        passes=lambda step: step == 4 or step >= 8 or (step == 6 and after_demos),
        steps=2,
        template="",
        source="env",
        drill_steps=10,
        check_every=1,
    )
    phases = [r["phase"] for r in logged]
    if after_demos:  # the skill held: nothing more (the final check reuses the one at step 6)
        assert made == ["drill"] * 4 + ["demo"] * 2 and asked == [1, 2, 3, 4, 6]
        assert phases == ["drills"] * 4 + ["demonstrations"] * 2
    else:
        assert made == ["drill"] * 4 + ["demo"] * 2 + ["drill"] * 2 and asked == [1, 2, 3, 4, 6, 7, 8]
        assert phases == ["drills"] * 4 + ["demonstrations"] * 2 + ["drills again"] * 2
