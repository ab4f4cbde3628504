"""Multi-process training: 2 processes on the CPU (gloo, through ``accelerate launch``) against one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.advantages import group_advantages
from mmgrpo.batch import TokenBatch, VisionInputs
from mmgrpo.distributed import reduce_records, shard

ROOT = Path(__file__).resolve().parent.parent
TIMES = ("rollout_time", "train_time", "step_time")


def test_shard_takes_whole_tasks_round_robin():
    assert shard(list(range(6)), 0, 2) == [0, 2, 4] and shard(list(range(6)), 1, 2) == [1, 3, 5]
    assert shard([10, 11, 12], 3, 4) == []  # more processes than tasks: an empty share


def test_reduce_records_sums_shares_weights_means_and_takes_slowest_time():
    a = {"step": 3, "loss": 0.25, "kl": 0.01, "reward": 1.0, "num_episodes": 8, "lr": 1e-3, "step_time": 2.0}
    b = {"step": 3, "loss": 0.5, "kl": 0.03, "reward": 0.0, "num_episodes": 24, "lr": 1e-3, "step_time": 3.0}
    r = reduce_records([a, b])
    # loss and kl are each process's share of the global value: 0.25 + 0.5, 0.01 + 0.03
    assert r["loss"] == pytest.approx(0.75) and r["kl"] == pytest.approx(0.04)
    # reward: mean over 32 episodes = (8 * 1.0 + 24 * 0.0) / 32 = 0.25
    assert r["reward"] == pytest.approx(0.25) and r["num_episodes"] == 32
    assert r["step"] == 3 and r["lr"] == 1e-3 and r["step_time"] == 3.0
    assert reduce_records([a]) is a  # one process: untouched


def test_token_batch_concat_keeps_every_row():
    def batch(p: int, t: int, n: int, first: int) -> TokenBatch:
        ids = torch.arange(first, first + n * p).view(n, p)
        resp = torch.arange(100 + first, 100 + first + n * t).view(n, t)
        ones_p, ones_t = torch.ones(n, p, dtype=torch.long), torch.ones(n, t, dtype=torch.long)
        return TokenBatch(ids, ones_p, resp, ones_t, ones_t, VisionInputs.none(1), prompt_index=[0] * n)

    a, b = batch(3, 2, 2, 0), batch(5, 4, 2, 50)
    c = TokenBatch.concat([a, b], pad_token_id=-1)
    assert c.prompt_ids.shape == (4, 5) and c.response_ids.shape == (4, 4)
    assert c.prompt_ids[0].tolist() == [-1, -1, 0, 1, 2] and c.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert c.response_ids[1].tolist() == [102, 103, -1, -1] and c.loss_mask[1].tolist() == [1, 1, 0, 0]
    assert c.prompt_index == [0, 0, 1, 1]
    assert c.select([2, 3]).prompt_ids.tolist() == b.prompt_ids.tolist()


def _launch(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    """``accelerate launch`` 2 processes on the CPU. `--cpu` alone starts one process in accelerate 1.15
    (its multi-CPU path is mpirun), so torchrun's launcher (--multi_gpu) is used; with model.device=cpu
    each process joins a gloo group."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    res = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=600, cwd=out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def _grpo_lines(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows if "stage" not in r]


def _single_process_gradient(sets, tmp_path, r0, r1, G):
    """One process's gradient (no optimizer step) on the rows the two processes trained on."""
    from mmgrpo.config import load_config
    from mmgrpo.trainer import Trainer

    cfg = load_config(ROOT / "examples" / "counting_tiny.yaml", [*sets, f"output_dir={tmp_path / 'single'}"])
    single = Trainer(cfg, progress=False)
    single.policy.make_reference()
    grads = {}

    def capture(*args, **kwargs):
        model = single.policy.model
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    single.optimizer.step = capture
    tokens = TokenBatch.concat([r0["tokens"], r1["tokens"]], single.policy.pad_token_id)
    single.update(tokens, torch.cat([r0["adv"], r1["adv"]]), G)
    assert grads.keys() == r0["grads"].keys()
    worst = max(float((grads[n] - r0["grads"][n]).abs().max()) for n in grads)
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # a real gradient, not zeros
    return worst


