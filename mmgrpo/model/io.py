"""Model I/O: loading a checkpoint (path or hub id) at the right precision, LoRA, dropout, stop ids, saving.

Precision (``model.dtype``), as TRL and verl do it:

- ``float32``: weights and compute in fp32.
- ``bfloat16``: the trained weights stay in fp32 (the master copy the optimizer updates: a bf16 weight
  cannot take an update smaller than 1/256 of itself, so at lr 1e-6 most would never move), the forward
  runs under bf16 autocast (accelerate's mixed precision). Frozen weights (the LoRA base) are stored in
  bf16.
- ``float16``: the same with fp16 autocast and accelerate's loss scaler; GPU only (on the CPU accelerate
  has no loss scaler and unscaled fp16 gradients underflow, so it is refused at start-up).

Dropout is switched off at load (TRL does the same): with dropout on, the training pass and the
reference / sampling pass see different networks, so the KL and the importance ratio are off.

LoRA (``model.lora``) goes through peft: adapters on the language model's linear layers only, the KL
reference is the same model with the adapter disabled (no second copy), and the final save holds the
adapter (``save: adapter``) or the merged model (``save: merged``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import ConfigError
from mmgrpo.model.adapters import unwrap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""model.dtype -> the mixed-precision mode (accelerate's names)."""


@dataclass
class LoraSpec:
    """What ``model.lora`` asks for (see mmgrpo.config.core.LoraConfig for the documented keys)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    save: str = "adapter"


def check_precision(dtype: str, device: str) -> None:
    """Refuse what cannot train: fp16 on the CPU."""
    if dtype == "float16" and device == "cpu":
        raise ConfigError(
            "model.dtype=float16 on the CPU: accelerate has no loss scaler there and fp16 gradients underflow "
            "to zero or overflow to inf without one. Use model.dtype=bfloat16 (fp32 master weights, bf16 "
            "compute; no scaler needed) or float32, or train on a GPU."
        )


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (nn.Dropout modules and the float ``*dropout*``
    attributes attention modules read at forward time), except LoRA's own (``model.lora.dropout`` is the
    user's choice). Returns how many were changed."""
    changed = 0
    for name, m in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(m, torch.nn.Dropout):
            changed += m.p != 0
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float) and value != 0.0:
                setattr(m, name, 0.0)
                changed += 1
    return changed


def stop_ids_of(model, tokenizer, end_of_turn_id: int | None) -> list[int]:
    """Token ids that end an episode: generation_config.eos_token_id (Qwen: <|im_end|> and <|endoftext|>;
    Gemma 3: <eos> and <end_of_turn>; Llama 3: <|eot_id|> and <|end_of_text|>), the tokenizer's eos, and
    the token the chat template closes an assistant turn with."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    ids += [tokenizer.eos_token_id, end_of_turn_id]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "tokenizer.tiktoken")


def check_model_folder(path: Path) -> None:
    """A local checkpoint folder must hold a readable config.json, weights and tokenizer files; say which is
    missing or broken (instead of the loaders' own errors, one of which asks for sentencepiece)."""
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"model.path '{path}': config.json cannot be read ({e}); the folder is not a complete saved "
            "model. Save it again, or copy config.json from the checkpoint it came from."
        ) from None
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"model.path '{path}' has a config but no weights (none of {', '.join(WEIGHT_FILES)}): an "
            "interrupted save (a full disk?) or a config-only folder. Point model.path at a complete "
            "checkpoint."
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"model.path '{path}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}). Copy them "
            "from the base checkpoint (processor.save_pretrained(path) writes them)."
        )


