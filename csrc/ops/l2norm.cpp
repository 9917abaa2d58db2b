// multi_tensor_l2norm: global and per-tensor L2 norms in fp32 for gradient clipping.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../ops.h"
#include "checks.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "refusals.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kL2norm = "multi_tensor_l2norm";

// Outputs: a 0-dim global norm and, when asked for, one norm per tensor (else an
// empty vector), on the tensors' device (CPU for an empty list).
std::tuple<at::Tensor, at::Tensor> empty_outputs(const c10::optional<at::Device>& device,
                                                 std::int64_t tensors, bool per_tensor) {
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device.value_or(at::kCPU));
  return {at::empty({}, options), at::empty({per_tensor ? tensors : 0}, options)};
}

// multi_tensor_l2norm on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor) {
  const auto device = list_device(kL2norm, tensors, "tensors");
  std::vector<at::Tensor> keep_alive;
  const auto refs = tensor_refs(kL2norm, tensors, "tensors", /*mutated=*/false, keep_alive);
  auto [global, per_tensor_norms] = empty_outputs(device, tensors.size(), per_tensor);
  if constexpr (kDevice == at::kCPU) {
    const std::vector<Span> spans = split_into_spans(refs);
    std::vector<double> span_sums(spans.size());
    for_each_span(spans, [&](std::size_t s) {
      const Span& span = spans[s];
      const kernels::TensorRef& t = refs[span.tensor];
      span_sums[s] =
          kernels::cpu::sum_of_squares_span(element_ptr(t, span.offset), t.dtype, span.size);
    });
    // Sums are combined in a fixed order, so the result does not depend on the
    // number of threads.
    std::vector<double> tensor_sums(refs.size(), 0.0);
    for (std::size_t s = 0; s < spans.size(); ++s) tensor_sums[spans[s].tensor] += span_sums[s];
    double total = 0.0;
    for (std::size_t i = 0; i < refs.size(); ++i) {
      total += tensor_sums[i];
      if (per_tensor) {
        per_tensor_norms.data_ptr<float>()[i] = static_cast<float>(std::sqrt(tensor_sums[i]));
      }
    }
    *global.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  } else {
#ifdef AMPFUSE_WITH_CUDA
    if (refs.empty()) return {global.zero_(), per_tensor_norms};
    const c10::cuda::CUDAGuard guard(*device);
    const std::int64_t chunks = kernels::cuda::l2norm_scratch_chunks(refs);
    const auto scratch = at::TensorOptions().device(*device);
    at::Tensor chunk_sums = at::empty({chunks}, scratch.dtype(at::kFloat));
    at::Tensor chunk_owner = at::empty({chunks}, scratch.dtype(at::kInt));
    kernels::cuda::l2norm(refs, chunk_sums.data_ptr<float>(), chunk_owner.data_ptr<std::int32_t>(),
                          global.data_ptr<float>(),
                          per_tensor ? per_tensor_norms.data_ptr<float>() : nullptr,
                          current_stream(*device));
#endif
  }
  return {global, per_tensor_norms};
}

// multi_tensor_l2norm for arguments no CPU or CUDA kernel takes (CompositeExplicitAutograd):
// the norms of an empty list, which are 0 on the CPU, or a refusal.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_fallback(at::TensorList tensors,
                                                                bool per_tensor) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_supported(kL2norm, arg_label("tensors", static_cast<std::int64_t>(i)), tensors[i]);
  }
  TORCH_CHECK(tensors.empty(), "ampfuse.", kL2norm, ": tensors are on ", tensors[0].device(),
              ", which ampfuse has no kernels for; use CPU or CUDA tensors.");
  auto [global, per_tensor_norms] = empty_outputs(c10::nullopt, 0, per_tensor);
  return {global.zero_(), per_tensor_norms};
}

}  // namespace

OpKernels multi_tensor_l2norm_kernels() {
  OpKernels kernels = AMPFUSE_KERNELS(multi_tensor_l2norm);
  kernels.fallback.emplace(&multi_tensor_l2norm_fallback);
  return kernels;
}

}  // namespace ampfuse::ops
