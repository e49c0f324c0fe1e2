"""Drafter graphs: one EAGLE-3 / EAGLE 3.1 step, and optionally the whole depth-N chain.

Three graphs, all sharing one external weights file:

- `drafter_first`: the first step of a round. Inputs `input_ids` [B, T], `position_ids` [B, T],
  `aux_hidden_states` [B, T, k*Ht] (the target's tapped states), the past KV cache and
  `attention_mask` [B, P+T] (1: a real key; 0: padding, so sequences of different lengths share a
  call: `onnx_layers.attention_bias`).
- `drafter_next`: steps 2..n. Same, but `hidden_states` [B, T, H] (the drafter's own fed-back
  state) replaces the tapped states and no fc is applied.
- `drafter_chain` (with `chain_depth`): the first step plus n-1 fed-back steps unrolled, greedy
  argmax + d2t between steps; one call per speculation round.

Two graphs rather than one with a flag: each is a straight line (no `If` for TensorRT to
handle, no wasted fc GEMM on later steps), and the weights are stored once anyway.

Step outputs: `logits` [B, T, Vd], `target_token_ids` [B, T] (argmax mapped through d2t),
`fed_back_hidden` [B, T, H] (post-norm under `norm_output`, else pre-norm) and `new_key_i` /
`new_value_i` [B, heads, T, dim]: this call's cache entries only, which the caller appends to its
cache (returning past + new would hold a second copy of the whole cache for the length of every
call). The chain returns `draft_logits` [B, n, Vd] and `draft_token_ids` [B, n] for the last
position of every step, and the FIRST step's entries only: the speculation loop cuts the drafter
cache back to the committed positions after each round, so the n-1 speculative entries never leave
the graph.
The chain continues from each sequence's LAST position, so the sequences of one batched chain call
carry the same number of new tokens (no right padding; their caches may still be left-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import onnx
import torch
from onnx import TensorProto

from eagle31_export.config import DrafterConfig
from eagle31_export.errors import UserError
from eagle31_export.export import onnx_layers as L
from eagle31_export.export import onnx_plugins as P
from eagle31_export.export.onnx_graph import ExternalWeights, GraphBuilder, TensorSource, onnx_elem_type
from eagle31_export.kernels.folding import fold_fc_norm_weights
from eagle31_export.reference.rope import attention_factor, cos_sin, inv_frequencies, mla_softmax_scale

INT64 = TensorProto.INT64
B, T, PAST, PRESENT = "batch", "sequence", "past_sequence", "present_sequence"


@dataclass
class StepValues:
    logits: str
    fed_back: str
    caches: list[tuple[str, str]]  # past + this step's entries, per layer: what a next step attends to
    news: list[tuple[str, str]]  # this step's entries only: the graph's outputs


@dataclass(frozen=True)
class SharedWeight:
    """A drafter matrix that comes from the target (embeddings, lm_head): how to read it, its
    checkpoint dtype, and where it is written (`store`/`key`: the target graph's weights file
    and name, so that both graphs read the same bytes; None: the drafter's own file)."""

    source: TensorSource  # as the target holds it: [out, in] for lm_head (transposed where written)
    stored: torch.dtype
    store: ExternalWeights | None = None
    key: str | None = None


class DrafterGraphWriter:
    """Writes drafter graphs from a checkpoint's canonical tensors.

    `tensors` maps canonical names to tensors as stored (a lazy checkpoint mapping is read one
    tensor at a time, when the tensor is written); `shared` supplies the matrices a drafter takes
    from its target. Nothing is converted to the compute dtype before it is written.
    """

    def __init__(self, cfg: DrafterConfig, tensors: Mapping[str, torch.Tensor], weights: ExternalWeights,
                 dtype: torch.dtype, max_positions: int | None = None,
                 shared: Mapping[str, SharedWeight] | None = None, d2t: torch.Tensor | None = None):
        self.cfg = cfg
        self.tensors, self.shared = tensors, dict(shared or {})
        missing = [n for n in ("embed_tokens.weight", "lm_head.weight") if n not in tensors and n not in self.shared]
        if missing:
            raise UserError(f"the drafter has no {missing[0]}; export it together with its target (--target)")
        self.d2t = (d2t if d2t is not None else torch.zeros(cfg.draft_vocab_size)).to(torch.int64)
        # The reference attention's rope and softmax constants (reference.attention), from the config.
        rope_dim = cfg.mla.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
        self.inv_freq = inv_frequencies(rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.rope_scale = attention_factor(cfg.rope_scaling)  # yarn's cos/sin factor
        self.softmax_scale = (mla_softmax_scale(cfg.mla.qk_head_dim, cfg.rope_scaling) if cfg.attention == "mla"
                              else cfg.head_dim ** -0.5)
        self.weights, self.dtype, self.elem = weights, dtype, onnx_elem_type(dtype)
        self.max_positions = max_positions or self.cfg.max_position_embeddings

    # ---- public: the three graphs ---------------------------------------------------------
    def step_graph(self, hidden_is_aux: bool) -> onnx.ModelProto:
        name = "drafter_first" if hidden_is_aux else "drafter_next"
        g = GraphBuilder(name, self.weights)
        ids, positions = self._id_inputs(g)
        hidden = self._hidden_input(g, hidden_is_aux)
        past = self._past_inputs(g)
        out = self._step(g, ids, positions, hidden, hidden_is_aux, past, self._mask_input(g))
        with g.scope("outputs"):
            token_ids = self._to_target_ids(g, g.op("ArgMax", out.logits, axis=-1, keepdims=0))
        g.output(out.logits, "logits", self.elem, [B, T, self.cfg.draft_vocab_size])
        g.output(token_ids, "target_token_ids", INT64, [B, T])
        g.output(out.fed_back, "fed_back_hidden", self.elem, [B, T, self.cfg.hidden_size])
        self._new_kv_outputs(g, out.news)
        doc = ("EAGLE drafter, first step of a round (tapped target states in)" if hidden_is_aux
               else "EAGLE drafter, steps 2..n (fed-back state in)")
        return g.model(P.plugin_functions(g), doc)

    def chain_graph(self, depth: int) -> onnx.ModelProto:
        if depth < 1:
            raise UserError(f"--chain-depth must be >= 1, got {depth}")
        g = GraphBuilder("drafter_chain", self.weights)
        ids, positions = self._id_inputs(g)
        aux = self._hidden_input(g, True)
        past = self._past_inputs(g)
        mask = self._mask_input(g)
        with g.scope("step1"):
            first = self._step(g, ids, positions, aux, True, past, mask)
            logits, token = self._last_greedy(g, first.logits)
            position = g.op("Slice", positions, g.const([-1]), g.const([2**62]), g.const([1]))
            hidden = g.op("Slice", first.fed_back, g.const([-1]), g.const([2**62]), g.const([1]))
        all_logits, all_tokens, kv = [logits], [token], first.caches
        for i in range(2, depth + 1):
            with g.scope(f"step{i}"):
                position = g.op("Add", position, g.const(1))
                mask = L.extend_attention_mask(g, mask)
                out = self._step(g, token, position, hidden, False, kv, mask)
                logits, token = self._last_greedy(g, out.logits)
                hidden, kv = out.fed_back, out.caches
            all_logits.append(logits)
            all_tokens.append(token)
        cat = (lambda xs: g.op("Concat", *xs, axis=1)) if depth > 1 else (lambda xs: xs[0])
        g.output(cat(all_logits), "draft_logits", self.elem, [B, depth, self.cfg.draft_vocab_size])
        g.output(cat(all_tokens), "draft_token_ids", INT64, [B, depth])
        self._new_kv_outputs(g, first.news)
        return g.model(P.plugin_functions(g), f"EAGLE drafter, greedy chain of {depth} steps in one call")

    # ---- inputs / outputs -----------------------------------------------------------------
    def kv_dims(self) -> tuple[int, int, int]:
        """(heads stored in the cache, key dim, value dim)."""
        cfg = self.cfg
        if cfg.attention == "mla":
            return cfg.num_attention_heads, cfg.mla.qk_head_dim, cfg.mla.v_head_dim
        return cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim

    def _id_inputs(self, g: GraphBuilder) -> tuple[str, str]:
        return g.input("input_ids", INT64, [B, T]), g.input("position_ids", INT64, [B, T])

    def _hidden_input(self, g: GraphBuilder, hidden_is_aux: bool) -> str:
        if hidden_is_aux:
            return g.input("aux_hidden_states", self.elem, [B, T, self.cfg.fc_in_features])
        return g.input("hidden_states", self.elem, [B, T, self.cfg.hidden_size])

    def _past_inputs(self, g: GraphBuilder) -> list[tuple[str, str]]:
        heads, kd, vd = self.kv_dims()
        return [(g.input(f"past_key_{i}", self.elem, [B, heads, PAST, kd]),
                 g.input(f"past_value_{i}", self.elem, [B, heads, PAST, vd])) for i in range(self.cfg.num_layers)]

    def _mask_input(self, g: GraphBuilder) -> str:
        return g.input("attention_mask", INT64, [B, PRESENT])

    def _new_kv_outputs(self, g: GraphBuilder, news: list[tuple[str, str]]) -> None:
        heads, kd, vd = self.kv_dims()
        for i, (k, v) in enumerate(news):
            g.output(k, f"new_key_{i}", self.elem, [B, heads, T, kd])
            g.output(v, f"new_value_{i}", self.elem, [B, heads, T, vd])

    # ---- weights --------------------------------------------------------------------------
    def _w(self, g: GraphBuilder, name: str) -> str:
        """A vector (norm scale, bias) in the compute dtype: a few KiB, not worth a Cast."""
        return g.stored(name, lambda: self.tensors[name], self.dtype, stored=self.dtype)[0]

    def _matrix(self, name: str, transposed: bool) -> dict:
        """`GraphBuilder.weight` arguments for a matrix: from the target when shared, else the checkpoint's."""
        shared = self.shared.get(name)
        if shared is None:
            return {"source": (lambda: self.tensors[name].t()) if transposed else (lambda: self.tensors[name])}
        source = shared.source
        return {"source": (lambda: _read(source).t()) if transposed else source, "stored": shared.stored,
                "store": shared.store, "key": shared.key}

    def _linear(self, g: GraphBuilder, x: str, prefix: str) -> str:
        """x @ W.T (+ b); W stored transposed as `<prefix>.weight_t` [in, out]."""
        short = prefix.rsplit(".", 1)[-1]
        y = g.matmul(x, f"{prefix}.weight_t", self.dtype, short, **self._matrix(f"{prefix}.weight", True))
        if f"{prefix}.bias" not in self.tensors:
            return y
        return g.op("Add", y, self._w(g, f"{prefix}.bias"), name=f"{short}_bias")

    def _rope(self, g: GraphBuilder, positions: str) -> tuple[str, str]:
        # Exactly the reference's cos/sin (float64 angles, rounded once to the compute dtype).
        cos, sin = cos_sin(torch.arange(self.max_positions).unsqueeze(0), self.inv_freq, self.dtype, self.rope_scale)
        return L.rope_tables(g, g.tensor("rope.cos", cos[0]), g.tensor("rope.sin", sin[0]), positions)

    def _to_target_ids(self, g: GraphBuilder, draft_ids: str) -> str:
        """d2t is an offset table: target_id = d + d2t[d]."""
        return g.op("Add", draft_ids, g.op("Gather", g.tensor("d2t", self.d2t), draft_ids))

    def _last_greedy(self, g: GraphBuilder, logits: str) -> tuple[str, str]:
        """Logits of the last position [B, 1, Vd] and its greedy draft as a target id [B, 1]."""
        last = g.op("Slice", logits, g.const([-1]), g.const([2**62]), g.const([1]))
        return last, self._to_target_ids(g, g.op("ArgMax", last, axis=-1, keepdims=0))

    # ---- one step -------------------------------------------------------------------------
    def _fuse_taps(self, g: GraphBuilder, aux: str) -> str:
        """Eagle31FcNorm over the tapped states, with the norm weights folded into the fc weight."""
        cfg = self.cfg
        if cfg.fc_norm:
            norm_names = [f"fc_norm.{i}.weight" for i in range(cfg.num_aux_hidden_states)]
            sources = g.op("Split", aux, g.const([cfg.effective_target_hidden_size] * len(norm_names)),
                           outputs=len(norm_names), axis=-1)
            sources = list(sources) if isinstance(sources, tuple) else [sources]
        elif cfg.norm_before_fc:  # one RMSNorm over the whole concatenation: a single source
            norm_names, sources = ["input_norm.weight"], [aux]
        else:
            norm_names, sources = None, [aux]

        def folded() -> torch.Tensor:
            # The norm scales multiply into the weight: new values, so it is written in the compute dtype.
            norms = None if norm_names is None else [self.tensors[n].float() for n in norm_names]
            return fold_fc_norm_weights(self.tensors["fc.weight"].float(), norms, len(sources))

        folded = g.stored("fc.weight_folded", folded, self.dtype, stored=self.dtype)[0]
        return P.fc_norm(g, sources, folded, cfg.rms_norm_eps, has_norm=norm_names is not None)

    def _step(self, g: GraphBuilder, ids: str, positions: str, hidden: str, hidden_is_aux: bool,
              past: list[tuple[str, str]], attention_mask: str) -> StepValues:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        if hidden_is_aux:
            with g.scope("fc"):
                g_state = self._fuse_taps(g, hidden)
        else:
            g_state = hidden
        x = g.embedding("embed_tokens.weight", ids=ids, compute=self.dtype, **self._matrix("embed_tokens.weight", False))
        mask = L.attention_bias(g, L.past_len(g, past[0][0]), ids, attention_mask)
        cos, sin = self._rope(g, positions)
        caches, news = [], []
        for i in range(cfg.num_layers):
            p = f"layers.{i}"
            with g.scope(p):
                if i == 0:  # EAGLE-3's midlayer: attention over cat(norm(embed), norm(g)), width 2H
                    normed_g = L.rms_norm(g, g_state, self._w(g, f"{p}.hidden_norm.weight"), eps, "hidden_norm")
                    residual = normed_g if cfg.norm_before_residual else g_state
                    attn_in = g.op("Concat", L.rms_norm(g, x, self._w(g, f"{p}.input_layernorm.weight"), eps,
                                                      "input_layernorm"), normed_g, axis=-1)
                else:
                    residual, attn_in = x, L.rms_norm(g, x, self._w(g, f"{p}.input_layernorm.weight"), eps,
                                                     "input_layernorm")
                attend = self._mla if cfg.attention == "mla" else self._gqa
                with g.scope("self_attn"):
                    attn, cache, new = attend(g, f"{p}.self_attn", attn_in, cos, sin, past[i], mask)
                caches.append(cache)
                news.append(new)
                h1 = g.op("Add", residual, attn)
                normed = L.rms_norm(g, h1, self._w(g, f"{p}.post_attention_layernorm.weight"), eps,
                                    "post_attention_layernorm")
                update = L.gated_mlp(g, normed, self._linear, f"{p}.mlp", cfg.hidden_act)
                if i + 1 < cfg.num_layers:
                    x = g.op("Add", h1, update)
        with g.scope("norm"):
            normed, fed_back = P.post_norm_feedback(g, h1, update, self._w(g, "norm.weight"), eps, cfg.norm_output)
        with g.scope("lm_head"):
            logits = self._linear(g, normed, "lm_head")
        return StepValues(logits, fed_back, caches, news)

    def _gqa(self, g: GraphBuilder, p: str, x: str, cos: str, sin: str, past: tuple[str, str], mask: str):
        cfg = self.cfg
        heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = L.apply_rope(g, L.split_heads(g, self._linear(g, x, f"{p}.q_proj"), heads, hd), cos, sin, hd)
        k = L.apply_rope(g, L.split_heads(g, self._linear(g, x, f"{p}.k_proj"), kv, hd), cos, sin, hd)
        v = L.split_heads(g, self._linear(g, x, f"{p}.v_proj"), kv, hd)
        cache = L.append_to_cache(g, past, k, v)
        out = L.attention(g, q, *cache, mask, heads, kv, hd, hd, self.softmax_scale)
        return self._linear(g, out, f"{p}.o_proj"), cache, (k, v)

    def _mla(self, g: GraphBuilder, p: str, x: str, cos: str, sin: str, past: tuple[str, str], mask: str):
        """DeepSeek-V2 MLA as `reference.attention.MlaAttention` (expanded per-head cache)."""
        m, h, eps = self.cfg.mla, self.cfg.num_attention_heads, self.cfg.rms_norm_eps
        if m.q_lora_rank:
            q = self._linear(g, L.rms_norm(g, self._linear(g, x, f"{p}.q_a_proj"),
                                           self._w(g, f"{p}.q_a_layernorm.weight"), eps, "q_a_layernorm"),
                             f"{p}.q_b_proj")
        else:
            q = self._linear(g, x, f"{p}.q_proj")
        q_nope, q_pe = g.op("Split", L.split_heads(g, q, h, m.qk_head_dim),
                            g.const([m.qk_nope_head_dim, m.qk_rope_head_dim]), outputs=2, axis=-1)
        latent, k_pe = g.op("Split", self._linear(g, x, f"{p}.kv_a_proj_with_mqa"),
                            g.const([m.kv_lora_rank, m.qk_rope_head_dim]), outputs=2, axis=-1)
        kv = self._linear(g, L.rms_norm(g, latent, self._w(g, f"{p}.kv_a_layernorm.weight"), eps, "kv_a_layernorm"),
                          f"{p}.kv_b_proj")
        k_nope, v = g.op("Split", L.split_heads(g, kv, h, m.qk_nope_head_dim + m.v_head_dim),
                         g.const([m.qk_nope_head_dim, m.v_head_dim]), outputs=2, axis=-1)
        # Checkpoints store rope dims as interleaved (re, im) pairs: reorder to the rotate_half layout.
        order = g.const(list(range(0, m.qk_rope_head_dim, 2)) + list(range(1, m.qk_rope_head_dim, 2)))
        q_pe = L.apply_rope(g, g.op("Gather", q_pe, order, axis=-1), cos, sin, m.qk_rope_head_dim)
        k_pe = g.op("Unsqueeze", g.op("Gather", k_pe, order, axis=-1), g.const([1]))  # one shared head
        k_pe = L.apply_rope(g, k_pe, cos, sin, m.qk_rope_head_dim)
        heads_shape = g.op("Concat", g.op("Shape", k_nope, start=0, end=3), g.const([m.qk_rope_head_dim]), axis=0)
        k = g.op("Concat", k_nope, g.op("Expand", k_pe, heads_shape), axis=-1)
        cache = L.append_to_cache(g, past, k, v)
        out = L.attention(g, g.op("Concat", q_nope, q_pe, axis=-1), *cache, mask, h, h, m.qk_head_dim,
                          m.v_head_dim, self.softmax_scale)
        return self._linear(g, out, f"{p}.o_proj"), cache, (k, v)


def _read(source: TensorSource) -> torch.Tensor:
    return source() if callable(source) else source
