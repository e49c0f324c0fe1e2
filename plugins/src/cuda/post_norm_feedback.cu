// Eagle31PostNormFeedback on the GPU: one block per row, one fused pass.
//
//   pass 1: h = round(residual + update) -> written to fed_back (its final value under pre-norm
//           feedback), sum of h^2 reduced over the block;
//   pass 2: normed = round(w * round(h * inv_rms)) -> written to normed, and to fed_back under
//           post-norm feedback.
// Each thread reads back in pass 2 only the elements it wrote in pass 1, so no barrier is needed
// between the passes beyond the reduction's, and the re-read hits L1/L2, not HBM.
// The roundings mirror the reference (HF RMSNorm) so half-precision outputs match it.
#include <cstdint>

#include "common.cuh"
#include "eagle31_kernels.h"

namespace eagle31 {
namespace cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

template <typename T, int N, int THREADS>
__global__ void __launch_bounds__(THREADS)
    post_norm_feedback_kernel(const T* __restrict__ residual, const T* __restrict__ update,
                              const T* __restrict__ weight, T* __restrict__ normed, T* __restrict__ fed_back,
                              int hidden, float eps, int norm_output) {
    using P = Pack<T, N>;
    __shared__ float scratch[THREADS / 32];
    const int64_t row = static_cast<int64_t>(blockIdx.x) * (hidden / N);
    const P* res = reinterpret_cast<const P*>(residual) + row;
    const P* upd = reinterpret_cast<const P*>(update) + row;
    const P* w = reinterpret_cast<const P*>(weight);
    P* out_normed = reinterpret_cast<P*>(normed) + row;
    P* out_fed = reinterpret_cast<P*>(fed_back) + row;
    const int packs = hidden / N;

    float sum_sq = 0.0f;
    for (int j = threadIdx.x; j < packs; j += THREADS) {
        const P a = res[j], b = upd[j];
        P h;
#pragma unroll
        for (int e = 0; e < N; ++e) {
            h.v[e] = from_float<T>(to_float(a.v[e]) + to_float(b.v[e]));
            const float hf = to_float(h.v[e]);
            sum_sq += hf * hf;
        }
        out_fed[j] = h;
    }
    const float inv = inverse_rms(block_sum<THREADS>(sum_sq, scratch), hidden, eps);

    for (int j = threadIdx.x; j < packs; j += THREADS) {
        const P h = out_fed[j], g = w[j];
        P y;
#pragma unroll
        for (int e = 0; e < N; ++e) {
            y.v[e] = from_float<T>(to_float(g.v[e]) * round_to<T>(to_float(h.v[e]) * inv));
        }
        out_normed[j] = y;
        if (norm_output) out_fed[j] = y;
    }
}

template <typename T>
void launch(const T* residual, const T* update, const T* weight, T* normed, T* fed_back, int64_t rows, int hidden,
            float eps, int norm_output, cudaStream_t stream) {
    constexpr int THREADS = 256;
    constexpr int N = 16 / sizeof(T);  // elements per 16-byte access
    const bool vec = hidden % N == 0 && aligned16(residual) && aligned16(update) && aligned16(weight) &&
                     aligned16(normed) && aligned16(fed_back);
    const dim3 grid(static_cast<unsigned>(rows));
    if (vec) {
        post_norm_feedback_kernel<T, N, THREADS>
            <<<grid, THREADS, 0, stream>>>(residual, update, weight, normed, fed_back, hidden, eps, norm_output);
    } else {
        post_norm_feedback_kernel<T, 1, THREADS>
            <<<grid, THREADS, 0, stream>>>(residual, update, weight, normed, fed_back, hidden, eps, norm_output);
    }
}

}  // namespace
}  // namespace cuda
}  // namespace eagle31

extern "C" int eagle31_post_norm_feedback_cuda(int dtype, const void* residual, const void* update,
                                               const void* norm_weight, void* normed, void* fed_back, int64_t rows,
                                               int64_t hidden, float eps, int32_t norm_output, void* stream) {
    using namespace eagle31::cuda;
    if (!residual || !update || !norm_weight || !normed || !fed_back || rows < 0 || hidden < 1 ||
        rows > 0x7fffffffLL || hidden > 0x7fffffffLL) {
        return EAGLE31_BAD_ARGUMENT;
    }
    if (rows == 0) return EAGLE31_OK;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int h = static_cast<int>(hidden);
    const int post = norm_output != 0;
    switch (dtype) {
        case EAGLE31_FLOAT32:
            launch(static_cast<const float*>(residual), static_cast<const float*>(update),
                   static_cast<const float*>(norm_weight), static_cast<float*>(normed), static_cast<float*>(fed_back),
                   rows, h, eps, post, s);
            break;
        case EAGLE31_FLOAT16:
            launch(static_cast<const __half*>(residual), static_cast<const __half*>(update),
                   static_cast<const __half*>(norm_weight), static_cast<__half*>(normed),
                   static_cast<__half*>(fed_back), rows, h, eps, post, s);
            break;
        case EAGLE31_BFLOAT16:
            launch(static_cast<const __nv_bfloat16*>(residual), static_cast<const __nv_bfloat16*>(update),
                   static_cast<const __nv_bfloat16*>(norm_weight), static_cast<__nv_bfloat16*>(normed),
                   static_cast<__nv_bfloat16*>(fed_back), rows, h, eps, post, s);
            break;
        default:
            return EAGLE31_BAD_DTYPE;
    }
    return cudaGetLastError() == cudaSuccess ? EAGLE31_OK : EAGLE31_LAUNCH_FAILED;
}
