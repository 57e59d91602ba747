// The flash-attention backward kernels (FlashAttention-2 structure): a row kernel for
// delta = rowsum(dO * O) - grad_lse, the main kernel (one block per (batch, tile of kBN
// keys), looping over tiles of kBM query rows; dK and dV stay in registers, dQ goes out
// through float32 atomics), and a row kernel adding the dQ scratch into grad_q.
// See flash_attention.h for the design.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/cuda/flash_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda::flash {
namespace {

template <class T, int kD, int kBM, int kBN, int kWarps, int kStages>
struct BackwardConfig {
  using Elem = T;
  static constexpr int kHeadDim = kD, kBlockM = kBM, kBlockN = kBN, kNumStages = kStages;
  static constexpr int kThreads = kWarps * kWarpSize;
  using ScoreGrid = WarpGrid<kBM, kBN, kWarps>;  // S and dP: query rows x keys
  using KeyGrid = WarpGrid<kBN, kD, kWarps>;     // dK and dV: keys x head dim
  using QueryGrid = WarpGrid<kBM, kD, kWarps>;   // dQ: query rows x head dim
  // Rows padded by 16 bytes (see ForwardConfig).
  static constexpr int kPad = 16 / static_cast<int>(sizeof(T));
  static constexpr int kPitch = kD + kPad;                              // Q, dO, K, V tiles
  static constexpr int kSPitch = kBN + kPad;                            // P and dS tiles
  static constexpr size_t kQBytes = size_t{kBM} * kPitch * sizeof(T);   // one Q or dO tile
  static constexpr size_t kKBytes = size_t{kBN} * kPitch * sizeof(T);   // one K or V tile
  static constexpr size_t kSBytes = size_t{kBM} * kSPitch * sizeof(T);  // one P or dS tile
  static constexpr size_t kStatBytes = size_t{kBM} * sizeof(float);     // one lse or delta
  static constexpr size_t kStageBytes = 2 * kQBytes + 2 * kStatBytes;
  static constexpr size_t kSmemBytes = 2 * kKBytes + kStages * kStageBytes + 2 * kSBytes;
  static_assert(kQBytes % 16 == 0 && kStatBytes % 16 == 0, "BackwardConfig: 16-byte tiles");
};

// 16-bit: 128 keys x 64 query rows on 8 warps (FlashAttention-2's shape: half the dQ atomics
// of 64 keys and fewer shared-memory fragment loads per mma; measured 1.24x faster at
// D = 128 on an H100), Q/dO double-buffered, single-buffered at D = 128 to fit an A100's
// 163 KB. D = 256: 64 keys x 32 query rows. float32: 32 x 32 on 4 warps; D = 256
// single-buffered.
template <class T, int kD>
using BackwardConfigFor = std::conditional_t<
    kIsTensorCoreType<T>,
    std::conditional_t<kD == 256, BackwardConfig<T, kD, 32, 64, 8, 2>,
                       std::conditional_t<kD == 128, BackwardConfig<T, kD, 64, 128, 8, 1>,
                                          BackwardConfig<T, kD, 64, 128, 8, 2>>>,
    std::conditional_t<kD == 256, BackwardConfig<T, kD, 32, 32, 4, 1>,
                       BackwardConfig<T, kD, 32, 32, 4, 2>>>;

// The query row of one warp of a row kernel (256 threads a block, one warp per row).
struct WarpRow {
  int64_t id;   // b * lq + row
  int64_t row;  // within its batch
  int lane;
  BatchIndex bi;
};

// This warp's row; false for the warps past the last row.
__device__ __forceinline__ bool warp_row(const Problem& pr, WarpRow* r) {
  r->id = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / kWarpSize;
  r->lane = threadIdx.x % kWarpSize;
  if (r->id >= pr.batch_count * pr.lq) return false;
  r->row = r->id % pr.lq;
  r->bi = batch_index(pr.batch, r->id / pr.lq);
  return true;
}

// delta[b * lq + i] = sum_d dO[b, i, d] * O[b, i, d] - grad_lse[b, i]: one warp per row.
template <class T>
__global__ void __launch_bounds__(256) delta_kernel(const BackwardParams p) {
  WarpRow r;
  if (!warp_row(p.pr, &r)) return;
  auto row_ptr = [&](const Operand& op) {
    const int64_t elem = op.is_float32 ? 4 : static_cast<int64_t>(sizeof(T));
    return static_cast<const char*>(op.data) +
           (batch_offset(r.bi, op) + r.row * op.row_stride) * elem;
  };
  const void* out = row_ptr(p.out);
  const void* grad_out = row_ptr(p.grad_out);
  float sum = 0.0f;
  for (int c = r.lane; c < p.pr.d; c += kWarpSize) {
    sum += load_float<T>(p.out, out, c) * load_float<T>(p.grad_out, grad_out, c);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (r.lane == 0) {
    if (p.grad_lse.data != nullptr) {
      sum -= static_cast<const float*>(
          p.grad_lse.data)[batch_offset(r.bi, p.grad_lse) + r.row * p.grad_lse.row_stride];
    }
    p.delta[r.id] = sum;
  }
}

// grad_q[b, i, :] += dq_accum[b, i, :] (scratch, contiguous [batch * lq, d]): one warp per row.
template <class T>
__global__ void __launch_bounds__(256) add_dq_kernel(const BackwardParams p) {
  WarpRow r;
  if (!warp_row(p.pr, &r)) return;
  const float* src = static_cast<const float*>(p.dq_accum.data) + r.id * p.pr.d;
  T* dst =
      static_cast<T*>(p.grad_q.data) + batch_offset(r.bi, p.grad_q) + r.row * p.grad_q.row_stride;
  for (int c = r.lane; c < p.pr.d; c += kWarpSize) {
    dst[c] = from_float<T>(to_float(dst[c]) + src[c]);
  }
}

// dq[row0 + ..., col0 + ...] += scale * part (this warp's accumulator tiles), atomically.
// On sm_90 lanes pair up (lane ^ 1) so that each adds four consecutive floats of one row with
// a single vector reduction (a quarter of the atomic operations); elsewhere, and at ragged
// edges, element by element.
template <int MT, int NT>
__device__ __forceinline__ void add_dq(const float (&part)[MT][NT][4], float* dq,
                                       const Operand& dq_op, int64_t row0, int col0,
                                       const Problem& pr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool even = (t & 1) == 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float* x = part[mt][nt];
      // Even lanes keep row g and receive their neighbour's pair of row g; odd lanes keep
      // row g + 8 and receive their neighbour's pair of row g + 8.
      const float send0 = (even ? x[2] : x[0]) * pr.scale;
      const float send1 = (even ? x[3] : x[1]) * pr.scale;
      const float recv0 = __shfl_xor_sync(0xffffffffu, send0, 1);
      const float recv1 = __shfl_xor_sync(0xffffffffu, send1, 1);
      const int64_t row = row0 + mt * 16 + g + (even ? 0 : 8);
      const int col = col0 + nt * 8 + 2 * t - (even ? 0 : 2);
      const float4 v = even ? make_float4(x[0] * pr.scale, x[1] * pr.scale, recv0, recv1)
                            : make_float4(recv0, recv1, x[2] * pr.scale, x[3] * pr.scale);
      if (row >= pr.lq) continue;
      float* at = dq + row * dq_op.row_stride + col;
      if (dq_op.vec && col + 3 < pr.d) {
        atomicAdd(reinterpret_cast<float4*>(at), v);
      } else {
        const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (col + e < pr.d) atomicAdd(at + e, vals[e]);
        }
      }
    }
  }
