"""Supervised cold start that teaches the answer FORMAT only (DeepSeek-R1's "cold start", minimal form).

A freshly built (or a weak) model never writes ``<answer>N</answer>``, so every GRPO group scores all
zeros and nothing is learned. This stage fine-tunes on the environment's own prompts paired with
completions made from a template whose number is drawn at random (``<answer>{random}</answer>``): the
targets carry no information about the image, so the model learns where and how to answer, not what.
Its accuracy alone is about chance (1/5 on counts 1..5); the demo reports it as the "before" number.

With ``{answer}`` in the template the targets are the tasks' true answers instead: a supervised cold start
on true examples, as DeepSeek-R1 starts from a few thousand. ``examples`` limits it to a fixed pool of
that many tasks (cycled), so that it shows the model what an answer depends on without teaching the
whole task; the demo's "before" number then measures what that pool alone gives.

For multi-turn tool tasks (``source="env"``) the targets are the environment's own demonstrations
(``ToolEnv.demonstration``): whole episodes played through ``step`` (the tools really run), laid out token
for token as the rollout lays them out, trained on the policy turns only. With ``drill_steps`` a first
phase trains on the env's skill drills alone (``ToolEnv.skill_probe``), until the skill is measured on
held-out tasks: on the tiny model, learning to copy numbers from the demonstrations alone came between
step 400 and never (1100+ steps, loss flat) depending on the seed; drills alone at lr 3e-4 taught it in
350-400 steps on each of five task orders. Each env documents what its
demonstrations teach; the built-in ones teach the call syntax and leave which tool, when and with which
arguments to GRPO.

Only the language side is trained (``train_vision=False``, the default): the targets say nothing about the
image, so there is nothing for the vision encoder to learn, and measured on the tiny model, training it
on content-free targets at this learning rate collapses its features to a near-constant vector (patch
features differing by ~2% instead of ~80%), after which GRPO cannot learn to count at all.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import torch

from mmgrpo.env import ChatEnv, DemoTurn, assistant, bare_prompt, turn_pieces
from mmgrpo.errors import ConfigError, EnvError
from mmgrpo.model.batch import TokenBatch, VisionInputs, pad_right
from mmgrpo.model.policy import Policy
from mmgrpo.rollout.episodes import reset_group
from mmgrpo.train.optim import adamw
from mmgrpo.train.sft import masked_nll, supervised_batch


def format_targets(
    template: str,
    low: int,
    high: int,
    n: int,
    rng: random.Random,
    answers: list | None = None,
    random_share: float = 0.0,
) -> list[str]:
    """n completions from ``template``: ``{random}`` becomes a uniform integer in [low, high] and
    ``{answer}`` the task's true answer (``answers[i]``; a supervised cold start on true examples), except
    in a ``random_share`` of the rows, where ``{answer}`` is a random integer too (so that every answer
    stays likely enough to be sampled: answers the true examples never show are otherwise never tried)."""
    out = []
    for i in range(n):
        guess = rng.randint(low, high)
        answer = answers[i] if answers is not None and rng.random() >= random_share else guess
        out.append(template.format(random=guess, answer=answer))
    return out


def warm_start(
    policy: Policy,
    make_env: Callable[[], ChatEnv],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    template: str,
    low: int,
    high: int,
    seed: int,
    examples: int = 0,
    random_share: float = 0.0,
    source: str = "format",
    train_vision: bool = False,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
    drill_steps: int = 0,
    drill_lr: float | None = None,
    drill_bare_steps: int = 0,
    bare_share: float = 0.0,
    check_every: int = 0,
    done: Callable[[int], bool] | None = None,
) -> float:
    """Run the supervised warm start; returns the last loss (mean negative log-likelihood per token).

    With ``drill_steps`` (``source="env"``), first at most that many steps on the env's skill drills alone
    (``skill_probe`` of training tasks: the skill the check measures, the parts it shows untaught), at
    ``drill_lr`` (default ``lr``), then ``steps`` steps of demonstrations at ``lr``. With ``drill_bare_steps``
    the drills start with that many steps on bare prompts (``bare_prompt``: the question alone), then go on
    with the full ones. With ``bare_share`` that share of the demonstrations' rows (drawn at random) is
    on bare prompts (for ``grpo.bare_steps``, whose first steps pose them). With ``check_every`` and
    ``done``, the drills on full prompts (else the only phase) end after a step ``k`` (a multiple of
    ``check_every``) for which ``done(k)`` says the skill is there (mmgrpo.train.warm_check measures it
    on held-out tasks, on full prompts). When the skill is gone again after the demonstrations, the drills
    go on ("drills again") with what is left of ``drill_steps``, until the check passes."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    env = make_env()
    if source == "env" and getattr(env, "demonstration", None) is None:
        raise ConfigError(
            f"warm_start.source: env needs an environment with demonstrations (demonstration(info, rng): a "
            f"ToolEnv subclass that implements it, or the gym env with demo_policy); {type(env).__name__} has "
            "none. Use source: format."
        )
    probe = getattr(env, "skill_probe", None) if source == "env" else None
    if drill_steps > 0 and (probe is None or probe(reset_tasks(env, [10_000_000])[0][2]) is None):
        raise ConfigError(
            f"warm_start.drill_steps: {type(env).__name__} has no skill drill (a ToolEnv's skill_probe); "
            "set warm_start.drill_steps: 0"
        )
    pool = example_pool(env, examples) if examples and "{answer}" in template else []
    params = list(policy.model.parameters()) if train_vision else policy.language_parameters()
    params = [p for p in params if p.requires_grad]
    optimizer = adamw(params, lr=lr, weight_decay=0.0)
    policy.model.train()

    def task_seeds(step: int) -> list[int]:
        # training-split seeds far from the GRPO stage's (which start at 0), so the two stages see other
        # scenes, and another run of them for each config seed (with ``examples``, a fixed pool of that many
        # tasks, cycled)
        if pool:
            return [pool[(step * batch_size + i) % len(pool)] for i in range(batch_size)]
        first = 10_000_000 + 1_000_003 * seed
        return [first + step * batch_size + i for i in range(batch_size)]

    def drill(step: int, bare: bool = False) -> TokenBatch:
        return demonstration_batch(policy, env, task_seeds(step), rng, play=probe, bare=bare)

    def demonstrations(step: int) -> TokenBatch:
        if source == "env":
            seeds = task_seeds(step)
            bare = [rng.random() < bare_share for _ in seeds] if bare_share > 0 else False
            return demonstration_batch(policy, env, seeds, rng, bare=bare)
        resets = reset_tasks(env, task_seeds(step))  # a task the env cannot pose is left out
        answers = [info.get("answer") for _, _, info in resets] if "{answer}" in template else None
        targets = format_targets(template, low, high, len(resets), rng, answers, random_share)
        tools = [info.get("tools") or None for _, _, info in resets]  # the schemas GRPO's prompts will show
        return supervised_batch(policy, [obs for _, obs, _ in resets], targets, tools)

    phases = []  # (name, steps, batches, learning rate, whether the skill check may end it)
    if drill_steps > 0 and drill_bare_steps > 0:
        bare_drill = functools.partial(drill, bare=True)
        phases.append(("drills, bare prompts", drill_bare_steps, bare_drill, drill_lr or lr, False))
    if drill_steps > 0:
        phases.append(("drills", drill_steps, drill, drill_lr or lr, True))
    name = "demonstrations" if source == "env" else "format only"
    phases.append((name, steps, demonstrations, lr, not phases))
    state = {"loss": float("nan"), "steps": 0, "drilled": 0}

    def run(name: str, n: int, make_batch, phase_lr: float, until_skill: bool, check_last: bool) -> None:
        """``n`` steps of ``make_batch`` at ``phase_lr``; with ``until_skill``, ended by the first check
        that passes (checked every ``check_every`` steps; at the last step only with ``check_last``)."""
        for group in optimizer.param_groups:
            group["lr"] = phase_lr
        bar = tqdm(range(n), desc=f"warm start ({name})", unit="step", disable=not progress)
        for step in bar:
            batch = make_batch(state["steps"])
            loss = masked_nll(policy.logprobs(batch, scored=batch.loss_mask.bool()), batch.loss_mask)  # per target token
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            state["loss"], state["steps"] = float(loss.detach()), state["steps"] + 1
            state["drilled"] += make_batch is drill
            bar.set_postfix(nll=f"{state['loss']:.3f}")
            if log is not None:
                log({"stage": "warm_start", "step": state["steps"], "phase": name, "nll": state["loss"]})
            if until_skill and (step + 1) % check_every == 0 and (step + 1 < n or check_last):
                if done(state["steps"]):
                    break
        bar.close()

    checks = done is not None and check_every > 0
    for k, (name, n, make_batch, phase_lr, checked) in enumerate(phases):
        run(name, n, make_batch, phase_lr, checked and checks, k + 1 < len(phases))
    left = drill_steps - state["drilled"]
    if drill_steps > 0 and steps > 0 and checks and left > 0 and not done(state["steps"]):
        # the demonstrations wore the drilled skill down (tools_lookup, seed 2: the check passed after the
        # drills and read 56/64 after 300 demonstrations): drill again, with what is left of drill_steps,
        # until the check passes
        run("drills again", left, drill, drill_lr or lr, True, False)
    return state["loss"]


