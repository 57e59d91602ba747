// Shared pieces of the flash-attention kernels (flash_forward.cu, flash_backward.cu): the
// kernel parameters built by flash_attention.cu, strided tile loads into shared memory
// (cp.async), warp-level matrix products from shared memory (mma.sync m16n8k16 for 16-bit
// types, exact float32 FMAs for float32), and the in-kernel dropout mask.
//
// Every product works on the accumulator layout of mma.sync m16n8k16: a warp's output is a
// grid of 16x8 tiles, and in each tile lane l holds rows g = l / 4 and g + 8, columns
// 2 * (l % 4) and 2 * (l % 4) + 1 (four floats: (g, c), (g, c + 1), (g + 8, c),
// (g + 8, c + 1)). The float32 path computes the same layout with FMAs, so softmax, masking
// and the epilogues are written once for both.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/attention_dropout.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/philox.h"
#include "ringdilated/kernels/strided.h"

namespace rd::kernels::cuda::flash {

inline constexpr int kMaxBatchDims = kMaxDims - 2;
inline constexpr int kWarpSize = 32;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------
// Parameters (plain data, passed by value to the kernels).

// One strided operand [batch..., rows, D] (or [batch..., rows] for lse-like statistics)
// with a unit-stride head dim. Strides are in elements of the operand's own dtype.
struct Operand {
  void* data = nullptr;
  int64_t batch_strides[kMaxBatchDims] = {};
  int64_t row_stride = 0;
  bool is_float32 = false;  // stored as float32 (else as the kernel's 16-bit type)
  bool vec = false;         // every row starts 16-byte aligned and D fills whole 16-byte chunks
  bool pairs = false;       // elements (2c, 2c + 1) of a row can be accessed as one pair
};

// The flattened batch dims shared by every operand of a call.
struct BatchShape {
  int ndim = 0;
  int64_t shape[kMaxBatchDims] = {};
};

// What every kernel of one call needs besides its operands.
struct Problem {
  BatchShape batch;
  int64_t batch_count = 0;
  int64_t lq = 0, lk = 0;
  int d = 0;
  float scale = 1.0f;       // softmax scale
  float scale_log2 = 1.0f;  // scale * log2(e): p = exp2(scale_log2 * s - max), one FFMA
  bool causal = false;
  int64_t causal_offset = 0;  // clamped to [-(lq + 1), lk]: the same mask, no overflow
  bool dropout = false;
  uint32_t keep_threshold = 0;  // keep iff (Philox word 0 >> 8) < keep_threshold
  float keep_rescale = 1.0f;    // 1 / (1 - dropout), 1 without dropout
  uint64_t seed = 0, offset = 0;
  DropoutIndexing numbering;  // resolved (kernels/attention_dropout.h)
};

struct ForwardParams {
  Problem pr;
  Operand q, k, v, out, lse;  // lse.data == nullptr: not written
};

struct BackwardParams {
  Problem pr;
  Operand q, k, v, out, grad_out, lse, grad_lse;  // grad_lse.data may be nullptr
  Operand grad_q, grad_k, grad_v;
  float* delta = nullptr;  // [batch * lq] rowsum(dO * O) - grad_lse, contiguous scratch
  Operand dq_accum;        // float32 target of the dQ atomics: grad_q itself or scratch
};

// Host-side entry points of the two kernel files (dtype is q's: float32, bf16 or fp16).
void launch_forward(DType dtype, const ForwardParams& params, cudaStream_t stream);
void launch_backward(DType dtype, const BackwardParams& params, cudaStream_t stream);
// Dynamic shared memory the kernel serving (dtype, d) needs, for the support check.
size_t forward_smem_bytes(DType dtype, int d);
size_t backward_smem_bytes(DType dtype, int d);

// The smallest head-dim bucket (32, 64, 128 or 256) holding d; kernels are instantiated
// per bucket and zero-pad the head dim up to it. 0 when d > 256.
constexpr int head_dim_bucket(int d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

// Host side: calls f(std::type_identity<ConfigFor<T, bucket>>{}) for the element type T of
// `dtype` (float, __nv_bfloat16, __half) and the head-dim bucket of d, and returns what f
// returns. Unserved dtypes and head dims over 256 throw, naming `op`. The forward and the
// backward each pass their own ConfigFor, so the dispatch is written once.
template <template <class, int> class ConfigFor, class F>
auto with_config(DType dtype, int d, const char* op, F&& f) {
  auto with_bucket = [&](auto elem) {
    using T = typename decltype(elem)::type;
    switch (head_dim_bucket(d)) {
      case 32: return f(std::type_identity<ConfigFor<T, 32>>{});
      case 64: return f(std::type_identity<ConfigFor<T, 64>>{});
      case 128: return f(std::type_identity<ConfigFor<T, 128>>{});
      case 256: return f(std::type_identity<ConfigFor<T, 256>>{});
      default: RD_FAIL(kUnimplemented, op, ": head dim ", d, " is over 256");
    }
  };
  switch (dtype) {
    case DType::kFloat32: return with_bucket(std::type_identity<float>{});
    case DType::kBFloat16: return with_bucket(std::type_identity<__nv_bfloat16>{});
    case DType::kFloat16: return with_bucket(std::type_identity<__half>{});
    default:
      RD_FAIL(kDTypeMismatch, op, ": dtype ", dtype_name(dtype),
              " is not served (float32, bfloat16, float16)");
  }
}

// Shared memory a config needs per block, or 0 where no config serves (dtype, d).
template <template <class, int> class ConfigFor>
size_t config_smem_bytes(DType dtype, int d) {
  const bool served =
      head_dim_bucket(d) != 0 &&
      (dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16);
  if (!served) return 0;
  return with_config<ConfigFor>(dtype, d, "flash attention", [](auto config) -> size_t {
    return decltype(config)::type::kSmemBytes;
  });
}

// Launches `kernel` of config Cfg on `blocks` blocks with the config's dynamic shared memory,
// which may exceed the 48 KiB a kernel gets unless it asks for more.
template <class Cfg, class Params>
void launch_with_smem(void (*kernel)(Params), int64_t blocks, const Params& params,
                      cudaStream_t stream) {
  RD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(Cfg::kSmemBytes)));
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  RD_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Batch indexing.

struct BatchIndex {
  int64_t idx[kMaxBatchDims];
};

__device__ __forceinline__ BatchIndex batch_index(const BatchShape& s, int64_t b) {
  BatchIndex r;
#pragma unroll
  for (int d = kMaxBatchDims - 1; d >= 0; --d) {
    r.idx[d] = 0;
    if (d < s.ndim) {
      r.idx[d] = b % s.shape[d];
      b /= s.shape[d];
    }
  }
  return r;
}

// Element offset of batch `bi` in `op` (rows and head dim at 0).
__device__ __forceinline__ int64_t batch_offset(const BatchIndex& bi, const Operand& op) {
  int64_t off = 0;
#pragma unroll
  for (int d = 0; d < kMaxBatchDims; ++d) off += bi.idx[d] * op.batch_strides[d];
  return off;
}

// ---------------------------------------------------------------------------------------
// Element types: float, __nv_bfloat16, __half.

template <class T>
inline constexpr bool kIsTensorCoreType =
    std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// Two floats as one 32-bit register of two 16-bit values (lo in the low half).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  }
  return r;
}

