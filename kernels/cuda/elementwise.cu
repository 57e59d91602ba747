// CUDA data movement and elementwise math: fill, arange, copy, accumulate, unary, binary and
// where. Each op is a small __host__ __device__ functor run by one of two generic loops: a
// vectorized loop over contiguous operands (16-byte loads and stores; broadcast scalars such
// as the `s` of `x * s` stay on it) or a strided loop through OffsetCalculator (the
// accumulations also take a row loop: strided rows of whole 16-byte vectors). Kernels are
// instantiated per storage type only; the op is a runtime enum switched inside the functor,
// uniform across a launch. Results match the CPU backend bit for bit except where a device
// math function (exp, log, tanh, erf, pow) differs from the host's in the last ulps (the
// bf16/f16 GELUs use cheaper float-accurate forms, see gelu_tanh and gelu_erf), and for
// float sums into an overlapping `out` (atomics: the order of the adds is free).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ringdilated/kernels/cuda/dtype_dispatch.cuh"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/cuda/strided_index.cuh"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cuda {
namespace {


// ---------------------------------------------------------------------------------------
// The two generic loops.
// ---------------------------------------------------------------------------------------

// An op's operand pointers: out, then the inputs (typed by the loop's In... at use).
template <class Out, class... In>
struct Operands {
  Out* out;
  const void* in[sizeof...(In) > 0 ? sizeof...(In) : 1];
};

// One item = kVectors * kLanes consecutive elements of contiguous operands, loaded and
// stored as aligned vectors of kLanes; the last item may be partial and goes element by
// element. Inputs whose bit is set in scalar_mask are broadcast scalars: element 0 serves
// every lane. kLanes fills 16 bytes of the widest operand, so a conversion's narrower side
// would move only 8 (or 4) bytes a thread: conversions take two vectors an item, both loaded
// before either is stored, which doubles the bytes in flight per thread. (Math ops keep one:
// a second vector's registers would cost the GELUs occupancy.)
template <int kLanes, class Op, class Out, class... In>
struct VectorBody {
  static constexpr int kVectors =
      sizeof...(In) == 1 && (... && (sizeof(In) != sizeof(Out))) ? 2 : 1;
  static constexpr int kItemLanes = kVectors * kLanes;

  Op op;
  Operands<Out, In...> p;
  uint32_t scalar_mask;
  int64_t n;

  RD_HOST_DEVICE void operator()(int64_t item) const {
    const int64_t base = item * kItemLanes;
    if (base + kItemLanes <= n) {
      full(base, std::index_sequence_for<In...>{});
    } else {
      partial(base, std::index_sequence_for<In...>{});
    }
  }

 private:
  template <size_t... I>
  RD_HOST_DEVICE void full(int64_t base, std::index_sequence<I...>) const {
    if constexpr (kVectors == 1) {
      compute(base, load_lanes<In, I>(base)...);
    } else {
      using In0 = std::tuple_element_t<0, std::tuple<In...>>;
      AlignedVec<In0, kLanes> x[kVectors];
      RD_UNROLL
      for (int v = 0; v < kVectors; ++v) x[v] = load_lanes<In0, 0>(base + v * kLanes);
      RD_UNROLL
      for (int v = 0; v < kVectors; ++v) compute(base + v * kLanes, x[v]);
    }
  }

  RD_HOST_DEVICE void compute(int64_t base, const AlignedVec<In, kLanes>&... x) const {
    AlignedVec<Out, kLanes> r;
    if constexpr (requires { op.lanes(r, x...); }) {
      (void)base;
      op.lanes(r, x...);  // the op switches on its run-time kind once per vector
    } else {
      RD_UNROLL
      for (int j = 0; j < kLanes; ++j) r.v[j] = op(base + j, x.v[j]...);
    }
    *reinterpret_cast<AlignedVec<Out, kLanes>*>(p.out + base) = r;
  }

  template <class T, size_t I>
  RD_HOST_DEVICE AlignedVec<T, kLanes> load_lanes(int64_t base) const {
    const T* data = static_cast<const T*>(p.in[I]);
    if ((scalar_mask >> I) & 1u) {
      AlignedVec<T, kLanes> v;
      const T s = data[0];
      RD_UNROLL
      for (int j = 0; j < kLanes; ++j) v.v[j] = s;
      return v;
    }
    return *reinterpret_cast<const AlignedVec<T, kLanes>*>(data + base);
  }

  template <size_t... I>
  RD_HOST_DEVICE void partial(int64_t base, std::index_sequence<I...>) const {
    for (int64_t i = base; i < n; ++i) p.out[i] = op(i, element<In, I>(i)...);
  }

