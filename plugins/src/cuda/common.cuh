// Device helpers shared by the EAGLE 3.1 CUDA kernels: dtype conversion, reductions, cp.async.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace eagle31 {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The value the reference sees after `.to(dtype)`: identity for fp32, one rounding for halves.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// 1/sqrt(mean + eps) with IEEE sqrt and division (nvcc's defaults without --use_fast_math),
// the same expression the reference evaluates in fp32.
__device__ __forceinline__ float inverse_rms(float sum_of_squares, int n, float eps) {
    return 1.0f / sqrtf(sum_of_squares / static_cast<float>(n) + eps);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the block, returned to every thread. `scratch` holds THREADS/32 floats.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps only");
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

// 16-byte asynchronous global->shared copy (sm_80+). When `valid` is false nothing is read and the
// destination is zero-filled, which pads partial tiles without a branch in the compute loop.
// `.cg` caches in L2 only: the weight is streamed once and must not evict the activations from L1.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace cuda
}  // namespace eagle31
