"""mmgrpo's multi-turn (tool-calling) GRPO step: what the extra turns cost, and against TRL's tool calling.

    python benchmarks/multiturn.py                     # all three, 2 rounds alternated, 6 steps per run
    python benchmarks/multiturn.py --quick             # 1 round, 2 steps, B=2 x G=2 (the smoke test)
    python benchmarks/multiturn.py --only text,zoom    # a selection of text, zoom, trl
    python benchmarks/multiturn.py --only trl --model DIR --work DIR   # reuse a warm-started checkpoint
    PYTHONPATH=/path/to/other/checkout python benchmarks/multiturn.py  # measure that checkout's mmgrpo

Three measurements, each printed as ``multiturn: <name> ratio=<x>``:

``text_tool_vs_single`` (mmgrpo only). 8 tasks x G=8 per step; each episode is 3 policy turns with the
``calculator`` tool (``mmgrpo.make_tool("calculator")``) answering in between. The benchmark env
(``TextToolEnv``, a ``ChatEnv`` registered in-process with ``register_env`` so that the real ``Trainer``
builds it by name) ignores the model's text: after turns 1 and 2 it returns a ``tool`` message holding the
calculator's real result for the task's expression (the tool is called each time), after turn 3 it ends
the episode. Every policy turn is exactly ``--turn-tokens`` (24) tokens: a forward hook on the policy
masks the stop tokens and forces the end-of-turn token as the turn's last token (see ``ForcedTurns``;
suppressing the stop tokens alone, as vs_trl.py does, would end every episode after its first turn, which
mmgrpo counts as truncated by max_new_tokens). The operands are 32..99, so every result has 4 digits and
every episode the same length. The single-turn counterpart poses the same prompts and samples one turn of
as many tokens as the multi-turn episode's whole response (policy and tool tokens), so both sequences
have the same length. ratio = multi-turn step / single-turn step.

``zoom_vs_single`` (mmgrpo only). The same with one 112 x 112 image in the prompt and a ``zoom`` tool
message (an image part, a 112 x 112 enlargement of one cell of a 3 x 3 grid of the prompt image, and a
short text part), as envs/zoom_count.py's zoom returns it.

``vs_trl_tools``: mmgrpo's real ``tool_math`` env (examples/tools_math_tiny.yaml: ops ["*"], 10..99,
calculator, 3 turns, 160 response tokens) against TRL's ``GRPOTrainer(tools=[calculator])`` on the same
warm-started checkpoint (mmgrpo's warm start of that config, run once, cached in the work folder), the same
prompts (checked token for token) in the same order, B=8 x G=8, 40 new tokens per turn (TRL:
``generation_kwargs["max_new_tokens"]``; its ``max_completion_length`` is the episode's 160), at most 3
turns (TRL: ``max_tool_calling_iterations=2``), temperature 1, beta 0.02, ``loss_type="grpo"`` (mmgrpo:
``aggregation: sequence``), no KL bias correction, fp32, no gradient checkpointing, constant learning rate;
the rest as in benchmarks/vs_trl.py (``trl_args``). Natural lengths: the model decides when to call and
when to stop, so tool calls per episode and tokens per step are reported for each system.

How it is measured (as vs_trl.py): every run a fresh subprocess with one thread, runs alternated (A, B, A,
B, ...), the first step of each run left out, medians. The workers inherit PYTHONPATH and import mmgrpo
from there (the header prints the file); mmgrpo.envs / mmgrpo.verifiers are taken from the same checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import vs_trl  # noqa: E402  (benchmarks/vs_trl.py: the measuring helpers)

RESULT_TAG = "MULTITURN_RESULT "
"""A worker's result is the one stdout line starting with this tag."""
SHAPES = ("text", "zoom", "trl")
TEXT_ENV = "multiturn_bench_text"
ZOOM_ENV = "multiturn_bench_zoom"
SYSTEM_PROMPT = "Use a tool when you need it, then answer with the number only, inside <answer></answer>."
VERIFIERS = [{"name": "number_match", "weight": 1.0}, {"name": "format", "weight": 0.1}]
TOOLS_RECIPE = "examples/tools_math_tiny.yaml"
GRID = 3