  template <class T, size_t I>
  RD_HOST_DEVICE T element(int64_t i) const {
    return static_cast<const T*>(p.in[I])[((scalar_mask >> I) & 1u) ? 0 : i];
  }
};

// One item = one element of operands with any strides.
template <class Op, class Out, class... In>
struct StridedBody {
  Op op;
  Operands<Out, In...> p;
  OffsetCalculator<1 + sizeof...(In)> calc;

  RD_HOST_DEVICE void operator()(int64_t i) const {
    apply(i, calc.get(i), std::index_sequence_for<In...>{});
  }

 private:
  template <size_t... I>
  RD_HOST_DEVICE void apply(int64_t i, const Offsets<1 + sizeof...(In)>& o,
                            std::index_sequence<I...>) const {
    p.out[o.v[0]] = op(i, static_cast<const In*>(p.in[I])[o.v[I + 1]]...);
  }
};

template <class Out, class... In>
Operands<Out, In...> operands_of(const StridedView& out,
                                 const std::array<const StridedView*, sizeof...(In)>& ins) {
  Operands<Out, In...> p{};
  p.out = static_cast<Out*>(out.data);
  if constexpr (sizeof...(In) > 0) {
    for (size_t k = 0; k < sizeof...(In); ++k) p.in[k] = ins[k]->data;
  }
  return p;
}

// out[i] = op(i, ins[0][i], ...) over out's shape (every input has it), strided loop.
template <class Out, class... In, class Op>
void run_strided(const Op& op, const StridedView& out,
                 const std::array<const StridedView*, sizeof...(In)>& ins, cudaStream_t stream) {
  constexpr int kInputs = sizeof...(In);
  std::array<const StridedView*, 1 + kInputs> views{};
  views[0] = &out;
  if constexpr (kInputs > 0) {
    for (int k = 0; k < kInputs; ++k) views[k + 1] = ins[k];
  }
  launch_grid_stride(out.numel(),
                     StridedBody<Op, Out, In...>{op, operands_of<Out, In...>(out, ins),
                                                 make_offset_calculator<1 + kInputs>(views)},
                     stream);
}

// As run_strided, but takes the vectorized loop when out is contiguous, every input is
// contiguous or a broadcast scalar, and every contiguous pointer is aligned to its vector.
template <class Out, class... In, class Op>
void run_elementwise(const Op& op, const StridedView& out,
                     const std::array<const StridedView*, sizeof...(In)>& ins,
                     cudaStream_t stream) {
  constexpr int kInputs = sizeof...(In);
  constexpr size_t kWidest = std::max({sizeof(Out), sizeof(In)...});
  constexpr int kLanes = static_cast<int>(16 / kWidest);
  constexpr size_t kInSizes[] = {sizeof(In)..., 0};
  const int64_t n = out.numel();
  if (n == 0) return;
  bool vectorize = out.is_contiguous() && is_aligned(out.data, sizeof(Out) * kLanes);
  uint32_t scalar_mask = 0;
  if constexpr (kInputs > 0) {
    for (int k = 0; k < kInputs && vectorize; ++k) {
      if (is_broadcast_scalar(*ins[k])) {
        scalar_mask |= 1u << k;
      } else {
        vectorize = ins[k]->is_contiguous() && is_aligned(ins[k]->data, kInSizes[k] * kLanes);
      }
    }
  }
  if (!vectorize) return run_strided<Out, In...>(op, out, ins, stream);
  using Body = VectorBody<kLanes, Op, Out, In...>;
  launch_grid_stride((n + Body::kItemLanes - 1) / Body::kItemLanes,
                     Body{op, operands_of<Out, In...>(out, ins), scalar_mask, n}, stream);
}

// One item = one vector of kLanes consecutive elements of a row that every operand holds
// contiguously (rows_of_vectors): the strided loop with its offsets computed once per vector
// and 16-byte loads and stores, where per element it moved 2 or 4 bytes a thread.
template <int kLanes, class Op, class Out, class... In>
struct RowVectorBody {
  Op op;
  Operands<Out, In...> p;
  OffsetCalculator<1 + sizeof...(In)> calc;  // over the views in_vectors

  RD_HOST_DEVICE void operator()(int64_t item) const {
    apply(item * kLanes, calc.get(item), std::index_sequence_for<In...>{});
  }

 private:
  template <size_t... I>
  RD_HOST_DEVICE void apply(int64_t base, const Offsets<1 + sizeof...(In)>& o,
                            std::index_sequence<I...>) const {
    AlignedVec<Out, kLanes> r;
    compute(base, r,
            *reinterpret_cast<const AlignedVec<In, kLanes>*>(static_cast<const In*>(p.in[I]) +
                                                             o.v[I + 1])...);
    *reinterpret_cast<AlignedVec<Out, kLanes>*>(p.out + o.v[0]) = r;
  }

