"""NVFP4 numerics: bit-exact with ModelOpt's NVFP4QTensor, rounding rules, packing, activations."""

import pytest
import torch

from eagle31_export.formats.nvfp4 import numerics as nvfp4



@pytest.fixture(scope="module")
def NVFP4QTensor():  # noqa: N802  (ModelOpt's class): only the tests that compare with ModelOpt need it
    return pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def random_weight(shape, dtype, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * magnitude
    # Heavy tails and all-zero blocks: every third block of 16 is zeroed.
    w = w * torch.exp(torch.randn(shape, generator=gen))
    w.view(-1, 16)[::3] = 0
    return w.to(dtype)


CASES = [
    (shape, dtype, magnitude)
    for shape in [(1, 16), (3, 32), (64, 128), (5, 7, 48), (40, 512)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for magnitude in (1e-30, 1e-6, 1e-2, 1.0, 300.0, 1e30)
    if not (dtype == torch.float16 and not 1e-6 <= magnitude <= 300.0)
]


@pytest.mark.parametrize("shape,dtype,magnitude", CASES)
def test_quantize_and_dequantize_bit_exact_with_modelopt(shape, dtype, magnitude, NVFP4QTensor):  # noqa: N803
    w = random_weight(shape, dtype, magnitude, seed=len(shape) * 7 + int(abs(torch.tensor(magnitude).log())))
    ref_q, ref_scale, ref_scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    ours = nvfp4.quantize(w)
    assert_same_bits(ours.packed, ref_q._quantized_data)
    assert_same_bits(ours.weight_scale, ref_scale)
    assert_same_bits(ours.weight_scale_2, ref_scale_2.float())
    ref_w = ref_q.dequantize(scale=ref_scale, double_scale=ref_scale_2, block_sizes={-1: 16}, dtype=dtype)
    assert_same_bits(nvfp4.dequantize(ours.packed, ours.weight_scale, ours.weight_scale_2, dtype), ref_w)


def test_shared_global_scale_and_extremes_bit_exact(NVFP4QTensor):  # noqa: N803
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=gen, dtype=torch.float32)
    shared = nvfp4.weight_scale_2_from_amax(torch.tensor(40.0))  # a fused group's larger amax
    ref_q, ref_scale, _ = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=shared)
    ours = nvfp4.quantize(w, shared)
    assert_same_bits(ours.packed, ref_q._quantized_data)
    assert_same_bits(ours.weight_scale, ref_scale)
    # Values at the FP32 limits and single huge outliers next to tiny values.
    w = torch.full((4, 32), 1e-38)
    w[0, 0], w[1, 17], w[2, 5], w[3, 31] = 3.0e38, -3.0e38, 1e-45, -2.5
    ref_q, ref_scale, ref_scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    ours = nvfp4.quantize(w)
    assert_same_bits(ours.packed, ref_q._quantized_data)
    assert_same_bits(ours.weight_scale, ref_scale)
    assert_same_bits(ours.weight_scale_2, ref_scale_2)


def test_e2m1_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 100.0, -0.75, -0.1, -0.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, 0.0, 0.0]
    assert nvfp4.e2m1_values(nvfp4.e2m1_codes(x)).tolist() == expected
    codes = nvfp4.e2m1_codes(x)
    assert codes[-2].item() == 8 and codes[-1].item() == 0  # tiny negative -> -0 code; -0.0 -> +0 code


def test_pack_puts_even_element_in_low_nibble_and_unpack_inverts():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = nvfp4.pack(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    all_codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16) % 16
    assert torch.equal(nvfp4.unpack(nvfp4.pack(all_codes)), all_codes)


def test_block_scale_rules():
    w = torch.zeros(1, 64)
    w[0, 16:32] = 1e-12  # underflows: clamped to 2**-9, not 0
    w[0, 32:48] = 6.0 * 448.0  # the global amax block: scale exactly 448
    scale = nvfp4.block_scales(w, nvfp4.weight_scale_2_from_amax(torch.tensor(6.0 * 448.0)))
    assert scale.dtype == torch.float8_e4m3fn
    assert scale.float().tolist() == [[1.0, 2.0**-9, 448.0, 1.0]]


def test_rejects_partial_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.ones(4, 24))


