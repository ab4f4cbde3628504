"""Multi-turn rollout at its edges: a turn that stops on a stop id other than the end-of-turn token, and
episodes that grow to the model's positions limit.

Scripted policies (fixed texts as their canonical token ids, each turn ending at a chosen stop id) make
every length exact, so the limit can be placed between two turns of an episode.
"""

from __future__ import annotations

import pytest

from mmgrpo.env import ChatEnv, assistant, system, text_part, user
from mmgrpo.errors import DataError
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import rollout

TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "look", "arguments": {"cell": 5}}\n</tool_call>'


class ToolReplyEnv(ChatEnv):
    """Answers every policy turn with one tool message (``reply_words`` words) until ``turns`` policy turns
    are done, then ends. ``long_seeds``: tasks whose replies are ``long_words`` words and that never end."""

    def __init__(self, turns: int = 1, reply_words: int = 2, long_seeds=(), long_words: int = 0) -> None:
        self.turns, self.reply_words = turns, reply_words
        self.long_seeds, self.long_words = set(long_seeds), long_words

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seed_, self.turn = seed or 0, 0
        return [system("Use a tool when you need it."), user("How many circles?")], {"tools": TOOLS}

    def step(self, action):
        self.turn += 1
        long = self.seed_ in self.long_seeds
        if not long and self.turn > self.turns:
            return [], 1.0, True, False, {}
        words = self.long_words if long else self.reply_words
        reply = " ".join(["circle"] * words)
        return [{"role": "tool", "name": "look", "content": [text_part(reply)]}], 0.0, False, False, {}


class ScriptedPolicy(Policy):
    """Turn k of every row is ``script[k]``: (text, stop id), emitted as the text's ids plus that stop id.
    Both of Qwen's stop ids count as stops (``<|im_end|>`` and ``<|endoftext|>``, as its generation_config
    lists them). ``seen`` keeps each call's (real tokens per row, max_new_tokens)."""

    def __init__(self, base: Policy, script: list[tuple[str, str]]):
        super().__init__(base.model, base.processor, device=base.device)
        tok = self.tokenizer
        self.stop_ids = [self.end_of_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]
        self.script = [(text, tok.convert_tokens_to_ids(stop)) for text, stop in script]
        self.calls, self.seen = 0, []

    def turn_ids(self, k: int) -> list[int]:
        text, stop = self.script[min(k, len(self.script) - 1)]
        return self.encode_text(text) + [stop]

    def generate(self, prompt_ids, prompt_mask, vision, *, max_new_tokens, num_samples=1, **kw):
        self.seen.append((prompt_mask.sum(dim=1).tolist(), max_new_tokens))
        ids = self.turn_ids(self.calls)
        self.calls += 1
        n = prompt_ids.shape[0] * num_samples
        return [list(ids) for _ in range(n)], [True] * n


def test_a_turn_stopped_by_endoftext_is_closed_by_the_env_turn_as_the_template_does(tiny_policy):
    policy = ScriptedPolicy(tiny_policy, [(CALL, "<|endoftext|>"), ("<answer>3</answer>", "<|im_end|>")])
    endoftext = policy.stop_ids[1]
    assert endoftext != policy.end_of_turn_id
    batch = rollout(
        policy, [ToolReplyEnv() for _ in range(4)], [0, 1], group_size=2, max_new_tokens=40, max_turns=3
    )
    first = policy.turn_ids(0)
    for i, t in enumerate(batch.trajectories):
        assert t.turns == 2 and not t.truncated
        # the sampled stop token is kept and trained on; the env's tokens start by closing the turn
        assert t.response_ids[: len(first)] == first and first[-1] == endoftext
        assert t.response_ids[len(first)] == policy.end_of_turn_id
        n_env = len(t.response_ids) - len(first) - len(policy.turn_ids(1))
        assert t.loss_mask == [1] * len(first) + [0] * n_env + [1] * len(policy.turn_ids(1))
        # the episode's ids are the template's rendering of the conversation with the sampled stop token
        # in it (its last assistant turn ends with "<|im_end|>\n", ours at the sampled <|im_end|>)
        tok = batch.tokens
        prompt = tok.prompt_ids[i][tok.prompt_mask[i].bool()].tolist()
        ours = prompt + t.response_ids
        at = len(prompt) + len(first) - 1  # where the sampled <|endoftext|> is
        assert ours[at] == endoftext
        without = ours[:at] + ours[at + 1 :]
        rendered = policy.render(t.messages, add_generation_prompt=False, tools=TOOLS)
        assert policy.encode_text(rendered) == without + policy.encode_text("\n")
        assert policy.tokenizer.decode(without) + "\n" == rendered


def test_episodes_that_reach_the_positions_limit_end_truncated_and_the_others_go_on(tiny_policy, monkeypatch):
    M = 24  # max_new_tokens
    policy = ScriptedPolicy(tiny_policy, [(CALL, "<|im_end|>")])
    envs = [ToolReplyEnv(turns=1, reply_words=2, long_seeds={1}, long_words=40) for _ in range(4)]
    # lengths: the prompt, one policy turn, one short and one long env turn (closing "\n", tool message,
    # next assistant header)
    probe = ToolReplyEnv(long_seeds={1}, long_words=40)
    prompt, _ = probe.reset(seed=1)
    P = len(policy.encode_prompts([prompt], [TOOLS])[0][0])
    C = len(policy.turn_ids(0))
    R = len(policy.encode_continuation([*prompt, assistant(CALL)], probe.step(CALL)[0], TOOLS)[0])
    # the limit fits the prompt, two long rounds and a full third turn, not a third long env turn
    limit = P + 2 * (C + R) + M + (C + R) // 2
    assert P + 3 * (C + R) + 1 > limit  # where the rollout raised DataError for the whole batch before
    monkeypatch.setattr(policy.model.config.get_text_config(), "max_position_embeddings", limit)

    batch = rollout(policy, envs, [0, 1], group_size=2, max_new_tokens=M, max_turns=8)
    trajs = batch.trajectories
    assert len(trajs) == 4 and batch.tokens.response_ids.shape[0] == 4
    for t in trajs[:2]:  # seed 0: one tool round, then the env ends the episode
        assert t.turns == 2 and not t.truncated and t.truncation is None
    for t in trajs[2:]:  # seed 1: long rounds until the next one would not fit
        assert t.turns == 3 and t.truncated and t.truncation == "token_budget"
        assert len(t.response_ids) == 3 * C + 2 * R
        assert P + len(t.response_ids) + R + M > limit  # the env turn it was not given
    # no turn was ever asked for positions past the limit
    for lengths, max_new in policy.seen:
        assert all(n + max_new <= limit for n in lengths)
    assert [len(lengths) for lengths, _ in policy.seen] == [2, 4, 2]  # turn 1 per group, then live rows


def test_a_prompt_that_cannot_fit_one_turn_is_still_a_config_error(tiny_policy, monkeypatch):
    policy = ScriptedPolicy(tiny_policy, [(CALL, "<|im_end|>")])
    env = ToolReplyEnv()
    P = len(policy.encode_prompts([env.reset(seed=0)[0]], [TOOLS])[0][0])
    monkeypatch.setattr(policy.model.config.get_text_config(), "max_position_embeddings", P + 10)
    with pytest.raises(DataError, match="lower grpo.max_new_tokens"):
        rollout(policy, [ToolReplyEnv() for _ in range(2)], [0], group_size=2, max_new_tokens=11)