# ------------------------------------------------------------------------------------------ run spec
@dataclass(frozen=True)
class Spec:
    """One measured run (sent to a worker as JSON)."""

    model_dir: str
    out_dir: str
    shape: str = "text"
    """text | zoom (the benchmark envs) | tools (tool_math, for the TRL comparison)."""
    turns: int = 3
    """Policy turns per episode (shapes); 1 = the single-turn counterpart."""
    tasks: int = 8
    group_size: int = 8
    steps: int = 6
    max_new_tokens: int = 24
    """Tokens per policy turn (shapes: every turn exactly this many; tools: at most)."""
    max_episode_tokens: int = 1024
    beta: float = 0.04
    lr: float = 1e-5
    seed: int = 0


# --------------------------------------------------------------------------------------- the workers
def bind_plugins() -> dict[str, str]:
    """Import mmgrpo, and mmgrpo.envs / mmgrpo.verifiers from the same checkout when it has them (an
    editable install maps those two to its own folders, so a checkout on PYTHONPATH would otherwise mix
    its mmgrpo with another tree's envs). Returns the files in use."""
    import mmgrpo

    root = Path(mmgrpo.__file__).resolve().parent.parent
    for sub in ("envs", "verifiers"):
        name, init = f"mmgrpo.{sub}", root / sub / "__init__.py"
        if name in sys.modules or not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(mmgrpo, sub, module)
    import mmgrpo.envs
    import mmgrpo.verifiers

    return {"mmgrpo": mmgrpo.__file__, "envs": mmgrpo.envs.__file__, "verifiers": mmgrpo.verifiers.__file__}


def mmgrpo_root() -> Path:
    import mmgrpo

    return Path(mmgrpo.__file__).resolve().parent.parent


def recipe_path() -> Path:
    """examples/tools_math_tiny.yaml of the mmgrpo in use (this repository's when that checkout has none)."""
    own = mmgrpo_root() / TOOLS_RECIPE
    return own if own.is_file() else ROOT / TOOLS_RECIPE


def make_envs():
    """The two benchmark envs (classes defined here so that mmgrpo is imported in workers only)."""
    from PIL import Image, ImageDraw

    from mmgrpo import ChatEnv, Tool, image_part, make_tool, system, text_part, user

    class TextToolEnv(ChatEnv):
        """The question "What is a * b?" with the calculator offered; the model's text is ignored: after each of the
        first ``turns - 1`` turns a tool message with the calculator's result, then the end."""

        def __init__(self, turns: int = 3, low: int = 32, high: int = 99) -> None:
            self.turns, self.low, self.high = turns, low, high
            self.tool = make_tool("calculator")
            self.schemas = [Tool(self.tool).schema]

        def task(self, seed: int) -> tuple[list[dict], dict[str, Any]]:
            rng = random.Random(seed)
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            self.call = ("calculator", lambda: self.tool(f"{a} * {b}"))
            return [system(SYSTEM_PROMPT), user(f"What is {a} * {b}?")], {"answer": a * b}

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            seed = int(seed if seed is not None else self.np_random.integers(0, 2**31 - 1))
            messages, info = self.task(seed)
            self.turn = 0
            self.info = dict(info, seed=seed, split=(options or {}).get("split", "train"), tools=self.schemas)
            return messages, dict(self.info)

        def step(self, action: str):
            self.turn += 1
            if self.turn >= self.turns:
                return [], 0.0, True, False, dict(self.info, tool_calls=0)
            name, run = self.call
            content = run()
            parts = list(content) if isinstance(content, list) else [text_part(str(content))]
            message = {"role": "tool", "name": name, "content": parts}
            return [message], 0.0, False, False, dict(self.info, tool_calls=1, tool_names=[name])

    class ZoomToolEnv(TextToolEnv):
        """One 112 x 112 image; the tool message is a 112 x 112 enlargement of one of its 3 x 3 cells."""

        def __init__(self, turns: int = 3, size: int = 112) -> None:
            super().__init__(turns)
            self.size = size

            def zoom(cell: int) -> str:
                """Show one cell of the image enlarged.

                Args:
                    cell: the cell, 1 to 9, row by row
                """
                return ""

            self.schemas = [Tool(zoom).schema]

        def task(self, seed: int) -> tuple[list[dict], dict[str, Any]]:
            rng = random.Random(seed)
            image = Image.new("RGB", (self.size, self.size), "white")
            draw = ImageDraw.Draw(image)
            count = rng.randint(1, 5)
            for _ in range(count):
                x, y = rng.randint(4, self.size - 12), rng.randint(4, self.size - 12)
                draw.ellipse((x, y, x + 8, y + 8), fill="red")
            cell = rng.randint(1, GRID * GRID)
            row, col = divmod(cell - 1, GRID)
            box = tuple(int(v * self.size / GRID) for v in (col, row, col + 1, row + 1))

            def zoom() -> list[dict]:
                view = image.crop(box).resize((self.size, self.size), Image.BICUBIC)
                return [image_part(view), text_part(f"cell {cell}")]

            self.call = ("zoom", zoom)
            question = f"How many red dots are in cell {cell}? Use zoom to look closer."
            return [system(SYSTEM_PROMPT), user(image_part(image), text_part(question))], {"answer": count}

    return TextToolEnv, ZoomToolEnv