def reset_tasks(env: ChatEnv, seeds: list[int], split: str = "train") -> list[tuple[int, list[dict], dict]]:
    """``(seed, messages, info)`` of each task of ``seeds`` the env can pose. A reset that raises leaves its
    task out, as GRPO's rollout does (a bad task is data, not a crash); when no task can be posed, one
    EnvError naming the env, the first seed and its error (a traceback through the warm start before)."""
    posed, first = [], None
    for s in seeds:
        try:
            messages, info = reset_group([env], s, split)
        except Exception as exc:
            first = first or (s, f"{type(exc).__name__}: {exc}")
            continue
        posed.append((s, messages, info))
    if not posed and first is not None:
        raise none_posed(env, seeds, split, first)
    return posed


def none_posed(env: ChatEnv, seeds: list[int], split: str, first: tuple[int, str]) -> EnvError:
    """The one line of a warm start whose env raised in reset() for every task of ``seeds``."""
    return EnvError(
        f"warm start: env {type(env).__name__} raised in reset() for every task it was asked to pose "
        f"({len(seeds)} {split} seeds); first: seed {first[0]}: {first[1]}"
    )


def example_pool(env: ChatEnv, examples: int, scan: int = 5000) -> list[int]:
    """``examples`` training-task seeds for a cold start on true examples, as varied as possible: the
    first task of each answer not seen yet (within ``scan`` seeds), then the earliest unused ones. A pool
    that never shows some answer leaves it unlikely to be sampled, so GRPO never finds it (measured on
    text_math: eight examples with sums 2..7 plateaued at 0.85, the sums 0, 1 and 8 never answered)."""
    first_of: dict[str, int] = {}
    for k in range(0, scan, 64):
        for seed, _, info in reset_tasks(env, list(range(10_000_000 + k, 10_000_000 + min(k + 64, scan)))):
            first_of.setdefault(str(info.get("answer")), seed)
            if len(first_of) >= examples:
                break
        if len(first_of) >= examples:
            break
    pool = sorted(first_of.values())[:examples]
    rest = (10_000_000 + k for k in range(scan) if 10_000_000 + k not in pool)
    while len(pool) < examples:
        pool.append(next(rest))
    return pool


