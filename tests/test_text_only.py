"""Text-only models and tasks: the tiny Qwen2 causal LM, TextMathEnv, and the text-only position-id path.

The risk in the text-only path is positions under left padding: a plain causal LM given no position_ids
numbers the padding too, so the same prompt would get other logits in a shorter or longer batch. The tests
put prompts of different lengths in one batch and check that generation, the full training forward and the
shared-prompt (KV cache repeated) forward all agree.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mmgrpo.cli.app import main
from mmgrpo.env import check_env, message_text
from mmgrpo.envs.text_math import TextMathEnv
from mmgrpo.errors import ConfigError
from mmgrpo.model.policy import Policy
from mmgrpo.registry import make_env, make_verifier
from mmgrpo.rollout.episodes import rollout
from mmgrpo.tiny.text import build_tiny_text_model
from mmgrpo.verifier import Episode

ROOT = Path(__file__).resolve().parent.parent
LONG_QUESTION = "Please compute the following and think carefully before you answer: what is {a} {op} {b}?"


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model")


@pytest.fixture(scope="module")
def text_policy(text_model_dir):
    return Policy.from_pretrained(text_model_dir)


def _mixed_envs(n: int) -> list[TextMathEnv]:
    """Envs whose prompts differ in length: a long and a short question, numbers of 1 to 3 digits."""
    return [
        TextMathEnv(ops=("+", "-", "*"), high=999, question=LONG_QUESTION if (i // 4) % 2 else "{a}{op}{b}=")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def math_batch(text_policy):
    torch.manual_seed(0)
    return rollout(text_policy, _mixed_envs(16), [0, 1, 2, 3], group_size=4, max_new_tokens=6)


# ------------------------------------------------------------------------------------------- the model
def test_tiny_text_model_loads_with_auto_classes(text_model_dir, text_policy):
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    from mmgrpo.tiny.vlm import CHAT_TEMPLATE

    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    tok = AutoTokenizer.from_pretrained(text_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not hasattr(AutoProcessor.from_pretrained(text_model_dir), "image_processor")  # the tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert model.config.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == tok.pad_token_id
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
    assert tok.decode(tok("<answer>-42</answer>")["input_ids"]) == "<answer>-42</answer>"
    assert text_policy.is_vision is False and text_policy.suppress_ids == []


def test_tiny_text_model_is_deterministic_per_seed(text_model_dir, tmp_path):
    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    before = torch.random.get_rng_state()
    again = build_tiny_text_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    other = build_tiny_text_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json"):
        assert digest(again / name) == digest(text_model_dir / name)
    assert digest(other / "model.safetensors") != digest(text_model_dir / "model.safetensors")


# ---------------------------------------------------------------------------------------- the rollout
def test_rollout_masks_exactly_the_sampled_tokens(math_batch, text_policy):
    tok = math_batch.tokens
    assert len(tok) == 16 and tok.shared_prompt_runs() == 4 and tok.vision.empty
    assert len(set(tok.prompt_mask.sum(1).tolist())) > 1, "want prompts of different lengths"
    for i, t in enumerate(math_batch.trajectories):
        n = len(t.response_ids)
        assert 1 <= n <= 6 and t.group == i // 4
        assert tok.response_ids[i, :n].tolist() == t.response_ids  # the sampled ids, not a re-encoding
        assert tok.loss_mask[i].tolist() == [1] * n + [0] * (tok.loss_mask.shape[1] - n)
        assert tok.response_mask[i].tolist() == tok.loss_mask[i].tolist()
        assert t.truncated == (text_policy.eos_token_id not in t.response_ids)
        assert t.completion == text_policy.decode(t.response_ids)


def test_shared_prompt_logprobs_equal_full_forward(math_batch, text_policy):
    """Left-padded prompts of different lengths, G = 4: one prompt encoding with its KV cache repeated gives
    the same log-probs and gradients as the full forward."""
    tok, model = math_batch.tokens, text_policy.model
    mask = tok.loss_mask.bool()
    results = []
    for share in (False, True):
        model.zero_grad()
        lp = text_policy.logprobs(tok, share_prompt=share)  # (N, T)
        torch.where(mask, lp, 0.0).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((torch.where(mask, lp, 0.0).detach(), grad))
    model.zero_grad()
    (lp_full, g_full), (lp_shared, g_shared) = results
    assert torch.all(lp_full[mask] < 0)
    torch.testing.assert_close(lp_shared, lp_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_shared, g_full, atol=1e-4, rtol=1e-3)


def test_greedy_tokens_are_the_argmax_of_the_training_forward(text_policy):
    """Positions line up under left padding: the ids generated greedily are the argmax of the logits of a
    forward whose positions count real tokens only (position = number of real tokens before it), and
    ``Policy.logprobs`` reads the same logits (the greedy token is the most likely one)."""
    envs = _mixed_envs(8)[::4] * 4  # alternate short and long prompts
    batch = rollout(text_policy, envs, list(range(8)), group_size=1, max_new_tokens=5, temperature=0.0)
    tok = batch.tokens
    assert len(set(tok.prompt_mask.sum(1).tolist())) > 1, "want prompts of different lengths"
    with torch.no_grad():
        ids = torch.cat([tok.prompt_ids, tok.response_ids], 1)  # (N, P + T)
        mask = torch.cat([tok.prompt_mask, tok.response_mask], 1)  # (N, P + T)
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # (N, P + T)
        T = tok.response_ids.shape[1]
        logits = text_policy.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=T + 1
        ).logits[:, :-1]  # (N, T, V)
        lp = text_policy.logprobs(tok)  # (N, T)
    m = tok.loss_mask.bool()
    assert torch.equal(logits.argmax(-1)[m], tok.response_ids[m])
    torch.testing.assert_close(lp[m], logits.log_softmax(-1).max(-1).values[m], atol=1e-5, rtol=1e-5)


def test_train_two_steps_then_eval(text_model_dir, tmp_path, capsys, small_run, train_small):
    out = tmp_path / "run"
    cfg = str(ROOT / "examples" / "text_math_tiny.yaml")
    grpo, records = train_small(cfg, text_model_dir, out)
    sets = small_run(f"model.path={text_model_dir}", f"output_dir={out}")
    assert [r["step"] for r in grpo] == [1, 2]
    assert all(r["env_errors"] == 0 and r["verifier_failures"] == 0 for r in grpo)
    assert (out / "final" / "config.json").is_file()
    capsys.readouterr()
    assert main(["eval", cfg, "--model", str(out / "final"), *sets, "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("(n=6)")


# ------------------------------------------------------------------------------------------ the env
def test_same_seed_and_split_give_the_same_task_and_seeds_vary():
    env = TextMathEnv()
    tasks = [env.reset(seed=s) for s in range(30)]
    for s in (0, 11, 29):
        messages, info = TextMathEnv().reset(seed=s)
        assert messages == tasks[s][0] and info == tasks[s][1]
    questions = [message_text(m[1]) for m, _ in tasks]
    assert len(set(questions)) > 15
    for q, (_, info) in zip(questions, tasks, strict=True):
        assert q == f"What is {info['a']} {info['op']} {info['b']}?"
        assert info["op"] in ("+", "-") and 0 <= info["a"] <= 9 and 0 <= info["b"] <= 9
        assert int(info["answer"]) == (info["a"] + info["b"] if info["op"] == "+" else info["a"] - info["b"])


def test_train_and_eval_differ():
    env = TextMathEnv(ops=("*",), low=0, high=99)
    train = [env.reset(seed=s, options={"split": "train"})[1] for s in range(50)]
    evals = [env.reset(seed=s, options={"split": "eval"})[1] for s in range(50)]
    assert sum(t["answer"] == e["answer"] for t, e in zip(train, evals, strict=True)) < 5
    assert evals[3]["split"] == "eval" and int(evals[3]["answer"]) == evals[3]["a"] * evals[3]["b"]


def test_registered_and_check_env_passes():
    assert isinstance(make_env("text_math", ops=["*"]), TextMathEnv)
    check_env(TextMathEnv())
    check_env(TextMathEnv(ops=("*",), low=-5, high=5, system_prompt="", question="{a}{op}{b}"))


@pytest.mark.parametrize("name", ["number_match", "exact_match"])
def test_reference_completion_scores_one_and_a_wrong_answer_zero(name):
    env = TextMathEnv(ops=("+", "-", "*"), low=-3, high=12)
    verifier = make_verifier(name)
    for split in ("train", "eval"):
        for seed in range(30):
            messages, info = env.reset(seed=seed, options={"split": split})
            right = TextMathEnv.reference_completion(info)
            wrong = f"<answer>{int(info['answer']) + 1}</answer>"
            episodes = [Episode(c, messages, info) for c in (right, wrong, info["answer"])]
            assert verifier.score(episodes) == [1.0, 0.0, 0.0], info  # no tags, no credit


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ops": "+"}, r"ops='\+'"),
        ({"ops": []}, "non-empty list"),
        ({"ops": ["+", "/"]}, r"unknown operator '/'; valid operators are"),
        ({"ops": ["+", "+"]}, "distinct"),
        ({"low": 1.5}, r"low=1\.5"),
        ({"high": True}, "high=True"),
        ({"low": 5, "high": 2}, "low <= high"),
        ({"system_prompt": None}, "system_prompt"),
        ({"question": "What is {x}?"}, "question="),
    ],
)
def test_kwargs_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TextMathEnv(**kwargs)


def test_shared_prefill_generation_matches_hf_generate_greedy(math_batch, text_policy):
    """Left-padded text prompts of different lengths: the shared-prefill decode loop gives HF's ids."""
    tok = math_batch.tokens
    heads = list(range(0, len(tok), 4))
    hf = text_policy.generate(
        tok.prompt_ids, tok.prompt_mask, tok.row_vision(), max_new_tokens=6, temperature=0.0
    )
    shared = text_policy.generate(
        tok.prompt_ids[heads],
        tok.prompt_mask[heads],
        tok.vision,
        max_new_tokens=6,
        temperature=0.0,
        num_samples=4,
    )
    assert shared == hf
