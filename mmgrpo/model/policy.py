"""The policy: a Hugging Face model and its processor, seen as "messages in, token ids out".

Owns model I/O (loading, saving, the frozen reference), chat templating (with ``tools=``, which mmgrpo
writes into the conversation itself when the template has no tools section: mmgrpo.model.tool_prompt), image
inputs, the token-in / token-out continuation of multi-turn episodes, and the public ``generate`` /
``logprobs``.
The forward/decode work is ``mmgrpo.model.engine``'s; what differs between model families is
``mmgrpo.model.adapters``'. Knows nothing about environments or rewards.

Layout of a batch of N sequences (the same as TRL's and verl's "prompt | response" layout):

    prompt_ids   (N, P)  left-padded    every token before the first policy turn (system, user, images)
    response_ids (N, T)  right-padded   everything after it: policy turns and, in multi-turn episodes,
                                        the environment's turns in between (loss_mask 0 there)

The same class serves the embedded tiny Qwen2.5-VL, a real checkpoint by path or hub id, and a text-only
causal LM (whose "processor" is its tokenizer).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.model import engine, model_check, openings, samplers, shared_spans
from mmgrpo.model.adapters import adapter_for, holds_shards, unwrap
from mmgrpo.model.batch import TokenBatch, VisionInputs
from mmgrpo.model.engine import sample_tokens  # noqa: F401  (public here since the foundation)
from mmgrpo.model.io import (
    PRECISION,
    LoraSpec,
    checkpointing_on,
    disable_dropout,
    is_lora,
    load_model,
    looks_like_missing_folder,
    no_kernel_swaps,
    save_model,
    stop_ids_of,
    tiny_model_flags,
)
from mmgrpo.model.kept import KeptTokenizations
from mmgrpo.model.token_stats import block_stats
from mmgrpo.model.tool_prompt import find_placement, with_tools_block

_PROCESSOR_PLACEHOLDERS = (
    "image_token_id",
    "video_token_id",
    "fake_image_token_id",
    "global_image_token_id",
    "boi_token_id",
    "eoi_token_id",
)


class Policy:
    """A Hugging Face (vision-)language model with its processor, plus an optional frozen reference.

    ``Policy.from_pretrained(path_or_hub_id)`` loads any image-text-to-text model (Qwen2.5-VL, ...) or a
    text-only causal LM. ``model`` is the trainable module; ``reference`` a frozen copy (or None).
    """

    _tool_placement: str | None = None  # found on first use (see tool_placement)

    def __init__(
        self, model, processor, *, device: str | torch.device = "cpu", precision: str = "fp32"
    ) -> None:
        self.model = model
        self.processor = processor
        self.device = torch.device(device)
        self.precision = precision
        """fp32, or bf16 / fp16: every forward runs under autocast to that dtype (weights stay as stored)."""
        self.reference = None
        self.sampler = None  # an engine in another process that samples instead (mmgrpo.model.vllm_engine)
        self.reference_is_base = False
        """True with LoRA: the reference is this model with its adapter disabled, not a copy."""
        self._reference_vision_frozen = False
        """Whether the reference copy was made with the encoder frozen (it then shares its features)."""
        self.offload_reference = False
        """Keep the reference copy in CPU memory between its passes (see ``reference_on_device``)."""
        self._continuations = KeptTokenizations()  # tool messages tokenized lately (encode_continuation)
        self.lockstep = False
        """Weights sharded over processes (FSDP): a scoring pass is one forward whatever the batch, as every
        forward is a collective (no shared prefill, whose number of forwards depends on the episodes)."""
        disable_dropout(model)
        tok = self.tokenizer
        self.adapter = adapter_for(model)
        self.adapter.speed_up(model)
        model_check.check(model, self.adapter, self.autocast())  # causal, a cache, sampled = forward: else one line
        if self.device.type == "cpu":
            # grouped-query attention inside SDPA instead of copying every key/value head per query head
            # (transformers only does so without a mask by default): same numbers, 35% faster attention
            # on CPU, no copies of the G-fold repeated prompt cache
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
            no_kernel_swaps(model)
        self.end_of_turn_id = self._end_of_turn_id()
        """The token the chat template closes an assistant turn with (appended to supervised targets)."""
        self.eos_token_id = self.end_of_turn_id
        self.stop_ids = stop_ids_of(unwrap(model), tok, self.end_of_turn_id)
        """Every id that ends an episode (generation_config's eos ids, the tokenizer's, the turn end)."""
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.image_token_id = self.adapter.image_token_id
        self.video_token_id = self.adapter.video_token_id
        # placeholders never to sample: the config's, and those only the processor knows (Idefics3's
        # <fake_token_around_image> and <global-img>, Gemma 3's <start_of_image>)
        extra = [getattr(processor, a, None) for a in _PROCESSOR_PLACEHOLDERS] if self.is_vision else []
        self.adapter.suppress_ids = sorted(
            set(self.adapter.suppress_ids) | {i for i in extra if isinstance(i, int)}
        )
        self.suppress_ids = self.adapter.suppress_ids

    def autocast(self):
        """The autocast context of every forward (a no-op in fp32)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _end_of_turn_id(self) -> int | None:
        """The first special token the template writes after an assistant message's text."""
        tok = self.tokenizer
        try:
            text = self.render(
                [
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "MARK"}]},
                ],
                add_generation_prompt=False,
            )
        except Exception:  # no chat template: plain LMs end at eos
            return tok.eos_token_id
        tail = text[text.rfind("MARK") + 4 :]
        special = set(tok.all_special_ids) | {
            i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        for i in tok(tail, add_special_tokens=False)["input_ids"]:
            if i in special:
                return int(i)
        return tok.eos_token_id

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
        lora: LoraSpec | None = None,
    ) -> Policy:
        """Load a checkpoint folder, a hub id, or a saved LoRA adapter folder (see mmgrpo.model.io for
        what ``dtype`` means: trained weights stay fp32 and bf16/fp16 is the compute precision)."""
        if looks_like_missing_folder(path):
            raise ConfigError(
                f"model path '{path}' does not exist. Build the embedded model with `mmgrpo tiny-model "
                f"{path}{tiny_model_flags(path)}`, or give an existing checkpoint folder or a hub id such as "
                "Qwen/Qwen2.5-VL-3B-Instruct."
            )
        p = Path(path)
        if p.exists() and not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
            raise ConfigError(
                f"model.path '{path}' is a folder without config.json: it is not a saved model. "
                "Build the embedded one with `mmgrpo tiny-model PATH` or give a hub id / checkpoint folder."
            )
        pk = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        model, processor = load_model(
            path, dtype=dtype, trust_remote_code=trust_remote_code, lora=lora, processor_kwargs=pk
        )
        if gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # the transformers 5 name
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if is_lora(model):
                model.enable_input_require_grads()  # the frozen embeddings must still carry a graph
        model.to(device)
        return cls(model, processor, device=device, precision=PRECISION[dtype])

    @property
    def lora(self) -> bool:
        return is_lora(unwrap(self.model))

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_is_base

    def make_reference(self) -> None:
        """The KL reference: with LoRA, this model with its adapter disabled (no copy); otherwise a frozen
        copy of the current weights."""
        if self.lora:
            self.reference_is_base = True
            return
        ref = copy.deepcopy(unwrap(self.model))
        ref.requires_grad_(False)
        ref.eval()
        if self.offload_reference:
            ref.to("cpu")
        self.reference = ref
        self._reference_vision_frozen = self.vision_frozen

    @contextlib.contextmanager
    def reference_on_device(self):
        """With ``offload_reference``: the reference copy on the device inside the block, back in CPU
        memory after it. Otherwise nothing moves."""
        move = self.offload_reference and self.reference is not None and self.device.type != "cpu"
        if move:
            self.reference.to(self.device)
        try:
            yield
        finally:
            if move:
                self.reference.to("cpu")

    @property
    def vision_frozen(self) -> bool:
        """True when the model has a vision encoder whose features can be cached (see the adapter) and
        none of its parameters (LoRA ones included) trains: an image's features are then the same in every
        pass of a step, for the policy and for the reference alike."""
        if not self.is_vision or not self.adapter.caches_encoder:
            return False
        vision = [p for n, p in self.model.named_parameters() if self.adapter.is_vision_param(n)]
        return bool(vision) and not any(p.requires_grad for p in vision)

    @torch.no_grad()
    def encode_images(self, vision: VisionInputs, *, force: bool = False) -> VisionInputs:
        """``vision`` with each sequence's image features attached, computed once here (one encoder call
        for all its images, no graph), when the encoder is frozen (or ``force``); otherwise ``vision``
        unchanged. Every later forward over these sequences (generation, the reference pass, the training
        passes) then takes the features instead of running the vision tower again."""
        no_cache = vision.empty or vision.has_encoded or not (force or self.vision_frozen)
        if no_cache or holds_shards(self.model):  # FSDP shards, not gathered: the forward encodes
            return vision
        with self.evaluating(), self.autocast():
            encoded = self.adapter.encode_images(self.model, vision, self.device, engine.model_dtype(self.model))
        if encoded is None:
            return vision
        return VisionInputs(vision.seqs, vision.images_per_seq, encoded)

    @contextlib.contextmanager
    def evaluating(self):
        """The model in eval mode for the block, then training mode again if it was in it (a switch walks
        every module: a rollout switches once for all its passes)."""
        model = self.model
        if not model.training:
            yield
            return
        model.eval()
        try:
            yield
        finally:
            model.train()

    def freeze_vision(self) -> int:
        """Stop gradients into the vision encoder; returns how many parameters were frozen."""
        frozen = [p for n, p in self.model.named_parameters() if self.adapter.is_vision_param(n)]
        for p in frozen:
            p.requires_grad_(False)
        return sum(p.numel() for p in frozen)

    def language_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters outside the vision encoder (and its projector), e.g. to train the text side only."""
        return [p for n, p in self.model.named_parameters() if not self.adapter.is_vision_param(n)]

    def param_groups(self, lr: float, vision_lr: float | None = None) -> list[dict]:
        """Optimizer groups of the trainable parameters: the language side at ``lr``, the vision tower and
        projector at ``vision_lr`` (None: the same lr)."""
        lang, vis = [], []
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                (vis if self.adapter.is_vision_param(n) else lang).append(p)
        groups = [{"params": lang, "lr": lr, "name": "language"}]
        if vis:
            groups.append({"params": vis, "lr": lr if vision_lr is None else vision_lr, "name": "vision"})
        return [g for g in groups if g["params"]]

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
        the list of JSON schemas shown to the model: by the template when it has a tools section, else as
        mmgrpo's tools block in the system message or the first user message (see ``tool_placement``)."""
        if tools and self.tool_placement != "template":
            messages = with_tools_block(messages, tools, self.tool_placement)
            tools = None
        return self._apply_template(messages, add_generation_prompt, tools)

    @property
    def tool_placement(self) -> str:
        """Where ``render`` puts ``tools``: "template" (the chat template renders them), "system" or "user"
        (it cannot, and mmgrpo writes them into that message; see mmgrpo.model.tool_prompt). Found once, on a
        probe conversation; ConfigError when the template would hide them wherever they go."""
        if self._tool_placement is None:
            self._tool_placement = find_placement(
                lambda m, t: self._apply_template(m, True, t), self.name_or_path
            )
        return self._tool_placement

    def _apply_template(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None
    ) -> str:
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

    def _tokenize(
        self, texts: list[str], images: list[list], videos: list[list] | None = None
    ) -> tuple[Tensor, Tensor, VisionInputs]:
        """Tokenize texts (left-padded) with their images (and videos) expanded into placeholder tokens.

        Texts that all have images go through the processor at once when the family's adapter can split
        the output per text (Qwen-VL, LLaVA, Gemma 3); otherwise each text with images goes through it on
        its own (Idefics3, videos, mixed batches). Text-only batches are tokenized at once. Both ways give
        the same ids and tensors (tested).
        """
        videos = videos or [[] for _ in texts]
        if (any(images) or any(videos)) and not self.is_vision:
            raise DataError(
                "the environment sent images but the model is text-only: use an image-text-to-text model "
                "(e.g. the tiny Qwen2.5-VL from `mmgrpo tiny-model`) or an environment without images."
            )
        tok = self.tokenizer
        tok.padding_side = "left"
        if not any(images) and not any(videos):
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            return enc["input_ids"], enc["attention_mask"], VisionInputs.none(len(texts))
        counts = [len(a) + len(b) for a, b in zip(images, videos, strict=True)]
        if all(images) and not any(videos) and tok.pad_token_id is not None:  # one processor call, when
            # the family can split its output per text
            enc = self.processor(
                text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False
            )
            seqs = self.adapter.split_vision(enc, counts)
            if seqs is not None:
                return enc["input_ids"], enc["attention_mask"], VisionInputs(seqs, counts)
        rows, seqs = [], []
        for text, ims, vids in zip(texts, images, videos, strict=True):
            kw: dict[str, Any] = {"text": [text], "return_tensors": "pt", "add_special_tokens": False}
            if ims:
                kw["images"] = [ims]  # nested per text: every family's processor takes this form
            if vids:
                kw["videos"] = [vids]
            enc = (
                self.processor(**kw)
                if (ims or vids)
                else tok([text], return_tensors="pt", add_special_tokens=False)
            )
            rows.append(enc["input_ids"][0])
            seqs.append(self.adapter.vision_of(enc) if (ims or vids) else {})
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), self.pad_token_id, dtype=torch.long)  # (B, L) left-padded
        mask = torch.zeros((len(rows), L), dtype=torch.long)  # (B, L)
        for i, r in enumerate(rows):
            ids[i, L - len(r) :] = r
            mask[i, L - len(r) :] = 1
        return ids, mask, VisionInputs(seqs, counts)

    def encode_prompts(
        self, conversations: list[list[dict]], tools: list[list[dict] | None] | None = None
    ) -> tuple[Tensor, Tensor, VisionInputs]:
        """Template and tokenize prompts: ids (B, P) left-padded, mask (B, P), their vision inputs."""
        tools = tools or [None] * len(conversations)
        texts = [self.render(msgs, tools=t) for msgs, t in zip(conversations, tools, strict=True)]
        return self._tokenize(
            texts, [_images_of(m) for m in conversations], [_images_of(m, "video") for m in conversations]
        )

    def encode_continuation(
        self, history: list[dict], new: list[dict], tools: list[dict] | None = None, *, closed: bool = True
    ) -> tuple[list[int], VisionInputs]:
        """Token ids of the environment's ``new`` messages after ``history`` (which ends with the policy's
        turn, whose sampled ids end at the end-of-turn token), up to the next assistant header; and the
        vision inputs of their images (processed once, here).

        ``closed=False``: the sampled turn stopped on another stop id (Qwen's ``<|endoftext|>``), so the
        ids returned first close the turn as the template does (Qwen: ``<|im_end|>\n``); the episode's ids
        are then the template's rendering with the sampled stop token in it.

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
        # the sampled turn ends at a stop token; the template may add text after it (Qwen: "\n")
        ends = [s for s in self.tokenizer.convert_ids_to_tokens(self.stop_ids) if s and s in before]
        cut = max((before.rfind(s) + len(s) for s in ends), default=len(before))
        if not closed and self.end_of_turn_id is not None:
            eot = self.tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
            if eot and eot in before:  # the sampled ids end before the template's turn end: start there
                cut = before.rfind(eot)
        text, images, videos = before[cut:] + after[len(before) :], _images_of(new), _images_of(new, "video")
        return self._continuations.tokenize(text, images, videos, self._tokenize)  # once per content

    @property
    def name_or_path(self) -> str:
        return str(
            getattr(unwrap(self.model).config, "_name_or_path", "") or type(unwrap(self.model)).__name__
        )

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
        use_hf_generate: bool = False,
        return_logprobs: bool = False,
    ):
        """Sample ``num_samples`` continuations of each prompt (temperature 0 = greedy).

        prompt_ids, prompt_mask (B, P) and ``vision`` (one entry per prompt). Returns B * num_samples
        rows, prompt b's samples at rows b*G .. b*G+G-1: the generated ids up to and including the first
        stop token, and whether that token was produced (False: the episode hit max_new_tokens, i.e. it is
        truncated); with ``return_logprobs`` also each sampled token's log-prob. Training and evaluation
        sample through the same loop (mmgrpo.model.engine.generate: each prompt encoded once, the KV cache
        repeated G times); ``use_hf_generate`` runs Hugging Face ``generate`` instead, for comparison only.
        """
        model = self.model
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, num_samples=num_samples)
        if self.sampler is not None and not use_hf_generate:  # an engine in another process (rollout.engine)
            return samplers.engine_generate(self, prompt_ids, prompt_mask, vision, **kw, return_logprobs=return_logprobs)
        with self.evaluating(), self.autocast():
            if use_hf_generate:
                return samplers.hf_generate(self, prompt_ids, prompt_mask, vision, **kw)
            new_ids, logps = engine.generate(
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
                stop_ids=self.stop_ids,
                pad_token_id=self.pad_token_id,
                device=self.device,
                return_logprobs=return_logprobs,
            )
            completions, finished = self._cut_at_stop(new_ids.tolist())
            if return_logprobs:
                lps = [row[: len(c)] for row, c in zip(logps.tolist(), completions, strict=True)]
                return completions, finished, lps
            return completions, finished

    def _cut_at_stop(self, new: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Each row up to and including its first stop token, and whether it had one."""
        stops = set(self.stop_ids)
        completions, finished = [], []
        for row in new:
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), None)
            completions.append(row if cut is None else row[:cut])
            finished.append(cut is not None)
        return completions, finished

    # --------------------------------------------------------------------------------------- log-probs
    def logprobs(
        self,
        batch: TokenBatch,
        *,
        temperature: float = 1.0,
        reference: bool = False,
        share_prompt: bool = True,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        scored: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Per-token log-probs of ``batch.response_ids`` under the policy (or the reference): (N, T).

        Differentiable for the policy; no graph for the reference. Positions outside response_mask (and,
        given ``scored`` (N, T) bool, the positions outside it) hold garbage that callers mask out: the
        head then runs on the scored positions only where it can (``mmgrpo.model.head``). With
        ``share_prompt`` and rows in groups sharing a prompt, each prompt (and its images) is encoded once
        and the G responses run on its key/value cache, tool images included unless the adapter says
        ``images_on_cache = False`` (one full forward per row there). ``with_entropy`` also returns each
        position's entropy of softmax(logits / temperature), (N, T), differentiable with ``entropy_grad``.
        """
        model = self.model if (not reference or self.reference_is_base) else self.reference
        if model is None:
            raise RuntimeError("no reference model: call make_reference() (only needed when beta > 0)")
        if batch.vision.encoded is not None and not self._features_valid_for(reference):
            batch = dataclasses.replace(batch, vision=batch.vision.without_encoded())
        # the shared prefill needs a KV cache, which gradient checkpointing turns off in training passes
        checkpointing = model.training and checkpointing_on(unwrap(model))  # (the check walks the modules)
        images_ok = not batch.has_response_images or self.adapter.images_on_cache
        share = share_prompt and images_ok and not checkpointing and not self.lockstep
        G = batch.shared_prompt_runs() if share else 1
        base = reference and self.reference_is_base
        base_only = unwrap(model).disable_adapter() if base else contextlib.nullcontext()
        with torch.set_grad_enabled(not reference and torch.is_grad_enabled()), base_only, self.autocast():
            some = scored is not None and not self.lockstep  # sharded weights: the head runs inside forward
            parts = openings.opening_parts(batch, self.adapter) if share and G == 1 else None
            if G > 1:
                blocks = shared_spans.response_blocks(model, self.adapter, batch, G, self.device, some)
            elif parts is not None:  # distinct prompts that open alike: each opening encoded once
                blocks = openings.response_blocks_openings(model, self.adapter, batch, parts, self.device, some)
            else:
                blocks = engine.response_blocks_full(model, self.adapter, batch, self.device, some)
            targets, where = batch.response_ids.to(self.device), scored.to(self.device) if some else None
            logp, ent = block_stats(
                blocks, targets, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad, scored=where
            )  # (N, T), (N, T) or None: the entropy of each step
            return (logp, ent) if with_entropy else logp

    def _features_valid_for(self, reference: bool) -> bool:
        """Whether cached image features (computed by the policy's frozen encoder) are what this pass's
        model would compute: the policy's while its encoder stays frozen; the reference's when it shares
        those weights (LoRA's base, or a copy made while the encoder was frozen)."""
        if not self.vision_frozen:
            return False
        return not reference or self.reference_is_base or self._reference_vision_frozen

    # ------------------------------------------------------------------------------------------ saving
    def save(self, out_dir: str | Path, *, merged: bool = False) -> None:
        """Save the model and processor (a LoRA model: its adapter, or the merged model with ``merged``)."""
        save_model(unwrap(self.model), self.processor, out_dir, merged=merged)


def _text_of(content: list[dict] | str) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _images_of(messages: list[dict], kind: str = "image") -> list:
    """The images (or, with kind="video", the videos) of ``messages``' content parts, in order."""
    return [
        p[kind]
        for m in messages
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p.get("type") == kind
    ]

