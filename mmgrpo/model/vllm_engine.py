"""Generation through vLLM: token ids in, token ids and each sampled token's log-prob out, the policy's
weights pushed after every optimizer step.

vLLM runs in its own process and its own Python environment (``mmgrpo vllm-env`` makes one: vLLM pins its
torch and transformers), started from ``mmgrpo/model/vllm_worker.py``; this side speaks to it over a pipe
(pickled requests, see that file). ``Policy.generate`` hands its sampling here when ``rollout.engine`` is
``vllm``, so the rollout, the evaluation and the warm-start checks sample the same way; the sampled ids are
the trained ids, and the sampler's log-probs are kept for the mismatch correction (mmgrpo.grpo.mismatch).

What it does not do yet: images (vLLM's Qwen-VL path needs a CPU torchvision, which the registry does not
hold), LoRA adapters (merge first), episodes that advance on their own (the rollout still asks for one turn
of every live episode at a time). See docs/vllm.md.
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
            save_for_vllm(model, Path(self._weights.name))
            model_path = self._weights.name
        started = self._ask(
            op="start",
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            kv_bytes=kv_bytes,
            seed=seed,
        )
        self.start_seconds, self.version = started["seconds"], started["version"]
        self.pushes = 0
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
    ) -> list[tuple[list[int], list[float]]]:
        """n samples of each prompt (row b*n + j: prompt b's sample j): their ids, up to and including the
        first stop id, and each sampled token's log-prob at ``temperature``. Greedy at temperature 0."""
        answer = self._ask(
            op="generate",
            prompts=[list(map(int, p)) for p in prompts],
            n=n,
            max_tokens=max_tokens,
            temperature=max(float(temperature), 0.0),
            top_p=float(top_p),
            top_k=int(top_k),
            stop_ids=[int(i) for i in stop_ids],
        )
        return answer["rows"]

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


TEXT_VIEWS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}
"""Vision-language families whose language model vLLM serves as a plain text model for text-only episodes:
Qwen2-VL's and Qwen2.5-VL's are Qwen2 decoders whose M-RoPE, on text alone (the same position in its three
sections), is Qwen2's rotary embedding (tests/test_vllm_engine.py checks the log-probs)."""
TEXT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_dropout",
)


def save_for_vllm(model, folder: Path) -> None:
    """``model``'s weights (and config) in ``folder`` as vLLM loads them: a causal LM as it is; a Qwen2-VL /
    Qwen2.5-VL as its language model alone (``TEXT_VIEWS``), a Qwen2 config and renamed weights."""
    from safetensors.torch import save_file

    bare = unwrap(model)
    if hasattr(bare, "peft_config"):
        raise ConfigError(
            "rollout.engine=vllm with LoRA: not supported yet; merge the adapter or use engine mmgrpo."
        )
    config = bare.config
    if not hasattr(config, "vision_config"):
        bare.save_pretrained(folder, safe_serialization=True)
        return
    text = config.get_text_config()
    if text.model_type not in TEXT_VIEWS:
        raise ConfigError(
            f"rollout.engine=vllm with a {config.model_type} model: vLLM serves only the language model of "
            f"{', '.join(sorted(TEXT_VIEWS))} here (text-only episodes); use rollout.engine=mmgrpo."
        )
    from transformers import Qwen2Config

    rope = {
        k: v for k, v in dict(getattr(text, "rope_parameters", None) or {}).items() if k != "mrope_section"
    }
    tied = bool(getattr(config, "tie_word_embeddings", False))
    kwargs = {k: getattr(text, k) for k in TEXT_KEYS}
    Qwen2Config(**kwargs, rope_parameters=rope or None, tie_word_embeddings=tied).save_pretrained(folder)
    weights = {}
    for name, tensor in bare.state_dict().items():
        if name.startswith("model.language_model."):
            weights["model." + name[len("model.language_model.") :]] = tensor.detach().float().contiguous()
        elif name == "lm_head.weight" and not tied:
            weights[name] = tensor.detach().float().contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


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