  RD_HOST_DEVICE void compute(int64_t base, AlignedVec<Out, kLanes>& r,
                              const AlignedVec<In, kLanes>&... x) const {
    RD_UNROLL
    for (int j = 0; j < kLanes; ++j) r.v[j] = op(base + j, x.v[j]...);
  }
};

// As run_elementwise, but operands that are not contiguous yet hold whole vectors of their
// rows (rows_of_vectors) take RowVectorBody instead of the per-element strided loop. Only
// the gradient accumulations, fills, same-dtype copies and float32 <-> 16-bit conversions use
// it (dilated selections, scratch laid out like a packed projection), keeping instantiations
// few.
template <class Out, class... In, class Op>
void run_rows(const Op& op, const StridedView& out,
              const std::array<const StridedView*, sizeof...(In)>& ins, cudaStream_t stream) {
  constexpr int kInputs = sizeof...(In);
  constexpr int kLanes = static_cast<int>(16 / std::max({sizeof(Out), sizeof(In)...}));
  bool contiguous = out.is_contiguous(), rows = rows_of_vectors(out, kLanes);
  for (int k = 0; k < kInputs; ++k) {
    contiguous = contiguous && ins[k]->is_contiguous();
    rows = rows && rows_of_vectors(*ins[k], kLanes);
  }
  if (contiguous || !rows) return run_elementwise<Out, In...>(op, out, ins, stream);
  std::array<StridedView, 1 + kInputs> vectors{};
  std::array<const StridedView*, 1 + kInputs> views{};
  for (int k = 0; k <= kInputs; ++k) {
    vectors[k] = in_vectors(k == 0 ? out : *ins[k - 1], kLanes);
    views[k] = &vectors[k];
  }
  launch_grid_stride(
      out.numel() / kLanes,
      RowVectorBody<kLanes, Op, Out, In...>{op, operands_of<Out, In...>(out, ins),
                                            make_offset_calculator<1 + kInputs>(views)},
      stream);
}

// ---------------------------------------------------------------------------------------
// Names and dtype rules (as the CPU backend's, so errors read the same on every device).
// ---------------------------------------------------------------------------------------

[[noreturn]] void fail_dtype(std::string_view kernel, std::string_view op, DType dtype) {
  RD_FAIL(kDTypeMismatch, kernel, ": op ", op, " does not support dtype ", dtype_name(dtype));
}

bool is_integer_unary(UnaryOp op) {
  return op == UnaryOp::kNeg || op == UnaryOp::kAbs || op == UnaryOp::kRelu ||
         op == UnaryOp::kClamp;
}

// Whether arithmetic (non-comparison) binary `op` applies to dtype t.
bool binary_supports(BinaryOp op, DType t) {
  switch (op) {
    case BinaryOp::kMaximum:
    case BinaryOp::kMinimum: return true;
    case BinaryOp::kLogicalAnd: return t == DType::kBool;
    case BinaryOp::kAdd:
    case BinaryOp::kSub:
    case BinaryOp::kMul: return t != DType::kBool;
    case BinaryOp::kDiv:
    case BinaryOp::kPow: return is_floating(t);
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------
// Op functors: T operator()(int64_t logical_index, inputs...).
// ---------------------------------------------------------------------------------------

// Precise float/double overloads (never the fast-math intrinsics), so templates on the compute
// type pick the matching precision; on the host these are the C library's, as the CPU's.
RD_HOST_DEVICE inline float math_abs(float x) { return fabsf(x); }
RD_HOST_DEVICE inline double math_abs(double x) { return fabs(x); }
RD_HOST_DEVICE inline float math_exp(float x) { return expf(x); }
RD_HOST_DEVICE inline double math_exp(double x) { return exp(x); }
RD_HOST_DEVICE inline float math_log(float x) { return logf(x); }
RD_HOST_DEVICE inline double math_log(double x) { return log(x); }
RD_HOST_DEVICE inline float math_sqrt(float x) { return sqrtf(x); }
RD_HOST_DEVICE inline double math_sqrt(double x) { return sqrt(x); }
RD_HOST_DEVICE inline float math_tanh(float x) { return tanhf(x); }
RD_HOST_DEVICE inline double math_tanh(double x) { return tanh(x); }
RD_HOST_DEVICE inline float math_erf(float x) { return erff(x); }
RD_HOST_DEVICE inline double math_erf(double x) { return erf(x); }
RD_HOST_DEVICE inline float math_pow(float x, float y) { return powf(x, y); }
RD_HOST_DEVICE inline double math_pow(double x, double y) { return pow(x, y); }

template <class U>
struct FillOp {
  U value;
  RD_HOST_DEVICE U operator()(int64_t) const { return value; }
};

template <class T>
struct ArangeOp {
  double start;
  double step;
  RD_HOST_DEVICE T operator()(int64_t i) const {
    return convert<T>(affine_no_fma(start, step, static_cast<double>(i)));
  }
};

template <class U>
struct IdentityOp {
  RD_HOST_DEVICE U operator()(int64_t, U x) const { return x; }
};

// 16-bit <-> float conversions for the GELUs' vector path: the hardware's on the device (one
// instruction, round to nearest even like half.h; NaN payloads may differ), the storage
// types' own on the host.
template <class T>
RD_HOST_DEVICE inline Compute<T> lane_to_compute(T v) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
  } else if constexpr (std::is_same_v<T, Float16>) {
    return __half2float(__ushort_as_half(v.bits));
  }
#endif
  return static_cast<Compute<T>>(v);
}

template <class T>
RD_HOST_DEVICE inline T lane_from_compute(Compute<T> v) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  } else if constexpr (std::is_same_v<T, Float16>) {
    return Float16::from_bits(__half_as_ushort(__float2half_rn(v)));
  }
