// Which elements of a chunk each thread of a block handles, and in what order: written once
// for the device (multi_tensor_apply.cuh passes threadIdx.x and blockDim.x) and the host
// (tests/cpp/test_chunk_visit.cpp walks every thread of a block and checks the schedule).
#pragma once

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

namespace ampfuse::kernels {

// Visits elements [0, n) of a chunk as thread `thread` of `threads`: whole packs of N
// elements at offsets that are multiples of N when `aligned`, the rest one element at a time.
// Thread t takes the packs at t*N, t*N + threads*N, t*N + 2*threads*N, ... in that order.
//
// The packs come in batches of `Batch`: load(i) for every pack of a batch is called before
// use(i, loaded) for any of them, so a thread has Batch loads in flight instead of one. The
// order of the use calls, and so the rounding of a thread's running sums, does not depend on
// Batch. A read-only kernel (inf/nan check, l2norm) is otherwise latency-bound on 2-byte
// types, where a 16-byte pack holds 8 elements and a chunk only 16 packs per thread.
// In-place kernels may batch too: the packs of a batch are distinct memory.
template <int N, int Batch, typename Load, typename Use, typename ElementOp>
AMPFUSE_HOST_DEVICE void visit_chunk_in_batches(int thread, int threads, int n, bool aligned,
                                                Load&& load, Use&& use, ElementOp&& element_op) {
  static_assert(N >= 1 && Batch >= 1, "a pack and a batch hold at least one element");
  const int packed_end = aligned ? n - n % N : 0;
  const int stride = threads * N;
  int i = thread * N;
  // For a 64K-element chunk, i + (Batch - 1) * stride stays far below INT_MAX.
  for (; i + (Batch - 1) * stride < packed_end; i += Batch * stride) {
    decltype(load(i)) loaded[Batch];
#pragma unroll
    for (int b = 0; b < Batch; ++b) loaded[b] = load(i + b * stride);
#pragma unroll
    for (int b = 0; b < Batch; ++b) use(i + b * stride, loaded[b]);
  }
  for (; i < packed_end; i += stride) use(i, load(i));
  for (int j = packed_end + thread; j < n; j += threads) element_op(j);
}

}  // namespace ampfuse::kernels
