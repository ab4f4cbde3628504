"""The policy: a Hugging Face model and its processor, seen as "messages in, token ids out".

Owns model I/O (loading, saving, the frozen reference), chat templating (with ``tools=``), image inputs,
the token-in / token-out continuation of multi-turn episodes, and the public ``generate`` / ``logprobs``.
The forward/decode work is ``mmgrpo.engine``'s; what differs between model families is
``mmgrpo.adapters``'. Knows nothing about environments or rewards.

Layout of a batch of N sequences (the same as TRL's and verl's "prompt | response" layout):

    prompt_ids   (N, P)  left-padded    every token before the first policy turn (system, user, images)
    response_ids (N, T)  right-padded   everything after it: policy turns and, in multi-turn episodes,
                                        the environment's turns in between (loss_mask 0 there)

The same class serves the embedded tiny Qwen2.5-VL, a real checkpoint by path or hub id, and a text-only
causal LM (whose "processor" is its tokenizer).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmgrpo import engine
from mmgrpo.adapters import adapter_for
from mmgrpo.batch import TokenBatch, VisionInputs
from mmgrpo.engine import sample_tokens  # noqa: F401  (public here since the foundation)
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.losses import token_logprobs


class Policy:
    """A Hugging Face (vision-)language model with its processor, plus an optional frozen reference.

    ``Policy.from_pretrained(path_or_hub_id)`` loads any image-text-to-text model (Qwen2.5-VL, ...) or a
    text-only causal LM. ``model`` is the trainable module; ``reference`` a frozen copy (or None).
    """

    def __init__(self, model, processor, *, device: str | torch.device = "cpu"):
        self.model = model
        self.processor = processor
        self.device = torch.device(device)
        self.reference = None
        tok = self.tokenizer
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.adapter = adapter_for(model)
        self.image_token_id = self.adapter.image_token_id
        self.video_token_id = self.adapter.video_token_id
        self.suppress_ids = self.adapter.suppress_ids

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
    ) -> Policy:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        if _looks_like_missing_folder(path):
            raise ConfigError(
                f"model path '{path}' does not exist. Build the embedded model with `mmgrpo tiny-model "
                f"{path}`, or give an existing checkpoint folder or a hub id such as Qwen/Qwen2.5-VL-3B-Instruct."
            )
        if Path(path).exists() and not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"model.path '{path}' is a folder without config.json: it is not a saved model. "
                "Build the embedded one with `mmgrpo tiny-model PATH` or give a hub id / checkpoint folder."
            )
        kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if min_pixels is not None:
            kw["min_pixels"] = min_pixels
        if max_pixels is not None:
            kw["max_pixels"] = max_pixels
        processor = AutoProcessor.from_pretrained(path, **kw)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto = (
            AutoModelForImageTextToText
            if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            else AutoModelForCausalLM
        )
        model = auto.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        model.to(device)
        return cls(model, processor, device=device)

    def make_reference(self) -> None:
        """Keep a frozen copy of the current weights as the KL reference."""
        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        ref.eval()
        self.reference = ref

    def freeze_vision(self) -> int:
        """Stop gradients into the vision encoder; returns how many parameters were frozen."""
        frozen = [p for n, p in self.model.named_parameters() if self.adapter.is_vision_param(n)]
        for p in frozen:
            p.requires_grad_(False)
        return sum(p.numel() for p in frozen)

    def language_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters outside the vision encoder (and its projector), e.g. to train the text side only."""
        return [p for n, p in self.model.named_parameters() if not self.adapter.is_vision_param(n)]

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def is_vision(self) -> bool:
        return hasattr(self.processor, "image_processor")

    # -------------------------------------------------------------------------------------- templating
    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat-templated text of ``messages`` (images become their placeholder tokens); ``tools`` is
        the list of JSON schemas the template renders into the system message."""
        kw: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
        if tools:
            kw["tools"] = tools
        if self.is_vision:
            return self.processor.apply_chat_template(messages, **kw)
        flat = [
            dict(m, content=_text_of(m["content"])) if not isinstance(m["content"], str) else m
            for m in messages
        ]
        return self.tokenizer.apply_chat_template(flat, **kw)

    def _tokenize(self, texts: list[str], images: list[list]) -> tuple[Tensor, Tensor, VisionInputs]:
        """Tokenize texts (left-padded) with their images expanded into placeholder tokens."""
        if any(images) and not self.is_vision:
            raise DataError(
                "the environment sent images but the model is text-only: use an image-text-to-text model "
                "(e.g. the tiny Qwen2.5-VL from `mmgrpo tiny-model`) or an environment without images."
            )
        tok = self.tokenizer
        tok.padding_side = "left"
        if any(images):
            flat = [im for ims in images for im in ims]
            enc = self.processor(text=texts, images=flat, return_tensors="pt", padding=True)
            vision = VisionInputs(enc["pixel_values"], enc["image_grid_thw"], [len(ims) for ims in images])
        else:
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            vision = VisionInputs(images_per_seq=[0] * len(texts))
        return enc["input_ids"], enc["attention_mask"], vision

    def encode_prompts(
        self, conversations: list[list[dict]], tools: list[list[dict] | None] | None = None
    ) -> tuple[Tensor, Tensor, VisionInputs]:
        """Template and tokenize prompts: ids (B, P) left-padded, mask (B, P), their vision inputs."""
        tools = tools or [None] * len(conversations)
        texts = [self.render(msgs, tools=t) for msgs, t in zip(conversations, tools, strict=True)]
        return self._tokenize(texts, [_images_of(msgs) for msgs in conversations])

    def encode_continuation(
        self, history: list[dict], new: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], VisionInputs]:
        """Token ids of the environment's ``new`` messages after ``history`` (which ends with the policy's
        turn, whose sampled ids end at the end-of-turn token), up to the next assistant header; and the
        vision inputs of their images (processed once, here).

        Token in, token out: nothing already in the episode is re-encoded. The template must render the
        longer conversation as a prefix extension of the shorter one (every chat template of the Qwen,
        Llama and Hermes families does); when it does not, this raises DataError naming the template.
        """
        before = self.render(history, add_generation_prompt=False, tools=tools)
        after = self.render(history + new, add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            at = next(
                (i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y),
                min(len(before), len(after)),
            )
            raise DataError(
                f"the chat template of {self.name_or_path!r} does not render a conversation as a prefix "
                f"extension of its earlier turns (they differ at character {at}: {before[at : at + 40]!r} vs "
                f"{after[at : at + 40]!r}), so a multi-turn episode cannot be continued token by token. Use a "
                "template that renders past turns unchanged (no date, no 'last turn only' logic): set "
                "chat_template in the checkpoint's tokenizer_config.json or processor config."
            )
        eos = self.tokenizer.eos_token or ""
        # the sampled turn ends at the end-of-turn token; the template may add text after it (Qwen: "\n")
        tail = before[before.rfind(eos) + len(eos) :] if eos and eos in before else ""
        ids, _, vision = self._tokenize([tail + after[len(before) :]], [_images_of(new)])
        return ids[0].tolist(), vision

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int] | Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -------------------------------------------------------------------------------------- generation
    def _model_inputs(self, ids: Tensor, mask: Tensor, vision: VisionInputs, model) -> dict[str, Any]:
        """Keyword arguments of a forward / generate call for ids (N, L) and their images."""
        return self.adapter.forward_kwargs(ids, mask, vision, self.device, engine.model_dtype(model))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        vision: VisionInputs,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        num_samples: int = 1,
        use_hf_generate: bool | None = None,
    ) -> tuple[list[list[int]], list[bool]]:
        """Sample ``num_samples`` continuations of each prompt (temperature 0 = greedy).

        prompt_ids, prompt_mask (B, P) and ``vision`` (one entry per prompt). Returns B * num_samples
        rows, prompt b's samples at rows b*G .. b*G+G-1: the generated ids up to and including the first
        end-of-turn token, and whether that token was produced (False: the episode hit max_new_tokens,
        i.e. it is truncated). Each prompt and its images are encoded once and our decode loop runs on the
        KV cache repeated G times; with G = 1 Hugging Face ``generate`` runs unless ``use_hf_generate`` is
        False.
        """
        model = self.model
        was_training = model.training
        model.eval()
        try:
            if num_samples > 1 or use_hf_generate is False:
                new_ids = engine.generate(
                    model,
                    self.adapter,
                    prompt_ids,
                    prompt_mask,
                    vision,
                    G=num_samples,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    eos_token_id=self.eos_token_id,
                    pad_token_id=self.pad_token_id,
                    device=self.device,
                )
                return self._cut_at_eos(new_ids.tolist())
            greedy = temperature <= 0
            gen_kw: dict[str, Any] = dict(
                max_new_tokens=max_new_tokens,
                do_sample=not greedy,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                suppress_tokens=self.suppress_ids or None,
            )
            if not greedy:
                gen_kw.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
            else:
                gen_kw.update(temperature=None, top_p=None, top_k=None)
            out = model.generate(**self._model_inputs(prompt_ids, prompt_mask, vision, model), **gen_kw)
            return self._cut_at_eos(out[:, prompt_ids.shape[1] :].tolist())  # (N, <= max_new_tokens)
        finally:
            model.train(was_training)

    def _cut_at_eos(self, new: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Each row up to and including its first end-of-turn token, and whether it had one."""
        completions, finished = [], []
        for row in new:
            if self.eos_token_id in row:
                cut = row.index(self.eos_token_id) + 1
                completions.append(row[:cut])
                finished.append(True)
            else:
                completions.append(row)
                finished.append(False)
        return completions, finished

    # --------------------------------------------------------------------------------------- log-probs
    def logprobs(
        self,
        batch: TokenBatch,
        *,
        temperature: float = 1.0,
        reference: bool = False,
        share_prompt: bool = True,
    ) -> Tensor:
        """Per-token log-probs of ``batch.response_ids`` under the policy (or the reference): (N, T).

        Differentiable for the policy; no graph for the reference. Positions outside response_mask hold
        garbage that callers mask out. When rows come in groups sharing a prompt (``prompt_index``) and
        ``share_prompt`` is on, each prompt (and its images) is encoded once and its key/value cache is
        repeated for the G responses: the same numbers and gradients, a fraction of the compute. Responses
        that hold images (tool results) take one full forward per row (see mmgrpo.engine).
        """
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: call make_reference() (only needed when beta > 0)")
        G = batch.shared_prompt_runs() if share_prompt and not batch.has_response_images else 1
        with torch.set_grad_enabled(not reference and torch.is_grad_enabled()):
            if G > 1:
                logits = engine.response_logits_shared(
                    model, self.adapter, batch, G, self.device
                )  # (N, T, V)
            else:
                logits = engine.response_logits_full(model, self.adapter, batch, self.device)  # (N, T, V)
            return token_logprobs(logits, batch.response_ids.to(self.device), temperature)  # (N, T)

    # ------------------------------------------------------------------------------------------ saving
    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.processor.save_pretrained(out)


def _looks_like_missing_folder(path: str | Path) -> bool:
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


def _text_of(content: list[dict] | str) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _images_of(messages: list[dict]) -> list:
    return [
        p["image"]
        for m in messages
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p.get("type") == "image"
    ]