#endif
  return static_cast<T>(v);
}

// Every UnaryOp, with the CPU's formulas in Compute<T> (float for 16-bit floats). The host
// only lets float ops through for floating T.
template <class T>
struct UnaryFunctor {
  using C = Compute<T>;
  UnaryOp op;
  C scalar;  // kPowScalar's exponent
  C lo;      // kClamp's bounds, when has_lo / has_hi
  C hi;
  bool has_lo;
  bool has_hi;

  RD_HOST_DEVICE T operator()(int64_t, T v) const {
    return static_cast<T>(apply(static_cast<C>(v)));
  }

  // A whole vector: the GELUs (transcendental-heavy, and for 16-bit data many elements per
  // byte) get the op switch hoisted out of the lane loop, so the lanes' independent
  // evaluations interleave, and convert with the hardware's instructions; every other op goes
  // lane by lane through apply().
  template <int N>
  RD_HOST_DEVICE void lanes(AlignedVec<T, N>& r, const AlignedVec<T, N>& x) const {
    if constexpr (kIsFloating<T>) {
      if (op == UnaryOp::kGeluErf) {
        RD_UNROLL
        for (int j = 0; j < N; ++j) {
          r.v[j] = lane_from_compute<T>(gelu_erf(lane_to_compute(x.v[j])));
        }
        return;
      }
      if (op == UnaryOp::kGeluTanh) {
        RD_UNROLL
        for (int j = 0; j < N; ++j) {
          r.v[j] = lane_from_compute<T>(gelu_tanh(lane_to_compute(x.v[j])));
        }
        return;
      }
    }
    RD_UNROLL
    for (int j = 0; j < N; ++j) r.v[j] = static_cast<T>(apply(static_cast<C>(x.v[j])));
  }

 private:
  // The GELUs' constants, as functions: members of the integer instantiations would be unused.
  RD_HOST_DEVICE static constexpr C half() { return C(0.5); }
  RD_HOST_DEVICE static constexpr C sqrt_2_over_pi() { return C(0.79788456080286535588); }
  RD_HOST_DEVICE static constexpr C gelu_cubic() { return C(0.044715); }
  RD_HOST_DEVICE static constexpr C inv_sqrt_2() { return C(0.70710678118654752440); }

  RD_HOST_DEVICE static C gelu_erf(C x) {
#if defined(__CUDA_ARCH__)
    if constexpr (kIsHalf<T>) return gelu_erf_16bit(x);
#endif
    return half() * x * (C(1) + math_erf(x * inv_sqrt_2()));
  }

#if defined(__CUDA_ARCH__)
  // GELU(x) = x * Phi(x) for 16-bit data, at half the cost of erff. With t = |x| and
  // h = Phi(-t): GELU(x) = x * (1 - h) for x >= 0, x * h below. h = 2^P(t) with P a degree-8
  // polynomial (P(0) = -1 exactly), fitted to log2 Phi(-t) on [0, 5.5] for the least
  // maximum error of h itself: |h error| < 1.2e-8 (erff's own error is ~6e-8), so the result
  // is within about an ulp of float for x >= 0, and more accurate than
  // 0.5 x (1 + erff(x / sqrt 2)) for x < 0. Past the fitted range P keeps falling (checked
  // in float up to FLT_MAX; P(5.5) = -25.7, so 1 - h rounds to 1 there) and P(inf) = -inf,
  // so h = 0 at infinity: GELU(+inf) = inf and GELU(-inf) = GELU(NaN) = NaN, as on the CPU.
  __device__ static float gelu_erf_16bit(float x) {
    constexpr float kP[] = {-1.151105165e+00f, -4.592081904e-01f, -5.249617994e-02f,
                            7.063420955e-03f,  -1.369370148e-04f, -1.861799537e-04f,
                            3.937762813e-05f,  -2.834907264e-06f};  // t^1 .. t^8
    const float t = fabsf(x);
    float p = kP[7];
    RD_UNROLL
    for (int i = 6; i >= 0; --i) p = fmaf(p, t, kP[i]);
    p = fmaf(p, t, -1.0f);
    float h;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(h) : "f"(p));
    return x * (x >= 0.0f ? 1.0f - h : h);
  }
