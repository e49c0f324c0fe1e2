// Scalar fp16 / bf16 <-> fp32 conversions for the CPU kernels.
//
// Half types travel as uint16_t so that the CPU library needs no compiler extension. Rounding
// is round-to-nearest-even, like PyTorch's casts, so that "compute in fp32, round to the I/O
// dtype" gives the same bits as the reference's `.to(dtype)`.
#pragma once

#include <cstdint>
#include <cstring>

namespace eagle31 {

inline float bits_to_float(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
    uint32_t bits = float_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN after truncation
        return static_cast<uint16_t>((bits >> 16) | 0x0040u);
    }
    uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float fp16_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) {  // inf / NaN
        return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    }
    if (exponent == 0) {  // zero / subnormal: value = mantissa * 2^-24, exact in fp32
        float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float f) {
    // Round-to-nearest-even without a lookup table (the well-known "fast3_rtne" construction).
    const uint32_t f16_overflow = (127u + 16u) << 23;    // 65536.0f: inf after rounding
    const uint32_t subnormal_limit = 113u << 23;         // 2^-14: smallest normal fp16
    const uint32_t denorm_magic = 126u << 23;            // 0.5f: aligns the fp16 subnormal LSB
    uint32_t bits = float_to_bits(f);
    uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    uint32_t abs_bits = bits & 0x7fffffffu;
    if (abs_bits >= f16_overflow) {
        return static_cast<uint16_t>(sign | (abs_bits > 0x7f800000u ? 0x7e00u : 0x7c00u));
    }
    if (abs_bits < subnormal_limit) {
        // The float add rounds to a multiple of 2^-24 (nearest-even), which is the fp16 subnormal step.
        float shifted = bits_to_float(abs_bits) + bits_to_float(denorm_magic);
        return static_cast<uint16_t>(sign | (float_to_bits(shifted) - denorm_magic));
    }
    uint32_t mantissa_odd = (abs_bits >> 13) & 1u;
    abs_bits += 0xc8000fffu + mantissa_odd;  // rebias the exponent by -112 and add the rounding bias
    return static_cast<uint16_t>(sign | (abs_bits >> 13));
}

// Element access by dtype: the kernels are templated on these tag types.
struct F32 {
    using storage = float;
    static float load(storage v) { return v; }
    static storage store(float v) { return v; }
    static float round(float v) { return v; }
};

struct F16 {
    using storage = uint16_t;
    static float load(storage v) { return fp16_to_float(v); }
    static storage store(float v) { return float_to_fp16(v); }
    static float round(float v) { return fp16_to_float(float_to_fp16(v)); }
};

struct BF16 {
    using storage = uint16_t;
    static float load(storage v) { return bf16_to_float(v); }
    static storage store(float v) { return float_to_bf16(v); }
    static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

}  // namespace eagle31
