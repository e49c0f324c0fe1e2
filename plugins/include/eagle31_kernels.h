/*
 * The C ABI of the EAGLE 3.1 fused kernels (CPU and CUDA).
 *
 * A plain C interface so that the same library serves ctypes (Python), the TensorRT plugin
 * wrappers and any other host. Tensors are dense, row-major and contiguous; every "[rows, X]"
 * tensor may come from any leading shape flattened into rows.
 *
 * Semantics (the PyTorch reference in eagle31_export/reference/ops.py defines them):
 *   fc_norm:            y[r] = sum_i s_i[r] * (W'_i @ a_i[r]),  s_i[r] = 1/sqrt(mean(a_i[r]^2) + eps)
 *                       (s_i = 1 when has_norm == 0), where W' is the fc weight [H, k*Ht] with the
 *                       per-source RMSNorm weights folded into its columns.
 *   post_norm_feedback: h = residual + update; normed = RMSNorm(h) * w;
 *                       fed_back = normed if norm_output else h.
 * Accumulation is fp32 (reductions for the RMS are done in double on the CPU).
 */
#ifndef EAGLE31_KERNELS_H
#define EAGLE31_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of every tensor of one call (inputs and outputs share it). */
enum Eagle31DType {
    EAGLE31_FLOAT32 = 0,
    EAGLE31_FLOAT16 = 1,
    EAGLE31_BFLOAT16 = 2,
};

/* Status codes. */
enum Eagle31Status {
    EAGLE31_OK = 0,
    EAGLE31_BAD_ARGUMENT = 1,   /* null pointer, non-positive size, too many sources */
    EAGLE31_BAD_DTYPE = 2,      /* dtype not supported by this implementation */
    EAGLE31_LAUNCH_FAILED = 3,  /* CUDA launch error (CUDA implementation only) */
};

/* The most tapped sources one call accepts (EAGLE 3.x taps 3; 8 leaves room). */
#define EAGLE31_MAX_SOURCES 8

/* CPU implementation (libeagle31_kernels_cpu.so). */
int eagle31_fc_norm_cpu(int dtype, const void* const* sources, int32_t num_sources, const void* weight,
                        void* out, int64_t rows, int64_t hidden_in, int64_t hidden_out, float eps,
                        int32_t has_norm);

int eagle31_post_norm_feedback_cpu(int dtype, const void* residual, const void* update,
                                   const void* norm_weight, void* normed, void* fed_back, int64_t rows,
                                   int64_t hidden, float eps, int32_t norm_output);

/* Version of the ABI above; bumped on any incompatible change. */
int32_t eagle31_kernels_abi_version(void);

/*
 * CUDA implementation (libeagle31_kernels_cuda.so). Pointers are device pointers; `stream` is a
 * cudaStream_t passed as void* so that this header needs no CUDA include. fc_norm supports all
 * three dtypes (fp16/bf16 on tensor cores, fp32 on CUDA cores); post_norm_feedback all three.
 */
int eagle31_fc_norm_cuda(int dtype, const void* const* sources, int32_t num_sources, const void* weight,
                         void* out, int64_t rows, int64_t hidden_in, int64_t hidden_out, float eps,
                         int32_t has_norm, void* stream);

int eagle31_post_norm_feedback_cuda(int dtype, const void* residual, const void* update,
                                    const void* norm_weight, void* normed, void* fed_back, int64_t rows,
                                    int64_t hidden, float eps, int32_t norm_output, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* EAGLE31_KERNELS_H */
