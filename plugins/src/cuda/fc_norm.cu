// Eagle31FcNorm on the GPU: y[r] = sum_i s_i[r] * (W'_i @ a_i[r]),  s_i[r] = 1/rms(a_i[r]).
//
// W' [H, k*Ht] is the fc weight with the RMSNorm weights folded into its columns, so the norm
// reduces to one scalar per (row, source). In the drafter's regime (1..256 rows, H = 7168,
// k*Ht = 21504) the kernel is bound by reading W' once, so the design goal is: stream every
// weight tile exactly once per row tile, with 16-byte cp.async loads kept several stages deep.
//
// fp16/bf16 path (tensor cores, WMMA 16x16x16, fp32 accumulate), per block:
//   - a BM x BN output tile, BM = 16*MF rows, BN = 16*WN output features, one warp per 16 columns;
//   - the K loop walks source 0's columns, then source 1's, ...; each source's partial product is
//     accumulated separately and added to the result scaled by s_i[r] when the source ends;
//   - s_i[r] is computed from the activation tiles already staged in shared memory for the MMA,
//     so the norm prologue costs no extra global traffic.
// 1..8 rows (fp16/bf16, aligned): a matrix-vector kernel, below;
// on an H200 at Kimi sizes it reads W' at 1.6-3.8 TB/s where this tiled kernel reached ~1 TB/s
// (plugins/README.md, "Measured on an NVIDIA H200").
// fp32 path: one warp per output feature on CUDA cores (kept exact; not a tensor-core path).
#include <cstdint>
#include <type_traits>

#include <mma.h>

#include "common.cuh"
#include "eagle31_kernels.h"

namespace eagle31 {
namespace cuda {
namespace {

struct Sources {
    const void* ptr[EAGLE31_MAX_SOURCES];
};

struct FcNormArgs {
    Sources sources;
    int k;        // number of sources
    int rows;
    int ht;       // hidden size of each source
    int h;        // output features
    float eps;
    int has_norm;
};

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel (fp16 / bf16).
// ---------------------------------------------------------------------------------------------

template <typename T, int MF, int WN, int BK, int STAGES>
struct TcTile {
    static constexpr int BM = 16 * MF;
    static constexpr int BN = 16 * WN;
    static constexpr int BK_ = BK;
    static constexpr int THREADS = 32 * WN;
    static constexpr int LDS = BK + 8;   // +16 bytes per row: keeps WMMA's ldm rule, spreads banks
    static constexpr int LDC = BN + 4;
    static constexpr int ROW_THREADS = THREADS / BM;  // threads sharing one row's sum of squares
    static constexpr int OUT_PER_THREAD = BM * BN / THREADS;

    static_assert(BK % 16 == 0, "BK must be a multiple of the WMMA K step");
    static_assert(THREADS % BM == 0 && 32 % ROW_THREADS == 0, "rows must map onto whole lane groups");
    static_assert(BK % ROW_THREADS == 0, "each row's columns split evenly over its threads");
    static_assert((BM * BN) % THREADS == 0, "epilogue elements split evenly");