// Element `i` of an operand stored as float32 or as T, in float.
template <class T>
__device__ __forceinline__ float load_float(const Operand& op, const void* base, int64_t i) {
  return op.is_float32 ? static_cast<const float*>(base)[i]
                       : to_float(static_cast<const T*>(base)[i]);
}

// Stores (or adds into, when `accumulate`) elements col and col + 1 (those < d) of a row
// starting at `row` of an operand stored as float32 or as T.
template <class T>
__device__ __forceinline__ void store_pair(const Operand& op, void* row, int col, int d, float v0,
                                           float v1, bool accumulate) {
  if (op.is_float32) {
    float* p = static_cast<float*>(row) + col;
    if (op.pairs && col + 1 < d) {
      float2 x = make_float2(v0, v1);
      if (accumulate) {
        const float2 old = *reinterpret_cast<const float2*>(p);
        x.x += old.x;
        x.y += old.y;
      }
      *reinterpret_cast<float2*>(p) = x;
      return;
    }
    if (col < d) p[0] = accumulate ? p[0] + v0 : v0;
    if (col + 1 < d) p[1] = accumulate ? p[1] + v1 : v1;
  } else {
    T* p = static_cast<T*>(row) + col;
    if constexpr (!std::is_same_v<T, float>) {
      if (op.pairs && col + 1 < d) {
        if (accumulate) {
          v0 += to_float(p[0]);
          v1 += to_float(p[1]);
        }
        *reinterpret_cast<uint32_t*>(p) = pack2<T>(v0, v1);
        return;
      }
    }
    if (col < d) p[0] = from_float<T>(accumulate ? to_float(p[0]) + v0 : v0);
    if (col + 1 < d) p[1] = from_float<T>(accumulate ? to_float(p[1]) + v1 : v1);
  }
}

