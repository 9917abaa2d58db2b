// A map of bounded size that forgets its least recently used entry when full. No torch, no
// CUDA: the plain C++ of a cache, tested on its own (tests/cpp/test_lru_cache.cpp).
//
// Why: fp8_gemm keeps one cuBLASLt plan (descriptors, layouts and the heuristic's algorithm)
// per problem, because building one costs far more host time than the launch. The problem's
// key holds m, the tokens of the batch, so a workload with variable sequence lengths (or
// simply many shapes over a long run) keeps making new keys: an unbounded map would grow for
// as long as the process lives. A bounded one keeps the shapes in use and drops the one not
// asked for the longest, so a working set that fits stays cached and one that does not costs
// a rebuild per miss instead of memory without end.
//
// Not thread safe: the owner keeps it per thread (as fp8_gemm does) or locks it. Values may
// be move-only (std::unique_ptr); an evicted or replaced value is destroyed at once. A
// pointer or reference to a value stays valid until that entry is evicted, replaced or the
// cache destroyed (entries live in list nodes, which never move).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace ampfuse::kernels {

template <typename Key, typename Value, typename Hash = std::hash<Key>,
          typename KeyEqual = std::equal_to<Key>>
class LruCache {
 public:
  // capacity: the most entries held at once; 0 is refused (a cache that keeps nothing would
  // hand back a reference to a value it has already destroyed).
  explicit LruCache(std::size_t capacity) : capacity_(capacity) {
    if (capacity == 0) {
      throw std::invalid_argument("ampfuse LruCache: capacity must be at least 1");
    }
    index_.reserve(capacity);
  }

  LruCache(const LruCache&) = delete;
  LruCache& operator=(const LruCache&) = delete;

  // The value of `key`, now the most recently used entry; nullptr when absent.
  Value* find(const Key& key) {
    const auto found = index_.find(key);
    if (found == index_.end()) return nullptr;
    entries_.splice(entries_.begin(), entries_, found->second);  // moves no element
    return &found->second->second;
  }

  // Stores `value` under `key` as the most recently used entry and returns it. A value
  // already under `key` is replaced (and destroyed); otherwise, when the cache is full, the
  // least recently used entry is evicted (and destroyed) first, so the size never exceeds
  // the capacity.
  Value& insert(const Key& key, Value value) {
    if (Value* existing = find(key)) {
      *existing = std::move(value);
      return *existing;
    }
    if (entries_.size() == capacity_) evict_oldest();
    entries_.emplace_front(key, std::move(value));
    try {
      index_.emplace(key, entries_.begin());
    } catch (...) {
      entries_.pop_front();  // no entry the index does not know
      throw;
    }
    return entries_.front().second;
  }

  // Drops `key`'s entry (destroying its value) and says whether there was one. Not an
  // eviction: for an owner that finds a cached value unusable (fp8_gemm's plan that cuBLASLt
  // refused), so that the next ask builds it afresh instead of reusing it.
  bool erase(const Key& key) {
    const auto found = index_.find(key);
    if (found == index_.end()) return false;
    const auto entry = found->second;
    index_.erase(found);
    entries_.erase(entry);
    return true;
  }

  std::size_t size() const { return entries_.size(); }
  std::size_t capacity() const { return capacity_; }
  // Entries dropped for room since construction (replacements are not evictions).
  std::int64_t evictions() const { return evictions_; }

 private:
  using Entry = std::pair<Key, Value>;

  void evict_oldest() {
    // Unindexed first: the map's key is a copy, and the value dies with its list node.
    index_.erase(entries_.back().first);
    entries_.pop_back();
    ++evictions_;
  }

  std::size_t capacity_;
  std::int64_t evictions_ = 0;
  std::list<Entry> entries_;  // most recently used first
  std::unordered_map<Key, typename std::list<Entry>::iterator, Hash, KeyEqual> index_;
};

}  // namespace ampfuse::kernels
