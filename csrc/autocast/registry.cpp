// O1's policy sets: which aten ops each O1 model casts and how, registered on the Autocast
// keys for exactly those ops (an op no set lists keeps torch's kernels and pays nothing).
//
// One registration per op serves every set that lists it (refcounted by the sets): its
// torch::Library owns the two kernels (AutocastCPU, AutocastCUDA), and destroying it when the
// last set listing the op is released gives torch's own autocast kernel back. The kernels
// only act under the set active on the calling thread, which an O1 model's forward hooks set
// and restore (one call each per forward, not per op).
//
// Reached from Python as torch.ops.ampfuse.o1_* (python/ampfuse/amp/per_op.py).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "policy_kernel.h"

namespace ampfuse::autocast {

namespace {

constexpr const char* kOverrideWarning = "Overriding a previously registered kernel";

// Replacing torch's own autocast kernel is the point of the registration, so the dispatcher's
// one-time warning about it is dropped; every other warning goes on to the handler in place.
class DropOverrideWarning final : public c10::WarningHandler {
 public:
  explicit DropOverrideWarning(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find(kOverrideWarning) == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

std::pair<std::string, std::string> split_name(const std::string& qualified) {
  TORCH_CHECK_VALUE(qualified.rfind("aten::", 0) == 0, "ampfuse O1: '", qualified,
                    "' is not an aten operator name (expected aten::name or aten::name.overload).");
  const std::string name = qualified.substr(6);
  const auto dot = name.find('.');
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

constexpr c10::DeviceType kDevices[] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};

class Registry {
 public:
  int64_t create(const std::vector<std::string>& ops, const std::vector<std::string>& policies) {
    TORCH_CHECK_VALUE(ops.size() == policies.size(), "ampfuse O1: ", ops.size(), " ops but ",
                      policies.size(), " policies; give one policy per op.");
    // Everything is checked before anything is registered, so a bad entry changes nothing.
    std::vector<std::pair<c10::OperatorHandle, Policy>> parsed;
    std::set<std::string> seen;
    for (size_t i = 0; i < ops.size(); ++i) {
      TORCH_CHECK_VALUE(seen.insert(ops[i]).second, "ampfuse O1: ", ops[i],
                        " is listed twice in one policy set.");
      const auto [name, overload] = split_name(ops[i]);
      auto op = c10::Dispatcher::singleton().findSchema({"aten::" + name, overload});
      TORCH_CHECK_VALUE(op.has_value(), "ampfuse O1: no aten operator ", ops[i], ".");
      parsed.emplace_back(*op, parse_policy(policies[i]));
    }
    std::lock_guard lock(mutex_);
    const int64_t id = next_id_++;
    std::vector<std::string>& members = sets_[id];
    for (size_t i = 0; i < ops.size(); ++i) {
      registration(ops[i], parsed[i].first).set_policy(id, parsed[i].second);
      members.push_back(ops[i]);
    }
    count_live_sets(1);
    return id;
  }

  void release(int64_t id) {
    std::lock_guard lock(mutex_);
    auto set = sets_.find(id);
    TORCH_CHECK_VALUE(set != sets_.end(), "ampfuse O1: no policy set ", id,
                      " (already released?).");
    // Counted out before its policies go, as counted in after they came: a kernel running
    // meanwhile sees at least as many policies as live sets (policy_kernel.cpp).
    count_live_sets(-1);
    for (const std::string& name : set->second) {
      auto op = ops_.find(name);
      if (op->second.policies->drop_set(id)) ops_.erase(op);  // torch's kernels come back
    }
    sets_.erase(set);
  }

  std::vector<std::string> registered_ops() {
    std::lock_guard lock(mutex_);
    std::vector<std::string> names;
    for (const auto& [name, entry] : ops_) names.push_back(name);
    return names;
  }

 private:
  struct Registration {
    std::shared_ptr<OpPolicies> policies;
    std::unique_ptr<torch::Library> library;  // destroying it deregisters the kernels
  };

  OpPolicies& registration(const std::string& qualified, const c10::OperatorHandle& op) {
    auto found = ops_.find(qualified);
    if (found != ops_.end()) return *found->second.policies;
    auto policies = std::make_shared<OpPolicies>(op);
    for (c10::DeviceType device : kDevices) {
      // torch's kernel is taken before ours covers it; without one, torch falls through.
      const auto key = at::autocast::get_autocast_dispatch_key_from_device_type(device);
      const bool own = op.hasKernelForDispatchKey(key) && !op.isKernelFallthroughKernel(key);
      policies->keep_torch_kernel(
          key, own ? std::make_optional(op.getComputedKernelForDispatchKey(key)) : std::nullopt);
    }
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt,
                                                    __FILE__, __LINE__);
    const auto [name, overload] = split_name(qualified);
    const std::string impl_name = overload.empty() ? name : name + "." + overload;
    DropOverrideWarning drop(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&drop);
    for (c10::DeviceType device : kDevices) {
      library->impl(
          impl_name.c_str(),
          torch::dispatch(at::autocast::get_autocast_dispatch_key_from_device_type(device),
                          torch::CppFunction::makeFromBoxedFunctor(
                              std::make_unique<PolicyKernel>(policies, device))));
    }
    OpPolicies& result = *policies;
    ops_.emplace(qualified, Registration{std::move(policies), std::move(library)});
    return result;
  }

  std::mutex mutex_;
  int64_t next_id_ = 1;
  std::map<std::string, Registration> ops_;  // "aten::name.overload" -> its registration
  std::unordered_map<int64_t, std::vector<std::string>> sets_;
};

// Never destroyed: releasing registrations during static destruction could outlive the
// dispatcher they deregister from.
Registry& registry() {
  static Registry* instance = new Registry();
  return *instance;
}

int64_t create_set(const c10::List<std::string>& ops, const c10::List<std::string>& policies) {
  return registry().create(ops.vec(), policies.vec());
}

void release_set(int64_t id) { registry().release(id); }

std::vector<std::string> registered_ops() { return registry().registered_ops(); }

}  // namespace

}  // namespace ampfuse::autocast

TORCH_LIBRARY_FRAGMENT(ampfuse, m) {
  // A policy set: ops[i] ("aten::softmax.int") cast by policies[i] ("fp32", "lower", "promote",
  // "inplace_refused", "to_host_fp32") while the set is active. Returns its id (> 0).
  m.def("o1_policy_set_create(str[] ops, str[] policies) -> int", &ampfuse::autocast::create_set);
  // Releases a set; ops no other set lists get torch's own autocast kernels back.
  m.def("o1_policy_set_release(int set_id) -> ()", &ampfuse::autocast::release_set);
  // Makes set_id (0: none) the calling thread's active set; returns the one it replaces.
  m.def("o1_exchange_active_set(int set_id) -> int", &ampfuse::autocast::exchange_active_set);
  // The ops that carry ampfuse's autocast kernels now, sorted.
  m.def("o1_registered_ops() -> str[]", &ampfuse::autocast::registered_ops);
}