def check_hub_reachable(repo_id: str, timeout_s: float = 3.0) -> None:
    """A hub id that is neither in the local Hugging Face cache nor reachable fails at once with a clear
    error (the hub client would retry for minutes, then print a long traceback)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: loading works offline
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"model.path '{repo_id}' is not a local folder, is not in the Hugging Face cache, and {host} "
            f"cannot be reached ({e}). On an offline machine, download it elsewhere and give its folder "
            "(huggingface-cli download REPO --local-dir DIR), or build the offline tiny model with "
            f"`mmgrpo tiny-model {tiny_command_dir(repo_id)}`."
        ) from None


def tiny_model_flags(path: str | Path) -> str:
    """The ``mmgrpo tiny-model`` flags that a folder named as the examples name them wants: ``--sees`` for
    runs/tiny-model-sees (the model that sees), ``--text-only`` for runs/tiny-text-model."""
    name = Path(str(path)).name
    return " --sees" if "sees" in name else " --text-only" if "text" in name else ""


def tiny_command_dir(path: str) -> str:
    """What follows ``mmgrpo tiny-model`` in a hint: the folder and its flags when the name is a tiny model's
    (the examples' runs/tiny-model-sees), else the placeholder DIR."""
    return f"{path}{tiny_model_flags(path)}" if "tiny" in Path(path).name else "DIR"


def _adapter_base(path: Path) -> str | None:
    cfg = path / "adapter_config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("base_model_name_or_path")


def load_model(
    path: str | Path,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    lora: LoraSpec | None = None,
    processor_kwargs: dict[str, Any] | None = None,
):
    """The model and processor of ``path`` (a folder or hub id; a saved LoRA adapter folder loads its base
    and the adapter, trainable). Trained weights in fp32 (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    adapter_base = _adapter_base(Path(path)) if Path(path).is_dir() else None
    base = adapter_base or path
    if Path(base).is_dir():
        check_model_folder(Path(base))
    else:
        check_hub_reachable(str(base))
    stored = DTYPES[dtype] if (lora is not None or adapter_base) else torch.float32
    config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    auto = (
        AutoModelForImageTextToText
        if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        else AutoModelForCausalLM
    )
    processor = AutoProcessor.from_pretrained(
        path, trust_remote_code=trust_remote_code, **(processor_kwargs or {})
    )
    try:
        model = auto.from_pretrained(base, dtype=stored, trust_remote_code=trust_remote_code)
    except Exception as e:  # a weights file that exists but cannot be read: truncated or corrupt
        if Path(base).is_dir() and ("safetensor" in type(e).__name__.lower() or "deserializ" in str(e)):
            raise ConfigError(
                f"model.path '{base}': the weights cannot be read ({type(e).__name__}: {e}); the file is "
                "truncated or corrupt (an interrupted copy or save?). Copy or save the checkpoint again."
            ) from None
        raise
    if adapter_base:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(path), is_trainable=True)
    elif lora is not None:
        model = apply_lora(model, lora)
    return model, processor


def lora_targets(model, names: list[str], is_vision) -> list[str]:
    """Full names of the language model's linear layers whose last name part is in ``names`` (the vision
    tower, the projector and the output head are left out)."""
    out = []
    for full, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and full.rsplit(".", 1)[-1] in names and not is_vision(full):
            if not full.endswith("lm_head"):
                out.append(full)
    return out


def apply_lora(model, spec: LoraSpec):
    """Wrap ``model`` in peft LoRA adapters (fp32 adapter weights, base frozen)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is in the test extra
        raise ConfigError("model.lora needs peft: pip install 'mmgrpo[lora]' (or pip install peft)") from e
    from mmgrpo.model.adapters import adapter_for

    adapter = adapter_for(model)
    targets = lora_targets(model, spec.target_modules, adapter.is_vision_param)
    if not targets:
        names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.target_modules={spec.target_modules} matches no linear layer of the language model; "
            f"its linear layers are named {names}"
        )
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets)
    peft_model = get_peft_model(model, cfg)
    for p in peft_model.parameters():  # adapters train in fp32 whatever the base is stored in
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return peft_model


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def save_model(model, processor, out_dir: str | Path, *, merged: bool = False, state_dict=None) -> Path:
    """Save ``model`` (a LoRA model: its adapter, or with ``merged`` a merged plain copy) and processor.
    ``state_dict``: the full weights when the live model is sharded (FSDP, DeepSpeed) and was gathered."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_lora(model) and merged:
        copy.deepcopy(model).merge_and_unload().save_pretrained(out)
    elif state_dict is not None:
        model.save_pretrained(out, state_dict=state_dict)
    else:
        model.save_pretrained(out)
    if is_lora(model) and not merged:
        _absolute_adapter_base(out)
    processor.save_pretrained(out)
    share_file_modes(out)  # safetensors >= 0.8 writes weights 0600 (safetensors#782)
    return out


def _absolute_adapter_base(out: Path) -> None:
    """peft writes an adapter's base model as the path it was loaded from, relative to the run's working
    directory (``runs/tiny-model``), so the adapter folder would load from that directory only. A local
    base is stored as an absolute path instead; a hub id stays as it is."""
    config_file = out / "adapter_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if base and not Path(base).is_absolute() and Path(base).is_dir():
        config["base_model_name_or_path"] = str(Path(base).resolve())
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def share_file_modes(folder: Path) -> None:
    """Give ``folder``'s ``*.safetensors`` files the permissions its other files have.

    safetensors >= 0.8 writes through a temporary file, created with mode 0600 whatever the umask
    (safetensors/safetensors#782), so a model saved by one user could not be read by another while its
    config.json could. The mode of a file the folder got through ``open()`` (config.json) is the one the
    umask gives; without one the umask is read from /proc or, failing that, set and restored.
    """
    weights = list(folder.glob("*.safetensors"))
    if not weights:
        return
    reference = next((f for f in (folder / "config.json", *folder.glob("*.json")) if f.is_file()), None)
    if reference is not None:
        mode = reference.stat().st_mode & 0o777
    else:
        mode = 0o666 & ~_umask()
    for f in weights:
        os.chmod(f, mode)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- folders
def first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist (what ``mkdir(parents=True)`` creates)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def remove_if_no_files(folder: Path | None) -> None:
    """Remove ``folder`` when it holds no file at any depth (only empty folders, or nothing)."""
    if folder is None or not folder.is_dir() or folder.is_symlink():
        return
    if not any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)


def checkpointing_on(model) -> bool:
    """Whether activation checkpointing is on (the attribute was renamed in transformers 5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def looks_like_missing_folder(path: str | Path) -> bool:
    """True when ``path`` is clearly meant as a local folder that is not there (an absolute or relative
    path, or 'dir/name' whose 'dir' exists here), so that a typo fails at once instead of being sent to
    the hub as a repository id (which retries for minutes on an offline machine)."""
    p = Path(path).expanduser()
    if p.exists():
        return False
    text = str(path)
    if p.is_absolute() or text.startswith((".", "~")) or len(p.parts) > 2:
        return True
    return len(p.parts) == 2 and Path(p.parts[0]).is_dir()


def no_kernel_swaps(model) -> bool:
    """Turn off transformers' hub-kernel swapping on ``model`` (a model that runs on the CPU); True when
    it was on. With the ``kernels`` package installed, transformers 5 loads every model with it on, and each
    train() / eval() that changes the mode walks the whole model to swap layers for that mode's kernels:
    1.7 ms per flip on the tiny VLM, four flips a GRPO step (rollout, training pass). Its kernel mapping has
    no CPU layer, so on the CPU the walks swap nothing."""
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # LoRA: the wrapped model
    if not getattr(base, "use_kernels", False) or not hasattr(base, "reset_kernels"):
        return False
    base.use_kernels = False  # transformers' setter: reset_kernels(), which restores any swapped layer
    return True