    struct Shared {
        alignas(128) T a[STAGES][BM][LDS];
        alignas(128) T w[STAGES][BN][LDS];
        alignas(128) float c[BM][LDC];
        float inv_rms[BM];
    };
    static_assert(sizeof(Shared) <= 48 * 1024, "stay within static shared memory");
};

// Stage the activation and weight tiles of K-tile `t` into shared-memory stage `stage`.
template <typename T, typename Tile, bool VEC>
__device__ __forceinline__ void load_tile(typename Tile::Shared& sm, const FcNormArgs& p, const T* weight,
                                          int row0, int col0, int k_tiles, int t, int stage) {
    constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK_, THREADS = Tile::THREADS;
    const int source = t / k_tiles;
    const int k0 = (t % k_tiles) * BK;
    const T* act = static_cast<const T*>(p.sources.ptr[source]);
    const int64_t width = static_cast<int64_t>(p.k) * p.ht;
    const T* wsrc = weight + static_cast<int64_t>(source) * p.ht;

    if constexpr (VEC) {
        constexpr int CHUNKS = BK / 8;  // 16-byte chunks per tile row
        for (int c = threadIdx.x; c < BM * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, kc = (c % CHUNKS) * 8;
            const bool ok = row0 + r < p.rows && k0 + kc < p.ht;
            const T* g = ok ? act + static_cast<int64_t>(row0 + r) * p.ht + k0 + kc : act;
            cp_async_16(&sm.a[stage][r][kc], g, ok);
        }
        for (int c = threadIdx.x; c < BN * CHUNKS; c += THREADS) {
            const int n = c / CHUNKS, kc = (c % CHUNKS) * 8;
            const bool ok = col0 + n < p.h && k0 + kc < p.ht;
            const T* g = ok ? wsrc + static_cast<int64_t>(col0 + n) * width + k0 + kc : weight;
            cp_async_16(&sm.w[stage][n][kc], g, ok);
        }
    } else {
        // Any Ht / alignment: plain element loads with zero padding (synchronous, slower).
        const T zero = from_float<T>(0.0f);
        for (int e = threadIdx.x; e < BM * BK; e += THREADS) {
            const int r = e / BK, kk = e % BK;
            const bool ok = row0 + r < p.rows && k0 + kk < p.ht;
            sm.a[stage][r][kk] = ok ? act[static_cast<int64_t>(row0 + r) * p.ht + k0 + kk] : zero;
        }
        for (int e = threadIdx.x; e < BN * BK; e += THREADS) {
            const int n = e / BK, kk = e % BK;
            const bool ok = col0 + n < p.h && k0 + kk < p.ht;
            sm.w[stage][n][kk] = ok ? wsrc[static_cast<int64_t>(col0 + n) * width + k0 + kk] : zero;
        }
    }
}

template <typename T, int MF, int WN, int BK, int STAGES, bool VEC>
__global__ void __launch_bounds__(32 * WN) fc_norm_tc_kernel(FcNormArgs p, const T* __restrict__ weight,
                                                             T* __restrict__ out) {
    using namespace nvcuda;
    using Tile = TcTile<T, MF, WN, BK, STAGES>;
    constexpr int BM = Tile::BM, BN = Tile::BN, THREADS = Tile::THREADS;
    constexpr int ROW_THREADS = Tile::ROW_THREADS, COLS_PER_THREAD = BK / ROW_THREADS;
    __shared__ typename Tile::Shared sm;

    const int warp = threadIdx.x / 32;
    // Row tiles vary fastest so the blocks that share a weight tile run together and the weight
    // comes from HBM once, then from L2.
    const int row0 = blockIdx.x * BM;
    const int col0 = blockIdx.y * BN;
    const int k_tiles = (p.ht + BK - 1) / BK;
    const int total = p.k * k_tiles;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MF];
#pragma unroll
    for (int m = 0; m < MF; ++m) wmma::fill_fragment(acc[m], 0.0f);
    float result[Tile::OUT_PER_THREAD];
#pragma unroll
    for (int j = 0; j < Tile::OUT_PER_THREAD; ++j) result[j] = 0.0f;

    const int ss_row = threadIdx.x / ROW_THREADS;  // this thread's share of one row's sum of squares
    const int ss_col0 = (threadIdx.x % ROW_THREADS) * COLS_PER_THREAD;
    float sum_sq = 0.0f;

    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < total) load_tile<T, Tile, VEC>(sm, p, weight, row0, col0, k_tiles, s, s);
        cp_async_commit();
    }

    for (int t = 0; t < total; ++t) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile t have landed ...
        __syncthreads();              // ... everyone's have, and tile t-1's stage is free again
        const int next = t + STAGES - 1;
        if (next < total) load_tile<T, Tile, VEC>(sm, p, weight, row0, col0, k_tiles, next, next % STAGES);
        cp_async_commit();  // possibly empty: keeps the group count uniform for cp_async_wait

