// Host buffers for the emulated CUDA kernel tests: element bits of fp32 / fp16 / bf16 at a
// chosen offset from a 64-byte boundary (an offset of one element forces the kernels' scalar
// paths), filled with seeded values and with inf / nan planted where a test asks.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "dtype.h"
#include "variant_test_arrays.h"

namespace ampfuse::kernels::emulated_test {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// `numel` elements of `dtype` starting `offset_elements` past a 64-byte boundary.
class Elements {
 public:
  Elements(DType dtype, std::int64_t numel, int offset_elements = 0)
      : dtype_(dtype), numel_(numel), offset_bytes_(offset_elements * element_size(dtype)) {
    const std::size_t bytes = static_cast<std::size_t>(numel * element_size(dtype)) + 128;
    storage_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    std::memset(storage_.get(), 0, bytes);
  }
  void* data() { return storage_.get() + offset_bytes_; }
  const void* data() const { return storage_.get() + offset_bytes_; }
  DType dtype() const { return dtype_; }
  std::int64_t numel() const { return numel_; }

  void set(std::int64_t i, float v) {
    unsigned char* p = static_cast<unsigned char*>(data());
    if (dtype_ == DType::kFloat32) {
      std::memcpy(p + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = test::round_to(dtype_, v);
      std::memcpy(p + 2 * i, &h, 2);
    }
  }
  // Element i widened to fp32 (exactly).
  float get(std::int64_t i) const {
    const unsigned char* p = static_cast<const unsigned char*>(data());
    if (dtype_ == DType::kFloat32) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return dtype_ == DType::kFloat16 ? cpu::fp16_to_float(h) : cpu::bf16_to_float(h);
  }
  // Uniform in [-spread, spread) from `seed`.
  void fill(std::uint32_t seed, float spread) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-spread, spread);
    for (std::int64_t i = 0; i < numel_; ++i) set(i, dist(rng));
  }

 private:
  DType dtype_;
  std::int64_t numel_;
  int offset_bytes_;
  std::unique_ptr<unsigned char[], FreeDeleter> storage_;
};

// A byte array at a chosen offset from a 64-byte boundary (for the codes).
class Bytes {
 public:
  explicit Bytes(std::int64_t n, int offset = 0, unsigned char fill = 0xa5)
      : offset_(offset), fill_(fill), storage_(static_cast<std::size_t>(n) + 128, fill) {
    const auto address = reinterpret_cast<std::uintptr_t>(storage_.data());
    offset_ += static_cast<int>((64 - address % 64) % 64);
  }
  std::uint8_t* data() { return storage_.data() + offset_; }
  std::vector<std::uint8_t> copy(std::int64_t n) const {
    return {storage_.begin() + offset_, storage_.begin() + offset_ + n};
  }
  // Whether every byte before the array and after its first n is still the fill: nothing
  // wrote out of bounds.
  bool guards_intact(std::int64_t n) const {
    for (std::size_t i = 0; i < storage_.size(); ++i) {
      const bool inside =
          i >= static_cast<std::size_t>(offset_) && i < static_cast<std::size_t>(offset_ + n);
      if (!inside && storage_[i] != fill_) return false;
    }
    return true;
  }

 private:
  int offset_;
  unsigned char fill_;
  std::vector<std::uint8_t> storage_;
};

}  // namespace ampfuse::kernels::emulated_test
