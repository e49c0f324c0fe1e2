"""Drafter attention with its own KV cache: GQA (Llama) and MLA (DeepSeek-V2 / Kimi)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from eagle31_export.config import DrafterConfig
from eagle31_export.reference.ops import RMSNorm
from eagle31_export.reference.rope import apply_rope, attention_factor, cos_sin, inv_frequencies, mla_softmax_scale


class KVCache:
    """Per-layer key/value tensors [B, heads, S, dim], appended per call, cropped on rejection.

    `recorder` (opt-in, None by default): a callable `recorder(layer_id, probs)` that receives each
    attention call's softmax probabilities [B, heads, T, S] (`diagnose` measures where the drafter
    looks). The attention output is computed as without it, so recording changes no numerics.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.recorder = None

    def length(self, layer: int = 0) -> int:
        """Cached positions of `layer`; layer 0 by default (all layers agree between calls)."""
        if len(self.keys) <= layer or self.keys[layer] is None:
            return 0
        return self.keys[layer].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]


def causal_mask(q_len: int, past: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """Additive mask [q_len, past + q_len]: query j sees every cached key and new keys <= j."""
    allowed = torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) [B, heads, T, S], the weights `scaled_dot_product_attention` applies."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale + mask.double()
    return torch.softmax(scores, dim=-1)


def _attend(cache: KVCache, layer_id: int, q, k, v, past: int, scale: float) -> torch.Tensor:
    """SDPA over the cache; keys/values may have fewer heads than q (grouped: SDPA reads each group in
    place, with the numbers of repeating it per query head, without a [heads, S, dim] copy)."""
    recorder = getattr(cache, "recorder", None)  # any cache object with keys/values will do
    t, grouped = q.shape[2], k.shape[1] != q.shape[1]
    if recorder is None and (t == 1 or past == 0):
        # No [T, S] mask where SDPA's own causal rule is the same (a prompt: no past; one query: every
        # key): torch then runs a kernel that never holds the scores (a 16k prompt's mask alone is 1 GiB).
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=scale, enable_gqa=grouped)
    mask = causal_mask(t, past, q.dtype, q.device)
    if recorder is not None:
        rep = q.shape[1] // k.shape[1]
        recorder(layer_id, attention_probabilities(q, k.repeat_interleave(rep, dim=1), mask, scale))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)


class GqaAttention(nn.Module):
    """Llama-style grouped-query attention; `in_features` is 2H in the EAGLE-3 first layer."""

    def __init__(self, cfg: DrafterConfig, layer_id: int, in_features: int):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.register_buffer("inv_freq", inv_frequencies(self.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                         cfg.max_position_embeddings), persistent=False)
        self.rope_scale = attention_factor(cfg.rope_scaling)
        self.softmax_scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin(positions, self.inv_freq, x.dtype, self.rope_scale)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = cache.length(self.layer_id)
        k, v = cache.append(self.layer_id, k, v)
        out = _attend(cache, self.layer_id, q, k, v, past, self.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MlaAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention (the Kimi K2.x `eagle3.1-mla` drafter).

    The cache holds the expanded per-head keys/values: the reference favours clarity over the
    latent-cache trick, which does not change the result.
    """

    def __init__(self, cfg: DrafterConfig, layer_id: int, in_features: int):
        super().__init__()
        m = cfg.mla
        self.layer_id, self.heads, self.m = layer_id, cfg.num_attention_heads, m
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(in_features, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.heads * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(in_features, self.heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * m.v_head_dim, cfg.hidden_size, bias=False)
        self.register_buffer("inv_freq", inv_frequencies(m.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                         cfg.max_position_embeddings), persistent=False)
        self.rope_scale = attention_factor(cfg.rope_scaling)
        self.softmax_scale = mla_softmax_scale(m.qk_head_dim, cfg.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        b, t, _ = x.shape
        m, h = self.m, self.heads
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, h, m.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        k_nope, v = kv.view(b, t, h, -1).transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        cos, sin = cos_sin(positions, self.inv_freq, x.dtype, self.rope_scale)
        q_pe = apply_rope(_deinterleave(q_pe), cos, sin)
        k_pe = apply_rope(_deinterleave(k_pe.unsqueeze(1)), cos, sin).expand(b, h, t, m.qk_rope_head_dim)
        past = cache.length(self.layer_id)
        k, v = cache.append(self.layer_id, torch.cat([k_nope, k_pe], -1), v)
        q = torch.cat([q_nope, q_pe], -1)
        out = _attend(cache, self.layer_id, q, k, v, past, self.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * m.v_head_dim))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    # DeepSeek's checkpoints store rope dims as interleaved (re, im) pairs; reorder to the
    # rotate_half layout (all re, then all im) before applying rope.
    d = x.shape[-1]
    return x.view(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)
