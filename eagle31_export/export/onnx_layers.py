"""Transformer pieces shared by the drafter and target graphs, in standard ONNX ops.

Each function mirrors one reference computation (`reference/ops.py`, `reference/attention.py`,
`reference/rope.py`) and takes / returns value names of a `GraphBuilder`.

Layout conventions: activations [B, T, H]; per-head tensors [B, heads, T, dim]; KV cache
[B, kv_heads, S, dim] (the reference `KVCache` and transformers' cache use the same).
Linear weights are stored transposed, [in, out], so that a linear layer is one MatMul.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from eagle31_export.errors import UserError
from eagle31_export.export.onnx_graph import GraphBuilder

FLOAT = TensorProto.FLOAT


def rms_norm(g: GraphBuilder, x: str, weight: str | None, eps: float, name: str = "rms_norm") -> str:
    """HF RMSNorm: normalise in fp32, round back to the input type, then scale by the weight."""
    with g.scope(name):
        xf = g.op("Cast", x, to=FLOAT)
        ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const([-1]), keepdims=1)
        inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(eps, np.float32))))
        normed = g.op("CastLike", g.op("Mul", xf, inv), x)
        return normed if weight is None else g.op("Mul", weight, normed)


def activation(g: GraphBuilder, x: str, kind: str) -> str:
    if kind == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    if kind in ("gelu", "gelu_pytorch_tanh"):
        return g.op("Gelu", x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")
    if kind == "relu":
        return g.op("Relu", x)
    raise UserError(f"activation {kind!r} has no ONNX lowering here (supported: silu, gelu, gelu_pytorch_tanh, relu)")


def gated_mlp(g: GraphBuilder, x: str, linear, prefix: str, act: str) -> str:
    """down(act(gate(x)) * up(x)); `linear(g, x, name)` applies the weight named `name`."""
    with g.scope("mlp"):
        gate = activation(g, linear(g, x, f"{prefix}.gate_proj"), act)
        return linear(g, g.op("Mul", gate, linear(g, x, f"{prefix}.up_proj")), f"{prefix}.down_proj")


# ---- positions, masks, rope -------------------------------------------------------------------

def past_len(g: GraphBuilder, past_key: str) -> str:
    """S of a [B, heads, S, dim] cache tensor, as a 1-element int64 tensor."""
    return g.op("Shape", past_key, start=2, end=3)


def attention_bias(g: GraphBuilder, past: str, ids: str, attention_mask: str) -> str:
    """Additive fp32 mask [B, 1, T, P+T]: query j (at cache index P+j) sees key k where k <= P+j
    (causal, from cache lengths, as `reference.attention.causal_mask`) and `attention_mask` [B, P+T]
    marks k 1.

    0 marks padding, which is what lets sequences of different lengths share one call: each
    sequence's cache is left-padded to the longest (its real keys end at P) and its new tokens
    right-padded (they start at P). A padding query row still sees its sequence's first new key, so
    no row is all -inf; its outputs are dropped by the caller. Key and query indices are counted
    along `attention_mask` and `ids` (CumSum) rather than made with Range from their lengths, so
    every shape follows from the inputs' shapes (TensorRT's profiles, shape inference).
    """
    with g.scope("attention_bias"):
        def index(x: str) -> str:  # 0, 1, 2, ... along axis 1 of x, shaped like x
            ones = g.op("Cast", g.op("Equal", x, x), to=TensorProto.INT64)
            return g.op("Sub", g.op("CumSum", ones, g.const(1)), g.const(1))

        keys = g.op("Unsqueeze", index(attention_mask), g.const([1]))  # [B, 1, P+T]
        queries = g.op("Unsqueeze", g.op("Add", index(ids), past), g.const([2]))  # [B, T, 1]
        real = g.op("Unsqueeze", g.op("Not", g.op("Equal", attention_mask, g.const(0))), g.const([1]))
        allowed = g.op("And", g.op("LessOrEqual", keys, queries), real)  # [B, T, P+T]
        bias = g.op("Where", allowed, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
        return g.op("Unsqueeze", bias, g.const([1]))


def extend_attention_mask(g: GraphBuilder, attention_mask: str) -> str:
    """`attention_mask` [B, K] -> [B, K+1] with the new key marked real (a chain's next step)."""
    batch = g.op("Shape", attention_mask, start=0, end=1)
    ones = g.op("Expand", g.const([[1]]), g.op("Concat", batch, g.const([1]), axis=0))
    return g.op("Concat", attention_mask, ones, axis=1)


def rope_tables(g: GraphBuilder, cos_table: str, sin_table: str, positions: str) -> tuple[str, str]:
    """Gather cos/sin rows [max_pos, dim] by position ids [B, T] -> [B, 1, T, dim] (broadcast over heads).

    Tables are precomputed at export time exactly as the reference computes them (float64 angles,
    rounded once), so ONNX Runtime sees bit-identical rotations.
    """
    with g.scope("rope"):
        axis1 = g.const([1])
        return (g.op("Unsqueeze", g.op("Gather", cos_table, positions), axis1),
                g.op("Unsqueeze", g.op("Gather", sin_table, positions), axis1))


def apply_rope(g: GraphBuilder, x: str, cos: str, sin: str, dim: int) -> str:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])."""
    first, second = g.op("Split", x, g.const([dim // 2, dim // 2]), outputs=2, axis=-1)
    rotated = g.op("Concat", g.op("Neg", second), first, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


# ---- attention ------------------------------------------------------------------------------

def split_heads(g: GraphBuilder, x: str, heads: int, dim: int) -> str:
    """[B, T, heads*dim] -> [B, heads, T, dim]."""
    return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, heads, dim])), perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str, heads: int, dim: int) -> str:
    """[B, heads, T, dim] -> [B, T, heads*dim]."""
    return g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 1, 3]), g.const([0, 0, heads * dim]))


def append_to_cache(g: GraphBuilder, past: tuple[str, str], k: str, v: str) -> tuple[str, str]:
    """(past keys + k, past values + v) along the sequence axis of [B, heads, S, dim]: what this call
    attends to. The graphs output k and v alone; the caller appends them to the cache it holds."""
    return g.op("Concat", past[0], k, axis=2), g.op("Concat", past[1], v, axis=2)


def attention(g: GraphBuilder, q: str, k: str, v: str, mask: str, heads: int, kv_heads: int,
              qk_dim: int, v_dim: int, scale: float | None = None) -> str:
    """Causal (grouped-query) attention over the whole cache; returns [B, T, heads*v_dim]. `mask`:
    the additive [B, 1, T, P+T] of `attention_bias`.

    Query heads are grouped per KV head ([B, kv, rep*T, dim]) instead of repeating K/V: the same
    result as `repeat_interleave` + SDPA without materialising repeated keys. Scores are
    softmaxed in fp32 (as transformers' eager attention does), then rounded to the input type.
    """
    if heads % kv_heads:
        raise UserError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    rep = heads // kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(qk_dim)
    with g.scope("attention"):
        grouped = g.op("Reshape", q, g.const([0, kv_heads, -1, qk_dim])) if rep > 1 else q
        scores = g.op("MatMul", grouped, g.op("Transpose", k, perm=[0, 1, 3, 2]))
        scores = g.op("Mul", g.op("Cast", scores, to=FLOAT), g.const(scale, np.float32))
        full_mask = g.op("Tile", mask, g.const([1, 1, rep, 1])) if rep > 1 else mask
        probs = g.op("CastLike", g.op("Softmax", g.op("Add", scores, full_mask), axis=-1), q)
        out = g.op("MatMul", probs, v)
        if rep > 1:
            out = g.op("Reshape", out, g.const([0, heads, -1, v_dim]))
        return merge_heads(g, out, heads, v_dim)