#endif

  // 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3). For 16-bit
  // data (rounded to 8 or 11 bits after this) the sigmoid form with the hardware's 2^t and
  // reciprocal is accurate to a few float ulps; float/double keep the precise tanh.
  RD_HOST_DEVICE static C gelu_tanh(C x) {
#if defined(__CUDA_ARCH__)
    if constexpr (kIsHalf<T>) return gelu_tanh_16bit(x);
#endif
    const C inner = sqrt_2_over_pi() * (x + gelu_cubic() * x * x * x);
    return half() * x * (C(1) + math_tanh(inner));
  }

#if defined(__CUDA_ARCH__)
  // -2u log2(e) = x (k0 + k1 x^2) with the constants folded, so a 16-bit element costs two
  // multiplies, an FMA, an add and two MUFU ops: the shorter chain keeps more loads in
  // flight, which is what the 16-bit GELUs (8 elements a 16-byte vector) are bound by.
  // Large negative x: 2^t overflows to inf and the reciprocal gives -0, the true value
  // rounded; GELU(-inf) = NaN and GELU(+inf) = inf, as on the CPU.
  __device__ static float gelu_tanh_16bit(float x) {
    constexpr double kLog2e = 1.44269504088896340736;
    constexpr float k0 = static_cast<float>(-2.0 * 0.79788456080286535588 * kLog2e);
    constexpr float k1 = static_cast<float>(-2.0 * 0.79788456080286535588 * kLog2e * 0.044715);
    const float t = x * fmaf(x * x, k1, k0);
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return x * r;
  }
#endif

  RD_HOST_DEVICE C clamp(C x) const {
    // NaN passes through; lo > hi gives hi, as on the CPU.
    if (has_lo && x < lo) x = lo;
    if (has_hi && x > hi) x = hi;
    return x;
  }

  RD_HOST_DEVICE C apply(C x) const {
    if constexpr (kIsFloating<T>) {
      constexpr C kHalf = half();
      constexpr C kSqrt2OverPi = sqrt_2_over_pi();
      constexpr C kGeluCubic = gelu_cubic();
      constexpr C kInvSqrt2 = inv_sqrt_2();
      constexpr C kInvSqrt2Pi = C(0.39894228040143267794);  // 1 / sqrt(2 pi)
      switch (op) {
        case UnaryOp::kNeg: return -x;
        case UnaryOp::kAbs: return math_abs(x);
        case UnaryOp::kExp: return math_exp(x);
        case UnaryOp::kLog: return math_log(x);
        case UnaryOp::kSqrt: return math_sqrt(x);
        case UnaryOp::kRsqrt: return C(1) / math_sqrt(x);
        case UnaryOp::kTanh: return math_tanh(x);
        case UnaryOp::kSigmoid: return C(1) / (C(1) + math_exp(-x));
        case UnaryOp::kRelu: return x < C(0) ? C(0) : x;
        case UnaryOp::kSilu: return x / (C(1) + math_exp(-x));
        case UnaryOp::kGeluTanh: return gelu_tanh(x);
        case UnaryOp::kGeluTanhGrad: {
          const C inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
          const C t = math_tanh(inner);
          const C d_inner = kSqrt2OverPi * (C(1) + C(3) * kGeluCubic * x * x);
          return kHalf * (C(1) + t) + kHalf * x * (C(1) - t * t) * d_inner;
        }
        case UnaryOp::kGeluErf: return gelu_erf(x);
        case UnaryOp::kGeluErfGrad: {
          const C cdf = kHalf * (C(1) + math_erf(x * kInvSqrt2));
          return cdf + x * kInvSqrt2Pi * math_exp(-kHalf * x * x);
        }
        case UnaryOp::kPowScalar: return math_pow(x, scalar);
        case UnaryOp::kClamp: return clamp(x);
      }
    } else {
      switch (op) {
        case UnaryOp::kNeg: return C(0) - x;
        case UnaryOp::kAbs: return x < C(0) ? C(0) - x : x;
        case UnaryOp::kRelu: return x < C(0) ? C(0) : x;
        case UnaryOp::kClamp: return clamp(x);
        default: break;
      }
    }
    return x;
  }
};

