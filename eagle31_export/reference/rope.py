"""Rotary position embeddings (HF `rotate_half` layout), with the rope scalings drafters use.

`default`, `linear`, `llama3` and `yarn` (DeepSeek / Kimi K2: the MLA drafter's rope). Yarn also
scales cos/sin by an attention factor, and DeepSeek's attention multiplies its softmax scale by
mscale(factor, mscale_all_dim)**2 (`mla_softmax_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle31_export.errors import UserError


def rope_kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def inv_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_position_embeddings: int = 2048) -> torch.Tensor:
    """Per-pair inverse frequencies, float64."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    if kind == "yarn":
        return _yarn(inv, dim, theta, scaling, max_position_embeddings)
    raise UserError(f"rope scaling {kind!r} is not supported by the reference drafter "
                    "(supported: default, linear, llama3, yarn)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor yarn applies to cos/sin (1 for every other scaling)."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """DeepSeek's attention scale: 1/sqrt(d), times mscale(factor, mscale_all_dim)**2 under yarn."""
    scale = qk_head_dim ** -0.5
    if rope_kind(scaling) != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


def _yarn(inv: torch.Tensor, dim: int, theta: float, s: dict[str, Any], max_pos: int) -> torch.Tensor:
    """Blend interpolated and extrapolated frequencies over yarn's correction range."""
    factor = float(s["factor"])
    old_ctx = float(s.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, dim] for integer positions [B, T], times yarn's attention factor."""
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, dim]; cos/sin: [B, T, dim]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)