class ForcedTurns:
    """Every policy turn exactly ``length`` tokens, ending with the end-of-turn token.

    Wraps the engine's sampler (``mmgrpo.model.engine.sample_tokens``, one call per sampled token on every
    engine version) so that before a turn's last token the stop tokens are masked and at it everything but
    the end-of-turn token is. A turn starts at a prefill (``engine.prefill``: turn 1, and every turn of an
    engine that encodes each turn again) or at a decode loop (``engine.decode``, where the engine has one:
    every turn on a kept KV cache); both reset the count. Works whichever way the engine runs its forwards
    (the model's own, or a lean decode step that bypasses it)."""

    def __init__(self, policy, length: int) -> None:
        from mmgrpo.model import engine

        self.length, self.j = length, 0
        self.stop = sorted(set(policy.stop_ids))
        end = getattr(policy, "end_of_turn_id", None)
        self.end = end if end is not None else self.stop[0]
        sample = engine.sample_tokens

        def forced(logits, *args, **kwargs):
            logits = logits.clone()  # (N, V)
            if self.j >= self.length - 1:
                logits.fill_(float("-inf"))
                logits[:, self.end] = 0.0
            else:
                logits[:, self.stop] = float("-inf")
            self.j += 1
            return sample(logits, *args, **kwargs)

        engine.sample_tokens = forced
        for name in ("prefill", "decode"):
            if hasattr(engine, name):
                setattr(engine, name, self._resetting(getattr(engine, name)))

    def _resetting(self, fn):
        def wrapped(*args, **kwargs):
            self.j = 0
            return fn(*args, **kwargs)

        return wrapped


def shape_sets(spec: Spec) -> list[str]:
    """mmgrpo config overrides shared by every mmgrpo run here (the like-for-like list of vs_trl.py)."""
    micro = spec.tasks * spec.group_size
    return [
        f"model.path={spec.model_dir}",
        "model.device=cpu",
        "model.dtype=float32",
        "model.freeze_vision=true",
        f"output_dir={spec.out_dir}",
        f"seed={spec.seed}",
        "warm_start.steps=0",
        f"grpo.steps={spec.steps}",
        f"grpo.tasks_per_step={spec.tasks}",
        f"grpo.group_size={spec.group_size}",
        f"grpo.micro_batch_size={micro}",
        f"grpo.max_new_tokens={spec.max_new_tokens}",
        f"grpo.beta={spec.beta}",
        f"grpo.lr={spec.lr}",
        "grpo.temperature=1.0",
        "grpo.clip_eps_low=0.2",
        "grpo.clip_eps_high=0.2",
        *vs_trl.MATCHED,
    ]


def capture_batches(trainer) -> list:
    """Keep each step's RolloutBatch (wraps ``trainer.collect`` on the instance)."""
    kept: list = []
    collect = getattr(trainer, "collect", None)
    if collect is None:
        return kept

    def keeping(*args, **kwargs):
        out = collect(*args, **kwargs)
        kept.append(out[0])
        return out

    trainer.collect = keeping
    return kept


def timed_steps(trainer, spec: Spec, counter) -> list[dict[str, Any]]:
    """``spec.steps`` calls of ``trainer.train_step()``: time, tokens, turns, tool calls, images encoded."""
    batches = capture_batches(trainer)
    steps = []
    for _ in range(spec.steps):
        before = counter.snapshot()
        t0 = time.perf_counter()
        record = trainer.train_step()
        seconds = time.perf_counter() - t0
        step: dict[str, Any] = {
            "seconds": seconds,
            "rollout_s": record.get("rollout_time"),
            "policy_tokens": round(record["completion_len"] * record["num_episodes"]),
            "episodes": record["num_episodes"],
            "vision": counter.since(before),
            "reward": record["reward"],
        }
        if batches:
            trajs = batches[-1].trajectories
            step["response_tokens"] = [len(t.response_ids) for t in trajs]
            step["turns"] = [t.turns for t in trajs]
            step["tool_calls"] = [t.tool_calls for t in trajs]
            step["truncation"] = sorted({str(t.truncation) for t in trajs})
        steps.append(step)
    return steps


