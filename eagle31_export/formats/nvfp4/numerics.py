"""NVFP4 numerics: E2M1 codes, FP8-E4M3 block scales, packing, (de)quantization.

Weights: blocks of 16 along the last (input) dimension. Each element is an E2M1 code
(bit 3 = sign) scaled by a per-block FP8-E4M3 scale and one FP32 per-tensor scale:

    W[r, 16b+j] = e2m1(code) * float(weight_scale[r, b]) * weight_scale_2

The results are bit-exact with ModelOpt's `NVFP4QTensor` (quantize, pack, dequantize). To
get there the order of floating-point operations below follows it deliberately, e.g. the
block scale divides by `(6 * weight_scale_2)` rather than multiplying by its inverse; do not
"simplify" these expressions.

Activations (W4A4 emulation): the runtime quantizes GEMM inputs dynamically per block of 16
under a static per-tensor `input_scale`; `fake_quant_activation` reproduces that arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import numpy as np
import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest block scale written: 2**-9 is the smallest E4M3 subnormal, so nothing underflows to 0.
MIN_BLOCK_SCALE = 2.0**-9

# Value of each 4-bit code; bit 3 is the sign. Code 8 is -0 in E2M1; it decodes to +0.0 here,
# as in ModelOpt, so dequantized tensors agree bit for bit (the two are numerically equal).
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
# Midpoints between neighbouring magnitudes. A value exactly on a midpoint is a tie: it must
# round to the neighbour with an even mantissa, which is the lower one except at 0.75, 1.75
# and 3.5 (0.5|1, 1.5|2, 3|4), where it is the upper one.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIES_UP = (0.75, 1.75, 3.5)

# Set by `ambiguous_roundings`: activations within this many E2M1 units (the block's scaled values, 6 at
# its amax) of a rounding boundary, and block scales within band / 6 relative of an E4M3 one, round
# the other way. None: every rounding as computed.
_AMBIGUOUS_BAND: float | None = None

# Rows processed at a time: bounds temporary memory (fp32 copies) for very large weights.
_ROW_CHUNK = 2048


class NVFP4Tensor(NamedTuple):
    packed: torch.Tensor  # uint8 [..., n/2], even element in the low nibble
    weight_scale: torch.Tensor  # float8_e4m3fn [..., n/16]
    weight_scale_2: torch.Tensor  # float32, 0-dim


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scales) to E2M1 codes, uint8 in [0, 16).

    Round half to even over the E2M1 magnitudes, saturating at 6. The sign bit is set for
    x < 0 only, so -0.0 becomes code 0 and tiny negatives become code 8 (-0), as in ModelOpt.
    """
    mag = x.abs()
    # searchsorted(right=False) puts a value equal to a midpoint on the lower side...
    codes = torch.searchsorted(_MIDPOINTS.to(mag.device, mag.dtype), mag, out_int32=True).to(torch.uint8)
    # ...which is right for every tie except those whose lower neighbour has an odd mantissa.
    ties_up = (mag == _TIES_UP[0]) | (mag == _TIES_UP[1]) | (mag == _TIES_UP[2])
    return ((x < 0).to(torch.uint8) << 3) + codes + ties_up.to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes ({codes.shape[-1]})")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n/2] -> codes uint8 [..., n]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    # The table goes where the codes are: a target placed on a GPU (`--device cuda`) decodes there.
    return E2M1_VALUES.to(codes.device)[codes.long()]


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| in x's dtype without materialising |x| (ModelOpt's reduce_amax)."""
    return torch.maximum(x.amax().abs(), x.amin().abs())


def weight_scale_2_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale: amax / (6 * 448), FP32 0-dim. Also the input_scale rule for activations."""
    amax = torch.as_tensor(amax)
    return amax.float().reshape(()) / (E2M1_MAX * E4M3_MAX)


def block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 scale per block of 16: block_amax / (6 * weight_scale_2).

    All-zero blocks get 1.0 (any scale reproduces zeros; 1.0 keeps the scale finite), then
    the scale is clamped to [2**-9, 448] so the FP8 cast neither underflows to 0 nor overflows.
    """
    _check_blocks(w)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = torch.maximum(blocks.amax(-1).abs(), blocks.amin(-1).abs()).float()
    scale = block_amax / (E2M1_MAX * weight_scale_2.float())
    scale = scale.masked_fill(scale == 0, 1.0)
    return scale.clamp(min=MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize `w` [..., n] (n % 16 == 0). `weight_scale_2` defaults to amax(w) / 2688.

    Pass a shared `weight_scale_2` for fused groups (q/k/v, gate/up), as ModelOpt does.
    """
    _check_blocks(w)
    if not w.is_floating_point():
        raise ValueError(f"cannot quantize a {w.dtype} tensor")
    if weight_scale_2 is None:
        weight_scale_2 = weight_scale_2_from_amax(abs_max(w))
    weight_scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    flat = w.reshape(-1, w.shape[-1])
    packed, scales = [], []
    for rows in flat.split(_ROW_CHUNK):
        scale = block_scales(rows, weight_scale_2)
        blocks = rows.reshape(rows.shape[0], -1, BLOCK_SIZE)
        scaled = blocks / (scale.float() * weight_scale_2).unsqueeze(-1)
        packed.append(pack(e2m1_codes(scaled.reshape(rows.shape))))
        scales.append(scale)
    lead = w.shape[:-1]
    return NVFP4Tensor(
        torch.cat(packed).reshape(*lead, -1), torch.cat(scales).reshape(*lead, -1), weight_scale_2
    )