// ---------------------------------------------------------------------------------------
// Asynchronous copies and shared-memory matrix loads.

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}

// 4 bytes global -> shared, or zero when !valid.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

// c += a * b on one m16n8k16 tile, float32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------
// Tiles.

// Copies rows [row0, row0 + kRows) x head-dim columns [0, kCols) of one batch of `op`
// (`base` points at its row 0) into the shared tile `dst` (row pitch kPitch elements).
// Rows >= rows_limit and columns >= d are zero-filled, so padded products add nothing.
// Operands stored as T with aligned 16-byte chunks go through cp.async (the caller commits
// and waits); others (unaligned, odd D, float32 data for a 16-bit kernel) are read element
// by element and converted, synchronously.
template <class T, int kRows, int kCols, int kPitch, int kThreads>
__device__ __forceinline__ void load_tile(T* dst, const Operand& op, const void* base, int64_t row0,
                                          int64_t rows_limit, int d) {
  // Each thread copies one fixed 16-byte column chunk of every kRowStep-th row, so its
  // global address advances by a constant and its shared address by an immediate.
  constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunksPerRow = kCols / kChunk;
  static_assert(kThreads % kChunksPerRow == 0, "load_tile: a row must split over the threads");
  constexpr int kRowStep = kThreads / kChunksPerRow;
  static_assert(kRows % kRowStep == 0, "load_tile: the rows must split over the threads");
  const int r_first = static_cast<int>(threadIdx.x) / kChunksPerRow;
  const int col = (static_cast<int>(threadIdx.x) % kChunksPerRow) * kChunk;
  const int64_t step = kRowStep * op.row_stride;
  const bool stored_as_t = op.is_float32 == std::is_same_v<T, float>;
  if (stored_as_t && op.vec) {
    const T* src = static_cast<const T*>(base);
    const T* p = src + (row0 + r_first) * op.row_stride + col;
    const bool col_ok = col < d;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const int r = r_first + i * kRowStep;
      const bool valid = col_ok && row0 + r < rows_limit;
      cp_async_16(dst + r * kPitch + col, valid ? p : src, valid);
      p += step;
    }
    return;
  }
  int64_t offset = (row0 + r_first) * op.row_stride + col;
  for (int i = 0; i < kRows / kRowStep; ++i, offset += step) {
    const int r = r_first + i * kRowStep;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      float x = 0.0f;
      if (row0 + r < rows_limit && col + e < d) x = load_float<T>(op, base, offset + e);
      dst[r * kPitch + col + e] = from_float<T>(x);
    }
  }
}