def run_shape(spec: Spec) -> dict[str, Any]:
    """A text / zoom benchmark env under the real Trainer; every turn forced to max_new_tokens."""
    from mmgrpo import register_env
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    text_env, zoom_env = make_envs()
    register_env(TEXT_ENV, text_env, overwrite=True)
    register_env(ZOOM_ENV, zoom_env, overwrite=True)
    sets = shape_sets(spec) + [
        f"env.name={TEXT_ENV if spec.shape == 'text' else ZOOM_ENV}",
        f"env.kwargs={json.dumps({'turns': spec.turns})}",
        f"env.max_turns={spec.turns}",
        f"env.max_episode_tokens={spec.max_episode_tokens}",
        "verifiers=" + json.dumps(VERIFIERS),
    ]
    trainer = Trainer(load_config(None, sets), progress=False)
    policy = trainer.policy
    if spec.beta > 0 and not policy.has_reference:
        policy.make_reference()  # what the first train_step does; done first so that the hooks are the policy's
    counter = vs_trl.VisionCounter()
    counter.install(policy.model)
    if policy.reference is not None:
        counter.install(policy.reference)
    ForcedTurns(policy, spec.max_new_tokens)
    steps = timed_steps(trainer, spec, counter)
    return {"system": "mmgrpo", "steps": steps, **vs_trl.memory()}


# ----------------------------------------------------------------------------- the TRL comparison
def tool_math_env():
    """The recipe's tool_math env, as mmgrpo builds it."""
    from mmgrpo.config.core import load_config
    from mmgrpo.registry import make_env

    cfg = load_config(recipe_path())
    return make_env(cfg.env.name, **cfg.env.kwargs), cfg


def tools_sets(spec: Spec) -> list[str]:
    return shape_sets(spec) + [
        "warm_start.drill_steps=0",
        f"env.max_episode_tokens={spec.max_episode_tokens}",
    ]


