"""transformers' SDPA attention with grouped keys/values handed to SDPA as they are.

transformers' `sdpa` attention repeats a GQA layer's keys and values per query head whenever it
passes a mask (every forward over a cache: chunked prefill, verification), on the CPU always: a
[heads, S, dim] copy of the layer's cache per call, 0.5 GB at 16k tokens and 8B widths (32 heads
over 8). torch's `scaled_dot_product_attention(enable_gqa=True)` reads the groups in place, with
the same numbers (each query head attends to its group's keys either way). Registered with
transformers' public `AttentionInterface`; anything this does not cover goes to transformers' own.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

NAME = "eagle31_grouped_sdpa"


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                       else getattr(module, "is_causal", True))
    if (groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or (causal and kv_len > q_len) or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a transformers model running `sdpa` attention to `grouped_sdpa_attention`; others stay."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return model
    AttentionInterface.register(NAME, grouped_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks `sdpa` gets (an unknown name gets none)
    model.set_attn_implementation(NAME)
    return model
