"""FSDP2 (model.fsdp): the setting's checks, and 2 CPU processes (gloo) against one.

The two-process tests run ``tests/fsdp_worker.py`` under ``accelerate launch`` and are in the slow tier
(about 3 minutes together); the checks of the setting run in the fast tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TIMES = ("rollout_time", "train_time", "step_time")


# ------------------------------------------------------------------------------------ the setting's checks
def _accelerator(world: int, kind: str = "MULTI_CPU", **plugin):
    from accelerate.utils import DistributedType

    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(**plugin) if plugin else None)
    return SimpleNamespace(distributed_type=DistributedType[kind], num_processes=world, state=state)


def _cfg(*sets: str):
    return load_config(
        ROOT / "examples" / "counting_tiny.yaml", ["model.fsdp=true", "warm_start.steps=0", *sets]
    )


def test_fsdp_setting_refuses_what_it_cannot_shard_before_a_model_loads():
    from mmgrpo.train.fsdp_setup import wanted

    assert wanted(load_config(ROOT / "examples" / "counting_tiny.yaml"), _accelerator(2)) is False
    assert wanted(_cfg("grpo.tasks_per_step=4"), _accelerator(2)) is True
    cases = [
        (_cfg(), _accelerator(1), "this run has 1: start it with `accelerate launch --num_processes N"),
        (_cfg("model.lora={r: 4}"), _accelerator(2), "LoRA adapters are small.*model.fsdp=false"),
        (_cfg("model.offload_reference=true"), _accelerator(2), "set model.offload_reference=false"),
        (_cfg("grpo.tasks_per_step=3"), _accelerator(2), "tasks_per_step=3 must be a multiple of the 2"),
        (_cfg("warm_start.steps=100"), _accelerator(2), "warm_start.steps=100: .*run it first.*mmgrpo sft"),
        (
            load_config(ROOT / "examples" / "counting_tiny.yaml"),
            _accelerator(2, "FSDP", fsdp_version=1),
            "fsdp_version 1; mmgrpo drives FSDP2 only: set fsdp_version: 2",
        ),
    ]
    for cfg, acc, message in cases:
        with pytest.raises(ConfigError, match=message):
            wanted(cfg, acc)


def test_fsdp_setting_says_when_this_torch_has_no_fsdp2(monkeypatch):
    from mmgrpo.train import fsdp
    from mmgrpo.train.fsdp_setup import wanted

    monkeypatch.setattr(fsdp, "available", lambda: False)
    with pytest.raises(ConfigError, match="this torch has no FSDP2 .*install torch==2.14.1") as e:
        wanted(_cfg("grpo.tasks_per_step=4"), _accelerator(2))
    assert "processes" not in str(e.value)


def test_units_are_the_decoder_layers_and_the_vision_tower_stays_in_the_root(tiny_policy):
    from mmgrpo.train import fsdp

    model = tiny_policy.model
    found = fsdp.units(model, tiny_policy.adapter.is_vision_param)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(found) == layers and all(type(u).__name__.endswith("DecoderLayer") for u in found)
    with pytest.raises(ValueError, match="names no decoder layer class in _no_split_modules"):
        fsdp.units(torch.nn.Linear(2, 2), lambda n: False)


# ------------------------------------------------------------------------------------ 2 processes
def _launch(out: Path, config: Path, args: list[str], *, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_port", "0", str(ROOT / "tests" / "fsdp_worker.py"), str(out), str(config)]
    out.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=600, cwd=out)
    if ok:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def _records(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows if "stage" not in r]


def _check_shards(r: dict) -> None:
    """Each process holds ceil(d0 / 2) rows of every parameter (FSDP2 shards dim 0), the reference too."""
    for shapes in (r["shards"], r["reference_shards"]):
        for name, (local, full) in shapes.items():
            assert local[1:] == full[1:] and local[0] in (-(-full[0] // 2), full[0] // 2), name


def _one_process_gradient(config: Path, sets: list[str], out: Path, r0: dict, r1: dict) -> tuple[float, dict]:
    """The gradient one process computes on both processes' step-1 rows (worst difference to the
    synchronised one), and the bytes it then holds of parameters, gradients and AdamW state."""
    from mmgrpo.model.batch import TokenBatch
    from mmgrpo.train import fsdp
    from mmgrpo.train.trainer import Trainer

    cfg = load_config(config, [*[s for s in sets if not s.startswith("model.fsdp")], f"output_dir={out}"])
    single = Trainer(cfg, progress=False)
    if cfg.grpo.beta > 0:
        single.policy.make_reference()
    grads, real_step = {}, single.optimizer.step

    def step(*a, **kw):
        model = single.policy.model
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_step(*a, **kw)

    single.optimizer.step = step
    G = cfg.grpo.group_size
    tokens = TokenBatch.concat([r0["tokens"], r1["tokens"]], single.policy.pad_token_id)
    single.update(tokens, torch.cat([r0["adv"], r1["adv"]]), G)
    assert grads.keys() == r0["grads"].keys()
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # a real gradient, not zeros
    worst = max(float((grads[n] - r0["grads"][n]).abs().max()) for n in grads)
    return worst, fsdp.held_bytes(single.policy.model, single.optimizer)


STEPS = [
    "warm_start.steps=0",
    "grpo.steps=3",
    "grpo.tasks_per_step=4",
    "grpo.group_size=4",
    "grpo.max_grad_norm=1e9",  # no clipping: the raw gradients are compared
    "grpo.beta=0.02",
]


@pytest.mark.slow
def test_fsdp_vision_run_shards_matches_one_process_resumes_exactly_and_reloads(warm_model_dir, tmp_path):
    """The counting config on 2 processes with model.fsdp: each holds half of every parameter and of the
    reference; step 1's synchronised gradient equals one process's on the same 16 rows (1e-5); the
    process holds about half the bytes of parameters, gradients and AdamW state one process holds;
    held-out evaluation runs every step (on gathered weights); a run SIGKILLed right after step 2's
    checkpoint and resumed from it repeats step 3 exactly and ends with the same weights; the final
    folder loads with from_pretrained and holds the gathered weights. With model.fsdp_rollout=lockstep the
    run is the same, every process running as many forwards in its rollouts."""
    config = ROOT / "examples" / "counting_tiny.yaml"
    sets = [f"model.path={warm_model_dir}", *STEPS, "grpo.micro_batch_size=4", "grpo.eval_every=1"]
    sets += ["grpo.eval_episodes=6", "grpo.save_every=1", "model.fsdp=true"]
    run = tmp_path / "a"
    _launch(run, config, [*sets, f"output_dir={run / 'run'}"])
    r0, r1 = (torch.load(run / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    _check_shards(r0)
    _check_shards(r1)
    assert r0["reference_shards"].keys() == r0["shards"].keys()
    worst, held_one = _one_process_gradient(config, sets, tmp_path / "single", r0, r1)
    assert worst < 1e-5, worst
    for key in ("params", "grads", "optimizer"):
        ratio = r0["held"][key] / held_one[key]
        assert 0.49 < ratio < 0.52, (key, r0["held"][key], held_one[key])
    records = _records(run / "run")
    assert [r["step"] for r in records] == [1, 2, 3] and all("eval_accuracy" in r for r in records)
    _check_lockstep(tmp_path / "lockstep", config, sets)

    crashed = tmp_path / "b"
    res = _launch(crashed, config, [*sets, f"output_dir={crashed / 'run'}", "--kill-after", "2"], ok=False)
    assert res.returncode != 0 and not (crashed / "run" / "checkpoint-3").exists()
    ckpt = crashed / "run" / "checkpoint-2"
    assert (ckpt / "fsdp_shards" / ".metadata").is_file()
    _launch(crashed, config, [*sets, f"output_dir={crashed / 'run'}", "--resume", str(ckpt)])
    assert _records(crashed / "run") == records  # step 3 repeated exactly (and steps 1-2 kept)

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    final = load_file(str(run / "run" / "final" / "model.safetensors"))
    again = load_file(str(crashed / "run" / "final" / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)
    model = AutoModelForImageTextToText.from_pretrained(run / "run" / "final")
    start = AutoModelForImageTextToText.from_pretrained(warm_model_dir).state_dict()
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], r0["final"][k]) for k in r0["final"])
    assert any(not torch.equal(loaded[k], start[k]) for k in start)  # trained


def launched_run_check(
    out: Path, model_dir: Path, launcher: list[str], world: int, extra: list[str], *, exact: bool = True
) -> dict:
    """The counting config with sharded weights, started by ``launcher`` (a command that runs a script on
    ``world`` processes: `accelerate launch` with examples/accelerate/fsdp.yaml on GPUs, torchrun on the
    CPU): 3 GRPO steps, each process holding ceil(d0 / world) rows of every parameter and of the reference;
    the same run SIGKILLed right after step 2's checkpoint and resumed from it repeats step 3 (exactly, or
    within 1e-3 where ``exact`` is False: GPU kernels may add in another order) and ends with the same
    weights when exact; the final folder loads with from_pretrained and holds the gathered weights.
    Returns figures for a report (seconds per launch, bytes held, the largest difference on resume)."""
    import time

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    config = ROOT / "examples" / "counting_tiny.yaml"
    sets = [f"model.path={model_dir}", *STEPS, f"grpo.tasks_per_step={4 * world}", *extra]
    sets += ["grpo.micro_batch_size=8", "grpo.eval_every=1", "grpo.eval_episodes=8", "grpo.save_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    worker = [str(ROOT / "tests" / "fsdp_worker.py")]

    def launch(run: Path, *args: str) -> subprocess.CompletedProcess:
        run.mkdir(parents=True, exist_ok=True)
        cmd = [*launcher, *worker, str(run), str(config), *sets, f"output_dir={run / 'run'}", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=run)

    t0 = time.perf_counter()
    res = launch(out / "a")
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    warning = next((x for x in res.stderr.splitlines() if "shards nothing" in x), "")
    r0 = torch.load(out / "a" / "rank0.pt", weights_only=False, map_location="cpu")
    assert r0["world"] == world
    for shapes in (r0["shards"], r0["reference_shards"]):
        for name, (local, full) in shapes.items():
            assert local[1:] == full[1:] and local[0] in (-(-full[0] // world), full[0] // world), name
    records = _records(out / "a" / "run")
    assert [r["step"] for r in records] == [1, 2, 3] and all("eval_accuracy" in r for r in records)

    crashed = out / "b"
    res = launch(crashed, "--kill-after", "2")
    assert res.returncode != 0 and not (crashed / "run" / "checkpoint-3").exists()
    ckpt = crashed / "run" / "checkpoint-2"
    assert (ckpt / "fsdp_shards" / ".metadata").is_file()
    res = launch(crashed, "--resume", str(ckpt))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    again = _records(crashed / "run")
    assert [r.keys() for r in again] == [r.keys() for r in records]  # steps 1-3, the same metrics
    pairs = zip(records, again, strict=True)
    numbers = [(k, a[k], b[k]) for a, b in pairs for k in a if isinstance(a[k], float)]
    worst = max(abs(x - y) for _, x, y in numbers)
    final = load_file(str(out / "a" / "run" / "final" / "model.safetensors"))
    resumed = load_file(str(crashed / "run" / "final" / "model.safetensors"))
    if exact:
        assert again == records  # step 3 repeated exactly (and steps 1-2 kept)
        assert all(torch.equal(final[k], resumed[k]) for k in final)
    else:
        assert worst < 1e-3, [(k, x, y) for k, x, y in numbers if abs(x - y) >= 1e-3]
    model = AutoModelForImageTextToText.from_pretrained(out / "a" / "run" / "final")
    loaded = model.state_dict()
    start = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    assert all(torch.equal(loaded[k], r0["final"][k].to(loaded[k].dtype)) for k in r0["final"])
    assert any(not torch.equal(loaded[k], start[k]) for k in start)  # trained
    return {
        "world": world,
        "warning": warning,
        "seconds_3_steps": round(seconds, 1),
        "held_bytes": r0["held"],
        "peak_gpu_gib": round(r0.get("peak_gpu_bytes", float("nan")) / 2**30, 3),
        "resume_worst_diff": worst,
        "eval_accuracy": [r["eval_accuracy"] for r in records],
    }


def _check_lockstep(out: Path, config: Path, sets: list[str]) -> None:
    """The same run with model.fsdp_rollout=lockstep (rollouts and evaluations on the shards) gives the
    same records as on gathered weights (same samples, same losses), every process running as many forwards
    in its rollouts, those with fewer episode forwards padding with one-token ones.

    Both runs decode through the model's own forward (the worker's --model-forward): on gathered weights
    rollouts otherwise take the lean decode step, whose sampling probabilities differ from the forward's by
    up to about 5e-7, and inverse-CDF sampling then picks a neighbouring token now and then (measured on
    the tools config, 3 steps: the records parted at step 2 for 2 seeds of 8) and the runs drift apart.
    The lean step's own equivalence with the forward is tests/test_lean_decode.py's."""
    gathered = out / "gathered"
    _launch(gathered, config, [*sets, "--model-forward", f"output_dir={gathered / 'run'}"])
    lock = out / "lockstep"
    _launch(lock, config, [*sets, "model.fsdp_rollout=lockstep", f"output_dir={lock / 'run'}"])
    assert _records(lock / "run") == _records(gathered / "run")
    (real0, pad0), (real1, pad1) = (
        torch.load(lock / f"rank{r}.pt", weights_only=False)["forwards"] for r in (0, 1)
    )
    assert real0 + pad0 == real1 + pad1 and pad0 + pad1 > 0  # equal totals; the processes differed


def _warm(config: Path, model_dir: Path, out: Path, *sets: str) -> Path:
    """A few supervised warm-start steps (one process), so that GRPO's samples differ in reward."""
    from mmgrpo.train.trainer import Trainer

    base = [f"model.path={model_dir}", f"output_dir={out / 'run'}", "grpo.steps=0", "warm_start.min_skill=0"]
    trainer = Trainer(load_config(config, [*base, *sets]), progress=False)
    trainer.warm_start()
    trainer.save(out / "model")
    return out / "model"