        const int stage = t % STAGES;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
            wmma::load_matrix_sync(b, &sm.w[stage][warp * 16][kk], Tile::LDS);
#pragma unroll
            for (int m = 0; m < MF; ++m) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::load_matrix_sync(a, &sm.a[stage][m * 16][kk], Tile::LDS);
                wmma::mma_sync(acc[m], a, b, acc[m]);
            }
        }
        if (p.has_norm) {
#pragma unroll
            for (int j = 0; j < COLS_PER_THREAD; ++j) {
                const float v = to_float(sm.a[stage][ss_row][ss_col0 + j]);
                sum_sq += v * v;  // padding is zero, so partial tiles need no mask
            }
        }

        if ((t + 1) % k_tiles != 0) continue;

        // End of a source: fold its partial product into the result with the per-row scale.
        float ss = sum_sq;
#pragma unroll
        for (int offset = ROW_THREADS / 2; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
        if (threadIdx.x % ROW_THREADS == 0) sm.inv_rms[ss_row] = p.has_norm ? inverse_rms(ss, p.ht, p.eps) : 1.0f;
        sum_sq = 0.0f;
#pragma unroll
        for (int m = 0; m < MF; ++m) {
            wmma::store_matrix_sync(&sm.c[m * 16][warp * 16], acc[m], Tile::LDC, wmma::mem_row_major);
            wmma::fill_fragment(acc[m], 0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < Tile::OUT_PER_THREAD; ++j) {
            const int e = threadIdx.x + j * THREADS;
            result[j] += sm.inv_rms[e / BN] * sm.c[e / BN][e % BN];
        }
        // sm.c / sm.inv_rms are next written after the following loop-top __syncthreads.
    }

#pragma unroll
    for (int j = 0; j < Tile::OUT_PER_THREAD; ++j) {
        const int e = threadIdx.x + j * THREADS;
        const int r = row0 + e / BN, n = col0 + e % BN;
        if (r < p.rows && n < p.h) out[static_cast<int64_t>(r) * p.h + n] = from_float<T>(result[j]);
    }
}

template <typename T, int MF, int WN, int BK, int STAGES, bool VEC>
void launch_tc(const FcNormArgs& p, const T* weight, T* out, cudaStream_t stream) {
    using Tile = TcTile<T, MF, WN, BK, STAGES>;
    const dim3 grid((p.rows + Tile::BM - 1) / Tile::BM, (p.h + Tile::BN - 1) / Tile::BN);
    fc_norm_tc_kernel<T, MF, WN, BK, STAGES, VEC><<<grid, Tile::THREADS, 0, stream>>>(p, weight, out);
}

// ---------------------------------------------------------------------------------------------
// Few-row kernel (fp16 / bf16, 1..8 rows): NF output features per warp on CUDA cores.
// ---------------------------------------------------------------------------------------------
// With a handful of rows the product is a matrix-vector product, bound by reading W' once. The
// tensor-core kernel walks K in 64-column strips, so at any moment all blocks read 128-byte pieces
// of rows 43 KB apart (~1 TB/s measured on an H200 at 1..16 rows). Here each warp reads its own
// feature rows front to back, 512 contiguous bytes per load, streamed past L1 (`__ldcs`). The
// activations are staged in shared memory once per block, a 40 KB piece at a time (every warp reads
// all of them; staged, each block reads them from L2 once), their squares summed meanwhile.

// Eight consecutive elements (16 bytes, 16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 bits, float (&v)[8]) {
    const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            v[2 * j] = __uint_as_float(words[j] << 16);
            v[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
        } else {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[j]));
            v[2 * j] = f.x;
            v[2 * j + 1] = f.y;
        }
    }
}

