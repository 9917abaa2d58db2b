// The runtime behind emulated_cuda.h. Blocks run one after another; a block's threads are
// fibers on the calling host thread. A fiber runs until it reaches __syncthreads, a warp
// shuffle or its end; a shuffle goes on when every live lane of its warp is at it, a
// __syncthreads when every live thread of the block is. Warps run one at a time, each as far
// as it can, so one warp runs ahead of the others as far as the barriers allow; blocks take
// turns running the last warp first and the first warp first (run_block says what each shows).
// Deterministic and cheap (no OS threads); it stops with a message where a GPU's behaviour
// would be undefined: threads of one block at different __syncthreads, a shuffle with a lane
// that has returned.
//
// A fiber starts on its own stack through ucontext and from then on switches with _setjmp /
// _longjmp, which make no system call (swapcontext makes two per switch, which took a third
// of the coded kernels' run in their shuffles).

// glibc's fortified longjmp refuses a jump to another stack, which is what a switch between
// fibers is: this file asks for the plain one.
#undef _FORTIFY_SOURCE

#include "emulated_cuda.h"

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <unordered_map>
#include <vector>

namespace ampfuse_emu {
namespace {

// Room for a kernel's locals and a by-value 32 KB ChunkTable copied twice on the way in.
constexpr std::size_t kFiberStackBytes = 256 * 1024;

enum class Wait { kRunnable, kBlockBarrier, kWarpShuffle, kDone };

struct Fiber {
  ucontext_t start;  // the fiber's first entry, on its own stack
  jmp_buf resume;    // where it waits after it has started
  bool started = false;
  std::unique_ptr<char[]> stack;
  ThreadContext builtins;
  Wait wait = Wait::kRunnable;
  std::uint64_t value = 0;             // a shuffle's contribution
  std::uint64_t result = 0;            // and what it read
  int source_lane = 0;                 // from this lane
  const char* op = nullptr;            // the shuffle's name, for messages
  const char* barrier_file = nullptr;  // the __syncthreads it waits at
  int barrier_line = 0;
};

struct BlockRun {
  std::vector<Fiber> fibers;  // grows to the largest block seen, stacks reused
  int threads = 0;
  int current = -1;
  jmp_buf scheduler;  // where the scheduler waits while a fiber runs
  const std::function<void()>* body = nullptr;
};

thread_local ThreadContext context{};
// Counts the blocks run; fresh_shared's record of the block that last reached each variable.
thread_local std::uint64_t block_generation = 0;
thread_local std::unordered_map<void*, std::uint64_t> shared_generation;
thread_local cudaError_t last_error = cudaSuccess;
thread_local BlockRun run;

[[noreturn]] void fail(const char* what, const ThreadContext& at) {
  std::fprintf(stderr,
               "emulated CUDA: %s (block %u,%u,%u thread %u,%u,%u); on a GPU this is undefined "
               "behaviour\n",
               what, at.block_idx.x, at.block_idx.y, at.block_idx.z, at.thread_idx.x,
               at.thread_idx.y, at.thread_idx.z);
  std::abort();
}

bool valid(const Config& cfg) {
  const std::uint64_t threads = std::uint64_t{cfg.block.x} * cfg.block.y * cfg.block.z;
  return threads >= 1 && threads <= 1024 && cfg.block.z <= 64 && cfg.grid.x >= 1 &&
         cfg.grid.x <= 0x7fffffffu && cfg.grid.y >= 1 && cfg.grid.y <= 65535 && cfg.grid.z >= 1 &&
         cfg.grid.z <= 65535 && cfg.shared_bytes <= 48 * 1024;
}

[[noreturn]] void fiber_entry() {
  (*run.body)();
  run.fibers[static_cast<std::size_t>(run.current)].wait = Wait::kDone;
  _longjmp(run.scheduler, 1);
}

// Switches from the running fiber to the scheduler until the scheduler resumes it.
void yield_to_scheduler() {
  Fiber& self = run.fibers[static_cast<std::size_t>(run.current)];
  if (_setjmp(self.resume) == 0) _longjmp(run.scheduler, 1);
  context = self.builtins;
}

// Runs fiber t until it waits or ends.
void resume(int t) {
  Fiber& f = run.fibers[static_cast<std::size_t>(t)];
  run.current = t;
  context = f.builtins;
  if (_setjmp(run.scheduler) != 0) return;
  if (!f.started) {
    f.started = true;
    setcontext(&f.start);
  }
  _longjmp(f.resume, 1);
}

// Lets the lanes of warp [first, last) go on if every live one waits at a shuffle. Returns
// whether they did.
bool release_warp(int first, int last) {
  int waiting = 0, done = 0;
  for (int t = first; t < last; ++t) {
    const Wait w = run.fibers[static_cast<std::size_t>(t)].wait;
    waiting += w == Wait::kWarpShuffle;
    done += w == Wait::kDone;
  }
  if (waiting == 0 || waiting + done != last - first) return false;
  for (int t = first; t < last; ++t) {
    Fiber& f = run.fibers[static_cast<std::size_t>(t)];
    if (f.wait != Wait::kWarpShuffle) continue;
    if (done != 0 || last - first != 32) {
      std::fprintf(stderr, "emulated CUDA: %s over a full mask\n", f.op);
      fail("a shuffle in a warp with a lane that has returned or with fewer than 32 threads",
           f.builtins);
    }
    const int source = first + f.source_lane;
    if (source >= last) fail("a shuffle from a lane outside the warp", f.builtins);
    f.result = run.fibers[static_cast<std::size_t>(source)].value;
  }
  for (int t = first; t < last; ++t) {
    Fiber& f = run.fibers[static_cast<std::size_t>(t)];
    if (f.wait == Wait::kWarpShuffle) f.wait = Wait::kRunnable;
  }
  return true;
}

// Lets every thread go on if every live one waits at __syncthreads. Returns whether they did.
bool release_block() {
  int at_barrier = 0, done = 0;
  for (int t = 0; t < run.threads; ++t) {
    const Wait w = run.fibers[static_cast<std::size_t>(t)].wait;
    at_barrier += w == Wait::kBlockBarrier;
    done += w == Wait::kDone;
  }
  if (at_barrier == 0 || at_barrier + done != run.threads) return false;
  const Fiber* first = nullptr;
  for (int t = 0; t < run.threads; ++t) {
    const Fiber& f = run.fibers[static_cast<std::size_t>(t)];
    if (f.wait != Wait::kBlockBarrier) continue;
    if (first == nullptr) {
      first = &f;
    } else if (f.barrier_line != first->barrier_line ||
               std::strcmp(f.barrier_file, first->barrier_file) != 0) {
      std::fprintf(stderr, "emulated CUDA: __syncthreads at %s:%d and at %s:%d\n",
                   first->barrier_file, first->barrier_line, f.barrier_file, f.barrier_line);
      fail("threads of one block wait at different __syncthreads", f.builtins);
    }
  }
  for (int t = 0; t < run.threads; ++t) {
    Fiber& f = run.fibers[static_cast<std::size_t>(t)];
    if (f.wait == Wait::kBlockBarrier) f.wait = Wait::kRunnable;
  }
  return true;
}

// Runs warp [first, last) as far as it goes without the rest of the block: through its
// shuffles, up to a __syncthreads or its end.
void run_warp(int first, int last) {
  for (;;) {
    bool ran = false;
    for (int t = first; t < last; ++t) {
      Fiber& f = run.fibers[static_cast<std::size_t>(t)];
      if (f.wait != Wait::kRunnable) continue;
      resume(t);
      ran = true;
    }
    if (!ran || !release_warp(first, last)) return;
  }
}

// Thread `t` of a block, ready to start at fiber_entry.
void start_fiber(Fiber& f, unsigned t, const Config& cfg, uint3 block_idx) {
  if (!f.stack) f.stack.reset(new char[kFiberStackBytes]);
  f.builtins = ThreadContext{
      uint3{t % cfg.block.x, t / cfg.block.x % cfg.block.y, t / (cfg.block.x * cfg.block.y)},
      block_idx, cfg.block, cfg.grid};
  f.wait = Wait::kRunnable;
  f.started = false;
  getcontext(&f.start);
  f.start.uc_stack.ss_sp = f.stack.get();
  f.start.uc_stack.ss_size = kFiberStackBytes;
  f.start.uc_link = nullptr;  // fiber_entry never returns: it jumps back to the scheduler
  makecontext(&f.start, fiber_entry, 0);
}

void run_block(const Config& cfg, uint3 block_idx) {
  ++block_generation;
  // Blocks alternate between two schedules: the last warp first shows a warp that runs ahead
  // and overwrites shared memory a slower warp still needs; the first warp first shows a read
  // of shared memory that a barrier should have made wait for the other warps' writes.
  const bool last_warp_first = block_generation % 2 == 1;
  for (int t = 0; t < run.threads; ++t) {
    start_fiber(run.fibers[static_cast<std::size_t>(t)], static_cast<unsigned>(t), cfg, block_idx);
  }
  // Warp by warp, each as far as it goes before the next starts.
  for (;;) {
    const int warps = (run.threads + 31) / 32;
    for (int w = 0; w < warps; ++w) {
      const int first = 32 * (last_warp_first ? warps - 1 - w : w);
      run_warp(first, std::min(run.threads, first + 32));
    }
    bool all_done = true;
    for (int t = 0; t < run.threads; ++t) {
      all_done = all_done && run.fibers[static_cast<std::size_t>(t)].wait == Wait::kDone;
    }
    if (all_done) return;
    if (!release_block()) {
      for (int t = 0; t < run.threads; ++t) {
        const Fiber& f = run.fibers[static_cast<std::size_t>(t)];
        if (f.wait != Wait::kDone) {
          fail("threads of one block wait at different barriers (or at a barrier others skip)",
               f.builtins);
        }
      }
    }
  }
}

}  // namespace

ThreadContext& current() { return context; }

void run_grid(const Config& cfg, const std::function<void()>& body) {
  if (!valid(cfg)) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (run.body != nullptr) {
    std::fprintf(stderr, "emulated CUDA: a kernel launched a kernel\n");
    std::abort();
  }
  run.threads = static_cast<int>(cfg.block.x * cfg.block.y * cfg.block.z);
  if (run.fibers.size() < static_cast<std::size_t>(run.threads)) {
    run.fibers.resize(static_cast<std::size_t>(run.threads));
  }
  run.body = &body;
  for (unsigned bz = 0; bz < cfg.grid.z; ++bz) {
    for (unsigned by = 0; by < cfg.grid.y; ++by) {
      for (unsigned bx = 0; bx < cfg.grid.x; ++bx) run_block(cfg, uint3{bx, by, bz});
    }
  }
  run.body = nullptr;
  context = ThreadContext{};
}

void fresh_shared(void* p, std::size_t bytes) {
  std::uint64_t& seen = shared_generation[p];
  if (seen == block_generation) return;
  seen = block_generation;
  std::memset(p, 0xff, bytes);
}

void syncthreads(const char* file, int line) {
  Fiber& self = run.fibers[static_cast<std::size_t>(run.current)];
  self.barrier_file = file;
  self.barrier_line = line;
  self.wait = Wait::kBlockBarrier;
  yield_to_scheduler();
}

void require_whole_warp(unsigned mask, int width, unsigned offset, const char* op) {
  if (mask == 0xffffffffu && width == 32 && offset < 32) return;
  std::fprintf(stderr,
               "emulated CUDA: %s with mask %#x, width %d, offset %u: only full-mask, width-32 "
               "shuffles with offsets below 32 are emulated\n",
               op, mask, width, offset);
  std::abort();
}

int lane_id() {
  const ThreadContext& c = context;
  const unsigned linear =
      c.thread_idx.x + c.block_dim.x * (c.thread_idx.y + c.block_dim.y * c.thread_idx.z);
  return static_cast<int>(linear % 32);
}

std::uint64_t warp_exchange(std::uint64_t value, int source_lane, const char* op) {
  Fiber& self = run.fibers[static_cast<std::size_t>(run.current)];
  self.value = value;
  self.source_lane = source_lane;
  self.op = op;
  self.wait = Wait::kWarpShuffle;
  yield_to_scheduler();
  return self.result;
}

cudaError_t get_last_error() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t peek_at_last_error() { return last_error; }

namespace {

// The errors the emulation reports, by name and in words.
struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* words;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error (emulated)"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument (emulated)"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument (emulated)"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal (emulated)"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory (emulated)"},
};

const ErrorText& text_of(cudaError_t error) {
  static constexpr ErrorText kUnknown{cudaErrorUnknown, "cudaErrorUnknown",
                                      "unknown error (emulated)"};
  for (const ErrorText& e : kErrors) {
    if (e.error == error) return e;
  }
  return kUnknown;
}

}  // namespace