def demonstration_batch(
    policy: Policy,
    env: ChatEnv,
    seeds: list[int],
    rng: random.Random,
    *,
    split: str = "train",
    play: Callable[[dict], list[DemoTurn]] | None = None,
    share_prefix: bool = True,
    bare: bool | list[bool] = False,
) -> TokenBatch:
    """The env's demonstrations of ``seeds``, played through ``step`` and laid out as the rollout lays
    out an episode: policy turns (loss 1, each ending with end-of-turn; ``Shown`` turns or pieces 0), env turns
    (loss 0) between. ``play(info)`` gives the turns instead of ``env.demonstration`` (the skill probe).
    With ``share_prefix`` the prompt prefix every row shares is encoded once (``share_common_prefix``).
    With ``bare`` each prompt is cut to ``bare_prompt`` (the tools still run and their results still
    follow the calls); a list says it per seed."""
    prompts, tools, responses, masks, images = [], [], [], [], []
    bare_rows = bare if isinstance(bare, list) else [bare] * len(seeds)
    first = None  # a task the env cannot pose is left out (the first failure is said if none is posed)
    for s, row_bare in zip(seeds, bare_rows, strict=True):
        try:  # each task is reset just before it is played: the env holds one episode at a time
            messages, info = reset_group([env], s, split)
        except Exception as exc:
            first = first or (s, f"{type(exc).__name__}: {exc}")
            continue
        if row_bare:
            messages, info = bare_prompt(messages), {**info, "tools": None}
        turns = (play(info) if play is not None else env.demonstration(info, rng)) or []
        ids: list[int] = []
        mask: list[int] = []
        row_images: list[VisionInputs] = []
        history = list(messages)
        for k, item in enumerate(turns):
            text, turn, taught = encode_turn(policy, item)
            ids, mask = ids + turn + [policy.end_of_turn_id], mask + taught + [taught[-1] if taught else 1]
            history.append(assistant(text))
            obs, _, terminated, truncated, _ = env.step(text)
            if terminated or truncated or not obs or k == len(turns) - 1:
                break
            more, new_vision = policy.encode_continuation(history, obs, info.get("tools"))
            history += obs
            ids, mask = ids + more, mask + [0] * len(more)
            if not new_vision.empty:
                row_images.append(new_vision)
        prompts.append(messages)
        tools.append(info.get("tools"))
        responses.append(ids)
        masks.append(mask)
        images.append(VisionInputs.one_sequence(row_images))
    if not prompts and first is not None:
        raise none_posed(env, seeds, split, first)
    prompt_ids, prompt_mask, vision = policy.encode_prompts(prompts, tools)  # (B, P)
    response_ids, response_mask = pad_right(responses, policy.pad_token_id)  # (B, T)
    loss_mask, _ = pad_right(masks, 0)  # (B, T)
    response_vision = VisionInputs.concat_rows(images)
    batch = TokenBatch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        loss_mask,
        vision,
        response_vision=None if response_vision.empty else response_vision,
    )
    return share_common_prefix(batch, policy.pad_token_id) if share_prefix else batch