def dequantize(
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """e2m1(code) * (float(weight_scale) * weight_scale_2), computed in FP32, cast to `dtype`."""
    weight_scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    n = packed.shape[-1] * 2
    flat_packed = packed.reshape(-1, packed.shape[-1])
    flat_scale = weight_scale.reshape(-1, weight_scale.shape[-1])
    out = []
    for p, s in zip(flat_packed.split(_ROW_CHUNK), flat_scale.split(_ROW_CHUNK)):
        values = e2m1_values(unpack(p)).reshape(p.shape[0], -1, BLOCK_SIZE)
        per_block = s.float() * weight_scale_2
        out.append((values * per_block.unsqueeze(-1)).reshape(p.shape[0], n).to(dtype))
    return torch.cat(out).reshape(*packed.shape[:-1], n)


def fake_quant_activation(x: torch.Tensor, input_global_scale: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 quantize-dequantize of GEMM inputs, as TensorRT-LLM's / vLLM's FP4 kernels do.

    `input_global_scale` is 1 / input_scale (what the kernels are given). Per block of 16:
    sf = fp8(gs * amax / 6); values = e2m1(clamp(x * gs / sf, +-6)); out = values * sf / gs.
    Unlike weights there is no 2**-9 floor: a block whose scale underflows becomes zeros.
    """
    _check_blocks(x)
    gs = torch.as_tensor(input_global_scale, dtype=torch.float32).reshape(())
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(-1, keepdim=True)
    band = _AMBIGUOUS_BAND
    sf = gs * (block_amax * (1.0 / E2M1_MAX))
    sf = _e4m3(sf) if band is None else _other_side(sf, band / E2M1_MAX, _e4m3, lambda s, d: s * (1 + d))
    # The kernels compute 1 / (sf * (1 / gs)) and use 0 where sf is 0.
    inv_sf = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / (sf * (1.0 / gs)))
    scaled = (blocks * inv_sf).clamp(-E2M1_MAX, E2M1_MAX)
    values = (e2m1_values(e2m1_codes(scaled)) if band is None
              else _other_side(scaled, band, lambda v: e2m1_values(e2m1_codes(v.clamp(-E2M1_MAX, E2M1_MAX))),
                               lambda v, d: v + d))
    return (values * (sf / gs)).reshape(x.shape).to(x.dtype)


def _e4m3(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn).float()


def _other_side(x: torch.Tensor, band: float, rounded, moved) -> torch.Tensor:
    """`rounded(x)`, except where moving x by `band` either way rounds elsewhere: there the other side."""
    here, up, down = rounded(x), rounded(moved(x, band)), rounded(moved(x, -band))
    return torch.where(up != here, up, torch.where(down != here, down, here))


@contextlib.contextmanager
def ambiguous_roundings(band: float | None) -> Iterator[None]:
    """None: every rounding as computed. Otherwise, within: every NVFP4 activation rounding that an error of `band` E2M1 units could turn (the
    element's, or its block scale's: band / 6 relative, the amax sitting at 6 units) goes the other
    way. What another engine computing the same inputs to within that error may round differently;
    parity measures with it (parity/numerics.py: FP4_ROUNDING_BAND)."""
    global _AMBIGUOUS_BAND
    before, _AMBIGUOUS_BAND = _AMBIGUOUS_BAND, band
    try:
        yield
    finally:
        _AMBIGUOUS_BAND = before


def reciprocal_f32(value: float) -> float:
    """1 / value rounded once to FP32 (IEEE division), as the runtimes compute it.

    ModelOpt stores scales, compressed-tensors their reciprocals ("global scales"). Note that
    reciprocal_f32(reciprocal_f32(v)) != v for about one FP32 value in seven: the converter
    records the source value where that happens (see formats.nvfp4.scheme.exact_inverse).
    """
    with np.errstate(divide="ignore"):
        return float(np.float32(1.0) / np.float32(value))


def _check_blocks(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 needs the last dimension to be a multiple of {BLOCK_SIZE}; got shape {list(x.shape)}"
        )