def reference_activation_qdq(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """Independent restatement of the runtime kernels' activation quantization (interval form)."""
    gs = torch.tensor(global_scale, dtype=torch.float32)
    xb = x.float().reshape(-1, x.shape[-1] // 16, 16)
    sf = (gs * (xb.abs().amax(-1, keepdim=True) / 6.0)).clamp(max=448).to(torch.float8_e4m3fn).float()
    inv = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / (sf * (1.0 / gs)))
    y = (xb * inv).clamp(-6, 6)
    a = y.abs()
    q = torch.zeros_like(a)
    for lo, hi, v, closed_lo, closed_hi in [(0.25, 0.75, 0.5, False, False), (0.75, 1.25, 1.0, True, True),
                                            (1.25, 1.75, 1.5, False, False), (1.75, 2.5, 2.0, True, True),
                                            (2.5, 3.5, 3.0, False, False), (3.5, 5.0, 4.0, True, True)]:
        inside = ((a >= lo) if closed_lo else (a > lo)) & ((a <= hi) if closed_hi else (a < hi))
        q = torch.where(inside, torch.full_like(a, v), q)
    q = torch.where(a > 5.0, torch.full_like(a, 6.0), q) * torch.sign(y)
    return (q * (sf / gs)).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_fake_quant_matches_kernel_arithmetic(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 7, 64, generator=gen) * torch.exp(2 * torch.randn(3, 7, 64, generator=gen))).to(dtype)
    x[0, 0, :16] = 0
    input_scale = float(x.float().abs().max()) / (6 * 448) * 0.5  # calibrated lower: some saturation
    gs = nvfp4.reciprocal_f32(input_scale)
    ours = nvfp4.fake_quant_activation(x, gs)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert torch.equal(ours, reference_activation_qdq(x, gs))  # values: the reference may give -0
    # Quantized values sit on the NVFP4 grid: at most 8 distinct magnitudes per block.
    per_block = ours.float().abs().reshape(-1, 16)
    assert max(len(set(row.tolist())) for row in per_block) <= 8


def test_ambiguous_roundings_take_the_other_side_within_the_band_only():
    """What parity's float64 measurement of an fp32 engine computes with: an activation within the band
    of an E2M1 rounding boundary (1.25 between 1 and 1.5), or a block whose scale sits within band / 6
    of an E4M3 one, rounds the other way; everything else as computed."""
    # gs = 1, block amax 6: the E4M3 scale is 1 exactly and the scaled values are the values
    near, far = 1.25 + 2e-5, 1.1
    block = torch.tensor([[6.0, near, far] + [0.0] * 13])
    plain = nvfp4.fake_quant_activation(block, 1.0)
    assert plain[0, :3].tolist() == [6.0, 1.5, 1.0]
    with nvfp4.ambiguous_roundings(1.5e-4):
        taken = nvfp4.fake_quant_activation(block, 1.0)
    assert taken[0, :3].tolist() == [6.0, 1.0, 1.0]  # the near one crossed, the far one did not
    with nvfp4.ambiguous_roundings(1e-5):
        assert torch.equal(nvfp4.fake_quant_activation(block, 1.0), plain)  # outside a narrower band
    # the block scale: amax / 6 = 1.0625 * (1 + 1e-6), 1e-6 above the E4M3 midpoint of 1 and 1.125
    scaled = torch.tensor([[6 * 1.0625 * (1 + 1e-6)] + [0.0] * 15])
    assert float(nvfp4.fake_quant_activation(scaled, 1.0)[0, 0]) == 6 * 1.125
    with nvfp4.ambiguous_roundings(1.5e-4):  # 1.5e-4 / 6 relative > 1e-6: the scale rounds down instead
        assert float(nvfp4.fake_quant_activation(scaled, 1.0)[0, 0]) == 6.0
    assert nvfp4.fake_quant_activation(block, 1.0).equal(plain)  # the setting ends with its block


def test_reciprocal_is_not_an_involution_in_fp32():
    # Why format conversions record source values: 1/(1/x) != x for many FP32 values.
    values = [float(v) for v in torch.exp(torch.linspace(-20, 20, 2000))]  # FP32-representable
    misses = sum(nvfp4.reciprocal_f32(nvfp4.reciprocal_f32(v)) != v for v in values)
    assert 50 < misses < 1000


def test_codes_and_values_are_computed_on_the_device_of_the_data():
    """A target placed on a GPU (`--device cuda`) decodes its weights there. The meta device stands in
    for the GPU: its tensors cannot be mixed with the CPU tables either, which is how a CUDA run failed
    ("indices should be either on cpu or on the same device as the indexed tensor")."""
    q = nvfp4.quantize(torch.randn(4, 32))
    on_meta = [t.to("meta") for t in q]
    assert nvfp4.dequantize(*on_meta, torch.bfloat16).device.type == "meta"
    assert nvfp4.e2m1_codes(torch.randn(4, 8, device="meta")).device.type == "meta"