// Builds the functor with the CPU's parameter rounding: float bounds are cast to the compute
// type; integer bounds round toward the kept range, are limited to what T holds, and NaN
// bounds are ignored.
template <class T>
UnaryFunctor<T> make_unary(UnaryOp op, const UnaryParams& p) {
  using C = Compute<T>;
  UnaryFunctor<T> f{op, static_cast<C>(p.scalar), C(0), C(0), false, false};
  if constexpr (kIsFloating<T>) {
    f.has_lo = p.lo.has_value();
    f.has_hi = p.hi.has_value();
    if (f.has_lo) f.lo = static_cast<C>(*p.lo);
    if (f.has_hi) f.hi = static_cast<C>(*p.hi);
  } else {
    constexpr double kMax = std::is_same_v<T, int32_t> ? 2147483647.0 : 9.2e18;
    f.has_lo = p.lo && !std::isnan(*p.lo);
    f.has_hi = p.hi && !std::isnan(*p.hi);
    if (f.has_lo) f.lo = static_cast<C>(std::ceil(std::clamp(*p.lo, -kMax, kMax)));
    if (f.has_hi) f.hi = static_cast<C>(std::floor(std::clamp(*p.hi, -kMax, kMax)));
  }
  return f;
}

// Arithmetic BinaryOps in Compute<T>; the host has checked binary_supports(op, T).
template <class T>
struct BinaryFunctor {
  BinaryOp op;

  RD_HOST_DEVICE T operator()(int64_t, T a, T b) const {
    using C = Compute<T>;
    const C x = static_cast<C>(a);
    const C y = static_cast<C>(b);
    switch (op) {  // max/min propagate NaN: either operand NaN gives NaN
      case BinaryOp::kMaximum: return static_cast<T>((x > y || is_nan(x)) ? x : y);
      case BinaryOp::kMinimum: return static_cast<T>((x < y || is_nan(x)) ? x : y);
      default: break;
    }
    if constexpr (std::is_same_v<T, bool>) {
      return x && y;  // kLogicalAnd, the only other op allowed on bool
    } else {
      switch (op) {
        case BinaryOp::kAdd: return static_cast<T>(x + y);
        case BinaryOp::kSub: return static_cast<T>(x - y);
        case BinaryOp::kMul: return static_cast<T>(x * y);
        case BinaryOp::kDiv:
          if constexpr (kIsFloating<T>) return static_cast<T>(x / y);
          break;
        case BinaryOp::kPow:
          if constexpr (kIsFloating<T>) return static_cast<T>(math_pow(x, y));
          break;
        default: break;
      }
      return T{};
    }
  }
};

template <class T>
struct CompareFunctor {
  BinaryOp op;

  RD_HOST_DEVICE bool operator()(int64_t, T a, T b) const {
    using C = Compute<T>;
    const C x = static_cast<C>(a);
    const C y = static_cast<C>(b);
    switch (op) {
      case BinaryOp::kEq: return x == y;
      case BinaryOp::kNe: return x != y;
      case BinaryOp::kLt: return x < y;
      case BinaryOp::kLe: return x <= y;
      case BinaryOp::kGt: return x > y;
      case BinaryOp::kGe: return x >= y;
      default: return false;
    }
  }
};

template <class U>
struct WhereOp {
  RD_HOST_DEVICE U operator()(int64_t, bool c, U a, U b) const { return c ? a : b; }
};

// Copy with dtype conversion: one kernel per destination type, the source type switched at
// run time (see load_converted).
template <class To>
struct ConvertBody {
  To* out;
  const void* in;
  DType from;
  OffsetCalculator<2> calc;

  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<2> o = calc.get(i);
    out[o.v[0]] = load_converted<To>(in, from, o.v[1]);
  }
};

// Conversion with both types known at compile time, for the vectorized loop.
template <class To, class From>
struct ConvertOp {
  RD_HOST_DEVICE To operator()(int64_t, From x) const { return convert<To>(x); }
};

// float32 <-> bfloat16 / float16 copies (mixed precision's common case) take the typed
// loops: 16-byte accesses of the float side when contiguous and aligned, or over rows of
// whole vectors (run_rows: a scratch gradient laid out like a packed projection converted
// into float32 buffers ran 1.6x slower per element). Other pairs keep ConvertBody's run-time
// switch (one kernel per destination type, fewer instantiations). Returns whether the copy
// was launched.
bool copy_float_converted(const StridedView& out, const StridedView& in, cudaStream_t stream) {
  const DType to = out.dtype, from = in.dtype;
  if (to == DType::kBFloat16 && from == DType::kFloat32) {
    run_rows<BFloat16, float>(ConvertOp<BFloat16, float>{}, out, {&in}, stream);
  } else if (to == DType::kFloat32 && from == DType::kBFloat16) {
    run_rows<float, BFloat16>(ConvertOp<float, BFloat16>{}, out, {&in}, stream);
  } else if (to == DType::kFloat16 && from == DType::kFloat32) {
    run_rows<Float16, float>(ConvertOp<Float16, float>{}, out, {&in}, stream);
  } else if (to == DType::kFloat32 && from == DType::kFloat16) {
    run_rows<float, Float16>(ConvertOp<float, Float16>{}, out, {&in}, stream);
  } else {
    return false;
  }
  return true;
}

