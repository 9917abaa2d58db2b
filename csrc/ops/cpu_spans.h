// CPU work splitting: lists become spans of at most one 64K-element chunk, run on
// torch's intra-op thread pool (so torch.set_num_threads applies).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "../kernels/launch_plan.h"

namespace ampfuse::ops {

struct Span {
  std::size_t tensor;   // index in the list
  std::int64_t offset;  // first element
  std::int64_t size;    // elements
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

// Runs visit(span_index) for every span on torch's intra-op pool, each thread taking one run
// of consecutive spans holding about the same number of elements. A model's list mixes 64K
// chunks with small biases and norms, so an even split by span count is not even by work: on a
// 10M-param transformer list the first of two threads got 59% of the elements. Which thread runs
// a span never changes its result. Fewer than three spans run on the calling thread: waking the
// pool costs more than it saves there.
template <typename Visit>
void for_each_span(const std::vector<Span>& spans, Visit&& visit) {
  const std::int64_t count = static_cast<std::int64_t>(spans.size());
  const std::int64_t parts = std::min<std::int64_t>(at::get_num_threads(), (count + 1) / 2);
  if (parts <= 1 || at::in_parallel_region()) {
    for (std::size_t s = 0; s < spans.size(); ++s) visit(s);
    return;
  }
  std::int64_t total = 0;
  for (const Span& span : spans) total += span.size;
  // first[p]: the first span of part p; a span goes to the part its first element falls in.
  std::vector<std::size_t> first(static_cast<std::size_t>(parts) + 1, spans.size());
  std::int64_t seen = 0;
  std::int64_t part = 0;
  for (std::size_t s = 0; s < spans.size(); ++s) {
    while (part < parts && seen >= total / parts * part + std::min(part, total % parts)) {
      first[static_cast<std::size_t>(part++)] = s;
    }
    seen += spans[s].size;
  }
  at::parallel_for(0, parts, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t p = begin; p < end; ++p) {
      for (std::size_t s = first[p]; s < first[p + 1]; ++s) visit(s);
    }
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