def run_tools_mmgrpo(spec: Spec) -> dict[str, Any]:
    """mmgrpo on the recipe's tool_math env (natural lengths); its first step's prompt ids, hashed."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    trainer = Trainer(load_config(recipe_path(), tools_sets(spec)), progress=False)
    policy = trainer.policy
    if spec.beta > 0 and not policy.has_reference:
        policy.make_reference()
    counter = vs_trl.VisionCounter()
    steps = timed_steps(trainer, spec, counter)
    env, _ = tool_math_env()
    resets = [env.reset(seed=s, options={"split": "train"}) for s in range(spec.tasks)]
    ids, mask, _ = policy.encode_prompts([m for m, _ in resets], tools=[i["tools"] for _, i in resets])
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    return {
        "system": "mmgrpo",
        "steps": steps,
        **vs_trl.memory(),
        "prompt_digest": vs_trl.digest(prompts),
        "prompt_tokens": len(prompts[0]),
    }


def tool_chat_template() -> str:
    """A chat template of the tiny model that renders ``tool_calls`` (TRL needs it): the mmgrpo in use's,
    or this repository's when that one has no tool_calls branch (an older checkout)."""
    from mmgrpo.tiny import vlm

    if "tool_calls" in vlm.CHAT_TEMPLATE:
        return vlm.CHAT_TEMPLATE
    spec = importlib.util.spec_from_file_location("_multiturn_vlm", ROOT / "mmgrpo" / "tiny" / "vlm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.CHAT_TEMPLATE


def run_tools_trl(spec: Spec) -> dict[str, Any]:
    """TRL's GRPOTrainer with tools=[calculator] on the tool_math prompts, in mmgrpo's task order."""
    from datasets import Dataset
    from transformers import AutoProcessor
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_schema, qwen3_template

    from mmgrpo.env import message_text
    from mmgrpo.model.adapters import adapter_for
    from mmgrpo.registry import make_verifier
    from mmgrpo.toolbox import make_tool
    from mmgrpo.verifier import Episode

    env, cfg = tool_math_env()
    rows: dict[str, list] = {"prompt": [], "answer": [], "seed": []}
    for seed in range(spec.steps * spec.tasks):
        messages, info = env.reset(seed=seed, options={"split": "train"})
        rows["prompt"].append([{"role": m["role"], "content": message_text(m)} for m in messages])
        rows["answer"].append(info["answer"])
        rows["seed"].append(seed)
    dataset = Dataset.from_dict(rows)

    processor = AutoProcessor.from_pretrained(spec.model_dir)
    template = tool_chat_template()
    processor.chat_template = template
    processor.tokenizer.chat_template = template
    # the response parser of Qwen-style <tool_call> blocks (what trl's add_response_schema sets for Qwen)
    if hasattr(type(processor.tokenizer), "parse_response"):
        processor.tokenizer.response_template = qwen3_template
    else:
        processor.tokenizer.response_schema = qwen3_schema

    calls_log: list[list[int]] = []
    tokens_log: list[int] = []

    def final_text(completion) -> str:
        if isinstance(completion, str):
            return completion
        said = [m for m in completion if m.get("role") == "assistant"]
        content = said[-1].get("content", "") if said else ""
        return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)

    funcs = []
    for i, v in enumerate(VERIFIERS):
        verifier = make_verifier(v["name"], weight=v["weight"])

        def reward(completions, answer, completion_ids=None, _v=verifier, _first=i == 0, **kwargs):
            if _first:
                calls_log.append(
                    [
                        sum(len(m.get("tool_calls") or []) for m in c if m.get("role") == "assistant")
                        if isinstance(c, list)
                        else 0
                        for c in completions
                    ]
                )
                tokens_log.append(sum(len(c) for c in completion_ids or []))
            episodes = [
                Episode(completion=final_text(c), task={"answer": a})
                for c, a in zip(completions, answer, strict=True)
            ]
            return _v.score(episodes)

        reward.__name__ = v["name"]
        funcs.append(reward)

    model = vs_trl.load_trl_model(vs_trl.Spec(model_dir=spec.model_dir, out_dir=spec.out_dir))
    base = vs_trl.Spec(
        model_dir=spec.model_dir,
        out_dir=spec.out_dir,
        tasks=spec.tasks,
        group_size=spec.group_size,
        steps=spec.steps,
        max_new_tokens=spec.max_episode_tokens,  # TRL's max_completion_length: the whole episode
        beta=spec.beta,
        lr=spec.lr,
        equal_lengths=False,
        seed=spec.seed,
    )
    args = vs_trl.trl_args(base, str(Path(spec.out_dir) / "trl"), adapter_for(model).suppress_ids)
    # per turn, as mmgrpo's grpo.max_new_tokens
    args.generation_kwargs["max_new_tokens"] = spec.max_new_tokens
    args.max_tool_calling_iterations = spec.turns - 1
    args.use_bias_correction_kl = False
    counter = vs_trl.VisionCounter()
    timer = vs_trl.make_step_timer(counter)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[timer],
        tools=[make_tool(name) for name in cfg.env.kwargs.get("tools", ["calculator"])],
    )
    trainer.train()
    steps = []
    for s, calls, tokens in zip(timer.steps, calls_log, tokens_log, strict=False):
        steps.append(dict(s, tool_calls=calls, completion_tokens=tokens, episodes=len(calls)))
    prompts = None
    try:
        ids, _, _ = trainer._tokenize_prompts([list(p) for p in dataset.select(range(spec.tasks))["prompt"]])
        prompts = [list(map(int, r)) for r in ids]
    except (AttributeError, TypeError, ValueError):
        pass
    return {
        "system": "trl",
        "steps": steps,
        **vs_trl.memory(),
        "prompt_digest": vs_trl.digest(prompts) if prompts else None,
        "prompt_tokens": len(prompts[0]) if prompts else None,
        "chat_template_has_tool_calls": "tool_calls" in template,
    }


def build_model(spec: Spec) -> dict[str, Any]:
    from mmgrpo.tiny.vlm import build_tiny_model

    return {"model_dir": str(build_tiny_model(spec.model_dir))}


