"""Folding the per-source RMSNorm weights of `fc_norm` into the fc weight (done once, at export).

    fc(concat_i(w_i * n_i)) = sum_i W_i @ (w_i * n_i) = sum_i (W_i * w_i) @ n_i

where W_i = fc_weight[:, i*Ht:(i+1)*Ht] and n_i = a_i / rms(a_i). Scaling W_i's columns by w_i
leaves only the scalar 1/rms(a_i) per (row, source) for the kernel to apply. The product is
formed in fp32 (fp64 stays fp64) and rounded once to the fc weight's dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch


def fold_fc_norm_weights(
    fc_weight: torch.Tensor,
    norm_weights: Sequence[torch.Tensor] | torch.Tensor | None,
    num_sources: int,
) -> torch.Tensor:
    """W' with W'[:, i*Ht:(i+1)*Ht] = fc_weight[:, i*Ht:(i+1)*Ht] * norm_weights[i].

    `norm_weights` is one [Ht] tensor per source (or a stacked [k, Ht] tensor); None means
    `fc_norm` is off and `fc_weight` is returned unchanged.
    """
    if fc_weight.dim() != 2:
        raise ValueError(f"fc weight must be 2-D [H, k*Ht], got shape {tuple(fc_weight.shape)}")
    if num_sources < 1 or fc_weight.shape[1] % num_sources:
        raise ValueError(
            f"fc weight has {fc_weight.shape[1]} input columns, not a multiple of num_sources={num_sources}"
        )
    if norm_weights is None:
        return fc_weight
    hidden = fc_weight.shape[1] // num_sources
    weights = list(norm_weights)
    if len(weights) != num_sources:
        raise ValueError(f"expected {num_sources} fc_norm weights, got {len(weights)}")
    for i, w in enumerate(weights):
        if tuple(w.shape) != (hidden,):
            raise ValueError(f"fc_norm weight {i} has shape {tuple(w.shape)}, expected ({hidden},)")
    compute = torch.float64 if fc_weight.dtype == torch.float64 else torch.float32
    scale = torch.cat([w.to(device=fc_weight.device, dtype=compute) for w in weights])
    return (fc_weight.to(compute) * scale).to(fc_weight.dtype)
