"""The calculator task: env protocol, reference answers, demonstrations, and a two-step tool-agent run."""

from __future__ import annotations

import json
import random

import pytest

from mmgrpo.env import check_env, message_text
from mmgrpo.envs.tool_math import ToolMathEnv, tool_call_text
from mmgrpo.errors import ConfigError
from mmgrpo.registry import make_env, make_verifier
from mmgrpo.verifier import Episode


def test_env_protocol_and_tools_in_info():
    env = make_env("tool_math")
    check_env(env)
    messages, info = env.reset(seed=3, options={"split": "eval"})
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator"]
    a, b = info["a"], info["b"]
    assert message_text(messages[-1]) == f"What is {a} * {b}?" and info["answer"] == str(a * b)
    assert 10 <= a <= 99 and 10 <= b <= 99


def test_a_call_returns_the_calculators_result_and_an_answer_ends_the_episode():
    env = ToolMathEnv()
    _, info = env.reset(seed=0)
    obs, reward, terminated, truncated, step_info = env.step(
        tool_call_text("calculator", {"expression": f"{info['a']} * {info['b']}"})
    )
    assert not terminated and not truncated and reward == 0.0
    assert obs[0]["role"] == "tool" and message_text(obs[0]) == info["answer"]
    assert step_info["tool_calls"] == 1 and step_info["tool_failures"] == {}
    obs, _, terminated, _, _ = env.step(f"<answer>{info['answer']}</answer>")
    assert terminated and obs == []


def test_a_bad_call_is_an_observation():
    env = ToolMathEnv()
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(
        '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert not terminated and info["tool_failures"] == {"unknown_tool": 1}
    assert "calculator" in message_text(obs[0]) and obs[0]["error"] == "unknown_tool"


@pytest.mark.parametrize("name", ["number_match", "exact_match", "format"])
def test_reference_answer_scores_one_and_a_number_in_a_tool_result_does_not(name):
    env = ToolMathEnv()
    verifier = make_verifier(name)
    for seed in range(10):
        messages, info = env.reset(seed=seed)
        good = Episode(completion=ToolMathEnv.reference_completion(info), messages=messages, task=info)
        assert verifier.score([good]) == [1.0]
    if name != "format":
        wrong = Episode(completion="<answer>1</answer>", messages=messages, task=info)
        assert verifier.score([wrong]) == [0.0]


def test_demonstrations_mix_direct_answers_wrong_and_right_calls():
    env = ToolMathEnv(demo_answer_prob=0.5, demo_wrong_op_prob=0.25, demo_copy_prob=0.0)
    rng = random.Random(0)
    kinds = {"direct": 0, "wrong": 0, "right": 0}
    for seed in range(400):
        _, info = env.reset(seed=seed)
        turns = env.demonstration(info, rng)
        if len(turns) == 1:
            kinds["direct"] += 1
            continue
        call = json.loads(turns[0].split("\n")[1])
        right = call["arguments"]["expression"] == f"{info['a']} * {info['b']}"
        kinds["right" if right else "wrong"] += 1
        obs, *_ = env.step(turns[0])  # the demonstration's answer is what the tool returns
        assert turns[1] == f"<answer>{message_text(obs[0])}</answer>"
    assert 160 < kinds["direct"] < 240 and 60 < kinds["wrong"] < 140 and 60 < kinds["right"] < 140


def test_bad_kwargs_name_the_fix():
    with pytest.raises(ConfigError, match="ops"):
        ToolMathEnv(ops=["^"])
    with pytest.raises(ConfigError, match="demo_answer_prob"):
        ToolMathEnv(demo_answer_prob=0.9, demo_wrong_op_prob=0.2)
    with pytest.raises(ConfigError, match="calculater"):
        ToolMathEnv(tools=["calculater"])


def test_demonstration_batch_is_laid_out_like_a_rollout(tiny_policy):
    from mmgrpo.train.warmstart import demonstration_batch

    env = ToolMathEnv(demo_answer_prob=0.0, demo_wrong_op_prob=0.0, demo_copy_prob=0.0)  # all call right
    batch = demonstration_batch(tiny_policy, env, [0, 1], random.Random(0), share_prefix=False)
    for i in range(2):
        ids = batch.response_ids[i][batch.response_mask[i].bool()].tolist()
        mask = batch.loss_mask[i][: len(ids)].tolist()
        # policy turn (call), env turn (tool result and the next assistant header), policy turn (answer)
        runs = [mask[0]] + [m for k, m in enumerate(mask[1:], 1) if m != mask[k - 1]]
        assert runs == [1, 0, 1]
        assert ids.count(tiny_policy.eos_token_id) == 3  # two policy turns and the tool turn end with it
        text = tiny_policy.tokenizer.decode(ids)
        assert "<tool_response>" in text and "</tool_call>" in text


def test_tool_agent_trains_two_steps_and_evaluates(tiny_model_dir, tmp_path, capsys, small_run):
    from mmgrpo.cli.app import main

    sets = small_run(  # two drill steps too: the config's 800 would run in full here (min_skill 0 stops no check)
        f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "grpo.max_new_tokens=24",
        "warm_start.drill_steps=2",
    )
    assert main(["train", "examples/tools_math_tiny.yaml", *sets, "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "stage" not in r]
    assert len(steps) == 2
    for key in ("turns", "tool_calls", "tools/used_frac", "tools/failures", "truncated/max_turns"):
        assert key in steps[-1]
    assert (
        main(["eval", "examples/tools_math_tiny.yaml", *sets, "--model", str(tmp_path / "run" / "final")])
        == 0
    )
    out = capsys.readouterr().out
    assert "tools/used_frac" in out and "accuracy:" in out
    assert any((tmp_path / "run" / "final" / "transcripts").glob("episode-*.md"))


def test_right_call_metric_tells_the_questions_expression_from_another():
    env = ToolMathEnv()
    _, info = env.reset(seed=5)
    a, b = info["a"], info["b"]
    *_, step_info = env.step(tool_call_text("calculator", {"expression": f"{a} + {b}"}))
    assert step_info["metrics"] == {"right_call": 0.0}
    *_, step_info = env.step(tool_call_text("calculator", {"expression": f"{b}*{a}"}))  # same value counts
    assert step_info["metrics"] == {"right_call": 1.0}
    *_, step_info = env.step(f"<answer>{a * b}</answer>")
    assert step_info["metrics"] == {"right_call": 1.0}


def test_transcripts_are_saved_as_markdown_with_images_as_png(tmp_path):
    from PIL import Image

    from mmgrpo.env import image_part, text_part, user
    from mmgrpo.rollout.evaluation import EvalResult, write_transcripts

    zoomed = Image.new("RGB", (112, 112), (220, 40, 40))
    conversation = [
        user("How many red dots are in cell 5?"),
        {"role": "assistant", "content": [text_part(tool_call_text("zoom", {"cell": 5}))]},
        {"role": "tool", "name": "zoom", "content": [image_part(zoomed)], "error": None},
        {"role": "assistant", "content": [text_part("<answer>3</answer>")]},
    ]
    result = EvalResult(accuracy=1.0, n=1, metric="number_match", transcripts=[conversation])
    folder = write_transcripts(result, tmp_path)
    text = (folder / "episode-0.md").read_text()
    assert "## tool (zoom)" in text and '"cell": 5' in text and "<answer>3</answer>" in text
    (png,) = folder.glob("*.png")
    assert f"![image]({png.name})" in text
    assert Image.open(png).getpixel((56, 56)) == (220, 40, 40)
    assert "transcripts" not in result.to_json()  # eval.json keeps the numbers, the folder the episodes
