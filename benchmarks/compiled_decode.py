"""What a compiled decode step would buy on this CPU: the same step eager and through torch.compile.

    python benchmarks/compiled_decode.py                     # the tiny model's shapes, 32 and 64 rows
    python benchmarks/compiled_decode.py --rows 32 --model PATH   # another model's shapes (its config only)

The step is the best case for compilation: one new token per row through every decoder layer of a
Llama-style stack (RMS norm, q/k/v as one product with bias, rotation, grouped-query attention over a
static cache of ``--cache`` columns, o, gated MLP, final norm, LM head), written in plain tensor
operations with fixed shapes and no Python objects in the way, so that ``torch.compile(fullgraph=True,
dynamic=False)`` takes it as one graph. mmgrpo's own decode step (``mmgrpo/model/lean.py``) holds each
group's prompt once and grows a Hugging Face cache; a compiled version of it would need a static cache and
fixed shapes first, and could not do better than this one. The weights are random (the time does not depend
on them); the shapes come from the model's config: the tiny Qwen2.5-VL that mmgrpo builds (built in a
temporary folder), or ``--model``.

One thread; eager and compiled timed alternately, ``--rounds`` times each, the medians compared. Prints
``compiled_decode: rows=<n> eager_us=<x> compiled_us=<y> ratio=<y/x> compile_s=<s>`` per row count.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor


def text_dims(model: str | None) -> dict[str, int]:
    """Hidden size, layers, heads, head size, MLP width and vocabulary of ``model``'s text stack (the tiny
    Qwen2.5-VL when None)."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from mmgrpo.tiny.vlm import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
        c = AutoConfig.from_pretrained(model).get_text_config()
    heads = c.num_attention_heads
    return {
        "hidden": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        "mlp": c.intermediate_size,
        "vocab": c.vocab_size,
    }


class Step:
    """One decode step of random weights with the shapes ``dims``, for ``rows`` rows and a static cache of
    ``cache`` columns; ``__call__(ids, cos, sin, mask, col)`` writes column ``col`` and returns (rows, V)."""

    def __init__(self, dims: dict[str, int], rows: int, cache: int) -> None:
        g = torch.Generator().manual_seed(0)
        H, L, D = dims["hidden"], dims["layers"], dims["head_dim"]
        self.Hq, self.Hk, self.D, self.H = dims["heads"], dims["kv_heads"], D, H
        width = (self.Hq + 2 * self.Hk) * D

        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g) * 0.02

        self.layers = [
            {
                "qkv": rand(width, H),
                "qkv_bias": rand(width),
                "o": rand(H, self.Hq * D),
                "gate_up": rand(2 * dims["mlp"], H),
                "down": rand(H, dims["mlp"]),
                "norm1": torch.ones(H),
                "norm2": torch.ones(H),
            }
            for _ in range(L)
        ]
        self.embed, self.norm = rand(dims["vocab"], H), torch.ones(H)
        self.keys = [torch.zeros(rows, self.Hk, cache, D) for _ in range(L)]  # (N, Hk, C, D) each
        self.values = [torch.zeros(rows, self.Hk, cache, D) for _ in range(L)]

    def __call__(self, ids: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, col: Tensor) -> Tensor:
        """ids (N,), cos / sin (N, 1, 1, D), mask (N, 1, 1, C) bool, col (1,) the column written."""
        N, Hq, Hk, D, H = ids.shape[0], self.Hq, self.Hk, self.D, self.H
        h = F.embedding(ids, self.embed)  # (N, H)
        for w, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            x = F.rms_norm(h, (H,), w["norm1"], 1e-6)
            q, k, v = F.linear(x, w["qkv"], w["qkv_bias"]).split([Hq * D, Hk * D, Hk * D], dim=-1)
            qk = torch.cat([q, k], dim=-1).view(N, Hq + Hk, 1, D)  # (N, Hq + Hk, 1, D)
            a, b = qk.chunk(2, dim=-1)
            q, k = (qk * cos + torch.cat((-b, a), dim=-1) * sin).split([Hq, Hk], dim=1)
            keys.index_copy_(2, col, k)  # (N, Hk, C, D)
            values.index_copy_(2, col, v.view(N, Hk, 1, D))
            q = q.reshape(N, Hk, Hq // Hk, D)  # a key/value head's query heads as query rows
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (N, Hk, Hq/Hk, D)
            h = h + F.linear(out.reshape(N, Hq * D), w["o"])
            gate, up = F.linear(F.rms_norm(h, (H,), w["norm2"], 1e-6), w["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down"])
        return F.linear(F.rms_norm(h, (H,), self.norm, 1e-6), self.embed)  # (N, V)


def measure(dims: dict[str, int], rows: int, cache: int, calls: int, rounds: int) -> dict[str, float]:
    """Eager and compiled microseconds per step (medians of ``rounds`` alternated rounds of ``calls``),
    and the seconds of the first compiled call."""
    step = Step(dims, rows, cache)
    D = dims["head_dim"]
    ids = torch.randint(0, dims["vocab"], (rows,), generator=torch.Generator().manual_seed(1))
    angle = torch.rand(rows, 1, 1, D, generator=torch.Generator().manual_seed(2))
    args = (
        ids,
        angle.cos(),
        angle.sin(),
        torch.ones(rows, 1, 1, cache, dtype=torch.bool),
        torch.tensor([cache // 2]),
    )
    compiled = torch.compile(step.__call__, fullgraph=True, dynamic=False)
    with torch.no_grad():
        t = time.perf_counter()
        compiled(*args)
        compile_s = time.perf_counter() - t
        same = torch.allclose(compiled(*args), step(*args), rtol=1e-4, atol=1e-5)
        if not same:
            raise RuntimeError("compiled_decode: the compiled step's logits differ from the eager step's")
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(rounds):
            for name, fn in (("eager", step), ("compiled", compiled)):
                for _ in range(5):
                    fn(*args)
                t = time.perf_counter()
                for _ in range(calls):
                    fn(*args)
                times[name].append((time.perf_counter() - t) / calls * 1e6)
    eager, comp = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"eager_us": eager, "compiled_us": comp, "ratio": comp / eager, "compile_s": compile_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64], help="rows decoding (B x G)")
    ap.add_argument("--cache", type=int, default=100, help="cache columns (prompt + tokens so far)")
    ap.add_argument("--model", default=None, help="take the shapes from this checkpoint's config")
    ap.add_argument("--calls", type=int, default=200, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds, eager then compiled")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dims = text_dims(args.model)
    print("shapes: " + ", ".join(f"{k} {v}" for k, v in dims.items()) + f"; cache {args.cache}; one thread")
    for rows in args.rows:
        r = measure(dims, rows, args.cache, args.calls, args.rounds)
        print(
            f"compiled_decode: rows={rows} eager_us={r['eager_us']:.0f} compiled_us={r['compiled_us']:.0f} "
            f"ratio={r['ratio']:.2f} compile_s={r['compile_s']:.1f}"
        )


if __name__ == "__main__":
    main()