def prepare_warm(spec: Spec) -> dict[str, Any]:
    """mmgrpo's warm start of the tools recipe (drills, then demonstrations, then the skill check) from the
    tiny model in ``spec.model_dir``, saved to ``spec.out_dir``/warm."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    out = Path(spec.out_dir)
    sets = [f"model.path={spec.model_dir}", f"output_dir={out / 'warm-run'}"]
    trainer = Trainer(load_config(recipe_path(), sets), progress=False)
    t0 = time.perf_counter()
    trainer.warm_start()
    seconds = time.perf_counter() - t0
    tmp = out / "warm.tmp"
    trainer.save(tmp)
    os.replace(tmp, out / "warm")
    return {"warm_dir": str(out / "warm"), "warm_seconds": seconds}


def worker(kind: str, spec: Spec) -> dict[str, Any]:
    files = bind_plugins()
    vs_trl.pin_threads()
    if kind == "tools-trl":
        import transformers

        transformers.logging.set_verbosity_error()
    jobs = {
        "build": build_model,
        "prepare": prepare_warm,
        "shape": run_shape,
        "tools-mmgrpo": run_tools_mmgrpo,
        "tools-trl": run_tools_trl,
    }
    return dict(jobs[kind](spec), files=files)


# ------------------------------------------------------------------------------------------- parent
def spawn(kind: str, spec: Spec, timeout: float) -> dict[str, Any]:
    """Run a worker in a fresh single-threaded subprocess (PYTHONPATH inherited); its result, parsed."""
    env = vs_trl.worker_env()
    payload = json.dumps(asdict(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--payload", payload]
    proc = subprocess.run(cmd, env=env, cwd=spec.out_dir, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-40:])
    raise RuntimeError(f"multiturn: the {kind} worker failed (exit {proc.returncode}):\n{tail}")


def flat(steps: list[dict[str, Any]], key: str) -> list[Any]:
    return [x for s in steps for x in s.get(key, [])]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the measured steps (the first of each run left out) over every run of one side."""
    steps = [s for r in runs for s in vs_trl.measured(r["steps"])]
    times = [s["seconds"] for s in steps]
    out: dict[str, Any] = {
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "steps": steps,
    }
    if "policy_tokens" in steps[0]:
        out["policy_tokens_per_step"] = statistics.median(s["policy_tokens"] for s in steps)
    if "completion_tokens" in steps[0]:
        out["completion_tokens_per_step"] = statistics.median(s["completion_tokens"] for s in steps)
    if "vision" in steps[0]:
        out["vision_grad"] = statistics.median(s["vision"]["grad"] for s in steps)
        out["vision_no_grad"] = statistics.median(s["vision"]["no_grad"] for s in steps)
    if steps[0].get("response_tokens"):
        out["response_tokens"] = statistics.median(flat(steps, "response_tokens"))
        out["response_tokens_per_step"] = statistics.median(sum(s["response_tokens"]) for s in steps)
        out["turns"] = statistics.mean(flat(steps, "turns"))
        out["truncation"] = sorted({x for s in steps for x in s.get("truncation", [])})
    if steps[0].get("tool_calls") is not None:
        calls = flat(steps, "tool_calls")
        out["calls_per_episode"] = statistics.mean(calls) if calls else float("nan")
        out["called_frac"] = statistics.mean(c > 0 for c in calls) if calls else float("nan")
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def shape_spec(args, model_dir: Path, work: Path, shape: str, turns: int, tokens: int, tag: str) -> Spec:
    out = work / tag
    out.mkdir(parents=True, exist_ok=True)
    return Spec(
        model_dir=str(model_dir),
        out_dir=str(out),
        shape=shape,
        turns=turns,
        tasks=args.tasks,
        group_size=args.group_size,
        steps=args.steps,
        max_new_tokens=tokens,
        max_episode_tokens=args.max_episode_tokens,
        beta=args.beta,
        lr=args.lr,
    )


def run_shape_pair(args, model_dir: Path, work: Path, shape: str) -> dict[str, Any]:
    """Alternating multi-turn / single-turn runs of one shape; the single turn as long as the episode."""
    runs: dict[str, list] = {"multi": [], "single": []}
    single_tokens = None
    for r in range(args.rounds):
        multi = spawn(
            "shape",
            shape_spec(args, model_dir, work, shape, args.turns, args.turn_tokens, f"{shape}-multi-r{r}"),
            args.timeout,
        )
        runs["multi"].append(multi)
        if single_tokens is None:
            lengths = flat(multi["steps"], "response_tokens")
            single_tokens = int(statistics.median(lengths))
        spec = shape_spec(args, model_dir, work, shape, 1, single_tokens, f"{shape}-single-r{r}")
        runs["single"].append(spawn("shape", spec, args.timeout))
        print(f"  {shape} round {r + 1}/{args.rounds}: done", flush=True)
    res = {k: summarize(v) for k, v in runs.items()}
    res["single_tokens"] = single_tokens
    res["files"] = runs["multi"][0]["files"]
    return res


def ensure_model(args, work: Path) -> Path:
    model_dir = work / "tiny-model"
    if not (model_dir / "config.json").is_file():
        spawn("build", Spec(model_dir=str(model_dir), out_dir=str(work)), args.timeout)
    return model_dir


