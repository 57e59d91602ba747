// The one strided loop of the CPU backend: an N-operand iteration space with dims coalesced,
// walked as runs along the innermost dim, split into fixed-size chunks across OpenMP threads.
// The walking and threading code is compiled once (strided_iter.cc); ops only supply the
// body of a run, passed as a FunctionRef, which keeps per-op template instantiations small.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringdilated/kernels/view_checks.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/strided.h"

namespace rd::kernels::cpu {

// Work (in elements) below which a loop stays on the calling thread, and the chunk size
// above it. Fixed, never derived from the thread count, so that results depending on chunk
// boundaries (reduction order) are identical for any number of threads.
inline constexpr int64_t kGrain = 32768;

// A non-owning reference to a callable (like C++26 std::function_ref). The callable must
// outlive the call it is passed to.
template <class Signature>
class FunctionRef;
template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
             std::is_invocable_r_v<R, F&, Args...>)
  FunctionRef(F&& f)  // NOLINT: implicit, like a function parameter
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(object))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

// Runs body(i) for every i in [0, count); in parallel when count * work_per_item reaches
// kGrain. body must not throw (exceptions cannot leave an OpenMP region).
void parallel_items(int64_t count, int64_t work_per_item, FunctionRef<void(int64_t)> body);

// Splits [0, count) into kGrain-sized ranges and runs body(begin, end) on each, in parallel.
void parallel_range(int64_t count, FunctionRef<void(int64_t, int64_t)> body);

// One piece of a list of tensors (the multi-tensor ops, AdamW): elements [begin, end) of
// tensor `tensor` of the list.
struct TensorChunk {
  size_t tensor;
  int64_t begin, end;
};

// The tensors of a list (anything with a `numel` field) cut into pieces of `chunk`
// elements, in list order: the parallel work items, numbered the same way on every run.
template <class Tensors>
std::vector<TensorChunk> tensor_chunks(const Tensors& tensors, int64_t chunk) {
  std::vector<TensorChunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (int64_t begin = 0; begin < tensors[i].numel; begin += chunk) {
      chunks.push_back({i, begin, std::min(tensors[i].numel, begin + chunk)});
    }
  }
  return chunks;
}

// N operands sharing one shape; strides in bytes, dims ordered outermost first, size-1 dims
// dropped and adjacent dims merged where every operand allows it.
template <int N>
struct StridedIter {
  using Ptrs = std::array<char*, N>;
  using Strides = std::array<int64_t, N>;

  int ndim = 1;
  std::array<int64_t, kMaxDims> shape{};
  std::array<Strides, kMaxDims> strides{};
  Ptrs data{};
  int64_t numel = 0;
};

// The body of a run: (pointers to the run's first element, length, byte strides along the
// run, logical index of the first element).
template <int N>
using RunBody = FunctionRef<void(const typename StridedIter<N>::Ptrs&, int64_t,
                                 const typename StridedIter<N>::Strides&, int64_t)>;

// Builds the iteration over views[0]'s shape (every view must have it). `order` lists the
// dims outermost first; null means 0..ndim-1. The logical (linear) index of an element is its
// row-major position in that order.
template <int N>
StridedIter<N> make_iter(const std::array<const StridedView*, N>& views,
                         const int* order = nullptr);

// Calls body once per run of consecutive elements along the innermost dim covering the
// logical range [begin, end), in order, on the calling thread.
template <int N>
void iterate_range(const StridedIter<N>& it, int64_t begin, int64_t end, RunBody<N> body);

// Runs body over every element of `it`, in parallel kGrain-sized chunks when large.
template <int N>
void for_each_run(const StridedIter<N>& it, RunBody<N> body);

namespace detail {
template <class Out, class... In, class Fn, size_t... I>
inline void typed_run(const std::array<char*, sizeof...(In) + 1>& p, int64_t n,
                      const std::array<int64_t, sizeof...(In) + 1>& s, const Fn& fn,
                      std::index_sequence<I...>) {
  bool contiguous = s[0] == sizeof(Out) && ((s[I + 1] == sizeof(In)) && ...);
  if (contiguous) {  // plain indexing lets the compiler vectorize
    Out* out = reinterpret_cast<Out*>(p[0]);
    std::tuple<const In*...> in{reinterpret_cast<const In*>(p[I + 1])...};
    for (int64_t k = 0; k < n; ++k) fn(out[k], std::get<I>(in)[k]...);
  } else {
    for (int64_t k = 0; k < n; ++k) {
      fn(*reinterpret_cast<Out*>(p[0] + k * s[0]),
         *reinterpret_cast<const In*>(p[I + 1] + k * s[I + 1])...);
    }
  }
}
}  // namespace detail

// fn(Out& out_elem, const In&... in_elems) over every element; views share out's shape and
// Out, In... are their storage types. Parallel unless `serial` (needed when out overlaps
// itself).
template <class Out, class... In, class Fn>
void for_each_typed(const StridedView& out,
                    const std::array<const StridedView*, sizeof...(In)>& ins, const Fn& fn,
                    bool serial = false) {
  constexpr int N = sizeof...(In) + 1;
  std::array<const StridedView*, N> views;
  views[0] = &out;
  for (size_t i = 0; i < sizeof...(In); ++i) views[i + 1] = ins[i];
  const StridedIter<N> it = make_iter<N>(views);
  auto run = [&fn](const auto& p, int64_t n, const auto& s, int64_t) {
    detail::typed_run<Out, In...>(p, n, s, fn, std::index_sequence_for<In...>{});
  };
  if (serial) {
    iterate_range<N>(it, 0, it.numel, run);
  } else {
    for_each_run<N>(it, run);
  }
}

}  // namespace rd::kernels::cpu
