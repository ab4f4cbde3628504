"""The CUDA path: 5 GRPO steps of a randomly initialised Qwen2.5-VL of about 0.5B parameters in bf16, with
and without LoRA; reports generation and training tokens per second and peak GPU memory. Then FSDP2
through accelerate's FSDP config (examples/accelerate/fsdp.yaml) on every GPU: 3 steps, a resume, a reload.

    python -m pytest -m gpu -s tests/test_gpu.py

Marked ``gpu`` (deselected by default; skipped without CUDA). ``MMGRPO_GPU_DRYRUN=1`` runs the same code on
the CPU with the embedded tiny model, to check the test itself on a machine without a GPU.
Each run prints one line ``gpu: ...`` and appends it to ``$MMGRPO_GPU_REPORT`` when that is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from mmgrpo.config.core import load_config
from mmgrpo.tiny.vlm import TinyModelSpec, build_tiny_model
from mmgrpo.train.trainer import Trainer

DRYRUN = os.environ.get("MMGRPO_GPU_DRYRUN") == "1"

# Qwen2.5-0.5B's language model (24 x 896, 14 heads, 2 KV heads, MLP 4864) with an 8-block, 1280-wide
# Qwen2.5-VL vision tower: about 0.5B parameters (the vocabulary is the tiny tokenizer's).
HALF_B = TinyModelSpec(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vision_hidden_size=1280,
    vision_depth=8,
    vision_heads=16,
    vision_intermediate_size=3420,
    max_position_embeddings=4096,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not DRYRUN and not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device (set MMGRPO_GPU_DRYRUN=1 to run this test on the CPU with the tiny model)"
        )
    return build_tiny_model(tmp_path_factory.mktemp("gpu") / "model", TinyModelSpec() if DRYRUN else HALF_B)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_five_bf16_steps(model_dir, tmp_path, lora):
    device = "cpu" if DRYRUN else "cuda"
    sets = [
        f"model.path={model_dir}",
        f"output_dir={tmp_path}",
        f"model.device={device}",
        "model.dtype=bfloat16",
        "grpo.steps=5",
        "grpo.tasks_per_step=8",
        "grpo.group_size=8",
        "grpo.max_new_tokens=32",
        "grpo.micro_batch_size=64",
        "grpo.beta=0.04",
        "warm_start.steps=0",
        "verifiers=[{name: number_match}, {name: format}]",
    ]
    if lora:
        sets.append("model.lora={r: 16, alpha: 32}")
    trainer = Trainer(load_config(None, sets), progress=False)
    params = sum(p.numel() for p in trainer.policy.model.parameters())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    gen_tokens = train_tokens = 0
    gen_time = train_time = 0.0
    t0 = time.perf_counter()
    for _ in range(5):
        record = trainer.train_step()
        n = 8 * 8
        gen_tokens += record["completion_len"] * n
        gen_time += record["rollout_time"]
        train_time += record["train_time"]
        train_tokens += record["completion_len"] * n
        assert torch.isfinite(torch.tensor(record["loss"])) and torch.isfinite(torch.tensor(record["kl"]))
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    report = {
        "variant": "lora" if lora else "full",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "params": params,
        "gen_tokens_per_s": gen_tokens / gen_time,
        "train_tokens_per_s": train_tokens / train_time,
        "peak_gib": peak,
        "seconds_5_steps": wall,
    }
    line = "gpu: " + json.dumps(report)
    print(line)
    if path := os.environ.get("MMGRPO_GPU_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")
    assert all(p.dtype == torch.float32 for p in trainer.policy.model.parameters() if p.requires_grad)
    if not DRYRUN:
        assert 0.4e9 < params < 0.7e9


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_five_bf16_steps_sampled_by_vllm(model_dir, tmp_path, lora):
    """The same 5 steps with ``rollout.engine=vllm``: the engine (vLLM for CUDA, from ``mmgrpo vllm-env``) samples
    counting prompts from the policy's image features, takes the weights after each step (merged for LoRA),
    and its log-probs stay within bf16 rounding of the training pass. Reports tokens per second beside the
    in-process engine's line above. Without a vLLM environment it is skipped (reported as not run)."""
    from mmgrpo.model.vllm_engine import default_venv

    if not (default_venv() / "bin" / "python").exists():
        pytest.skip(f"no vLLM environment at {default_venv()}: run `mmgrpo vllm-env` first")
    device = "cpu" if DRYRUN else "cuda"
    sets = [
        f"model.path={model_dir}",
        f"output_dir={tmp_path}",
        f"model.device={device}",
        "model.dtype=bfloat16",
        "rollout.engine=vllm",
        "grpo.steps=5",
        "grpo.tasks_per_step=8",
        "grpo.group_size=8",
        "grpo.max_new_tokens=32",
        "grpo.micro_batch_size=64",
        "warm_start.steps=0",
        "verifiers=[{name: number_match}, {name: format}]",
    ]
    if lora:
        sets.append("model.lora={r: 16, alpha: 32}")
    trainer = Trainer(load_config(None, sets), progress=False)
    gen_tokens, gen_time, gaps = 0.0, 0.0, []
    try:
        for _ in range(5):
            record = trainer.train_step()
            gen_tokens += record["completion_len"] * 64
            gen_time += record["rollout_time"]
            gaps.append(record["mismatch/max_abs"])
        pushes = trainer.policy.sampler.pushes
    finally:
        trainer.policy.sampler.close()
    report = {
        "variant": ("lora" if lora else "full") + " via vllm",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "gen_tokens_per_s": gen_tokens / gen_time,
        "mismatch_max_abs": max(gaps),
        "pushes": pushes,
    }
    line = "gpu: " + json.dumps(report)
    print(line)
    if path := os.environ.get("MMGRPO_GPU_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")
    assert pushes >= 5  # one after each of the 5 steps' updates (the first sampling's too)
    assert max(gaps) < 0.5, gaps  # bf16 on both sides, different kernels: rounding, not another function


def test_fsdp_through_accelerates_fsdp_config(warm_model_dir, tmp_path):
    """`accelerate launch --config_file examples/accelerate/fsdp.yaml` on every GPU of the machine (FSDP2
    through accelerate's plugin, bf16): 3 GRPO steps of the counting config on the tiny VLM, each process
    holding 1/N of every parameter, a SIGKILL after step 2's checkpoint and a resume that repeats step 3
    (within 1e-3: GPU kernels may add in another order), and a final folder that from_pretrained loads.
    On one GPU nothing is sharded, but the plugin, the units, NCCL, the sharded checkpoint and the gathering
    all run. The dry run starts one CPU process with torchrun and model.fsdp=true instead."""
    from test_fsdp import launched_run_check

    root = Path(__file__).resolve().parent.parent
    if DRYRUN:
        world, extra = 1, ["model.fsdp=true"]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    elif not torch.cuda.is_available():
        pytest.skip("no CUDA device (set MMGRPO_GPU_DRYRUN=1 to run this test on the CPU)")
    else:
        world, extra = torch.cuda.device_count(), ["model.device=cuda", "model.dtype=bfloat16"]
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world)]
        launcher += ["--config_file", str(root / "examples" / "accelerate" / "fsdp.yaml")]
        launcher += ["--main_process_port", "0"]
    report = launched_run_check(tmp_path, warm_model_dir, launcher, world, extra, exact=DRYRUN)
    line = "gpu-fsdp: " + json.dumps(report)
    print(line)
    if path := os.environ.get("MMGRPO_GPU_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")
