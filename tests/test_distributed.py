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

from mmgrpo.config.core import load_config
from mmgrpo.grpo.advantages import group_advantages
from mmgrpo.model.batch import TokenBatch, VisionInputs
from mmgrpo.train.distributed import reduce_records, shard

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


def _single_process_gradient(sets, tmp_path, r0, r1, G, stats_out: dict | None = None):
    """One process's gradient (no optimizer step) on the rows the two processes trained on; its loss
    statistics go to ``stats_out``."""
    from mmgrpo.config.core import load_config
    from mmgrpo.train.trainer import Trainer

    cfg = load_config(ROOT / "examples" / "counting_tiny.yaml", [*sets, f"output_dir={tmp_path / 'single'}"])
    single = Trainer(cfg, progress=False)
    single.policy.make_reference()
    grads = {}

    def capture(*args, **kwargs):
        model = single.policy.model
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    single.optimizer.step = capture
    tokens = TokenBatch.concat([r0["tokens"], r1["tokens"]], single.policy.pad_token_id)
    stats, _ = single.update(tokens, torch.cat([r0["adv"], r1["adv"]]), G)
    if stats_out is not None:
        stats_out.update(stats)
    assert grads.keys() == r0["grads"].keys()
    worst = max(float((grads[n] - r0["grads"][n]).abs().max()) for n in grads)
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # a real gradient, not zeros
    return worst


def test_two_processes_split_the_groups_and_match_one_process(warm_model_dir, tmp_path):
    """2 processes, 4 tasks x G=4 per step: each process rolls out 2 whole groups (different tasks); the
    group advantages are those of the whole group; the all-reduced gradient of step 1 equals that of one
    process on the same 16 rows (1e-5), and so do the step's loss, KL and entropy; held-out evaluation
    runs every step on both processes (it hung on 48bbbf8) and gives one process's accuracy; the linear
    schedule's lr of every step is one process's; the run saves checkpoints and resumes from one exactly."""
    sets = [
        f"model.path={warm_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "warm_start.steps=0",
        "grpo.steps=3",
        "grpo.eval_every=1",
        "grpo.eval_episodes=6",
        "grpo.lr_schedule=linear",
        "grpo.warmup_steps=1",
        "grpo.tasks_per_step=4",
        "grpo.group_size=4",
        "grpo.micro_batch_size=4",
        "grpo.max_grad_norm=1e9",  # no clipping: the raw gradients are compared
        "grpo.save_every=1",
        "grpo.keep_checkpoints=3",
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
    single: dict = {}
    worst = _single_process_gradient(sets, tmp_path, r0, r1, G, single)
    print(f"2 processes vs 1: largest gradient difference {worst:.1e}")
    assert worst < 1e-5, worst

    run = tmp_path / "run"
    first = _grpo_lines(run / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3] and first[0]["num_episodes"] == 16
    # step 1's loss statistics over both processes are one process's on the 16 rows (entropy was halved)
    for key in ("loss", "kl", "entropy", "clip_frac"):
        assert first[0][key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
    # the lr after each step is one process's: linear, 1 warm-up step, 3 steps -> 1e-3 x 1, 1/2, 0
    lr = load_config(ROOT / "examples" / "counting_tiny.yaml", sets).grpo.lr
    assert [r["lr"] for r in first] == pytest.approx([lr, lr / 2, 0.0])
    # held-out accuracy every step, both processes evaluating 3 of the 6 episodes: the last equals one
    # process evaluating the final model on all 6
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in first)
    assert first[-1]["eval_accuracy"] == pytest.approx(_single_process_eval(sets, run / "final"))

    # saved and resumed: from checkpoint-1, steps 2 and 3 are done again exactly
    assert (run / "checkpoint-1" / "random_states_1.pkl").is_file() and (run / "final").is_dir()
    shutil.rmtree(run / "final")
    cfg_file = str(ROOT / "examples" / "counting_tiny.yaml")
    more = [x for s in sets for x in ("--set", s)]
    _launch(
        tmp_path,
        ["-m", "mmgrpo", "train", cfg_file, *more, "--no-progress", "--resume", str(run / "checkpoint-1")],
    )
    resumed = _grpo_lines(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed == first


def _single_process_eval(sets, model_dir) -> float:
    from mmgrpo.rollout.evaluation import evaluate_config
    from mmgrpo.train.trainer import build_env_factory, build_rewards, eval_metric, load_policy

    cfg = load_config(ROOT / "examples" / "counting_tiny.yaml", sets)
    policy = load_policy(cfg, model_path=str(model_dir))
    return evaluate_config(
        cfg.eval,
        cfg.env,
        policy,
        build_env_factory(cfg),
        build_rewards(cfg),
        eval_metric(cfg),
        episodes=cfg.grpo.eval_episodes,
    ).accuracy


def test_zero3_is_refused_fsdp_is_not_and_deepspeed_gets_one_micro_batch():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from mmgrpo.config.core import GRPOConfig
    from mmgrpo.errors import ConfigError
    from mmgrpo.train.trainer import check_engine

    g = GRPOConfig(tasks_per_step=4, group_size=8, micro_batch_size=16)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace())
    check_engine(fsdp, g, 2)  # driven by mmgrpo.train.fsdp (tests/test_fsdp.py)
    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={})
    ds = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=plugin)
    )
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3 shards.*only through FSDP2.*fsdp.yaml"):
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