def share_common_prefix(batch: TokenBatch, pad_token_id: int) -> TokenBatch:
    """The same rows with the prompt cut to the tokens every row's prompt starts with (a tool task's system
    prompt and tool schemas: most of the sequence) and the rest of each prompt moved to the front of its
    response with loss mask 0. ``Policy.logprobs`` then encodes that prefix once and repeats its KV cache
    for every row (the engine's shared-prompt path): the same log-probs and gradients (the repeat sums the
    rows' gradients back into the one prefix), for a fraction of the compute. Batches with images in their
    prompts or responses are returned unchanged (an image's tokens must not be cut)."""
    if not batch.vision.empty or batch.has_response_images or len(batch) < 2:
        return batch
    prompts = [row[m.bool()].tolist() for row, m in zip(batch.prompt_ids, batch.prompt_mask, strict=True)]
    c = 0
    while all(len(p) > c for p in prompts) and len({p[c] for p in prompts}) == 1:
        c += 1
    if c == 0:
        return batch
    responses, masks = [], []
    for i, p in enumerate(prompts):
        n = int(batch.response_mask[i].sum())
        responses.append(p[c:] + batch.response_ids[i, :n].tolist())
        masks.append([0] * (len(p) - c) + batch.loss_mask[i, :n].tolist())
    response_ids, response_mask = pad_right(responses, pad_token_id)  # (N, T')
    loss_mask, _ = pad_right(masks, 0)  # (N, T')
    N = len(prompts)
    return TokenBatch(
        torch.as_tensor([prompts[0][:c]] * N, dtype=torch.long),  # (N, c) the shared prefix, no padding
        torch.ones((N, c), dtype=torch.long),  # (N, c)
        response_ids,
        response_mask,
        loss_mask,
        batch.vision.select([0]),
        prompt_index=[0] * N,
    )


def encode_turn(policy: Policy, turn: DemoTurn) -> tuple[str, list[int], list[int]]:
    """A demonstration turn's text, its token ids (as ``encode_text`` gives them: the whole text at once)
    and per token 1 when taught, 0 when it overlaps a ``Shown`` piece."""
    pieces = turn_pieces(turn)
    text = "".join(t for t, _ in pieces)
    if all(taught for _, taught in pieces) or not any(taught for _, taught in pieces):
        ids = policy.encode_text(text)
        return text, ids, [int(pieces[0][1] if pieces else 1)] * len(ids)
    shown, at = [], 0  # character spans of the shown pieces
    for t, taught in pieces:
        if not taught:
            shown.append((at, at + len(t)))
        at += len(t)
    enc = policy.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [  # a token is shown (0) when its characters [s, e) overlap a shown piece's [a, b)
        int(not any(s < b and a < e for a, b in shown)) for s, e in enc["offset_mapping"]
    ]
    return text, list(enc["input_ids"]), mask