// Shared memory one staged piece of activations takes at most: [R rows][piece columns]. 40 KB stays
// within the 48 KB a launch gets without opting in, and leaves room for several blocks per SM.
constexpr int kRowsPieceBytes = 40 * 1024;

// 16-byte chunks per row in one piece: a whole source's row where it fits (small R stages less).
__host__ __device__ inline int rows_piece_chunks(int rows_r, int ht) {
    const int fit = kRowsPieceBytes / (rows_r * 16);
    return ht / 8 < fit ? ht / 8 : fit;
}

// MIN_BLOCKS caps the registers so that more blocks fit on an SM: at 1 row the kernel fits in 64
// without spilling (tests/test_plugins_nvcc.py holds every kernel to no spills).
template <typename T, int R, int NF, int U, int WARPS, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
    fc_norm_rows_kernel(FcNormArgs p, const T* __restrict__ weight, T* __restrict__ out) {
    extern __shared__ uint4 staged[];  // [R][PIECE]: a piece of one source's activations
    const int PIECE = rows_piece_chunks(R, p.ht);
    __shared__ float warp_ss[WARPS * R];
    __shared__ float inv_rms[R];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * WARPS + warp) * NF;
    const int64_t width = static_cast<int64_t>(p.k) * p.ht;
    const int chunks = p.ht / 8;
    const T* wrow[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) wrow[f] = weight + static_cast<int64_t>(min(n0 + f, p.h - 1)) * width;  // clamped:
    // every warp stays in the loop and its __syncthreads; only features < h are written.

    float y[NF][R];
#pragma unroll
    for (int f = 0; f < NF; ++f) {
#pragma unroll
        for (int r = 0; r < R; ++r) y[f][r] = 0.0f;
    }
    for (int i = 0; i < p.k; ++i) {
        const T* act = static_cast<const T*>(p.sources.ptr[i]);
        const uint4* wsrc[NF];
#pragma unroll
        for (int f = 0; f < NF; ++f) wsrc[f] = reinterpret_cast<const uint4*>(wrow[f] + static_cast<int64_t>(i) * p.ht);
        float part[NF][R], sum_sq[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            sum_sq[r] = 0.0f;
#pragma unroll
            for (int f = 0; f < NF; ++f) part[f][r] = 0.0f;
        }
        for (int piece0 = 0; piece0 < chunks; piece0 += PIECE) {
            const int piece = min(PIECE, chunks - piece0);
            __syncthreads();  // every warp is done with the previous piece
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r >= p.rows) break;
                const uint4* src = reinterpret_cast<const uint4*>(act + static_cast<int64_t>(r) * p.ht) + piece0;
                for (int c = threadIdx.x; c < piece; c += 32 * WARPS) {
                    const uint4 bits = __ldg(src + c);
                    staged[r * PIECE + c] = bits;
                    float v[8];
                    unpack8<T>(bits, v);
#pragma unroll
                    for (int e = 0; e < 8; ++e) sum_sq[r] += v[e] * v[e];
                }
            }
            __syncthreads();
            // U loads of each feature row are issued before any is used, so that a warp waits on
            // U * NF * 512 bytes of the weight at once rather than on one load at a time.
            for (int base = lane; base < piece; base += U * 32) {
                uint4 wbits[U][NF];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = base + u * 32;
#pragma unroll
                    for (int f = 0; f < NF; ++f) wbits[u][f] = c < piece ? __ldcs(wsrc[f] + piece0 + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = base + u * 32;
                    if (c >= piece) break;
                    float w[NF][8];
#pragma unroll
                    for (int f = 0; f < NF; ++f) unpack8<T>(wbits[u][f], w[f]);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r >= p.rows) break;
                        float a[8];
                        unpack8<T>(staged[r * PIECE + c], a);
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
#pragma unroll
                            for (int f = 0; f < NF; ++f) part[f][r] += w[f][e] * a[e];
                        }
                    }
                }
            }
        }
        // This source's scales, from the squares summed while staging, in a fixed order (deterministic).
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float ss = warp_sum(sum_sq[r]);
            if (lane == 0) warp_ss[warp * R + r] = ss;
        }
        __syncthreads();
        if (threadIdx.x < R) {
            float ss = 0.0f;
            for (int w = 0; w < WARPS; ++w) ss += warp_ss[w * R + threadIdx.x];
            inv_rms[threadIdx.x] = p.has_norm ? inverse_rms(ss, p.ht, p.eps) : 1.0f;
        }
        __syncthreads();