const char* get_error_string(cudaError_t error) { return text_of(error).words; }

const char* get_error_name(cudaError_t error) { return text_of(error).name; }

cudaError_t memset_async(void* p, int value, std::size_t bytes, cudaStream_t) {
  if (p == nullptr && bytes != 0) return last_error = cudaErrorInvalidValue;
  if (bytes != 0) std::memset(p, value, bytes);
  return cudaSuccess;
}

// An H100: compute capability 9.0, 132 SMs.
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return last_error = cudaErrorInvalidDevice;
  switch (attribute) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    default:
      return last_error = cudaErrorInvalidValue;
  }
}

cudaError_t driver_get_version(int* version) {
  *version = 13000;
  return cudaSuccess;
}

cudaError_t malloc_device(void** p, std::size_t bytes) {
  // 256-byte aligned, as cudaMalloc's allocations are.
  *p = std::aligned_alloc(256, (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256);
  return *p != nullptr ? cudaSuccess : (last_error = cudaErrorMemoryAllocation);
}

cudaError_t free_device(void* p) {
  std::free(p);
  return cudaSuccess;
}

cudaError_t memcpy_any(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (bytes != 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t memset_sync(void* p, int value, std::size_t bytes) {
  return memset_async(p, value, bytes, nullptr);
}

cudaError_t synchronize() { return cudaSuccess; }

cudaError_t get_device_count(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t set_device(int device) {
  return device == 0 ? cudaSuccess : (last_error = cudaErrorInvalidDevice);
}

}  // namespace ampfuse_emu