// Copies entries [row0, row0 + kRows) of a per-row float32 statistic (lse, delta) into
// shared memory with cp.async; entries >= rows_limit become 0.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_row_stat(float* dst, const float* base, int64_t stride,
                                              int64_t row0, int64_t rows_limit) {
  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    const int64_t row = row0 + r;
    const bool valid = row < rows_limit;
    cp_async_4(dst + r, valid ? base + row * stride : base, valid);
  }
}

// How a warp's share of a [kRows x kCols] product is laid out: warps form a kWarpsM x
// kWarpsN grid, each owning kMT x kNT tiles of 16x8.
template <int kRows, int kCols, int kWarps>
struct WarpGrid {
  static constexpr int kWarpsM = kWarps < kRows / 16 ? kWarps : kRows / 16;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kMT = kRows / 16 / kWarpsM;
  static constexpr int kNT = kCols / 8 / kWarpsN;
  static_assert(kWarpsM * kWarpsN == kWarps && kMT * 16 * kWarpsM == kRows &&
                    kNT * 8 * kWarpsN == kCols,
                "WarpGrid: the tile does not split evenly over the warps");
  __device__ static int row0(int warp) { return (warp % kWarpsM) * kMT * 16; }
  __device__ static int col0(int warp) { return (warp / kWarpsM) * kNT * 8; }
};

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    }
  }
}

// B fragments of n-tiles 2 * np and 2 * np + 1 at k-step ks (16-bit types): regs 0-1 for the
// first tile, 2-3 for the second. B's element (k, n) is b[n * ldb + k] (k contiguous), or
// b[k * ldb + n] when kBRowMajor.
template <bool kBRowMajor, class T>
__device__ __forceinline__ void load_b_pair(uint32_t (&frag)[4], const T* b, int ldb, int ks,
                                            int np, int lane) {
  const int i = lane >> 3, r = lane & 7;
  if constexpr (kBRowMajor) {
    ldmatrix_x4_trans(frag, b + (ks * 16 + r + (i & 1) * 8) * ldb + np * 16 + (i >> 1) * 8);
  } else {
    ldmatrix_x4(frag, b + (np * 16 + r + (i >> 1) * 8) * ldb + ks * 16 + (i & 1) * 8);
  }
}

