"""Target graph: a transformers causal LM (Llama, Mistral, Qwen2, Qwen3) with taps and KV cache.

Inputs `input_ids` [B, T], `position_ids` [B, T], `past_key_i` / `past_value_i` [B, kv, P, hd] and
`attention_mask` [B, P+T] (1: a real key; 0: padding of a batch of sequences of different lengths,
`onnx_layers.attention_bias`); outputs `logits` [B, T, V], `aux_hidden_states` [B, T, k*H] (the
OUTPUT of each tapped layer, concatenated in `aux_layer_ids` order, as
`reference.target.ReferenceTarget` returns them) and `new_key_i` / `new_value_i` [B, kv, T, hd],
this call's cache entries only: the caller appends them to its cache (`onnx_drafter` says why).

The graph is written from the module's weights op by op (not traced), mirroring transformers'
Llama / Qwen forward: RMSNorm in fp32, rotate-half rope from the model's own rotary tables,
grouped-query attention with fp32 softmax, gated MLP. NVFP4 Linears use `onnx_nvfp4`.
"""

from __future__ import annotations

from typing import Mapping

import onnx
import torch
from onnx import TensorProto
from torch import nn

from eagle31_export.errors import UserError
from eagle31_export.export import onnx_layers as L
from eagle31_export.export import onnx_nvfp4 as Q
from eagle31_export.export.onnx_drafter import SharedWeight
from eagle31_export.export.onnx_graph import ExternalWeights, GraphBuilder, onnx_elem_type
from eagle31_export.reference.target import decoder_layers

INT64 = TensorProto.INT64
B, T, PAST, PRESENT = "batch", "sequence", "past_sequence", "present_sequence"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def graph_problem(config: dict) -> str | None:
    """Why this graph writer does not model a target, from config.json alone (None: it does)."""
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    family = text.get("model_type", config.get("model_type", "?"))
    if family not in FAMILIES:
        return f"target model_type {family!r} has no ONNX export here (supported: {', '.join(FAMILIES)})"
    if "sliding_attention" in (text.get("layer_types") or []):
        return "the target uses sliding-window attention layers, which the ONNX target graph does not model"
    return None