@pytest.mark.slow
def test_fsdp_multi_turn_tools_and_text_lm_train_and_match_one_process(tiny_model_dir, tmp_path):
    """Multi-turn tool episodes on the tiny VLM and single-turn ones on the tiny text LM (Qwen2), each
    3 steps on 2 processes with model.fsdp: every parameter sharded in half; step 1's gradient equals
    one process's on the same rows (1e-5); the tool episodes really took several turns, and in lockstep on
    the shards they give the same run."""
    from mmgrpo.tiny.text import build_tiny_text_model

    tools = ROOT / "examples" / "tools_math_tiny.yaml"
    text = ROOT / "examples" / "text_math_tiny.yaml"
    tools_model = _warm(
        tools, tiny_model_dir, tmp_path / "tw", "warm_start.drill_steps=0", "warm_start.steps=60"
    )
    text_model = _warm(text, build_tiny_text_model(tmp_path / "text"), tmp_path / "xw", "warm_start.steps=40")
    for name, config, model_dir in (("tools", tools, tools_model), ("text", text, text_model)):
        sets = [f"model.path={model_dir}", *STEPS, "grpo.micro_batch_size=8", "model.fsdp=true"]
        if name == "tools":
            sets.append("warm_start.drill_steps=0")
        run = tmp_path / name
        _launch(run, config, [*sets, f"output_dir={run / 'run'}"])
        r0, r1 = (torch.load(run / f"rank{r}.pt", weights_only=False) for r in (0, 1))
        _check_shards(r0)
        worst, _ = _one_process_gradient(config, sets, tmp_path / f"{name}-single", r0, r1)
        assert worst < 1e-5, (name, worst)
        records = _records(run / "run")
        assert [r["step"] for r in records] == [1, 2, 3], name
        if name == "tools":
            assert max(r["turns"] for r in records) > 1.2  # episodes with tool results in them
            _check_lockstep(tmp_path / "tools-lockstep", config, sets)


@pytest.mark.slow
def test_fsdp_on_one_launched_process_runs_resumes_and_reloads(warm_model_dir, tmp_path):
    """model.fsdp on one process started by torchrun: nothing is sharded (every shard is the whole
    tensor), but the units, collectives, sharded checkpoints and the gathered final folder all run, as on
    one GPU with accelerate's FSDP config (tests/test_gpu.py runs that one); it resumes exactly."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    report = launched_run_check(tmp_path, warm_model_dir, launcher, 1, ["model.fsdp=true"])
    assert "model.fsdp=true on 1 process: FSDP runs" in report["warning"]
    assert report["held_bytes"]["params"] > 0
