// CPU work splitting: lists become spans of at most one 64K-element chunk, run on
// torch's intra-op thread pool (so torch.set_num_threads applies).
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "../kernels/launch_plan.h"

namespace ampfuse::ops {

struct Span {
  std::size_t tensor;      // index in the list
  std::int64_t offset;     // first element
  std::int64_t size;       // elements
};

inline std::vector<Span> split_into_spans(const std::vector<kernels::TensorRef>& list) {
  std::vector<Span> spans;
  spans.reserve(static_cast<std::size_t>(kernels::total_chunks(list)));
  for (std::size_t i = 0; i < list.size(); ++i) {
    for (std::int64_t offset = 0; offset < list[i].numel; offset += kernels::kChunkSize) {
      spans.push_back({i, offset, std::min(kernels::kChunkSize, list[i].numel - offset)});
    }
  }
  return spans;
}

// Pointer to element `offset` of a tensor given as a TensorRef.
inline void* element_ptr(const kernels::TensorRef& t, std::int64_t offset) {
  return static_cast<char*>(t.data) + offset * kernels::element_size(t.dtype);
}

// The fp32 elements of `span` in an optional companion list (null when absent).
inline float* optional_fp32_ptr(const std::vector<kernels::TensorRef>& list, const Span& span) {
  return list.empty() ? nullptr : static_cast<float*>(element_ptr(list[span.tensor], span.offset));
}

// Runs visit(span_index) for every span on torch's intra-op pool. Fewer than two
// spans' worth of work runs on the calling thread: waking the pool costs more than
// it saves there.
template <typename Visit>
void for_each_span(const std::vector<Span>& spans, Visit&& visit) {
  at::parallel_for(0, static_cast<std::int64_t>(spans.size()), 2,
                   [&](std::int64_t begin, std::int64_t end) {
                     for (std::int64_t s = begin; s < end; ++s) visit(static_cast<std::size_t>(s));
                   });
}

// Like for_each_span, and returns true if any call returned true (an inf/nan seen).
template <typename Visit>
bool any_span(const std::vector<Span>& spans, Visit&& visit) {
  std::atomic<bool> any{false};
  for_each_span(spans, [&](std::size_t s) {
    if (visit(s)) any.store(true, std::memory_order_relaxed);
  });
  return any.load();
}

// Like any_span, for visits that return the kinds of non-finite values they saw (kHeldInf |
// kHeldNan; 0 when none). With `tensor_flags` (one int32 per tensor of the list, or null), a
// span that saw any ORs them into its tensor's flag. Spans of one tensor run on several threads,
// hence the atomic; a clean span writes nothing.
template <typename Visit>
bool any_span_flagging(const std::vector<Span>& spans, std::int32_t* tensor_flags, Visit&& visit) {
  return any_span(spans, [&](std::size_t s) {
    const std::uint32_t kinds = visit(s);
    if (kinds != 0 && tensor_flags != nullptr) {
      __atomic_fetch_or(tensor_flags + spans[s].tensor, static_cast<std::int32_t>(kinds),
                        __ATOMIC_RELAXED);
    }
    return kinds != 0;
  });
}

}  // namespace ampfuse::ops