class TargetGraphWriter:
    def __init__(self, model: nn.Module, aux_layer_ids: tuple[int, ...], weights: ExternalWeights,
                 dtype: torch.dtype, nvfp4: dict[str, Q.Nvfp4Weight] | None = None, flavor: str = "onnxruntime",
                 max_positions: int | None = None, stored: Mapping[str, torch.dtype] | None = None):
        """`stored`: each weight's dtype in the checkpoint (default: as the model holds it), which
        the graph keeps for its matrices (see onnx_graph.storage_dtype)."""
        self.config = model.config.get_text_config()
        family = getattr(self.config, "model_type", "?")
        if family not in FAMILIES:
            raise UserError(f"target model_type {family!r} has no ONNX export here (supported: {', '.join(FAMILIES)})")
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or []):
            raise UserError("the target uses sliding-window attention layers, which the ONNX target graph does not model")
        if flavor not in Q.FLAVORS:
            raise UserError(f"unknown --flavor {flavor!r}; choose one of {', '.join(Q.FLAVORS)}")
        self.model, self.aux_layer_ids = model, tuple(aux_layer_ids)
        self.layers = decoder_layers(model)
        bad = [i for i in self.aux_layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise UserError(f"tapped layer ids {bad} out of range for a target with {len(self.layers)} layers")
        # Views of the model's parameters (no copy): each is converted as it is written.
        self.state = {k: v.detach() for k, v in model.state_dict().items()}
        self.stored_dtypes = dict(stored or {})
        self.prefix = _layers_prefix(self.state, len(self.layers))
        self.weights, self.dtype, self.elem = weights, dtype, onnx_elem_type(dtype)
        self.nvfp4, self.flavor = dict(nvfp4 or {}), flavor
        modules = {name for name, _ in model.named_modules()}
        unknown = [m for m in self.nvfp4 if m not in modules]
        if unknown:
            raise UserError(f"NVFP4 modules {unknown[:3]} are not Linear layers of the loaded target")
        self.max_positions = max_positions or int(self.config.max_position_embeddings)
        self.heads = self.config.num_attention_heads
        self.kv_heads = getattr(self.config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.heads

    def graph(self) -> onnx.ModelProto:
        cfg, eps = self.config, self.config.rms_norm_eps
        g = GraphBuilder("target", self.weights)
        ids, positions = g.input("input_ids", INT64, [B, T]), g.input("position_ids", INT64, [B, T])
        past = [(g.input(f"past_key_{i}", self.elem, [B, self.kv_heads, PAST, self.head_dim]),
                 g.input(f"past_value_{i}", self.elem, [B, self.kv_heads, PAST, self.head_dim]))
                for i in range(len(self.layers))]
        attention_mask = g.input("attention_mask", INT64, [B, PRESENT])
        x = g.embedding(self._embed_name(), ids=ids, compute=self.dtype, **self._matrix(self._embed_name(), False))
        mask = L.attention_bias(g, L.past_len(g, past[0][0]), ids, attention_mask)
        cos, sin = self._rope(g, positions)
        taps, news = {}, []
        for i in range(len(self.layers)):
            p = f"{self.prefix}.{i}"
            with g.scope(p):
                normed = L.rms_norm(g, x, self._w(g, f"{p}.input_layernorm.weight"), eps, "input_layernorm")
                with g.scope("self_attn"):
                    attn, new = self._attention(g, f"{p}.self_attn", normed, cos, sin, past[i], mask)
                news.append(new)
                x = g.op("Add", x, attn)
                normed = L.rms_norm(g, x, self._w(g, f"{p}.post_attention_layernorm.weight"), eps,
                                    "post_attention_layernorm")
                x = g.op("Add", x, L.gated_mlp(g, normed, self._linear, f"{p}.mlp", cfg.hidden_act))
            if i in self.aux_layer_ids:
                taps[i] = x  # output of layer i: the residual stream after it, before the final norm
        with g.scope("lm_head"):
            logits = self._linear(g, L.rms_norm(g, x, self._w(g, f"{self._base()}.norm.weight"), eps, "norm"), "lm_head")
        aux = [taps[i] for i in self.aux_layer_ids]
        g.output(logits, "logits", self.elem, [B, T, cfg.vocab_size])
        g.output(g.op("Concat", *aux, axis=-1) if len(aux) > 1 else aux[0], "aux_hidden_states", self.elem,
                 [B, T, len(aux) * cfg.hidden_size])
        for i, (k, v) in enumerate(news):
            g.output(k, f"new_key_{i}", self.elem, [B, self.kv_heads, T, self.head_dim])
            g.output(v, f"new_value_{i}", self.elem, [B, self.kv_heads, T, self.head_dim])
        functions = [Q.dequantize_function()] if self.nvfp4 and self.flavor == "onnxruntime" else []
        quant = f", NVFP4 weights ({self.flavor} flavour)" if self.nvfp4 else ""
        return g.model(functions, f"{cfg.model_type} target, taps at outputs of layers {list(self.aux_layer_ids)}{quant}")

    # ---- pieces ---------------------------------------------------------------------------
    def _base(self) -> str:
        return self.prefix.rsplit(".", 1)[0]  # "model" for model.layers

    def _embed_name(self) -> str:
        return f"{self._base()}.embed_tokens.weight"

    def shared_weights(self, draft_lm_head: bool) -> dict[str, SharedWeight]:
        """What a drafter without its own embeddings (and, with `draft_lm_head`, lm_head) reads
        from this graph's weights file: the same tensors, under the names this graph gives them."""
        embed = self._embed_name()
        out = {"embed_tokens.weight": SharedWeight(self.state[embed], self._stored(embed), self.weights, embed)}
        if draft_lm_head:
            if "lm_head" in self.nvfp4:  # packed here: the drafter keeps a dense copy of its own
                out["lm_head.weight"] = SharedWeight(lambda: self._dense("lm_head"), self.dtype)
            else:
                out["lm_head.weight"] = SharedWeight(self.state["lm_head.weight"], self._stored("lm_head.weight"),
                                                     self.weights, "lm_head.weight_t")
        return out

    def _dense(self, module: str) -> torch.Tensor:
        """The dense weight of a Linear, also of one the model keeps packed."""
        m = self.model.get_submodule(module)
        return m.dense_weight(self.dtype) if hasattr(m, "dense_weight") else self.state[f"{module}.weight"]

    def _stored(self, name: str) -> torch.dtype:
        return self.stored_dtypes.get(name, self.state[name].dtype)

    def _matrix(self, name: str, transposed: bool) -> dict:
        return {"source": (lambda: self.state[name].t()) if transposed else self.state[name],
                "stored": self._stored(name)}

    def _w(self, g: GraphBuilder, name: str) -> str:
        """A vector (norm scale, bias) in the compute dtype: a few KiB, not worth a Cast."""
        return g.stored(name, self.state[name], self.dtype, stored=self.dtype)[0]

    def _linear(self, g: GraphBuilder, x: str, module: str) -> str:
        short = module.rsplit(".", 1)[-1]
        if module in self.nvfp4:
            with g.scope(short):
                w = Q.dequantized_weight(g, module, self.nvfp4[module], self.flavor, after=x)
                w_t = g.op("CastLike", g.op("Transpose", w, perm=[1, 0]), x)
            y = g.op("MatMul", x, w_t, name=short)
        else:
            y = g.matmul(x, f"{module}.weight_t", self.dtype, short, **self._matrix(f"{module}.weight", True))
        return y if f"{module}.bias" not in self.state else \
            g.op("Add", y, self._w(g, f"{module}.bias"), name=f"{short}_bias")

    def _rope(self, g: GraphBuilder, positions: str) -> tuple[str, str]:
        # The model's own rotary module makes the tables: every rope type and attention scaling it
        # supports comes out exactly as in its forward.
        rotary = getattr(self.model.get_decoder(), "rotary_emb", None)
        if rotary is None:
            raise UserError(f"{type(self.model).__name__} has no rotary_emb module; cannot build rope tables")
        pos = torch.arange(self.max_positions).unsqueeze(0)
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=self.dtype), pos)
        return L.rope_tables(g, g.tensor("rope.cos", cos[0].to(self.dtype)), g.tensor("rope.sin", sin[0].to(self.dtype)),
                             positions)

    def _attention(self, g: GraphBuilder, p: str, x: str, cos: str, sin: str, past: tuple[str, str], mask: str):
        heads, kv, hd, eps = self.heads, self.kv_heads, self.head_dim, self.config.rms_norm_eps
        q = self._linear(g, x, f"{p}.q_proj")
        k = self._linear(g, x, f"{p}.k_proj")
        if f"{p}.q_norm.weight" in self.state:  # Qwen3: RMSNorm over each head before rope
            q = L.rms_norm(g, g.op("Reshape", q, g.const([0, 0, heads, hd])), self._w(g, f"{p}.q_norm.weight"), eps,
                           "q_norm")
            k = L.rms_norm(g, g.op("Reshape", k, g.const([0, 0, kv, hd])), self._w(g, f"{p}.k_norm.weight"), eps,
                           "k_norm")
        q = L.apply_rope(g, L.split_heads(g, q, heads, hd), cos, sin, hd)
        k = L.apply_rope(g, L.split_heads(g, k, kv, hd), cos, sin, hd)
        v = L.split_heads(g, self._linear(g, x, f"{p}.v_proj"), kv, hd)
        scale = getattr(self.layers[0].self_attn, "scaling", hd ** -0.5)
        out = L.attention(g, q, *L.append_to_cache(g, past, k, v), mask, heads, kv, hd, hd, scale)
        return self._linear(g, out, f"{p}.o_proj"), (k, v)


def _layers_prefix(state: dict, n: int) -> str:
    for prefix in ("model.layers", "model.language_model.layers"):
        if f"{prefix}.{n - 1}.input_layernorm.weight" in state:
            return prefix
    raise UserError("cannot find the decoder layer weights (model.layers.N.*) of the target")
