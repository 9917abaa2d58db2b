// The kernel O1 puts on the Autocast keys of each listed op. Under the calling thread's active
// policy set it casts the op's floating args the way torch's autocast wrappers do (cached_cast,
// so fp32 weights are cast once per autocast region) and calls the op again with this
// device's autocast key excluded. With no set active, or a set that does not list the op, it
// does what torch would have done: torch's own autocast kernel, or a fall through.
#include "policy_kernel.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace ampfuse::autocast {

namespace {

thread_local int64_t t_active_set = 0;
std::atomic<int64_t> g_live_sets{0};

// An op's arguments: the last values on its stack, cast there in place.
struct Args {
  Args(torch::jit::Stack* stack, size_t count)
      : data(stack->data() + stack->size() - count), count(count) {}
  c10::IValue* begin() const { return data; }
  c10::IValue* end() const { return data + count; }
  c10::IValue& operator[](size_t i) const { return data[i]; }
  bool empty() const { return count == 0; }
  operator c10::ArrayRef<c10::IValue>() const { return c10::ArrayRef<c10::IValue>(data, count); }

  c10::IValue* data;
  size_t count;
};

bool is_low(at::ScalarType type) { return type == at::kHalf || type == at::kBFloat16; }

const char* python_name(at::ScalarType type) {
  return type == at::kHalf ? "torch.float16" : "torch.bfloat16";
}

// Casts the floating tensors of one argument (a tensor or a list of them) that autocast may
// cast on `device`. A list is copied, never changed in place: it belongs to the caller.
void cast_arg(c10::IValue& arg, at::ScalarType to, c10::DeviceType device) {
  if (arg.isTensor()) {
    const at::Tensor& tensor = arg.toTensor();
    if (at::autocast::is_eligible(tensor, device) && tensor.scalar_type() != to) {
      arg = at::autocast::cached_cast(to, tensor, device);
    }
  } else if (arg.isTensorList()) {
    std::vector<at::Tensor> tensors = arg.toTensorVector();
    bool changed = false;
    for (at::Tensor& tensor : tensors) {
      if (at::autocast::is_eligible(tensor, device) && tensor.scalar_type() != to) {
        tensor = at::autocast::cached_cast(to, tensor, device);
        changed = true;
      }
    }
    if (changed) arg = c10::IValue(std::move(tensors));
  }
}

template <class Visit>
void for_each_eligible(c10::ArrayRef<c10::IValue> args, c10::DeviceType device, Visit visit) {
  for (const c10::IValue& arg : args) {
    if (arg.isTensor()) {
      if (at::autocast::is_eligible(arg.toTensor(), device)) visit(arg.toTensor());
    } else if (arg.isTensorList()) {
      for (const at::Tensor& tensor : arg.toTensorList().vec()) {
        if (at::autocast::is_eligible(tensor, device)) visit(tensor);
      }
    }
  }
}

// The widest floating dtype of the args when they differ (fp16 with bf16 gives fp32), else
// none: args that agree are left alone, as they are by torch's promote policy.
std::optional<at::ScalarType> widest_type(c10::ArrayRef<c10::IValue> args, c10::DeviceType device) {
  std::optional<at::ScalarType> widest;
  bool mixed = false;
  for_each_eligible(args, device, [&](const at::Tensor& tensor) {
    const at::ScalarType type = tensor.scalar_type();
    if (!widest) {
      widest = type;
    } else if (type != *widest) {
      widest = c10::promoteTypes(*widest, type);
      mixed = true;
    }
  });
  return mixed ? widest : std::nullopt;
}

std::string short_name(const c10::OperatorHandle& op) {
  std::string name = op.schema().name();
  const auto colons = name.find("::");
  return colons == std::string::npos ? name : name.substr(colons + 2);
}

void refuse_inplace_on_low(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  if (args.empty() || !args[0].isTensor()) return;
  const at::ScalarType type = args[0].toTensor().scalar_type();
  if (!is_low(type)) return;
  const std::string name = short_name(op);
  const std::string base = name.substr(0, name.size() - 1);
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "amp O1: in-place ", name, "() on a ", python_name(type), " tensor. ", base,
      "() is on the fp32 list, so it runs in fp32, but an in-place op cannot change its "
      "tensor's dtype. To fix, use the out-of-place ",
      base, "() (x = x.", base,
      "(...)), which gives an fp32 result, or call it outside the model's forward.");
}

// aten::to.dtype_layout, which Tensor.cpu() and Tensor.to("cpu") call with the tensor's own
// dtype: a fp16/bf16 accelerator tensor copied to the host arrives as fp32 (apex's O1).
void host_copy_in_fp32(const c10::OperatorHandle& op, const Args& args) {
  const auto& schema = op.schema();
  const auto dtype_index = schema.argumentIndexWithName("dtype");
  const auto device_index = schema.argumentIndexWithName("device");
  if (!dtype_index || !device_index || args.empty() || !args[0].isTensor()) return;
  const at::Tensor& self = args[0].toTensor();
  const c10::IValue& device = args[*device_index];
  c10::IValue& dtype = args[*dtype_index];
  const bool to_host = device.isDevice() && device.toDevice().is_cpu() && !self.is_cpu();
  const bool own_dtype = dtype.isNone() || dtype.toScalarType() == self.scalar_type();
  if (to_host && own_dtype && is_low(self.scalar_type())) dtype = c10::IValue(at::kFloat);
}

}  // namespace