// acc (MT x NT tiles of 16x8) += A (MT*16 x kK) * B (kK x NT*8), both in shared memory.
// A's element (m, k) is a[m * lda + k], or a[k * lda + m] when kATransposed (A stored
// transposed, e.g. P^T from a row-major P). B as in load_b_pair. 16-bit types use
// ldmatrix + mma.sync; float32 uses exact FMAs in the same accumulator layout.
template <class T, int MT, int NT, int kK, bool kATransposed, bool kBRowMajor>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], const T* a, int lda, const T* b,
                                          int ldb) {
  const int lane = threadIdx.x & 31;
  if constexpr (std::is_same_v<T, float>) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int k = 0; k < kK; ++k) {
      float av[MT][2], bv[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = mt * 16 + g + 8 * h;
          av[mt][h] = kATransposed ? a[k * lda + m] : a[m * lda + k];
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = nt * 8 + 2 * t + e;
          bv[nt][e] = kBRowMajor ? b[k * ldb + n] : b[n * ldb + k];
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[mt][nt][0] = fmaf(av[mt][0], bv[nt][0], acc[mt][nt][0]);
          acc[mt][nt][1] = fmaf(av[mt][0], bv[nt][1], acc[mt][nt][1]);
          acc[mt][nt][2] = fmaf(av[mt][1], bv[nt][0], acc[mt][nt][2]);
          acc[mt][nt][3] = fmaf(av[mt][1], bv[nt][1], acc[mt][nt][3]);
        }
      }
    }
  } else {
    static_assert(NT % 2 == 0 && kK % 16 == 0, "warp_gemm: tiles come in pairs of 16x8");
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (kATransposed) {
          const int i = lane >> 3, r = lane & 7;
          ldmatrix_x4_trans(af[mt], a + (ks * 16 + r + (i >> 1) * 8) * lda + mt * 16 + (i & 1) * 8);
        } else {
          ldmatrix_x4(af[mt], a + (mt * 16 + (lane & 15)) * lda + ks * 16 + (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        load_b_pair<kBRowMajor>(bf, b, ldb, ks, np, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
          mma_16816<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dropout: the mask of kernels/attention.h, bit for bit.

__device__ __forceinline__ bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t threshold,
                                             uint64_t element) {
  return (philox_for_element(seed, offset, element).w[0] >> 8) < threshold;
}

// Bit (mt * NT + nt) * 4 + i is set when element i of the warp's accumulator tile (mt, nt)
// survives dropout. `first` is the dropout number of the lane's first element (row
// row0 + g, column col0 + 2 t); rows advance the number by row_stride, columns by
// col_stride, added up as the loops go (no multiplication or division per element).
// Elements outside [0, lq) x [0, lk) count as kept. Not inlined, with rolled loops: one
// Philox call per element without unrolling it 64 times into the caller or holding every
// element's number in registers.
template <int MT, int NT>
__device__ __noinline__ uint64_t dropout_keep_mask(uint64_t seed, uint64_t offset,
                                                   uint32_t threshold, int64_t lq, int64_t lk,
                                                   int64_t row0, int64_t col0, uint64_t first,
                                                   uint64_t row_stride, uint64_t col_stride) {
  static_assert(MT * NT * 4 <= 64, "dropout_keep_mask: at most 64 elements a lane");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint64_t mask = 0;
  // Rows of the lane: row0 + g + 8 * half, half = 2 * mt + h (h: the tile's upper or lower 8).
  int64_t row = row0 + g;
  uint64_t row_number = first;
#pragma unroll 1
  for (int half = 0; half < 2 * MT; ++half, row += 8, row_number += 8 * row_stride) {
    int64_t col = col0 + 2 * t;
    uint64_t number = row_number;
#pragma unroll 1
    for (int nt = 0; nt < NT; ++nt, col += 8, number += 8 * col_stride) {
      uint64_t element = number;
#pragma unroll 1
      for (int e = 0; e < 2; ++e, element += col_stride) {
        bool keep = true;
        if (row < lq && col + e < lk) keep = dropout_keep(seed, offset, threshold, element);
        const int bit = ((half >> 1) * NT + nt) * 4 + 2 * (half & 1) + e;
        mask |= static_cast<uint64_t>(keep) << bit;
      }
    }
  }
  return mask;
}

// The keep mask of the warp's accumulator tiles starting at (row0, col0) of the batch whose
// dropout number of element (0, 0) is `batch_base` (dropout_batch_base, once per block).
template <int MT, int NT>
__device__ __forceinline__ uint64_t dropout_keep_mask(const Problem& pr, uint64_t batch_base,
                                                      int64_t row0, int64_t col0) {
  const int lane = threadIdx.x & 31;
  const uint64_t first =
      dropout_element(pr.numbering, batch_base, row0 + (lane >> 2), col0 + 2 * (lane & 3));
  return dropout_keep_mask<MT, NT>(pr.seed, pr.offset, pr.keep_threshold, pr.lq, pr.lk, row0, col0,
                                   first, static_cast<uint64_t>(pr.numbering.row_stride),
                                   static_cast<uint64_t>(pr.numbering.col_stride));
}

// The dropout number of element (0, 0) of flattened batch b (0 without dropout).
__device__ __forceinline__ uint64_t batch_dropout_base(const Problem& pr, int64_t b) {
  return pr.dropout ? kernels::dropout_batch_base(pr.numbering, pr.batch.shape, pr.batch.ndim, b)
                    : 0;
}

}  // namespace rd::kernels::cuda::flash
