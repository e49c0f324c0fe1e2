"""Teacher-forced chain drafting ("training-time test") over whole sequences at once.

For every anchor position j, step k of the chain sits at position j+k, reads the REAL token
j+1+k, and consumes the drafter's own fed-back state from step k-1; it attends to the step-0
keys at positions <= j plus its own chain's keys from steps 1..k. That is exactly the cache the
reference drafter holds when it drafts from position j at inference (a test checks it), so the
same function serves training and per-position agreement on held-out text.
"""

from __future__ import annotations

import torch

from eagle31_export.reference.drafter import Eagle3Drafter
from eagle31_export.reference.rope import apply_rope, cos_sin


def ttt_forward(drafter: Eagle3Drafter, taps: torch.Tensor, x: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Training-time test: draft logits [B, T, Vd] for each of `unroll` chained steps.

    Step k at chain anchor j sits at position j+k, reads token j+1+k, and attends to the real
    (step-0) keys at positions <= j plus its own chain's keys from steps 1..k: the same keys the
    inference-time cache holds when the chain is drafted from position j.
    """
    b, t = taps.shape[0], taps.shape[1]
    layer, cfg = drafter.layers[0], drafter.cfg
    attn = layer.self_attn
    hidden = drafter.fuse_taps(taps)
    keys, values, out_logits = [], [], []
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scale = attn.softmax_scale
    rep = attn.heads // attn.kv_heads
    for k in range(unroll):
        emb = drafter.embed_tokens(x[:, 1 + k:1 + k + t])
        gn = layer.hidden_norm(hidden)
        residual = gn if cfg.norm_before_residual else hidden
        u = torch.cat([layer.input_layernorm(emb), gn], -1)
        q = attn.q_proj(u).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
        kk = attn.k_proj(u).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(u).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = cos_sin(torch.arange(t).unsqueeze(0) + k, attn.inv_freq, q.dtype, attn.rope_scale)
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        keys.append(kk.repeat_interleave(rep, 1))
        values.append(v.repeat_interleave(rep, 1))
        s0 = ((q @ keys[0].transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
        p = torch.softmax(torch.cat([s0, *diag], -1), -1)
        out = p[..., :t] @ values[0]
        for i, vj in enumerate(values[1:]):
            out = out + p[..., t + i:t + i + 1] * vj
        h1 = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        normed = drafter.norm(h)
        out_logits.append(drafter.lm_head(normed))
        hidden = normed if cfg.norm_output else h
    return out_logits
