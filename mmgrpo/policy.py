"""The policy: a Hugging Face model and its processor, seen as "messages in, token ids out".

Owns chat templating, image inputs, batched generation, per-token log-probs and the frozen reference.
Knows nothing about environments or rewards.

Layout of a batch of N sequences (the same as TRL's and verl's "prompt | response" layout):

    prompt_ids   (N, P)  left-padded    every token before the first policy turn (system, user, images)
    response_ids (N, T)  right-padded   everything after it: policy turns and, in multi-turn episodes,
                                        the environment's turns in between (loss_mask 0 there)

so the log-prob of response token t is read from the logits at column P + t - 1, and one forward with
``logits_to_keep = T + 1`` serves any mix of prompt lengths. Vision inputs (``pixel_values`` rows, one per
14x14 patch, and ``image_grid_thw``, one row per image) travel with the batch in sequence order.

The same class serves the embedded tiny Qwen2.5-VL, a real checkpoint by path or hub id, and a text-only
causal LM (whose "processor" is its tokenizer).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmgrpo.batch import TokenBatch, VisionInputs
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.losses import token_logprobs

# name fragments of vision-encoder parameters across HF families (Qwen-VL "visual", LLaVA "vision_tower", ...)
VISION_PARAM_KEYS = ("visual.", "vision_tower", "vision_model", "multi_modal_projector")


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
        cfg = model.config
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.video_token_id = getattr(cfg, "video_token_id", None)
        # placeholders the policy must never sample: a generated image token has no image behind it
        vision_ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        self.suppress_ids = sorted({i for a in vision_ids if (i := getattr(cfg, a, None)) is not None})

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
        frozen = [p for n, p in self.model.named_parameters() if any(k in n for k in VISION_PARAM_KEYS)]
        for p in frozen:
            p.requires_grad_(False)
        return sum(p.numel() for p in frozen)

    def language_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters outside the vision encoder (and its projector), e.g. to train the text side only."""
        return [p for n, p in self.model.named_parameters() if not any(k in n for k in VISION_PARAM_KEYS)]

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def is_vision(self) -> bool:
        return hasattr(self.processor, "image_processor")

    # -------------------------------------------------------------------------------------- templating
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat-templated text of ``messages`` (images become their placeholder tokens)."""
        if self.is_vision:
            return self.processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        flat = [
            {"role": m["role"], "content": _text_of(m["content"])} if not isinstance(m["content"], str) else m
            for m in messages
        ]
        return self.tokenizer.apply_chat_template(
            flat, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode_prompts(self, conversations: list[list[dict]]) -> tuple[Tensor, Tensor, VisionInputs]:
        """Template and tokenize prompts: ids (B, P) left-padded, mask (B, P), their vision inputs."""
        texts = [self.render(msgs) for msgs in conversations]
        images = [_images_of(msgs) for msgs in conversations]
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

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int] | Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -------------------------------------------------------------------------------------- generation
    def _model_inputs(self, ids: Tensor, mask: Tensor, vision: VisionInputs, model) -> dict[str, Any]:
        """Keyword arguments of a forward / generate call for ids (N, L) and their images."""
        kw: dict[str, Any] = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if not vision.empty:
            v = vision.to(self.device, dtype=next(model.parameters()).dtype)
            kw["pixel_values"] = v.pixel_values
            kw["image_grid_thw"] = v.image_grid_thw
        if self.image_token_id is not None:
            # 0 text, 1 image, 2 video: Qwen-VL models need it for their 3-D (M-RoPE) positions
            tt = torch.zeros_like(ids, dtype=torch.int)  # (N, L)
            tt[ids == self.image_token_id] = 1
            if self.video_token_id is not None:
                tt[ids == self.video_token_id] = 2
            kw["mm_token_type_ids"] = tt.to(self.device)
        return kw

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
    ) -> tuple[list[list[int]], list[bool]]:
        """Sample ``num_samples`` continuations of each prompt (temperature 0 = greedy).

        prompt_ids, prompt_mask (B, P) and ``vision`` (one entry per prompt). Returns B * num_samples
        rows, prompt b's samples at rows b*G .. b*G+G-1: the generated ids up to and including the first
        end-of-turn token, and whether that token was produced (False: the episode hit max_new_tokens,
        i.e. it is truncated). With num_samples G > 1 each prompt and its images are encoded once and
        our decode loop runs on the KV cache repeated G times; with G = 1 Hugging Face ``generate`` runs.
        """
        model = self.model
        was_training = model.training
        model.eval()
        if num_samples > 1:
            new_ids = self._generate_shared(
                prompt_ids, prompt_mask, vision, num_samples, max_new_tokens, temperature, top_p, top_k
            )
            model.train(was_training)
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
        model.train(was_training)
        return self._cut_at_eos(out[:, prompt_ids.shape[1] :].tolist())  # (N, <= max_new_tokens)

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
        repeated for the G responses: the same numbers and gradients, a fraction of the compute.
        """
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: call make_reference() (only needed when beta > 0)")
        G = batch.shared_prompt_runs() if share_prompt else 1
        with torch.set_grad_enabled(not reference and torch.is_grad_enabled()):
            if G > 1:
                logits = self._response_logits_shared(model, batch, G)  # (N, T, V)
            else:
                logits = self._response_logits_full(model, batch)  # (N, T, V)
            return token_logprobs(logits, batch.response_ids.to(self.device), temperature)  # (N, T)

    def _uses_mrope(self, model) -> bool:
        """Qwen-VL family: 3-D rotary positions, with a per-row offset (rope_deltas) after the images."""
        inner = getattr(getattr(model, "module", model), "model", None)
        return hasattr(inner, "rope_deltas")

    def _text_positions(self, mask: Tensor, model) -> Tensor:
        """Positions that skip left padding: (N, L), or (3, N, L) for M-RoPE models."""
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0).to(self.device)  # (N, L)
        return pos.unsqueeze(0).expand(3, -1, -1) if self._uses_mrope(model) else pos

    def _response_logits_full(self, model, batch: TokenBatch) -> Tensor:
        """One forward over prompt + response: logits predicting each response token, (N, T, V)."""
        ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # (N, P + T)
        mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)  # (N, P + T)
        T = batch.response_ids.shape[1]
        vision = batch.row_vision()
        kw = self._model_inputs(ids, mask, vision, model)
        if vision.empty or not self._uses_mrope(model):
            kw["position_ids"] = self._text_positions(mask, model)
        logits = model(**kw, logits_to_keep=T + 1, use_cache=False).logits  # (N, T + 1, V)
        return logits[:, :-1, :]  # (N, T, V): logits at column P+t-1 predict response token t

    def _prefill_shared(self, model, p_ids: Tensor, p_mask: Tensor, pv: VisionInputs, G: int):
        """Encode B distinct prompts once and repeat the result G times (row b -> rows bG .. bG+G-1).

        p_ids, p_mask (B, P); pv their images. Returns the logits predicting the first response token
        (B*G, V), the KV cache repeated to B*G rows, and the per-row offset that M-RoPE models add to text
        positions after images ((B*G, 1) or None).
        """
        kw = self._model_inputs(p_ids, p_mask, pv, model)
        mrope_images = self._uses_mrope(model) and not pv.empty
        if not mrope_images:
            kw["position_ids"] = self._text_positions(p_mask, model)
        out = model(**kw, logits_to_keep=1, use_cache=True)
        first = out.logits[:, -1, :].repeat_interleave(G, dim=0)  # (N, V)
        cache = out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.x
        cache.batch_repeat_interleave(G)  # (B, ...) -> (N, ...), differentiable
        delta = None
        if mrope_images:
            delta = getattr(model, "module", model).model.rope_deltas  # (B, 1) offset left by the images
            delta = delta.to(self.device).repeat_interleave(G, dim=0)  # (N, 1)
        return first, cache, delta

    def _continuation_positions(self, full_mask: Tensor, start: int, delta: Tensor | None, model) -> Tensor:
        """Positions of columns ``start:`` of a left-padded sequence: (N, L) or (3, N, L) for M-RoPE."""
        pos = (full_mask.long().cumsum(-1) - 1)[:, start:]  # (N, L) text positions, padding skipped
        if delta is not None:
            pos = pos + delta  # (N, L)
        return pos.unsqueeze(0).expand(3, -1, -1) if self._uses_mrope(model) else pos

    def _response_logits_shared(self, model, batch: TokenBatch, G: int) -> Tensor:
        """Encode each of the N/G distinct prompts once, repeat its KV cache G times, run the responses."""
        N, P = batch.prompt_ids.shape
        heads = list(range(0, N, G))  # first row of each group
        owners = batch.row_prompts()
        pv = batch.vision.select([owners[h] for h in heads])
        first, cache, delta = self._prefill_shared(
            model, batch.prompt_ids[heads], batch.prompt_mask[heads], pv, G
        )
        full_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(self.device)  # (N, P + T)
        rest = model(
            input_ids=batch.response_ids.to(self.device),
            attention_mask=full_mask,
            position_ids=self._continuation_positions(full_mask, P, delta, model),
            **{_cache_kwarg(model): cache},
            use_cache=True,
        ).logits  # (N, T, V): column t predicts response token t + 1
        return torch.cat([first.unsqueeze(1), rest[:, :-1, :]], dim=1)  # (N, T, V)

    def _generate_shared(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        vision: VisionInputs,
        G: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
    ) -> Tensor:
        """Sample G continuations of each of B prompts with one prompt encoding each: the decode loop of
        HF generate, minus the G-fold prefill. Returns the new ids (B*G, <= max_new_tokens), pad after
        end-of-turn."""
        model = self.model
        logits, cache, delta = self._prefill_shared(model, prompt_ids, prompt_mask, vision, G)  # (N, V)
        mask = prompt_mask.repeat_interleave(G, dim=0).to(self.device)  # (N, P), grows a column per step
        done = torch.zeros(mask.shape[0], dtype=torch.bool, device=self.device)  # (N,)
        steps = []
        for _ in range(max_new_tokens):
            nxt = sample_tokens(logits, temperature, top_p, top_k, self.suppress_ids)  # (N,)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)  # (N,)
            steps.append(nxt)
            done |= nxt == self.eos_token_id
            if bool(done.all()) or len(steps) == max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (N, P + t + 1)
            logits = model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=self._continuation_positions(mask, mask.shape[1] - 1, delta, model),
                **{_cache_kwarg(model): cache},
                use_cache=True,
            ).logits[:, -1, :]  # (N, V)
        return torch.stack(steps, dim=1)  # (N, t)

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


def sample_tokens(
    logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, suppress: list[int] | None = None
) -> Tensor:
    """One token per row from logits (N, V): greedy when temperature <= 0, else softmax(logits / T)
    restricted to the top_k tokens and to the smallest set whose probability reaches top_p. Returns (N,)."""
    logits = logits.float()  # (N, V)
    if suppress:
        logits[:, suppress] = float("-inf")
    if temperature <= 0:
        return logits.argmax(dim=-1)  # (N,)
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(dim=-1)  # (N, V)
        drop = probs.cumsum(dim=-1) - probs > top_p  # (N, V) mass before this token already exceeds top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)  # (N,)


def _cache_kwarg(model) -> str:
    """The forward keyword that takes a KV cache: ``cache`` in recent transformers, else past_key_values."""
    import inspect

    params = inspect.signature(getattr(model, "module", model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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