@pytest.mark.parametrize("aggregation", ["sequence", "bnpo"])
def test_an_uneven_split_pads_the_smaller_share_with_zero_weight_passes(
    warm_model_dir, tmp_path, aggregation
):
    """3 tasks on 2 processes: process 0 trains 2 groups (2 micro-batches), process 1 one group and a
    zero-weight pass so that both sync their gradients on the same backward; the result still equals
    one process's gradient on the 12 rows. bnpo averages over the 3 real micro-batches, not the 4 passes
    (on 48bbbf8 its loss was x 3/4)."""
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
        f"grpo.aggregation={aggregation}",
    ]
    _launch(tmp_path, [str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), *sets])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["seeds"] == [0] * 4 + [2] * 4 and r1["seeds"] == [1] * 4
    worst = _single_process_gradient(sets, tmp_path, r0, r1, 4)
    print(f"uneven split: largest gradient difference {worst:.1e}")
    assert worst < 1e-5, worst


def test_the_lr_schedule_advances_once_per_step_on_two_processes(tiny_model_dir, tmp_path):
    """constant, linear and cosine with 2 warm-up steps over 6 steps: each process's lr at every step equals
    one process's, and the schedule's by hand. (On 48bbbf8 accelerate's wrapper stepped the schedule once
    per process: linear reached 0 at step 3 of 6 on 2 processes; and "constant" ignored its warm-up.)"""
    import math

    sys.path.insert(0, str(ROOT / "tests"))
    from lr_worker import SCHEDULES, schedule_lrs

    _launch(tmp_path, [str(ROOT / "tests" / "lr_worker.py"), str(tiny_model_dir), str(tmp_path)])
    ranks = [json.loads((tmp_path / f"lrs{r}.json").read_text()) for r in (0, 1)]
    cos = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]  # steps 3..6: progress k/4 after warm-up
    by_hand = {
        "constant": [0.0, 0.5, 1.0, 1.0, 1.0, 1.0],
        "linear": [0.0, 0.5, 1.0, 0.75, 0.5, 0.25],
        "cosine": [0.0, 0.5, *cos[:4]],
    }
    for name in SCHEDULES:
        one = schedule_lrs(str(tiny_model_dir), tmp_path / "one" / name, name)
        want = [1e-3 * f for f in by_hand[name]]
        assert one == pytest.approx(want, abs=1e-12), (name, one)
        for r, got in enumerate(ranks):
            assert got[name] == pytest.approx(one, abs=1e-12), (name, r, got[name], one)