#else
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + mt * 16 + g + 8 * (i >> 1);
      if (row >= pr.lq) continue;
      float* dq_row = dq + row * dq_op.row_stride;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = col0 + nt * 8 + 2 * t + (i & 1);
        if (col < pr.d) atomicAdd(dq_row + col, part[mt][nt][i] * pr.scale);
      }
    }
  }
#endif
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) backward_kernel(const BackwardParams p) {
  using T = typename Cfg::Elem;
  using SG = typename Cfg::ScoreGrid;
  using KG = typename Cfg::KeyGrid;
  using QG = typename Cfg::QueryGrid;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = Cfg::kHeadDim;
  constexpr int kPitch = Cfg::kPitch, kSPitch = Cfg::kSPitch;
  constexpr int kThreads = Cfg::kThreads, kStages = Cfg::kNumStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_k = reinterpret_cast<T*>(smem);
  T* s_v = s_k + kBN * kPitch;
  unsigned char* stages = smem + 2 * Cfg::kKBytes;  // per stage: Q, dO, lse, delta
  T* s_p = reinterpret_cast<T*>(stages + kStages * Cfg::kStageBytes);
  T* s_ds = s_p + kBM * kSPitch;
  auto stage_q = [&](int s) { return reinterpret_cast<T*>(stages + s * Cfg::kStageBytes); };
  auto stage_do = [&](int s) { return stage_q(s) + kBM * kPitch; };
  auto stage_lse = [&](int s) {
    return reinterpret_cast<float*>(stages + s * Cfg::kStageBytes + 2 * Cfg::kQBytes);
  };
  auto stage_delta = [&](int s) { return stage_lse(s) + kBM; };

  const Problem& pr = p.pr;
  const int64_t n_blocks = (pr.lk + kBN - 1) / kBN;
  const int64_t b = static_cast<int64_t>(blockIdx.x) / n_blocks;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) % n_blocks) * kBN;
  const int64_t m_blocks = (pr.lq + kBM - 1) / kBM;
  int64_t m_begin = 0;
  if (pr.causal) {
    const int64_t first_row = n0 - pr.causal_offset;  // the first row that sees key n0
    if (first_row >= pr.lq) return;                   // no row sees these keys: adds 0
    m_begin = std::max<int64_t>(first_row, 0) / kBM;
  }

  const BatchIndex bi = batch_index(pr.batch, b);
  const uint64_t drop_base = batch_dropout_base(pr, b);
  const T* q = static_cast<const T*>(p.q.data) + batch_offset(bi, p.q);
  const T* k = static_cast<const T*>(p.k.data) + batch_offset(bi, p.k);
  const T* v = static_cast<const T*>(p.v.data) + batch_offset(bi, p.v);
  const int64_t grad_out_elem = p.grad_out.is_float32 ? 4 : static_cast<int64_t>(sizeof(T));
  const void* grad_out =
      static_cast<const char*>(p.grad_out.data) + batch_offset(bi, p.grad_out) * grad_out_elem;
  const float* lse = static_cast<const float*>(p.lse.data) + batch_offset(bi, p.lse);
  const float* delta = p.delta + b * pr.lq;
  float* dq = static_cast<float*>(p.dq_accum.data) + batch_offset(bi, p.dq_accum);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2, t = lane & 3;

  auto load_rows = [&](int64_t m_block, int s) {
    const int64_t m0 = m_block * kBM;
    load_tile<T, kBM, kD, kPitch, kThreads>(stage_q(s), p.q, q, m0, pr.lq, pr.d);
    load_tile<T, kBM, kD, kPitch, kThreads>(stage_do(s), p.grad_out, grad_out, m0, pr.lq, pr.d);
    load_row_stat<kBM, kThreads>(stage_lse(s), lse, p.lse.row_stride, m0, pr.lq);
    load_row_stat<kBM, kThreads>(stage_delta(s), delta, 1, m0, pr.lq);
  };

  load_tile<T, kBN, kD, kPitch, kThreads>(s_k, p.k, k, n0, pr.lk, pr.d);
  load_tile<T, kBN, kD, kPitch, kThreads>(s_v, p.v, v, n0, pr.lk, pr.d);
  load_rows(m_begin, 0);
  cp_async_commit();

  float dk[KG::kMT][KG::kNT][4], dv[KG::kMT][KG::kNT][4];
  zero(dk);
  zero(dv);
  const int s_row0 = SG::row0(warp), s_col0 = SG::col0(warp);

  for (int64_t m_block = m_begin; m_block < m_blocks; ++m_block) {
    const int stage = kStages == 2 ? static_cast<int>((m_block - m_begin) & 1) : 0;
    cp_async_wait<0>();
    // Rows m_block are in shared memory for every thread, and every warp is done with the
    // previous rows (their stage, P and dS), so the prefetch may refill that stage.
    __syncthreads();
    if (kStages == 2 && m_block + 1 < m_blocks) {
      load_rows(m_block + 1, stage ^ 1);
      cp_async_commit();
    }
    const T* s_q = stage_q(stage);
    const T* s_do = stage_do(stage);
    const float* s_lse = stage_lse(stage);
    const float* s_delta = stage_delta(stage);
    const int64_t m0 = m_block * kBM;

    // S = Q K^T and dP = dO V^T on this warp's part of the kBM x kBN tile.
    {
      float s[SG::kMT][SG::kNT][4], dp[SG::kMT][SG::kNT][4];
      zero(s);
      zero(dp);
      warp_gemm<T, SG::kMT, SG::kNT, kD, false, false>(s, s_q + s_row0 * kPitch, kPitch,
                                                       s_k + s_col0 * kPitch, kPitch);
      warp_gemm<T, SG::kMT, SG::kNT, kD, false, false>(dp, s_do + s_row0 * kPitch, kPitch,
                                                       s_v + s_col0 * kPitch, kPitch);
      // Tile-local indices (see the forward): key c is visible to row r iff r < rows_left,
      // c < kv_left and (without causal or) c <= r + diag.
      const int rows_left = static_cast<int>(std::min<int64_t>(pr.lq - m0, kBM));
      const int kv_left = static_cast<int>(std::min<int64_t>(pr.lk - n0, kBN));
      const int diag = static_cast<int>(
          std::clamp<int64_t>(m0 + pr.causal_offset - n0, -(int64_t{1} << 30), int64_t{1} << 30));
      const bool need_mask = rows_left < kBM || kv_left < kBN || (pr.causal && kBN - 1 > diag);
      const uint64_t keep =
          pr.dropout ? dropout_keep_mask<SG::kMT, SG::kNT>(pr, drop_base, m0 + s_row0, n0 + s_col0)
                     : 0;
      // P, Z (P with dropout) and dS into shared memory. kMasked (a type tag) selects the
      // variant with the per-element visibility test; most tiles take the plain one.
      auto write_p_ds = [&](auto masked_tag) {
        constexpr bool kMasked = decltype(masked_tag)::value;
#pragma unroll
        for (int mt = 0; mt < SG::kMT; ++mt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = s_row0 + mt * 16 + g + 8 * h;
            // P = exp(scale * s - lse) with the merged lse; a row whose lse is -inf saw no
            // key anywhere, so all its P are 0.
            const float lse_log2 = s_lse[r] == -INFINITY ? INFINITY : s_lse[r] * kLog2e;
            const float row_delta = s_delta[r];
#pragma unroll
            for (int nt = 0; nt < SG::kNT; ++nt) {
              float z[2], ds[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int c = s_col0 + nt * 8 + 2 * t + e;
                bool visible = true;
                if constexpr (kMasked) {
                  visible = r < rows_left && c < kv_left && (!pr.causal || c <= r + diag);
                }
                float prob = fast_exp2(fmaf(s[mt][nt][2 * h + e], pr.scale_log2, -lse_log2));
                if constexpr (kMasked) prob = visible ? prob : 0.0f;
                float dprob = dp[mt][nt][2 * h + e];
                z[e] = prob;
                if (pr.dropout) {
                  const bool kept = (keep >> ((mt * SG::kNT + nt) * 4 + 2 * h + e)) & 1u;
                  z[e] = kept ? prob * pr.keep_rescale : 0.0f;
                  dprob = kept ? dprob * pr.keep_rescale : 0.0f;
                }
                ds[e] = prob * (dprob - row_delta);
              }
              const int c = s_col0 + nt * 8 + 2 * t;
              if constexpr (std::is_same_v<T, float>) {
                s_p[r * kSPitch + c] = z[0];
                s_p[r * kSPitch + c + 1] = z[1];
                s_ds[r * kSPitch + c] = ds[0];
                s_ds[r * kSPitch + c + 1] = ds[1];
              } else {
                *reinterpret_cast<uint32_t*>(s_p + r * kSPitch + c) = pack2<T>(z[0], z[1]);
                *reinterpret_cast<uint32_t*>(s_ds + r * kSPitch + c) = pack2<T>(ds[0], ds[1]);
              }
            }
          }
        }
      };
      if (need_mask) {
        write_p_ds(std::true_type{});
      } else {
        write_p_ds(std::false_type{});
      }
    }
    __syncthreads();

    // dV += Z^T dO and dK += dS^T Q (scaled at the end) on this warp's keys x head dims.
    const int k_row0 = KG::row0(warp), k_col0 = KG::col0(warp);
    warp_gemm<T, KG::kMT, KG::kNT, kBM, true, true>(dv, s_p + k_row0, kSPitch, s_do + k_col0,
                                                    kPitch);
    warp_gemm<T, KG::kMT, KG::kNT, kBM, true, true>(dk, s_ds + k_row0, kSPitch, s_q + k_col0,
                                                    kPitch);

    // dQ += scale * dS K on this warp's query rows x head dims, added atomically.
    {
      const int q_row0 = QG::row0(warp), q_col0 = QG::col0(warp);
      float dq_part[QG::kMT][QG::kNT][4];
      zero(dq_part);
      warp_gemm<T, QG::kMT, QG::kNT, kBN, false, true>(dq_part, s_ds + q_row0 * kSPitch, kSPitch,
                                                       s_k + q_col0, kPitch);
      add_dq<QG::kMT, QG::kNT>(dq_part, dq, p.dq_accum, m0 + q_row0, q_col0, pr);
    }
    if (kStages == 1) {
      __syncthreads();  // the single stage is refilled only after every warp is done with it
      if (m_block + 1 < m_blocks) {
        load_rows(m_block + 1, 0);
        cp_async_commit();
      }
    }
  }

  // grad_k += scale * dK, grad_v += dV: each element belongs to exactly one thread.
  auto add_into = [&](const Operand& op, float(&acc)[KG::kMT][KG::kNT][4], float factor) {
    const int64_t elem = op.is_float32 ? 4 : static_cast<int64_t>(sizeof(T));
    char* base = static_cast<char*>(op.data) + batch_offset(bi, op) * elem;
    const int k_row0 = KG::row0(warp), k_col0 = KG::col0(warp);
#pragma unroll
    for (int mt = 0; mt < KG::kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = n0 + k_row0 + mt * 16 + g + 8 * h;
        if (row >= pr.lk) continue;
        char* row_ptr = base + row * op.row_stride * elem;
#pragma unroll
        for (int nt = 0; nt < KG::kNT; ++nt) {
          const int col = k_col0 + nt * 8 + 2 * t;
          if (col < pr.d) {
            store_pair<T>(op, row_ptr, col, pr.d, acc[mt][nt][2 * h] * factor,
                          acc[mt][nt][2 * h + 1] * factor, true);
          }
        }
      }
    }
  };
  add_into(p.grad_k, dk, pr.scale);
  add_into(p.grad_v, dv, 1.0f);
}