def ensure_warm(args, work: Path) -> tuple[Path, dict[str, Any]]:
    """The warm-started checkpoint: --model, else work/warm (built once, then reused)."""
    if args.model:
        return args.model, {"reused": str(args.model)}
    warm = work / "warm"
    if (warm / "config.json").is_file():
        return warm, {"reused": str(warm)}
    model_dir = ensure_model(args, work)
    print("  warm start of the tools recipe (a few minutes, once) ...", flush=True)
    prep = spawn("prepare", Spec(model_dir=str(model_dir), out_dir=str(work)), args.warm_timeout)
    print(f"  warm start: {prep['warm_seconds']:.0f} s -> {prep['warm_dir']}", flush=True)
    return Path(prep["warm_dir"]), prep


def run_trl_pair(args, work: Path) -> dict[str, Any]:
    """Alternating mmgrpo / TRL runs on the tool_math prompts, from the same checkpoint."""
    vs_trl.require_trl()
    if args.quick and not args.model:
        model_dir, prep = ensure_model(args, work), {"untrained": True}  # the smoke test: no warm start
    else:
        model_dir, prep = ensure_warm(args, work)
    runs: dict[str, list] = {"mmgrpo": [], "trl": []}
    for r in range(args.rounds):
        for system in ("mmgrpo", "trl"):
            out = work / f"tools-{system}-r{r}"
            out.mkdir(parents=True, exist_ok=True)
            spec = Spec(
                model_dir=str(model_dir),
                out_dir=str(out),
                shape="tools",
                turns=args.tool_turns,
                tasks=args.tasks,
                group_size=args.group_size,
                steps=args.steps,
                max_new_tokens=args.tool_tokens,
                max_episode_tokens=args.tool_episode_tokens,
                beta=args.tool_beta,
                lr=args.tool_lr,
            )
            runs[system].append(spawn(f"tools-{system}", spec, args.timeout))
            print(f"  trl round {r + 1}/{args.rounds} {system}: done", flush=True)
    res = {k: summarize(v) for k, v in runs.items()}
    res["model_dir"] = str(model_dir)
    res["prepare"] = prep
    res["same_prompts"] = runs["mmgrpo"][0]["prompt_digest"] == runs["trl"][0]["prompt_digest"]
    res["prompt_tokens"] = runs["mmgrpo"][0]["prompt_tokens"]
    res["files"] = runs["mmgrpo"][0]["files"]
    return res


