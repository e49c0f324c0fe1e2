// Reductions shared by the CPU kernels.
#pragma once

#include <cmath>
#include <cstdint>

namespace eagle31 {

// fp32 dot product with eight independent partial sums: the compiler vectorises it without
// -ffast-math, and the error grows like sqrt(n/8) instead of n for a single running sum.
inline float dot(const float* a, const float* b, int64_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int l = 0; l < 8; ++l) lane[l] += a[j + l] * b[j + l];
    }
    for (; j < n; ++j) lane[0] += a[j] * b[j];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// 1/sqrt(mean(x^2) + eps) as HF RMSNorm computes it in fp32: the mean is accumulated in double so
// that it is (almost always) the correctly rounded fp32 mean, whatever the reduction order of the
// reference; the eps add and the reciprocal square root then follow the reference in fp32.
inline float inverse_rms(const float* x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += static_cast<double>(x[j]) * x[j];
    float mean = static_cast<float>(sum / static_cast<double>(n));
    return 1.0f / std::sqrt(mean + eps);
}

}  // namespace eagle31
