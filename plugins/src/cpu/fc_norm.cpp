// Eagle31FcNorm on the CPU: y[r] = sum_i s_i[r] * (W'_i @ a_i[r]).
//
// W' is the fc weight with the per-source RMSNorm weights already folded into its columns, so the
// norm leaves only one scalar per (row, source): s_i[r] = 1/sqrt(mean(a_i[r]^2) + eps). The kernel
// converts the activations to fp32 once, then streams the weight one output row at a time (each
// weight row is converted once and reused for every activation row).
#include <cmath>
#include <cstdint>
#include <vector>

#include "eagle31_kernels.h"
#include "half_convert.h"
#include "cpu_common.h"

namespace eagle31 {
namespace {

template <typename T>
void to_float(const typename T::storage* src, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; ++j) dst[j] = T::load(src[j]);
}

template <typename T>
void fc_norm(const void* const* sources, int k, const void* weight, void* out, int64_t rows, int64_t ht,
             int64_t h, float eps, bool has_norm) {
    using S = typename T::storage;
    const int64_t width = k * ht;  // columns of the (folded) fc weight

    // Activations as [rows][k*ht] fp32 (the concat order), and one scale per (row, source).
    std::vector<float> act(static_cast<size_t>(rows * width));
    std::vector<float> scale(static_cast<size_t>(rows * k), 1.0f);
    for (int i = 0; i < k; ++i) {
        const S* src = static_cast<const S*>(sources[i]);
        for (int64_t r = 0; r < rows; ++r) {
            float* row = &act[static_cast<size_t>(r * width + i * ht)];
            to_float<T>(src + r * ht, row, ht);
            if (has_norm) scale[static_cast<size_t>(r * k + i)] = inverse_rms(row, ht, eps);
        }
    }

    std::vector<float> wrow(static_cast<size_t>(width));
    const S* w = static_cast<const S*>(weight);
    S* y = static_cast<S*>(out);
    for (int64_t n = 0; n < h; ++n) {
        to_float<T>(w + n * width, wrow.data(), width);
        for (int64_t r = 0; r < rows; ++r) {
            const float* a = &act[static_cast<size_t>(r * width)];
            float acc = 0.0f;
            for (int i = 0; i < k; ++i) {
                acc += scale[static_cast<size_t>(r * k + i)] * dot(wrow.data() + i * ht, a + i * ht, ht);
            }
            y[r * h + n] = T::store(acc);
        }
    }
}

}  // namespace
}  // namespace eagle31

extern "C" int eagle31_fc_norm_cpu(int dtype, const void* const* sources, int32_t num_sources,
                                   const void* weight, void* out, int64_t rows, int64_t hidden_in,
                                   int64_t hidden_out, float eps, int32_t has_norm) {
    using namespace eagle31;
    if (!sources || !weight || !out || num_sources < 1 || num_sources > EAGLE31_MAX_SOURCES || rows < 0 ||
        hidden_in < 1 || hidden_out < 1) {
        return EAGLE31_BAD_ARGUMENT;
    }
    for (int i = 0; i < num_sources; ++i) {
        if (!sources[i]) return EAGLE31_BAD_ARGUMENT;
    }
    const bool norm = has_norm != 0;
    switch (dtype) {
        case EAGLE31_FLOAT32:
            fc_norm<F32>(sources, num_sources, weight, out, rows, hidden_in, hidden_out, eps, norm);
            return EAGLE31_OK;
        case EAGLE31_FLOAT16:
            fc_norm<F16>(sources, num_sources, weight, out, rows, hidden_in, hidden_out, eps, norm);
            return EAGLE31_OK;
        case EAGLE31_BFLOAT16:
            fc_norm<BF16>(sources, num_sources, weight, out, rows, hidden_in, hidden_out, eps, norm);
            return EAGLE31_OK;
        default:
            return EAGLE31_BAD_DTYPE;
    }
}

extern "C" int32_t eagle31_kernels_abi_version(void) { return 1; }
