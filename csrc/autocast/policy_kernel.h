// O1's per-op casting as kernels on the Autocast dispatch keys (see registry.cpp for how they
// are registered and scoped). One PolicyKernel is registered per listed op and autocast key;
// what it does for a call depends on the policy set active on the calling thread.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

namespace ampfuse::autocast {

enum class Policy : uint8_t {
  kFp32,            // floating args on the autocast device cast to fp32
  kLower,           // ... to the autocast dtype (fp16/bf16)
  kPromote,         // ... to the widest floating dtype among them
  kInPlaceRefused,  // in-place form of an fp32 op: refused on a fp16/bf16 tensor
  kToHostFp32,      // Tensor.to(device="cpu") of a fp16/bf16 accelerator tensor gives fp32
};

// Parses "fp32", "lower", "promote", "inplace_refused", "to_host_fp32"; throws on anything else.
Policy parse_policy(const std::string& name);

// The active policy set of the calling thread (0: none). Set by an O1 model's forward pre-hook
// and restored by its post-hook; returns the previous id.
int64_t exchange_active_set(int64_t id);

// How many policy sets are registered (one per O1 model and copy of one); kept by the registry.
void count_live_sets(int64_t change);

// What one op does under each policy set that lists it, and what torch does without one.
class OpPolicies {
 public:
  explicit OpPolicies(c10::OperatorHandle op) : op_(std::move(op)) {}

  std::optional<Policy> policy_of(int64_t set_id) const;
  // The policy every one of `live_sets` registered sets gives the op (none: torch's), or
  // false in `agreed` when they differ.
  std::optional<Policy> common_policy(int64_t live_sets, bool& agreed) const;
  void set_policy(int64_t set_id, Policy policy);
  // Returns true when no set lists the op any more.
  bool drop_set(int64_t set_id);

  const c10::OperatorHandle& op() const { return op_; }
  // torch's own kernel on `key` before ours replaced it; none where torch falls through.
  void keep_torch_kernel(c10::DispatchKey key, std::optional<c10::SafeKernelFunction> kernel);
  const std::optional<c10::SafeKernelFunction>& torch_kernel(c10::DispatchKey key) const;

 private:
  c10::OperatorHandle op_;
  mutable std::shared_mutex mutex_;
  std::vector<std::pair<int64_t, Policy>> policies_;  // a few sets at most: a flat list
  std::optional<c10::SafeKernelFunction> torch_cpu_, torch_cuda_;
};

// The boxed kernel registered on an autocast key for one op.
class PolicyKernel final : public c10::OperatorKernel {
 public:
  PolicyKernel(std::shared_ptr<const OpPolicies> policies, c10::DeviceType device);
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

 private:
  std::optional<Policy> policy_for_call(const c10::OperatorHandle& op) const;
  void run_as_torch(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack) const;
  void cast_and_call(Policy policy, const c10::OperatorHandle& op, torch::jit::Stack* stack) const;

  std::shared_ptr<const OpPolicies> policies_;
  c10::DeviceType device_;
  c10::DispatchKey key_;
};

}  // namespace ampfuse::autocast
