// The shared CPU iteration machinery (see strided_iter.h): dim coalescing, run walking and
// the OpenMP loops, compiled once for every operand count the kernels use.
#include "ringdilated/kernels/cpu/strided_iter.h"

#include <omp.h>

#include <algorithm>

namespace rd::kernels::cpu {

void parallel_items(int64_t count, int64_t work_per_item, FunctionRef<void(int64_t)> body) {
  if (count <= 0) return;
  bool serial = count == 1 || count * std::max<int64_t>(work_per_item, 1) < kGrain ||
                omp_in_parallel() || omp_get_max_threads() == 1;
  if (serial) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) body(i);
}

void parallel_range(int64_t count, FunctionRef<void(int64_t, int64_t)> body) {
  const int64_t chunks = (count + kGrain - 1) / kGrain;
  auto chunk = [&](int64_t c) { body(c * kGrain, std::min(count, (c + 1) * kGrain)); };
  parallel_items(chunks, kGrain, chunk);
}

template <int N>
StridedIter<N> make_iter(const std::array<const StridedView*, N>& views, const int* order) {
  const StridedView& first = *views[0];
  StridedIter<N> it;
  it.numel = first.numel();
  for (int op = 0; op < N; ++op) it.data[op] = static_cast<char*>(views[op]->data);
  int nd = 0;
  for (int i = 0; i < first.ndim; ++i) {
    const int d = order ? order[i] : i;
    if (first.shape[d] == 1) continue;
    typename StridedIter<N>::Strides s;
    for (int op = 0; op < N; ++op) {
      s[op] = views[op]->strides[d] * static_cast<int64_t>(dtype_size(views[op]->dtype));
    }
    // Merge into the previous (outer) dim when, for every operand, stepping the outer dim
    // equals stepping this one shape[d] times.
    bool mergeable = nd > 0;
    for (int op = 0; op < N && mergeable; ++op) {
      mergeable = it.strides[nd - 1][op] == s[op] * first.shape[d];
    }
    if (mergeable) {
      it.shape[nd - 1] *= first.shape[d];
      it.strides[nd - 1] = s;
    } else {
      it.shape[nd] = first.shape[d];
      it.strides[nd] = s;
      ++nd;
    }
  }
  if (nd == 0) {  // a scalar, or all dims of size 1
    it.shape[0] = 1;
    it.strides[0].fill(0);
    nd = 1;
  }
  it.ndim = nd;
  return it;
}

template <int N>
void iterate_range(const StridedIter<N>& it, int64_t begin, int64_t end, RunBody<N> body) {
  if (begin >= end) return;
  const int inner = it.ndim - 1;
  std::array<int64_t, kMaxDims> idx{};
  typename StridedIter<N>::Ptrs p = it.data;
  int64_t rem = begin;
  for (int d = inner; d >= 0; --d) {
    idx[d] = rem % it.shape[d];
    rem /= it.shape[d];
    for (int op = 0; op < N; ++op) p[op] += idx[d] * it.strides[d][op];
  }
  const auto& inner_strides = it.strides[inner];
  int64_t pos = begin;
  while (true) {
    const int64_t n = std::min(it.shape[inner] - idx[inner], end - pos);
    body(p, n, inner_strides, pos);
    pos += n;
    if (pos >= end) return;
    // Step to the start of the next run, carrying into outer dims.
    idx[inner] += n;
    for (int op = 0; op < N; ++op) p[op] += n * inner_strides[op];
    for (int d = inner; d > 0 && idx[d] == it.shape[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
      for (int op = 0; op < N; ++op) {
        p[op] += it.strides[d - 1][op] - it.shape[d] * it.strides[d][op];
      }
    }
  }
}

template <int N>
void for_each_run(const StridedIter<N>& it, RunBody<N> body) {
  auto range = [&](int64_t begin, int64_t end) { iterate_range<N>(it, begin, end, body); };
  parallel_range(it.numel, range);
}

#define RD_INSTANTIATE_STRIDED_ITER(N)                                                  \
  template StridedIter<N> make_iter<N>(const std::array<const StridedView*, N>&,        \
                                       const int*);                                     \
  template void iterate_range<N>(const StridedIter<N>&, int64_t, int64_t, RunBody<N>); \
  template void for_each_run<N>(const StridedIter<N>&, RunBody<N>);

RD_INSTANTIATE_STRIDED_ITER(1)
RD_INSTANTIATE_STRIDED_ITER(2)
RD_INSTANTIATE_STRIDED_ITER(3)
RD_INSTANTIATE_STRIDED_ITER(4)

#undef RD_INSTANTIATE_STRIDED_ITER

}  // namespace rd::kernels::cpu