// out and in as `rows` runs of `run` contiguous elements, the runs a fixed pitch apart in
// each (in elements): the form of a slice of a packed buffer, such as v of [B, N, 3, H, D].
struct RowRuns {
  int64_t rows = 1, run = 1, out_pitch = 0, in_pitch = 0;
};

// Runs shorter than this copy faster through the strided kernel than as 2-D copy rows.
constexpr size_t kMinRunBytes = 256;

std::optional<RowRuns> as_row_runs(const StridedView& out, const StridedView& in) {
  RowRuns r;
  int d = out.ndim - 1;
  for (; d >= 0; --d) {  // the contiguous innermost dims, shared by both
    if (out.shape[d] == 1) continue;
    if (out.strides[d] != r.run || in.strides[d] != r.run) break;
    r.run *= out.shape[d];
  }
  bool pitched = false;
  for (; d >= 0; --d) {  // the rest must merge into one dim of rows
    if (out.shape[d] == 1) continue;
    if (!pitched) {
      r.out_pitch = out.strides[d];
      r.in_pitch = in.strides[d];
      pitched = true;
    } else if (out.strides[d] != r.out_pitch * r.rows || in.strides[d] != r.in_pitch * r.rows) {
      return std::nullopt;
    }
    r.rows *= out.shape[d];
  }
  if (!pitched || r.out_pitch < r.run || r.in_pitch < r.run) return std::nullopt;
  return r;
}

// out += in where out overlaps itself: elements sharing memory each add atomically. `In` is
// T, or a 16-bit float read widened into a float32 out.
template <class T, class In = T>
struct AtomicAccumulateBody {
  T* out;
  const In* in;
  OffsetCalculator<2> calc;

  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<2> o = calc.get(i);
    atomic_add_into(out + o.v[0], convert<T>(in[o.v[1]]));
  }
};

// acc + x in float32, x read in its narrower type: one pass where a widened copy plus an
// add took three.
template <class Narrow>
struct WidenAddOp {
  RD_HOST_DEVICE float operator()(int64_t, float acc, Narrow x) const {
    return acc + convert<float>(x);
  }
};

// float32 out += a bf16/f16 in, each element read once in its own type.
template <class Narrow>
void accumulate_widened(const StridedView& out, const StridedView& in, cudaStream_t stream) {
  if (has_distinct_elements(out)) {
    run_rows<float, float, Narrow>(WidenAddOp<Narrow>{}, out, {&out, &in}, stream);
    return;
  }
  launch_grid_stride(out.numel(),
                     AtomicAccumulateBody<float, Narrow>{static_cast<float*>(out.data),
                                                         static_cast<const Narrow*>(in.data),
                                                         make_offset_calculator<2>({&out, &in})},
                     stream);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------------------

void fill(const StridedView& out, double value, cudaStream_t stream) {
  if (out.numel() == 0) return;
  // Convert on the host with the CPU's rules, then only move bytes: one kernel per size.
  // Several threads writing one element of an overlapping out store the same value.
  uint64_t bits = 0;
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = convert<T>(value);
    std::memcpy(&bits, &v, sizeof(T));  // little-endian: the low bytes hold v
  });
  // Strided outs whose rows hold whole vectors (the rows of a dilated selection that
  // attention buffers zero where no call writes) store 16 bytes a thread, not one element.
  dispatch_by_size(out.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    run_rows<U>(FillOp<U>{static_cast<U>(bits)}, out, {}, stream);
  });
}

void arange(const StridedView& out, double start, double step, cudaStream_t stream) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Strided loop only: a contiguous out collapses to one dim and needs no division.
    run_strided<T>(ArangeOp<T>{start, step}, out, {}, stream);
  });
}