template <class Cfg>
void launch_config(const BackwardParams& params, cudaStream_t stream) {
  const Problem& pr = params.pr;
  const int64_t rows = pr.batch_count * pr.lq;
  const int64_t row_blocks = (rows + 7) / 8;
  const int64_t n_blocks = (pr.lk + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int64_t blocks = n_blocks * pr.batch_count;
  RD_CHECK(blocks <= 2147483647 && row_blocks <= 2147483647, kUnimplemented,
           "flash_attention_backward: ", blocks, " blocks of ", Cfg::kBlockN, " keys or ",
           row_blocks, " row blocks exceed one CUDA grid");
  using T = typename Cfg::Elem;
  delta_kernel<T><<<static_cast<unsigned>(row_blocks), 256, 0, stream>>>(params);
  RD_CUDA_CHECK_LAUNCH();
  launch_with_smem<Cfg>(&backward_kernel<Cfg>, blocks, params, stream);
  if (params.dq_accum.data != params.grad_q.data) {
    add_dq_kernel<T><<<static_cast<unsigned>(row_blocks), 256, 0, stream>>>(params);
    RD_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void launch_backward(DType dtype, const BackwardParams& params, cudaStream_t stream) {
  with_config<BackwardConfigFor>(dtype, params.pr.d, "flash_attention_backward", [&](auto config) {
    launch_config<typename decltype(config)::type>(params, stream);
  });
}

size_t backward_smem_bytes(DType dtype, int d) {
  return config_smem_bytes<BackwardConfigFor>(dtype, d);
}

}  // namespace rd::kernels::cuda::flash
