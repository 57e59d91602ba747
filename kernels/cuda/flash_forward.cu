// The flash-attention forward kernel (FlashAttention-2 structure): one block per (batch,
// tile of kBM query rows), looping over tiles of kBN keys with an online softmax, K/V tiles
// double-buffered in shared memory through cp.async. See flash_attention.h for the design.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/cuda/flash_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda::flash {
namespace {

// Tile shape of one instantiation. Each warp owns kBM / kWarps query rows (16 or 32) and
// all kBN keys of a tile, so the softmax of a row never leaves its quad of lanes.
template <class T, int kD, int kBM, int kBN, int kWarps, int kStages, int kMinBlocks = 1>
struct ForwardConfig {
  using Elem = T;
  static constexpr int kHeadDim = kD, kBlockM = kBM, kBlockN = kBN, kNumStages = kStages;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlocksPerSM = kMinBlocks;  // register budget: 64K / (threads * this)
  static constexpr int kWarpRows = kBM / kWarps;
  static constexpr int kMT = kWarpRows / 16;  // 16-row tiles per warp
  static constexpr int kNT = kBN / 8;         // 8-key tiles of a score tile
  static constexpr int kDT = kD / 8;          // 8-column tiles of the output
  static constexpr bool kTensorCores = kIsTensorCoreType<T>;
  // Rows padded by 16 bytes: the 8 rows an ldmatrix phase reads hit 8 different bank groups.
  static constexpr int kPitch = kD + 16 / static_cast<int>(sizeof(T));
  static constexpr int kPPitch = kBN + 4;  // float32 path: P staged in shared memory
  static constexpr size_t kQBytes = size_t{kBM} * kPitch * sizeof(T);
  static constexpr size_t kKVBytes = size_t{kBN} * kPitch * sizeof(T);  // one K or V tile
  static constexpr size_t kPBytes = kTensorCores ? 0 : size_t{kBM} * kPPitch * sizeof(float);
  static constexpr size_t kSmemBytes = kQBytes + 2 * kStages * kKVBytes + kPBytes;
  static_assert(kMT * 16 * kWarps == kBM, "ForwardConfig: kBM must give 16 or 32 rows a warp");
  static_assert(kStages == 1 || kStages == 2, "ForwardConfig: one or two K/V stages");
};

// 16-bit: 128x64 tiles on 4 warps (FlashAttention-2's choice for D <= 128); D = 256 keeps
// 128 rows on 8 warps with 32-key tiles so that two stages fit in 163 KB (A100). float32:
// 64x32 on 4 warps; D = 256 single-buffered for the same reason.
template <class T, int kD>
using ForwardConfigFor =
    std::conditional_t<kIsTensorCoreType<T>,
                       std::conditional_t<kD == 256, ForwardConfig<T, kD, 128, 32, 8, 2>,
                                          ForwardConfig<T, kD, 128, 64, 4, 2>>,
                       std::conditional_t<kD == 256, ForwardConfig<T, kD, 64, 32, 4, 1>,
                                          ForwardConfig<T, kD, 64, 32, 4, 2>>>;

// O += P V with P in registers (the score accumulators, rounded to T): the accumulator
// layout of a 16x16 score block is exactly mma.sync's A-fragment layout.
template <class Cfg, class T = typename Cfg::Elem>
__device__ __forceinline__ void accumulate_pv_registers(float (&o)[Cfg::kMT][Cfg::kDT][4],
                                                        const float (&s)[Cfg::kMT][Cfg::kNT][4],
                                                        const T* v_tile) {
  const int lane = threadIdx.x & 31;
  constexpr int kKS = Cfg::kBlockN / 16;
  // Round all of P first, so that the float scores die before the V fragments arrive.
  uint32_t a[kKS][Cfg::kMT][4];
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
      a[ks][mt][0] = pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
      a[ks][mt][1] = pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
      a[ks][mt][2] = pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
      a[ks][mt][3] = pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
    }
  }
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks) {
#pragma unroll
    for (int np = 0; np < Cfg::kDT / 2; ++np) {
      uint32_t bf[4];
      load_b_pair<true>(bf, v_tile, Cfg::kPitch, ks, np, lane);
#pragma unroll
      for (int mt = 0; mt < Cfg::kMT; ++mt) {
        mma_16816<T>(o[mt][2 * np], a[ks][mt], bf[0], bf[1]);
        mma_16816<T>(o[mt][2 * np + 1], a[ks][mt], bf[2], bf[3]);
      }
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kBlocksPerSM)
    forward_kernel(const ForwardParams p) {
  using T = typename Cfg::Elem;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = Cfg::kHeadDim;
  constexpr int kMT = Cfg::kMT, kNT = Cfg::kNT, kDT = Cfg::kDT, kPitch = Cfg::kPitch;
  constexpr int kThreads = Cfg::kThreads, kStages = Cfg::kNumStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_k = reinterpret_cast<T*>(smem + Cfg::kQBytes);  // stage s at s_k + s * kBN * kPitch
  T* s_v = s_k + kStages * kBN * kPitch;
  float* s_p = reinterpret_cast<float*>(s_v + kStages * kBN * kPitch);  // float32 path only

  const Problem& pr = p.pr;
  const int64_t m_blocks = (pr.lq + kBM - 1) / kBM;
  const int64_t b = static_cast<int64_t>(blockIdx.x) / m_blocks;
  int64_t m_block = static_cast<int64_t>(blockIdx.x) % m_blocks;
  if (pr.causal) m_block = m_blocks - 1 - m_block;  // the longest rows start first
  const int64_t m0 = m_block * kBM;

  const BatchIndex bi = batch_index(pr.batch, b);
  const uint64_t drop_base = batch_dropout_base(pr, b);
  const T* q = static_cast<const T*>(p.q.data) + batch_offset(bi, p.q);
  const T* k = static_cast<const T*>(p.k.data) + batch_offset(bi, p.k);
  const T* v = static_cast<const T*>(p.v.data) + batch_offset(bi, p.v);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2, t = lane & 3;
  const int warp_row0 = warp * Cfg::kWarpRows;

  // Keys past n_end are invisible to every row of this block.
  int64_t n_end = pr.lk;
  if (pr.causal) {
    n_end = std::min(m0 + kBM, pr.lq) + pr.causal_offset;
    n_end = std::max<int64_t>(0, std::min(n_end, pr.lk));
  }
  const int64_t n_blocks = (n_end + kBN - 1) / kBN;

  float o[kMT][kDT][4];
  zero(o);
  float row_max[kMT][2], row_sum[kMT][2];  // max of the raw scores; per-lane partial sums
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  auto load_kv = [&](int64_t n_block, int stage) {
    const int64_t n0 = n_block * kBN;
    load_tile<T, kBN, kD, kPitch, kThreads>(s_k + stage * kBN * kPitch, p.k, k, n0, pr.lk, pr.d);
    load_tile<T, kBN, kD, kPitch, kThreads>(s_v + stage * kBN * kPitch, p.v, v, n0, pr.lk, pr.d);
  };

  if (n_blocks > 0) {
    load_tile<T, kBM, kD, kPitch, kThreads>(s_q, p.q, q, m0, pr.lq, pr.d);
    load_kv(0, 0);
    cp_async_commit();
  }
  // One key tile: S = Q K^T, the online softmax, O += P V. kMasked (a type tag) selects the
  // variant that masks keys past Lk and, with causal, keys past row + offset, kDropout the
  // one that drops probabilities; the plain variant, which most tiles take, has no
  // per-element test at all.
  auto tile_step = [&](int64_t n_block, int stage, auto masked_tag, auto dropout_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    constexpr bool kDropout = decltype(dropout_tag)::value;
    const T* k_tile = s_k + stage * kBN * kPitch;
    const T* v_tile = s_v + stage * kBN * kPitch;
    float s[kMT][kNT][4];
    zero(s);
    warp_gemm<T, kMT, kNT, kD, false, false>(s, s_q + warp_row0 * kPitch, kPitch, k_tile, kPitch);

    // Tile-local indices: key c of the tile is visible to row r of the block iff
    // c < kv_left and (without causal or) c <= r + diag.
    const int64_t n0 = n_block * kBN;
    int kv_left = kBN, diag = 0;
    if constexpr (kMasked) {
      kv_left = static_cast<int>(std::min<int64_t>(pr.lk - n0, kBN));
      diag = static_cast<int>(
          std::clamp<int64_t>(m0 + pr.causal_offset - n0, -(int64_t{1} << 30), int64_t{1} << 30));
    }
    // Scores stay raw (the scale is positive, so the max commutes with it) and the scale is
    // folded into the exponent: p = 2^(s * scale * log2(e) - max * scale * log2(e)).
    // With two warps per scheduler there is little to hide latency behind, so the softmax
    // runs in phases over all of the lane's rows at once, and each row's max and sum are
    // folded as kChains independent chains instead of one dependent chain of 2 * kNT.
    constexpr int kChains = kNT >= 4 ? 4 : kNT;
    float mx[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + mt * 16 + g + 8 * h;
        float chain[kChains];
#pragma unroll
        for (int i = 0; i < kChains; ++i) chain[i] = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * h + e];
            if constexpr (kMasked) {
              const int c = nt * 8 + 2 * t + e;
              if (c >= kv_left || (pr.causal && c > r + diag)) x = -INFINITY;
            }
            chain[nt % kChains] = fmaxf(chain[nt % kChains], x);
          }
        }
#pragma unroll
        for (int i = 1; i < kChains; ++i) chain[0] = fmaxf(chain[0], chain[i]);
        mx[mt][h] = chain[0];
      }
    }
