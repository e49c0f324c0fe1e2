"""The two fused operations of EAGLE 3.1, defined once in plain torch.

These functions ARE the semantics: the reference drafter calls them, and every other
implementation (the C++/CUDA kernels in plugins/, the ONNX local functions) is tested
against them.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types are normalised in fp32 (as HF and vLLM do); float64 stays float64 so that
    # tests can compare against exact arithmetic.
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight."""
    xf = x.to(_compute_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fc_norm_fusion(
    sources: Sequence[torch.Tensor],
    fc_weight: torch.Tensor,
    norm_weights: Sequence[torch.Tensor] | None,
    eps: float,
) -> torch.Tensor:
    """`Eagle31FcNorm`: k tapped states -> per-source RMSNorm -> concat -> fc (no bias).

    With `norm_weights` None (EAGLE-3, `fc_norm` off) it is the plain fc of the concatenation.
    """
    if norm_weights is not None:
        sources = [rms_norm(a, w, eps) for a, w in zip(sources, norm_weights, strict=True)]
    return torch.nn.functional.linear(torch.cat(list(sources), dim=-1), fc_weight)


def post_norm_feedback(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    norm_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Eagle31PostNormFeedback`: h = residual + update; returns (norm(h), fed-back state).

    The fed-back state is norm(h) under EAGLE 3.1's `norm_output`, else the pre-norm h.
    """
    hidden = residual + update
    normed = rms_norm(hidden, norm_weight, eps)
    return normed, (normed if norm_output else hidden)


class DrafterKernels(Protocol):
    """What the drafter needs from a kernel provider (plain torch, or the plugin ops)."""

    def fc_norm(self, sources, fc_weight, norm_weights, eps): ...

    def post_norm_feedback(self, residual, update, norm_weight, eps, norm_output): ...


class TorchKernels:
    """The default provider: the definitions above."""

    def fc_norm(self, sources, fc_weight, norm_weights, eps):
        return fc_norm_fusion(sources, fc_weight, norm_weights, eps)

    def post_norm_feedback(self, residual, update, norm_weight, eps, norm_output):
        return post_norm_feedback(residual, update, norm_weight, eps, norm_output)


class RMSNorm(torch.nn.Module):
    """Module form of `rms_norm`, so checkpoints name its parameter `<name>.weight`."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