def test_multi_turn_counters_are_computed_over_every_process_s_episodes(monkeypatch):
    """Process 0 saw one bad_args failure in 2 episodes, process 1 none in 2: the rate is 1/4 (48bbbf8
    averaged the key over the processes that had it: 0.5). An env metric is averaged over the episodes
    that reported it (3 of 4), not per process."""
    from types import SimpleNamespace

    import accelerate.utils

    from mmgrpo.rollout.episodes import Trajectory
    from mmgrpo.train.metrics import all_episode_metrics, episode_counters

    def episode(fail: dict, metrics: dict) -> Trajectory:
        return Trajectory(
            group=0,
            task={},
            messages=[],
            completion="",
            response_ids=[],
            loss_mask=[],
            turns=2,
            tool_calls=1,
            tool_failures=fail,
            env_metrics=metrics,
        )

    mine = [episode({"bad_args": 1}, {"dist": 1.0}), episode({}, {"dist": 2.0})]
    theirs = [episode({}, {"dist": 6.0}), episode({}, {})]
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda obj: [*obj, episode_counters(theirs)])
    got = all_episode_metrics(SimpleNamespace(num_processes=2), mine)
    assert got["tools/fail/bad_args"] == 0.25 and got["tools/failures"] == 0.25
    assert got["env/dist"] == 3.0 and got["turns"] == 2.0 and got["tools/used_frac"] == 1.0


def test_processes_may_run_different_numbers_of_forwards(tiny_model_dir, tmp_path):
    """One process's prompts share a long opening and one of its responses is long, the other's not: on
    their own they would run different numbers of forwards (the opening encoded once, passes cut by
    length), and so they do, in no-grad passes (rank 1 runs three, rank 0 one) and in the training pass.
    Both finish and hold the same synchronised gradient. (DDP's buffer broadcast at each forward is off,
    see ``make_accelerator``: with it, this hangs.)"""
    _launch(tmp_path, [str(ROOT / "tests" / "uneven_worker.py"), str(tiny_model_dir), str(tmp_path)])
    grads = [json.loads((tmp_path / f"grad{r}.json").read_text()) for r in (0, 1)]
    forwards = [g["training_forwards"] for g in grads]
    assert forwards[0] == 2 and forwards[1] > 2, forwards  # the prompts, the responses; rank 1: more
    assert grads[0]["norm"] > 0
    assert grads[0]["first"] == pytest.approx(grads[1]["first"], rel=1e-5, abs=1e-9)


def test_a_command_that_succeeded_leaves_its_process_group(tmp_path, capsys):
    """A process of `accelerate launch` destroys its group before exit (left to the interpreter's teardown,
    gloo aborted a 2-process test now and then: `terminate called without an active exception`); a
    command that failed leaves it (its peers may be inside a collective)."""
    import torch.distributed as dist

    from mmgrpo.cli.app import main

    for argv, code, joined in ((["plot", str(tmp_path / "missing")], 2, True), (["list"], 0, False)):
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}{code}", rank=0, world_size=1
        )
        try:
            assert main(argv) == code
            assert dist.is_initialized() == joined
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    capsys.readouterr()


def test_a_launched_process_exits_right_after_leaving_its_group(tmp_path):
    """Under torchrun (LOCAL_RANK set) a command that succeeded exits at once after destroying its group,
    its output flushed, skipping the interpreter's teardown (where gloo aborted: see
    mmgrpo.train.distributed.leave_process_group)."""
    script = (
        "import sys, torch.distributed as dist\n"
        "from mmgrpo.cli.app import main\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "code = main(['list'])\n"
        "print('returned', code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": "0"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "counting" in res.stdout and "returned" not in res.stdout, res.stdout[-2000:]
