"""Teacher-forced chain drafting ("training-time test") over whole sequences at once.

For every anchor position j, step k of the chain sits at position j+k, reads the REAL token
j+1+k, and consumes the drafter's own fed-back state from step k-1; it attends to the step-0
keys at positions <= j plus its own chain's keys from steps 1..k. That is exactly the cache the
reference drafter holds when it drafts from position j at inference (a test checks it), so the
same function serves training and per-position agreement on held-out text.
"""

from __future__ import annotations

import torch

from eagle31_export.reference.attention import MlaAttention, _deinterleave
from eagle31_export.reference.drafter import Eagle3Drafter
from eagle31_export.reference.rope import apply_rope, cos_sin


def ttt_forward(drafter: Eagle3Drafter, taps: torch.Tensor, x: torch.Tensor, unroll: int,
                anchors: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Training-time test: draft logits [B, T, Vd] for each of `unroll` chained steps.

    Step k at chain anchor j sits at position j+k, reads token j+1+k, and attends to the real
    (step-0) keys at positions <= j plus its own chain's keys from steps 1..k: the same keys the
    inference-time cache holds when the chain is drafted from position j.

    `anchors` (sorted positions below T, 1-D): the chains from those anchors only, logits
    [B, len(anchors), Vd], the same rows the full call returns there. Step-0 keys still cover every
    position; the queries, the score rows and the later steps are computed at the anchors alone, so
    long windows train at a cost linear in their length (examples/tiny/train_long.py).
    """
    b, t = taps.shape[0], taps.shape[1]
    layer, cfg = drafter.layers[0], drafter.cfg
    attn = layer.self_attn
    rows = torch.arange(t) if anchors is None else anchors
    sparse = anchors is not None
    hidden = drafter.fuse_taps(taps)
    keys, values, out_logits = [], [], []
    visible = torch.arange(t).unsqueeze(0) <= rows.unsqueeze(1)  # [anchors, T]: step-0 keys at positions <= j
    scale = attn.softmax_scale
    for k in range(unroll):
        # step 0 runs at every position (its keys and values serve every anchor); later steps at the anchors
        at = torch.arange(t) if k == 0 else rows
        emb = drafter.embed_tokens(x[:, 1 + k + at])
        gn = layer.hidden_norm(hidden)
        residual = gn if cfg.norm_before_residual else hidden
        u = torch.cat([layer.input_layernorm(emb), gn], -1)
        q, kk, v = _project(attn, u, at.unsqueeze(0) + k)
        if k == 0:
            keys0, values0 = kk, v
            if sparse:
                q, residual = q[:, :, rows], residual[:, rows]
        else:
            keys.append(kk)
            values.append(v)
        s0 = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys]
        p = torch.softmax(torch.cat([s0, *diag], -1), -1)
        out = p[..., :t] @ values0
        for i, vj in enumerate(values):
            out = out + p[..., t + i:t + i + 1] * vj
        h1 = residual + attn.o_proj(out.transpose(1, 2).reshape(b, rows.numel(), -1))
        h = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        normed = drafter.norm(h)
        out_logits.append(drafter.lm_head(normed))
        hidden = normed if cfg.norm_output else h
    return out_logits


def _project(attn, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values [B, heads, T, dim] of one attention module at `positions`, keys and
    values repeated to every query head: what `reference.attention` computes before attending."""
    b, t, _ = u.shape
    if isinstance(attn, MlaAttention):
        m, h = attn.m, attn.heads
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(u))) if hasattr(attn, "q_a_proj") else attn.q_proj(u)
        q_nope, q_pe = q.view(b, t, h, m.qk_head_dim).transpose(1, 2).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = attn.kv_a_proj_with_mqa(u).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b, t, h, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
        cos, sin = cos_sin(positions, attn.inv_freq, u.dtype, attn.rope_scale)
        q_pe = apply_rope(_deinterleave(q_pe), cos, sin)
        k_pe = apply_rope(_deinterleave(k_pe.unsqueeze(1)), cos, sin).expand(b, h, t, m.qk_rope_head_dim)
        return torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v
    rep = attn.heads // attn.kv_heads
    q = attn.q_proj(u).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(u).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(u).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = cos_sin(positions, attn.inv_freq, q.dtype, attn.rope_scale)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
