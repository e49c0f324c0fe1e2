// Eagle31PostNormFeedback on the CPU: h = residual + update; normed = RMSNorm(h) * w;
// fed_back = normed (post-norm, EAGLE 3.1 `norm_output`) or h (pre-norm).
//
// Every intermediate the reference rounds to the I/O dtype is rounded here too (the sum h, the
// normalised value before the weight multiply), so half-precision results match bit for bit
// except where the fp32 mean itself differs in the last place.
#include <cstdint>
#include <vector>

#include "eagle31_kernels.h"
#include "half_convert.h"
#include "cpu_common.h"

namespace eagle31 {
namespace {

template <typename T>
void post_norm_feedback(const void* residual, const void* update, const void* norm_weight, void* normed,
                        void* fed_back, int64_t rows, int64_t h, float eps, bool norm_output) {
    using S = typename T::storage;
    const S* res = static_cast<const S*>(residual);
    const S* upd = static_cast<const S*>(update);
    const S* w = static_cast<const S*>(norm_weight);
    S* out_normed = static_cast<S*>(normed);
    S* out_fed = static_cast<S*>(fed_back);

    std::vector<float> hidden(static_cast<size_t>(h));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * h;
        for (int64_t j = 0; j < h; ++j) {
            hidden[j] = T::round(T::load(res[base + j]) + T::load(upd[base + j]));
        }
        const float inv = inverse_rms(hidden.data(), h, eps);
        for (int64_t j = 0; j < h; ++j) {
            const S value = T::store(T::load(w[j]) * T::round(hidden[j] * inv));
            out_normed[base + j] = value;
            out_fed[base + j] = norm_output ? value : T::store(hidden[j]);
        }
    }
}

}  // namespace
}  // namespace eagle31

extern "C" int eagle31_post_norm_feedback_cpu(int dtype, const void* residual, const void* update,
                                              const void* norm_weight, void* normed, void* fed_back,
                                              int64_t rows, int64_t hidden, float eps, int32_t norm_output) {
    using namespace eagle31;
    if (!residual || !update || !norm_weight || !normed || !fed_back || rows < 0 || hidden < 1) {
        return EAGLE31_BAD_ARGUMENT;
    }
    const bool post = norm_output != 0;
    switch (dtype) {
        case EAGLE31_FLOAT32:
            post_norm_feedback<F32>(residual, update, norm_weight, normed, fed_back, rows, hidden, eps, post);
            return EAGLE31_OK;
        case EAGLE31_FLOAT16:
            post_norm_feedback<F16>(residual, update, norm_weight, normed, fed_back, rows, hidden, eps, post);
            return EAGLE31_OK;
        case EAGLE31_BFLOAT16:
            post_norm_feedback<BF16>(residual, update, norm_weight, normed, fed_back, rows, hidden, eps, post);
            return EAGLE31_OK;
        default:
            return EAGLE31_BAD_DTYPE;
    }
}
