"""Generation through vLLM: token ids in, token ids and each sampled token's log-prob out, the policy's
weights pushed after every optimizer step.

vLLM runs in its own process and its own Python environment (``mmgrpo vllm-env`` makes one: vLLM pins its
torch and transformers), started from ``mmgrpo/model/vllm_worker.py``; this side speaks to it over a pipe
(pickled requests, see that file). ``Policy.generate`` hands its sampling here when ``rollout.engine`` is
``vllm``, so the rollout, the evaluation and the warm-start checks sample the same way; the sampled ids are
the trained ids, and the sampler's log-probs are kept for the mismatch correction (mmgrpo.grpo.mismatch).

Images (Qwen2-VL, Qwen2.5-VL) go to the engine as the policy's own image features, each image's tokens cut to
one placeholder that the engine expands from the image's grid: the samples are drawn from the features the
training pass uses. A LoRA model's engine serves the merged weights (``merged_weights``). What it does not
do yet: episodes that advance on their own (the rollout still asks for one turn of every live episode at a
time). See docs/vllm.md.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mmgrpo.errors import ConfigError, EngineError
from mmgrpo.model.adapters import unwrap

WORKER = Path(__file__).with_name("vllm_worker.py")
VENV_ENV = "MMGRPO_VLLM_VENV"
"""Environment variable naming the vLLM environment (a venv folder), instead of ``default_venv()``."""


def default_venv() -> Path:
    """Where ``mmgrpo vllm-env`` makes the vLLM environment: $MMGRPO_VLLM_VENV, else ~/.cache/mmgrpo/vllm."""
    return Path(os.environ.get(VENV_ENV) or Path.home() / ".cache" / "mmgrpo" / "vllm")


def find_python(explicit: str | None = None) -> Path:
    """The vLLM environment's python: ``explicit`` (rollout.vllm_python), else the default environment's."""
    python = Path(explicit) if explicit else default_venv() / "bin" / "python"
    if not python.exists():
        raise ConfigError(
            f"rollout.engine=vllm needs the vLLM environment, and {python} does not exist: run `mmgrpo vllm-env` "
            "(it creates one there, once), or set rollout.vllm_python to the python of an environment with vLLM."
        )
    return python


class VLLMEngine:
    """One vLLM engine in its own process, for the model at ``model_path`` (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        python: str | Path | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_bytes: int = 256 * 2**20,
        seed: int = 0,
        log_path: str | Path | None = None,
        model=None,
        processor=None,
    ) -> None:
        self.python = find_python(str(python) if python else None)
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="mmgrpo-vllm-")) / "vllm.log"
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._weights = tempfile.TemporaryDirectory(prefix="mmgrpo-vllm-weights-")
        env = dict(os.environ, PYTHONPATH=str(WORKER.parent), VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(self.python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,  # its own process group: vLLM's engine and worker processes go with it
        )
        if model is not None:  # start from the weights in memory, in the layout vLLM loads
            save_for_vllm(model, Path(self._weights.name), processor)
            model_path = self._weights.name
            self.images = takes_images(unwrap(model).config)
        else:
            from transformers import AutoConfig

            self.images = takes_images(AutoConfig.from_pretrained(model_path))
        started = self._ask(
            op="start",
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            kv_bytes=kv_bytes,
            seed=seed,
            images=self.images,
        )
        self.start_seconds, self.version = started["seconds"], started["version"]
        self.pushes = 0
        self.streams = True  # multi-turn rollouts send each episode's turns on their own (``submit``/``poll``)
        self.stale = (
            True  # the weights in memory may differ from the checkpoint it loaded (resume, warm start)
        )
        # any optimizer step in this process makes the engine's copy stale: ``sync`` pushes before sampling
        self._hook = register_optimizer_step_post_hook(lambda *_: self._mark_stale())

    def _mark_stale(self) -> None:
        self.stale = True

    def sync(self, model) -> None:
        """Push ``model``'s weights if an optimizer stepped since the last push (or none was pushed yet)."""
        if self.stale:
            self.push(model)

    def _ask(self, **request) -> dict:
        if self.proc.poll() is not None:
            raise EngineError(self._died())
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(struct.pack(">Q", len(data)) + data)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(8)
            if len(head) < 8:
                raise EOFError
            (size,) = struct.unpack(">Q", head)
            answer = pickle.loads(self.proc.stdout.read(size))
        except (BrokenPipeError, EOFError, pickle.UnpicklingError) as e:
            self.proc.wait(timeout=30)
            raise EngineError(self._died()) from e
        if not answer.pop("ok"):
            raise EngineError(
                f"the vLLM engine refused '{request['op']}': {answer['error']} (its log: {self.log_path})"
            )
        return answer

    def _died(self) -> str:
        return (
            f"the vLLM engine process exited (code {self.proc.poll()}); the run's saved checkpoints are kept. "
            f"Its log: {self.log_path}"
        )

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_ids: list[int],
        images: list | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """n samples of each prompt (row b*n + j: prompt b's sample j): their ids, up to and including the
        first stop id, and each sampled token's log-prob at ``temperature``. Greedy at temperature 0.
        ``images``: per prompt, None or its image features and grid (``image_inputs``), the prompt holding
        one image token per image (``one_placeholder``)."""
        if images is not None and not self.images:
            raise ConfigError("rollout.engine=vllm: images sent to an engine started for a text-only model")
        answer = self._ask(
            op="generate",
            prompts=[list(map(int, p)) for p in prompts],
            n=n,
            max_tokens=max_tokens,
            temperature=max(float(temperature), 0.0),
            top_p=float(top_p),
            top_k=int(top_k),
            stop_ids=[int(i) for i in stop_ids],
            images=images,
        )
        return answer["rows"]

    def submit(self, requests: list[dict]) -> None:
        """Start requests that end on their own, one sample each: dicts with "id" (any picklable key),
        "prompt" (ids), "images" (None or ``image_inputs``' entry), "max_tokens", "temperature", "top_p",
        "top_k", "stop_ids". ``poll`` hands each back as it ends."""
        if any(r.get("images") is not None for r in requests) and not self.images:
            raise ConfigError("rollout.engine=vllm: images sent to an engine started for a text-only model")
        self._ask(op="submit", requests=requests)

    def poll(self, max_steps: int = 16) -> tuple[list[tuple[object, list[int], list[float]]], int]:
        """The submitted requests that ended within ``max_steps`` engine steps (it returns as soon as one
        ends): [(id, ids, log-probs)], and how many are still running."""
        answer = self._ask(op="poll", max_steps=int(max_steps))
        return answer["done"], answer["pending"]

    def push(self, model) -> float:
        """Send ``model``'s current weights to the engine (caches reset); returns the seconds it took."""
        t = time.perf_counter()
        folder = Path(self._weights.name)
        save_for_vllm(model, folder)
        self._ask(op="update", path=str(folder))
        self.pushes, self.stale = self.pushes + 1, False
        return time.perf_counter() - t

    def close(self) -> None:
        """Stop the engine process (it also ends when this process does: its stdin closes); idempotent."""
        self._hook.remove()
        if self.proc.poll() is None:
            try:
                data = pickle.dumps({"op": "close"})
                self.proc.stdin.write(struct.pack(">Q", len(data)) + data)
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self._end_group()
        self._log.close()
        self._weights.cleanup()

    def _end_group(self) -> None:
        """Kill whatever is left of the engine's process group (its children outlive a killed worker)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def __del__(self) -> None:
        try:
            self._end_group()
        except Exception:
            pass


VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""Vision-language families vLLM serves here with the trainer's image features (``image_embeds`` with their
``image_grid_thw``): the features the training pass uses are the ones the samples are drawn from."""


def takes_images(config) -> bool:
    """Whether ``config`` (a model's config) is a vision-language model (refused unless in VISION_FAMILIES)."""
    if not hasattr(config, "vision_config"):
        return False
    if config.model_type not in VISION_FAMILIES:
        raise ConfigError(
            f"rollout.engine=vllm with a {config.model_type} model: vLLM serves the vision-language families "
            f"{', '.join(VISION_FAMILIES)} here; use rollout.engine=mmgrpo."
        )
    return True


def save_for_vllm(model, folder: Path, processor=None) -> None:
    """``model``'s weights and config in ``folder`` as vLLM loads them (safetensors); with ``processor``, its
    tokenizer and processor files too (a vision-language model's engine loads them)."""
    bare = unwrap(model)
    if hasattr(bare, "peft_config"):  # LoRA: the engine serves the merged weights, the model stays as it is
        base = bare.get_base_model()
        takes_images(base.config)
        base.save_pretrained(folder, safe_serialization=True, state_dict=merged_weights(base))
    else:
        takes_images(bare.config)
        bare.save_pretrained(folder, safe_serialization=True)
    if processor is not None and not (folder / "tokenizer_config.json").exists():
        processor.save_pretrained(folder)


@torch.no_grad()
def merged_weights(base) -> dict[str, torch.Tensor]:
    """A LoRA model's weights with every active adapter folded in (W + B A * scale, per layer), under the base
    model's own names: what ``merge_and_unload`` would save, computed aside (the trained model is neither
    copied nor merged and unmerged in place, which would drift it by rounding at every push)."""
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        for adapter in module.active_adapters:
            if adapter in getattr(module, "lora_A", {}) and adapter not in module.merged_adapters:
                delta = module.get_delta_weight(adapter)
                deltas[name] = deltas[name] + delta if name in deltas else delta
    state: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = tensor
    for name, delta in deltas.items():
        key = name + ".weight"
        state[key] = state[key] + delta.to(state[key].dtype)
    return state


def image_inputs(policy, vision, rows: int) -> list | None:
    """Per prompt row, its images as the engine takes them: (features (tokens, hidden) float32, grid
    (images, 3) int64) numpy arrays from the policy's own vision tower, None for a row without images; None
    when no row has any. The features are the policy's ``encode_images`` (computed once, no graph)."""
    if vision.empty:
        return None
    encoded = policy.encode_images(vision, force=True)
    if not encoded.has_encoded:
        raise ConfigError(
            "rollout.engine=vllm: this model's image features cannot be computed apart from its forward "
            "(FSDP shards or a video); use rollout.engine=mmgrpo."
        )
    out = []
    for seq, feats in zip(encoded.seqs, encoded.encoded, strict=True):
        if not seq:
            out.append(None)
            continue
        pooled = getattr(feats, "pooler_output", feats)
        pooled = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
        grid = seq["image_grid_thw"]
        out.append((pooled.detach().float().cpu().numpy(), grid.detach().long().cpu().numpy()))
    if len(out) != rows:
        raise ValueError(f"{len(out)} image rows for {rows} prompts")
    return out


def one_placeholder(ids: list[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of image tokens cut to one: the engine expands it again from the image's grid."""
    out: list[int] = []
    for t in ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def describe(python: Path) -> str:
    """One line: the environment's python and its vLLM version, or why vLLM does not import there."""
    out = subprocess.run(
        [str(python), "-c", "from vllm import LLM; import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{python}: vLLM does not import ({last})"
    return f"{python}: vLLM {out.stdout.strip()}"


__all__ = ["VLLMEngine", "default_venv", "describe", "find_python"]