void copy(const StridedView& out, const StridedView& in, cudaStream_t stream) {
  check_same_shape("copy", "out", out, "in", in);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.dtype == in.dtype) {
    if (out.is_contiguous() && in.is_contiguous()) {
      RD_CUDA_CHECK(cudaMemcpyAsync(out.data, in.data, n * dtype_size(out.dtype),
                                    cudaMemcpyDefault, stream));
      return;
    }
    // Rows of whole 16-byte vectors on both sides (a dilated selection, v of a packed
    // buffer): the row loop, one vector a thread. Other rows of contiguous runs go to the
    // copy engine's 2-D copy; the rest to the strided kernel, which computes every
    // element's offset. (cuda_ops_bench's elementwise/copy rows compare the two on the views
    // that meet both.)
    const size_t element = dtype_size(out.dtype);
    const int64_t lanes = static_cast<int64_t>(16 / element);
    if (!rows_of_vectors(out, lanes) || !rows_of_vectors(in, lanes)) {
      if (const std::optional<RowRuns> r = as_row_runs(out, in);
          r && r->run * element >= kMinRunBytes) {
        RD_CUDA_CHECK(cudaMemcpy2DAsync(out.data, r->out_pitch * element, in.data,
                                        r->in_pitch * element, r->run * element, r->rows,
                                        cudaMemcpyDefault, stream));
        return;
      }
    }
    dispatch_by_size(out.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      run_rows<U, U>(IdentityOp<U>{}, out, {&in}, stream);
    });
    return;
  }
  if (copy_float_converted(out, in, stream)) return;
  dispatch_dtype(out.dtype, [&](auto tag) {
    using To = typename decltype(tag)::type;
    launch_grid_stride(n,
                       ConvertBody<To>{static_cast<To*>(out.data), in.data, in.dtype,
                                       make_offset_calculator<2>({&out, &in})},
                       stream);
  });
}

void accumulate(const StridedView& out, const StridedView& in, cudaStream_t stream) {
  check_same_shape("accumulate", "out", out, "in", in);
  check_accumulate_dtypes("accumulate", out, in);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (in.dtype != out.dtype) {  // a 16-bit float into float32
    in.dtype == DType::kBFloat16 ? accumulate_widened<BFloat16>(out, in, stream)
                                 : accumulate_widened<Float16>(out, in, stream);
    return;
  }
  if (has_distinct_elements(out)) {
    // A plain elementwise out = out + in (logical or, i.e. maximum, for bool).
    const BinaryOp op = out.dtype == DType::kBool ? BinaryOp::kMaximum : BinaryOp::kAdd;
    dispatch_dtype(out.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, BFloat16> ||
                    std::is_same_v<T, Float16>) {
        run_rows<T, T, T>(BinaryFunctor<T>{op}, out, {&out, &in}, stream);
      } else {
        run_elementwise<T, T, T>(BinaryFunctor<T>{op}, out, {&out, &in}, stream);
      }
    });
    return;
  }
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_grid_stride(n,
                       AtomicAccumulateBody<T>{static_cast<T*>(out.data),
                                               static_cast<const T*>(in.data),
                                               make_offset_calculator<2>({&out, &in})},
                       stream);
  });
}

void unary(UnaryOp op, const StridedView& out, const StridedView& in, const UnaryParams& params,
           cudaStream_t stream) {
  check_same_shape("unary", "out", out, "in", in);
  check_dtype("unary", "out", out, in.dtype);
  if (is_floating(in.dtype)) {
    dispatch_floating(in.dtype, "unary", [&](auto tag) {
      using T = typename decltype(tag)::type;
      run_elementwise<T, T>(make_unary<T>(op, params), out, {&in}, stream);
    });
    return;
  }
  if (!is_integer_unary(op) || !is_integral(in.dtype)) {
    fail_dtype("unary", op_name(op), in.dtype);
  }
  if (in.dtype == DType::kInt32) {
    run_elementwise<int32_t, int32_t>(make_unary<int32_t>(op, params), out, {&in}, stream);
  } else {
    run_elementwise<int64_t, int64_t>(make_unary<int64_t>(op, params), out, {&in}, stream);
  }
}

void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b,
            cudaStream_t stream) {
  check_same_shape("binary", "out", out, "a", a);
  check_same_shape("binary", "out", out, "b", b);
  check_dtype("binary", "b", b, a.dtype);
  if (is_comparison(op)) {
    check_dtype("binary", "out", out, DType::kBool);
    dispatch_dtype(a.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      run_elementwise<bool, T, T>(CompareFunctor<T>{op}, out, {&a, &b}, stream);
    });
    return;
  }
  check_dtype("binary", "out", out, a.dtype);
  if (!binary_supports(op, a.dtype)) fail_dtype("binary", op_name(op), a.dtype);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise<T, T, T>(BinaryFunctor<T>{op}, out, {&a, &b}, stream);
  });
}

void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b, cudaStream_t stream) {
  check_where_args(out, cond, a, b);
  dispatch_by_size(out.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    run_elementwise<U, bool, U, U>(WhereOp<U>{}, out, {&cond, &a, &b}, stream);
  });
}

}  // namespace rd::kernels::cuda