def test_two_processes_split_the_groups_and_match_one_process(warm_model_dir, tmp_path):
    """2 processes, 4 tasks x G=4 per step: each process rolls out 2 whole groups (different tasks); the
    group advantages are those of the whole group; the all-reduced gradient of step 1 equals that of one
    process on the same 16 rows (1e-5); the run saves checkpoints and resumes from one exactly."""
    sets = [
        f"model.path={warm_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "warm_start.steps=0",
        "grpo.steps=2",
        "grpo.tasks_per_step=4",
        "grpo.group_size=4",
        "grpo.micro_batch_size=4",
        "grpo.max_grad_norm=1e9",  # no clipping: the raw gradients are compared
        "grpo.save_every=1",
        "grpo.beta=0.02",
    ]
    _launch(tmp_path, [str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), *sets])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    G = 4
    # different tasks: process 0 took seeds 0 and 2, process 1 seeds 1 and 3, G rows each
    assert r0["seeds"] == [0] * G + [2] * G and r1["seeds"] == [1] * G + [3] * G
    # each group's advantages equal those of the whole group computed in one place
    rewards = torch.cat([r0["rewards"], r1["rewards"]])  # (16,)
    ids = [s for s in r0["seeds"] + r1["seeds"]]
    whole = group_advantages(rewards, G, group_ids=ids)
    assert torch.allclose(torch.cat([r0["adv"], r1["adv"]]), whole, atol=1e-7)
    # the two processes hold the same (all-reduced) gradient ...
    assert r0["grads"].keys() == r1["grads"].keys() and r0["grads"]
    for n in r0["grads"]:
        assert torch.equal(r0["grads"][n], r1["grads"][n]), n

    # ... which equals one process's gradient on the same global batch
    worst = _single_process_gradient(sets, tmp_path, r0, r1, G)
    print(f"2 processes vs 1: largest gradient difference {worst:.1e}")
    assert worst < 1e-5, worst

    # saved and resumed: from checkpoint-1, step 2 is done again exactly and step 3 follows
    run = tmp_path / "run"
    first = _grpo_lines(run / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2] and first[0]["num_episodes"] == 16
    assert (run / "checkpoint-1" / "random_states_1.pkl").is_file() and (run / "final").is_dir()
    shutil.rmtree(run / "final")
    cfg_file = str(ROOT / "examples" / "counting_tiny.yaml")
    more = [x for s in [*sets, "grpo.steps=3"] for x in ("--set", s)]
    _launch(
        tmp_path,
        ["-m", "mmgrpo", "train", cfg_file, *more, "--no-progress", "--resume", str(run / "checkpoint-1")],
    )
    resumed = _grpo_lines(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == first


def test_sharded_engines_are_refused_and_deepspeed_gets_one_micro_batch():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from mmgrpo.config import GRPOConfig
    from mmgrpo.errors import ConfigError
    from mmgrpo.trainer import check_engine

    g = GRPOConfig(tasks_per_step=4, group_size=8, micro_batch_size=16)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace())
    with pytest.raises(ConfigError, match="FSDP shards the parameters.*Use DDP"):
        check_engine(fsdp, g, 2)
    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={})
    ds = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=plugin)
    )
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3 shards"):
        check_engine(ds, g, 2)
    plugin.zero_stage = 2
    check_engine(ds, g, 2)  # 2 tasks x G=8 = 16 episodes per process: one micro-batch of 16
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 16
    with pytest.raises(ConfigError, match="set grpo.micro_batch_size >= 32"):
        check_engine(ds, g, 1)
    check_engine(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=SimpleNamespace()), g, 2)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples" / "accelerate").glob("*.yaml")))
def test_accelerate_configs_load_with_accelerates_own_loader(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "examples" / "accelerate" / name))
    assert cfg.num_processes >= 2


def test_an_uneven_split_pads_the_smaller_share_with_zero_weight_passes(warm_model_dir, tmp_path):
    """3 tasks on 2 processes: process 0 trains 2 groups (2 micro-batches), process 1 one group and a
    zero-weight pass so that both sync their gradients on the same backward; the result still equals
    one process's gradient on the 12 rows."""
    sets = [
        f"model.path={warm_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "warm_start.steps=0",
        "grpo.steps=1",
        "grpo.tasks_per_step=3",
        "grpo.group_size=4",
        "grpo.micro_batch_size=4",
        "grpo.max_grad_norm=1e9",
        "grpo.beta=0.02",
    ]
    _launch(tmp_path, [str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), *sets])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["seeds"] == [0] * 4 + [2] * 4 and r1["seeds"] == [1] * 4
    worst = _single_process_gradient(sets, tmp_path, r0, r1, 4)
    print(f"uneven split: largest gradient difference {worst:.1e}")
    assert worst < 1e-5, worst