#pragma unroll
        for (int f = 0; f < NF; ++f) {
#pragma unroll
            for (int r = 0; r < R; ++r) y[f][r] += inv_rms[r] * warp_sum(part[f][r]);
        }
        // inv_rms / warp_ss are next written after this source's pieces' __syncthreads.
    }
    if (lane != 0) return;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < p.rows && n0 + f < p.h) out[static_cast<int64_t>(r) * p.h + n0 + f] = from_float<T>(y[f][r]);
        }
    }
}

template <typename T, int R>
void launch_rows(const FcNormArgs& p, const T* weight, T* out, cudaStream_t stream) {
    constexpr int NF = 2, U = 4, WARPS = 8;
    const dim3 grid((p.h + NF * WARPS - 1) / (NF * WARPS));
    const int smem = R * rows_piece_chunks(R, p.ht) * 16;  // <= 40 KB: within the default 48 KB
    fc_norm_rows_kernel<T, R, NF, U, WARPS, (R == 1 ? 4 : 2)><<<grid, 32 * WARPS, smem, stream>>>(p, weight, out);
}

template <typename T>
void launch_fc_norm_16bit(const FcNormArgs& p, const T* weight, T* out, cudaStream_t stream) {
    bool vec = p.ht % 8 == 0 && aligned16(weight);
    for (int i = 0; i < p.k; ++i) vec = vec && aligned16(p.sources.ptr[i]);
    if (!vec) {
        launch_tc<T, 1, 2, 64, 2, false>(p, weight, out, stream);
    } else if (p.rows <= 8) {
        if (p.rows == 1) launch_rows<T, 1>(p, weight, out, stream);
        else if (p.rows == 2) launch_rows<T, 2>(p, weight, out, stream);
        else if (p.rows <= 4) launch_rows<T, 4>(p, weight, out, stream);
        else launch_rows<T, 8>(p, weight, out, stream);
    } else if (p.rows <= 16) {
        // Few rows: narrow column tiles give H/32 blocks (224 at H = 7168) to cover every SM,
        // and five stages keep ~20 KB of weight in flight per block.
        launch_tc<T, 1, 2, 64, 5, true>(p, weight, out, stream);
    } else if (p.rows <= 64) {
        launch_tc<T, 2, 4, 32, 4, true>(p, weight, out, stream);
    } else {
        launch_tc<T, 4, 4, 32, 3, true>(p, weight, out, stream);
    }
}

// ---------------------------------------------------------------------------------------------
// fp32 kernel (CUDA cores): ROWS rows per block, one warp per output feature.
// ---------------------------------------------------------------------------------------------