def split_by_calls(steps: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Median step time over steps in which every episode called a tool, and over the others."""
    every = [s["seconds"] for s in steps if s.get("tool_calls") and min(s["tool_calls"]) > 0]
    rest = [s["seconds"] for s in steps if not (s.get("tool_calls") and min(s["tool_calls"]) > 0)]
    return (statistics.median(every) if every else None, statistics.median(rest) if rest else None)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_results(args, results: dict[str, Any]) -> None:
    files = next((r["files"] for r in results.values() if isinstance(r, dict) and "files" in r), {})
    print()
    print(f"mmgrpo multi-turn benchmark: mmgrpo from {files.get('mmgrpo')}")
    print(f"  (mmgrpo.envs from {files.get('envs')}); PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}")
    print(
        f"  B={args.tasks} tasks x G={args.group_size}, {args.rounds} round(s) alternated, {args.steps} steps per "
        "run (the first left out), 1 thread per run (fresh subprocess), fp32, CPU; step = Trainer.train_step()"
    )
    lines = []
    for shape, name in (("text", "text_tool_vs_single"), ("zoom", "zoom_vs_single")):
        if shape not in results:
            continue
        res = results[shape]
        m, s = res["multi"], res["single"]
        r = ratio(m["median_step_s"], s["median_step_s"])
        print()
        print(
            f"{shape}: {args.turns} policy turns x {args.turn_tokens} tokens (forced) + {args.turns - 1} tool "
            f"messages vs 1 turn of {res['single_tokens']} tokens (forced); beta {args.beta}"
        )
        head = (
            f"{'run':<7} | {'step s':>7} | {'resp tok/ep':>11} | {'policy tok/step':>15} | {'turns':>5} | "
            f"{'imgs grad':>9} | {'imgs no-grad':>12} | {'RSS MB':>6}"
        )
        print(head)
        print("-" * len(head))
        for label, x in (("multi", m), ("single", s)):
            print(
                f"{label:<7} | {x['median_step_s']:>7.3f} | {fmt(x.get('response_tokens'), 'g'):>11} | "
                f"{fmt(x.get('policy_tokens_per_step'), 'g'):>15} | {fmt(x.get('turns'), '.2f'):>5} | "
                f"{fmt(x.get('vision_grad'), 'g'):>9} | {fmt(x.get('vision_no_grad'), 'g'):>12} | "
                f"{x['peak_rss_mb']:>6.0f}"
            )
        print(f"  step times multi {[round(t, 3) for t in m['step_times_s']]}")
        print(f"  step times single {[round(t, 3) for t in s['step_times_s']]}")
        if m.get("truncation") and m["truncation"] != ["None"]:
            print(f"  NOTE: multi-turn episodes ended by {m['truncation']} (expected: None, all 3 turns)")
        lines.append(f"multiturn: {name} ratio={r:.2f}")
    if "trl" in results:
        res = results["trl"]
        m, t = res["mmgrpo"], res["trl"]
        r = ratio(m["median_step_s"], t["median_step_s"])
        print()
        print(
            f"tools (tool_math, {TOOLS_RECIPE}): mmgrpo vs TRL GRPOTrainer(tools=[calculator]); checkpoint "
            f"{res['model_dir']}{' (UNTRAINED: --quick without --model)' if res['prepare'].get('untrained') else ''}"
        )
        print(
            f"  {args.tool_tokens} tokens per turn, <= {args.tool_turns} turns, <= {args.tool_episode_tokens} "
            f"response tokens, beta {args.tool_beta}, lr {args.tool_lr}; prompt ids identical on both sides: "
            f"{'yes' if res['same_prompts'] else 'NO'} ({res['prompt_tokens']} tokens)"
        )
        head = (
            f"{'system':<7} | {'step s':>7} | {'calls/ep':>8} | {'called frac':>11} | {'policy tok/step':>15} | "
            f"{'all-called steps s':>18} | {'other steps s':>13} | {'RSS MB':>6}"
        )
        print(head)
        print("-" * len(head))
        for label, x in (("mmgrpo", m), ("TRL", t)):
            every, rest = split_by_calls(x["steps"])
            tokens = x.get("policy_tokens_per_step", x.get("completion_tokens_per_step"))
            print(
                f"{label:<7} | {x['median_step_s']:>7.3f} | {fmt(x.get('calls_per_episode'), '.2f'):>8} | "
                f"{fmt(x.get('called_frac'), '.2f'):>11} | {fmt(tokens, 'g'):>15} | {fmt(every):>18} | "
                f"{fmt(rest):>13} | {x['peak_rss_mb']:>6.0f}"
            )
        print(
            "  (policy tok/step: mmgrpo = sampled tokens; TRL = completion ids incl. tool-result tokens; "
            "all-called steps: every episode of the step called the tool at least once)"
        )
        lines.append(f"multiturn: vs_trl_tools ratio={r:.2f}")
    print()
    for line in lines:
        print(line)


# -------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    # no abbreviations: "--work" is an option of its own, not the hidden --worker
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="1 round, 2 steps, B=2 x G=2 (the smoke test)")
    ap.add_argument("--only", default="text,zoom,trl", help="comma-separated: text, zoom, trl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3, help="policy turns per episode (text, zoom)")
    ap.add_argument("--turn-tokens", type=int, default=24, help="tokens per policy turn (text, zoom)")
    ap.add_argument("--max-episode-tokens", type=int, default=1024)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--tool-turns", type=int, default=3)
    ap.add_argument("--tool-tokens", type=int, default=40)
    ap.add_argument("--tool-episode-tokens", type=int, default=160)
    ap.add_argument("--tool-beta", type=float, default=0.02)
    ap.add_argument("--tool-lr", type=float, default=3e-4)
    ap.add_argument("--model", type=Path, help="a warm-started tools checkpoint to reuse (trl)")
    ap.add_argument("--work", type=Path, help="work folder, kept (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--warm-timeout", type=float, default=3600, help="seconds for the warm start")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--payload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.tasks, args.group_size = 1, 2, 2, 2
        args.turn_tokens, args.tool_tokens = 8, 16
    args.selected = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.selected if s not in SHAPES]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {list(SHAPES)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = worker(args.worker, Spec(**json.loads(args.payload)))
        print(RESULT_TAG + json.dumps(result), flush=True)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="multiturn-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    try:
        for shape in ("text", "zoom"):
            if shape in args.selected:
                results[shape] = run_shape_pair(args, ensure_model(args, work), work, shape)
        if "trl" in args.selected:
            results["trl"] = run_trl_pair(args, work)
    finally:
        if args.work is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print_results(args, results)
    wall = time.perf_counter() - t0
    if args.json:
        args.json.write_text(json.dumps(dict(results, wall_s=wall), indent=1, default=str) + "\n")
    print(f"(total {wall:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