Policy parse_policy(const std::string& name) {
  if (name == "fp32") return Policy::kFp32;
  if (name == "lower") return Policy::kLower;
  if (name == "promote") return Policy::kPromote;
  if (name == "inplace_refused") return Policy::kInPlaceRefused;
  if (name == "to_host_fp32") return Policy::kToHostFp32;
  TORCH_CHECK_VALUE(false, "ampfuse O1: unknown cast policy '", name,
                    "'; expected fp32, lower, promote, inplace_refused or to_host_fp32.");
}

int64_t exchange_active_set(int64_t id) { return std::exchange(t_active_set, id); }

void count_live_sets(int64_t change) { g_live_sets.fetch_add(change); }

std::optional<Policy> OpPolicies::policy_of(int64_t set_id) const {
  std::shared_lock lock(mutex_);
  for (const auto& [id, policy] : policies_) {
    if (id == set_id) return policy;
  }
  return std::nullopt;
}

std::optional<Policy> OpPolicies::common_policy(int64_t live_sets, bool& agreed) const {
  std::shared_lock lock(mutex_);
  // A live set that does not list the op gives it torch's kernel. (More policies than live
  // sets: a set being created or released on another thread.)
  agreed = !policies_.empty() && static_cast<int64_t>(policies_.size()) >= live_sets;
  for (const auto& entry : policies_) agreed = agreed && entry.second == policies_[0].second;
  return agreed ? std::make_optional(policies_[0].second) : std::nullopt;
}

void OpPolicies::set_policy(int64_t set_id, Policy policy) {
  std::unique_lock lock(mutex_);
  policies_.emplace_back(set_id, policy);
}

bool OpPolicies::drop_set(int64_t set_id) {
  std::unique_lock lock(mutex_);
  policies_.erase(std::remove_if(policies_.begin(), policies_.end(),
                                 [&](const auto& entry) { return entry.first == set_id; }),
                  policies_.end());
  return policies_.empty();
}

void OpPolicies::keep_torch_kernel(c10::DispatchKey key,
                                   std::optional<c10::SafeKernelFunction> kernel) {
  (key == c10::DispatchKey::AutocastCPU ? torch_cpu_ : torch_cuda_) = std::move(kernel);
}

const std::optional<c10::SafeKernelFunction>& OpPolicies::torch_kernel(c10::DispatchKey key) const {
  return key == c10::DispatchKey::AutocastCPU ? torch_cpu_ : torch_cuda_;
}

PolicyKernel::PolicyKernel(std::shared_ptr<const OpPolicies> policies, c10::DeviceType device)
    : policies_(std::move(policies)),
      device_(device),
      key_(at::autocast::get_autocast_dispatch_key_from_device_type(device)) {}

// The policy of this call: the active set's. With no set active, a call made while the
// autograd engine runs a backward node comes from a forward being run again for the backward:
// activation checkpointing recomputing a checkpointed part of a model (torch.utils.checkpoint
// restores torch's autocast state for it, not the O1 set) or a custom_bwd backward. The first
// forward ran under its O1 model's set, so the second must too, or its dtypes differ (the
// non-reentrant checkpoint then refuses the recomputed tensors, the reentrant one silently
// computes other values). Which model it belongs to is not known here, so the live sets must
// agree on the op; they nearly always do (one O1 model, or copies of it).
std::optional<Policy> PolicyKernel::policy_for_call(const c10::OperatorHandle& op) const {
  const int64_t active = t_active_set;
  if (active != 0) return policies_->policy_of(active);
  if (torch::autograd::get_current_node() == nullptr) return std::nullopt;
  const int64_t live = g_live_sets.load();
  bool agreed = false;
  const std::optional<Policy> policy = policies_->common_policy(live, agreed);
  TORCH_CHECK(agreed, "amp O1: ", op.schema().name(),
              " ran under autocast during a backward "
              "pass (activation checkpointing recomputing part of a model's forward), where the ",
              live,
              " O1 models alive cast it differently, so whose lists apply cannot be told. "
              "To fix, give the O1 models the same custom lists, or do not checkpoint the parts "
              "that call ",
              op.schema().name(), ".");
  return policy;
}

void PolicyKernel::operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                              torch::jit::Stack* stack) {
  const std::optional<Policy> policy = policy_for_call(op);
  if (!policy) return run_as_torch(op, keys, stack);
  const Args args(stack, op.schema().arguments().size());
  switch (*policy) {
    case Policy::kInPlaceRefused:
      refuse_inplace_on_low(op, args);
      return run_as_torch(op, keys, stack);
    case Policy::kToHostFp32:
      host_copy_in_fp32(op, args);
      return run_as_torch(op, keys, stack);
    default:
      return cast_and_call(*policy, op, stack);
  }
}

void PolicyKernel::run_as_torch(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                                torch::jit::Stack* stack) const {
  const auto& torch_kernel = policies_->torch_kernel(key_);
  if (torch_kernel) {
    torch_kernel->callBoxed(op, keys, stack);
  } else {
    // What a fallthrough does: the next key down, with autocast still on for nested ops.
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key_), stack);
  }
}

void PolicyKernel::cast_and_call(Policy policy, const c10::OperatorHandle& op,
                                 torch::jit::Stack* stack) const {
  // As in torch's wrappers: excluded before casting (the casts are not autocast's business)
  // and for the call, so that the ops the op is made of are not cast again.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key_);
  const Args args(stack, op.schema().arguments().size());
  std::optional<at::ScalarType> to;
  if (policy == Policy::kFp32) {
    to = at::kFloat;
  } else if (policy == Policy::kLower) {
    to = at::autocast::get_lower_precision_fp_from_device_type(device_);
  } else {
    to = widest_type(args, device_);
  }
  if (to) {
    for (c10::IValue& arg : args) cast_arg(arg, *to, device_);
  }
  op.callBoxed(stack);
}

}  // namespace ampfuse::autocast