template <int ROWS, int WARPS>
__global__ void __launch_bounds__(32 * WARPS) fc_norm_f32_kernel(FcNormArgs p, const float* __restrict__ weight,
                                                                 float* __restrict__ out) {
    __shared__ float inv_rms[ROWS][EAGLE31_MAX_SOURCES];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = blockIdx.x * ROWS;

    // Prologue: one warp per (row, source) pair computes that pair's scale.
    for (int pair = warp; pair < ROWS * p.k; pair += WARPS) {
        const int rr = pair / p.k, i = pair % p.k;
        float scale = 1.0f;
        if (p.has_norm && row0 + rr < p.rows) {
            const float* a = static_cast<const float*>(p.sources.ptr[i]) + static_cast<int64_t>(row0 + rr) * p.ht;
            float ss = 0.0f;
            for (int j = lane; j < p.ht; j += 32) ss += a[j] * a[j];
            scale = inverse_rms(warp_sum(ss), p.ht, p.eps);
        }
        if (lane == 0) inv_rms[rr][i] = scale;
    }
    __syncthreads();

    const int n = blockIdx.y * WARPS + warp;
    if (n >= p.h) return;
    const int64_t width = static_cast<int64_t>(p.k) * p.ht;
    float y[ROWS];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) y[rr] = 0.0f;
    for (int i = 0; i < p.k; ++i) {
        const float* a = static_cast<const float*>(p.sources.ptr[i]);
        const float* wrow = weight + n * width + static_cast<int64_t>(i) * p.ht;
        float part[ROWS];
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) part[rr] = 0.0f;
        for (int j = lane; j < p.ht; j += 32) {
            const float w = wrow[j];
#pragma unroll
            for (int rr = 0; rr < ROWS; ++rr) {
                if (row0 + rr < p.rows) part[rr] += w * a[static_cast<int64_t>(row0 + rr) * p.ht + j];
            }
        }
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) y[rr] += inv_rms[rr][i] * warp_sum(part[rr]);
    }
    if (lane != 0) return;
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        if (row0 + rr < p.rows) out[static_cast<int64_t>(row0 + rr) * p.h + n] = y[rr];
    }
}

void launch_fc_norm_f32(const FcNormArgs& p, const float* weight, float* out, cudaStream_t stream) {
    constexpr int ROWS = 4, WARPS = 8;
    const dim3 grid((p.rows + ROWS - 1) / ROWS, (p.h + WARPS - 1) / WARPS);
    fc_norm_f32_kernel<ROWS, WARPS><<<grid, 32 * WARPS, 0, stream>>>(p, weight, out);
}

}  // namespace
}  // namespace cuda
}  // namespace eagle31

extern "C" int eagle31_fc_norm_cuda(int dtype, const void* const* sources, int32_t num_sources, const void* weight,
                                    void* out, int64_t rows, int64_t hidden_in, int64_t hidden_out, float eps,
                                    int32_t has_norm, void* stream) {
    using namespace eagle31::cuda;
    constexpr int64_t kIntMax = 0x7fffffff;
    if (!sources || !weight || !out || num_sources < 1 || num_sources > EAGLE31_MAX_SOURCES || rows < 0 ||
        hidden_in < 1 || hidden_out < 1 || rows > kIntMax || hidden_in * num_sources > kIntMax ||
        hidden_out > 65535LL * 8) {  // 65535 * 8: grid.y limit of the narrowest column tiling
        return EAGLE31_BAD_ARGUMENT;
    }
    if (rows == 0) return EAGLE31_OK;
    FcNormArgs p{};
    for (int i = 0; i < num_sources; ++i) {
        if (!sources[i]) return EAGLE31_BAD_ARGUMENT;
        p.sources.ptr[i] = sources[i];
    }
    p.k = num_sources;
    p.rows = static_cast<int>(rows);
    p.ht = static_cast<int>(hidden_in);
    p.h = static_cast<int>(hidden_out);
    p.eps = eps;
    p.has_norm = has_norm != 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case EAGLE31_FLOAT32:
            launch_fc_norm_f32(p, static_cast<const float*>(weight), static_cast<float*>(out), s);
            break;
        case EAGLE31_FLOAT16:
            launch_fc_norm_16bit(p, static_cast<const __half*>(weight), static_cast<__half*>(out), s);
            break;
        case EAGLE31_BFLOAT16:
            launch_fc_norm_16bit(p, static_cast<const __nv_bfloat16*>(weight), static_cast<__nv_bfloat16*>(out), s);
            break;
        default:
            return EAGLE31_BAD_DTYPE;
    }
    return cudaGetLastError() == cudaSuccess ? EAGLE31_OK : EAGLE31_LAUNCH_FAILED;
}