#pragma unroll
    for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[mt][h] = fmaxf(mx[mt][h], __shfl_xor_sync(0xffffffffu, mx[mt][h], lane_mask));
        }
      }
    }
    float correction[kMT][2], base[kMT][2];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float old_max = row_max[mt][h];
        const float new_max = fmaxf(old_max, mx[mt][h]);
        // A row with nothing visible yet keeps max -inf; subtract 0 so exp2 gives 0, not NaN.
        base[mt][h] = new_max == -INFINITY ? 0.0f : new_max * pr.scale_log2;
        correction[mt][h] =
            new_max == old_max ? 1.0f : fast_exp2(old_max * pr.scale_log2 - base[mt][h]);
        rescale |= new_max != old_max;
        row_max[mt][h] = new_max;
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float chain[kChains];
#pragma unroll
        for (int i = 0; i < kChains; ++i) chain[i] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * h + e];
            x = fast_exp2(fmaf(x, pr.scale_log2, -base[mt][h]));
            chain[nt % kChains] += x;
          }
        }
#pragma unroll
        for (int i = 1; i < kChains; ++i) chain[0] += chain[i];
        // Before dropout: the lse is that of the scores.
        row_sum[mt][h] = row_sum[mt][h] * correction[mt][h] + chain[0];
      }
    }
    // Once the row maxima settle, most tiles leave them unchanged: skip the rescale of O
    // unless some row of the warp moved.
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) o[mt][dt][i] *= correction[mt][i >> 1];
        }
      }
    }
    if constexpr (kDropout) {
      const uint64_t keep = dropout_keep_mask<kMT, kNT>(pr, drop_base, m0 + warp_row0, n0);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (!((keep >> ((mt * kNT + nt) * 4 + i)) & 1u)) s[mt][nt][i] = 0.0f;
          }
        }
      }
    }

    if constexpr (Cfg::kTensorCores) {
      accumulate_pv_registers<Cfg>(o, s, v_tile);
    } else {
      float* p_rows = s_p + warp_row0 * Cfg::kPPitch;  // this warp's rows only
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            p_rows[(mt * 16 + g + 8 * (i >> 1)) * Cfg::kPPitch + nt * 8 + 2 * t + (i & 1)] =
                s[mt][nt][i];
          }
        }
      }
      __syncwarp();
      warp_gemm<T, kMT, kDT, kBN, false, true>(o, p_rows, Cfg::kPPitch, v_tile, kPitch);
    }
  };

  for (int64_t n_block = 0; n_block < n_blocks; ++n_block) {
    const int stage = kStages == 2 ? static_cast<int>(n_block & 1) : 0;
    cp_async_wait<0>();
    // Tile n_block is in shared memory for every thread, and every warp is done with the
    // previous tile, so the prefetch below may refill its stage: one barrier per tile.
    __syncthreads();
    if (kStages == 2 && n_block + 1 < n_blocks) {
      load_kv(n_block + 1, stage ^ 1);
      cp_async_commit();
    }
    // Masks are needed on a partial last tile and on tiles crossing the causal diagonal of
    // some row of the block (decided for the whole block, so the branch is uniform).
    const int64_t n0 = n_block * kBN;
    // Dropout is a variant of its own too, so the plain tiles carry no select per element.
    const bool masked = n0 + kBN > pr.lk || (pr.causal && n0 + kBN - 1 > m0 + pr.causal_offset);
    if (pr.dropout) {
      if (masked) {
        tile_step(n_block, stage, std::true_type{}, std::true_type{});
      } else {
        tile_step(n_block, stage, std::false_type{}, std::true_type{});
      }
    } else if (masked) {
      tile_step(n_block, stage, std::true_type{}, std::false_type{});
    } else {
      tile_step(n_block, stage, std::false_type{}, std::false_type{});
    }
    if (kStages == 1) {
      __syncthreads();  // the single stage is refilled only after every warp is done with it
      if (n_block + 1 < n_blocks) {
        load_kv(n_block + 1, 0);
        cp_async_commit();
      }
    }
  }

  // Epilogue: normalize, write out (0 for rows that saw no key) and lse (-inf for those).
  const int64_t out_elem = p.out.is_float32 ? 4 : static_cast<int64_t>(sizeof(T));
  char* out = static_cast<char*>(p.out.data) + batch_offset(bi, p.out) * out_elem;
  float* lse =
      p.lse.data == nullptr ? nullptr : static_cast<float*>(p.lse.data) + batch_offset(bi, p.lse);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int64_t row = m0 + warp_row0 + mt * 16 + g + 8 * h;
      if (row >= pr.lq) continue;
      const float inv = sum > 0.0f ? pr.keep_rescale / sum : 0.0f;
      void* out_row = out + row * p.out.row_stride * out_elem;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < pr.d) {
          store_pair<T>(p.out, out_row, col, pr.d, o[mt][dt][2 * h] * inv,
                        o[mt][dt][2 * h + 1] * inv, false);
        }
      }
      if (lse != nullptr && t == 0) {
        lse[row * p.lse.row_stride] =
            sum > 0.0f ? (row_max[mt][h] * pr.scale_log2 + log2f(sum)) * kLn2 : -INFINITY;
      }
    }
  }
}

template <class Cfg>
void launch_config(const ForwardParams& params, cudaStream_t stream) {
  const int64_t m_blocks = (params.pr.lq + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = m_blocks * params.pr.batch_count;
  RD_CHECK(blocks <= 2147483647, kUnimplemented, "flash_attention_forward: ", blocks, " blocks of ",
           Cfg::kBlockM, " query rows exceed one CUDA grid");
  launch_with_smem<Cfg>(&forward_kernel<Cfg>, blocks, params, stream);
}

}  // namespace

void launch_forward(DType dtype, const ForwardParams& params, cudaStream_t stream) {
  with_config<ForwardConfigFor>(dtype, params.pr.d, "flash_attention_forward", [&](auto config) {
    launch_config<typename decltype(config)::type>(params, stream);
  });
}

size_t forward_smem_bytes(DType dtype, int d) {
  return config_smem_bytes<ForwardConfigFor>(dtype, d);
}

}  // namespace rd::kernels::cuda::flash
