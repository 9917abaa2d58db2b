// The bounded least-recently-used map behind fp8_gemm's plan cache: which entry goes when it
// is full, that a lookup counts as a use, and that a move-only value (a plan is held by a
// std::unique_ptr) is destroyed exactly once, when it leaves.
#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "lru_cache.h"

using ampfuse::kernels::LruCache;

namespace {

// Adds its id to `destroyed` when it dies: which values a cache has destroyed, in order.
struct Tracked {
  int id;
  std::vector<int>* destroyed;
  Tracked(int id_, std::vector<int>* destroyed_) : id(id_), destroyed(destroyed_) {}
  Tracked(const Tracked&) = delete;
  Tracked& operator=(const Tracked&) = delete;
  ~Tracked() { destroyed->push_back(id); }
};

using TrackedCache = LruCache<int, std::unique_ptr<Tracked>>;

std::unique_ptr<Tracked> tracked(int id, std::vector<int>& destroyed) {
  return std::make_unique<Tracked>(id, &destroyed);
}

}  // namespace

TEST_CASE("lru cache: a full cache evicts the least recently inserted entry first") {
  LruCache<int, std::string> cache(3);
  cache.insert(1, "one");
  cache.insert(2, "two");
  cache.insert(3, "three");
  CHECK(cache.size() == 3);
  CHECK(cache.evictions() == 0);

  cache.insert(4, "four");
  CHECK(cache.size() == 3);
  CHECK(cache.evictions() == 1);
  CHECK(cache.find(1) == nullptr);
  cache.insert(5, "five");  // 2 is now the oldest (3 and 4 were not asked for)
  CHECK(cache.evictions() == 2);
  CHECK(cache.find(2) == nullptr);
  REQUIRE(cache.find(3) != nullptr);
  CHECK(*cache.find(3) == "three");
  CHECK(*cache.find(4) == "four");
  CHECK(*cache.find(5) == "five");
}

TEST_CASE("lru cache: find makes an entry the most recently used") {
  LruCache<int, int> cache(3);
  cache.insert(1, 10);
  cache.insert(2, 20);
  cache.insert(3, 30);
  REQUIRE(cache.find(1) != nullptr);  // order of use now 2, 3, 1 (oldest first)
  cache.insert(4, 40);
  CHECK(cache.find(2) == nullptr);
  CHECK(cache.find(1) != nullptr);  // order now 3, 4, 1
  cache.insert(5, 50);
  CHECK(cache.find(3) == nullptr);
  CHECK(*cache.find(1) == 10);
  CHECK(*cache.find(4) == 40);
  CHECK(*cache.find(5) == 50);
  CHECK(cache.evictions() == 2);
}

TEST_CASE("lru cache: a missed find changes nothing") {
  LruCache<int, int> cache(2);
  cache.insert(1, 10);
  cache.insert(2, 20);
  CHECK(cache.find(7) == nullptr);
  cache.insert(3, 30);  // 1 is still the oldest
  CHECK(cache.find(1) == nullptr);
  CHECK(cache.find(2) != nullptr);
  CHECK(cache.size() == 2);
}

TEST_CASE("lru cache: inserting a key it holds replaces the value without an eviction") {
  std::vector<int> destroyed;
  TrackedCache cache(2);
  cache.insert(1, tracked(100, destroyed));
  cache.insert(2, tracked(200, destroyed));
  Tracked& replaced = *cache.insert(1, tracked(101, destroyed));  // 1 becomes the newest
  CHECK(replaced.id == 101);
  CHECK(destroyed == std::vector<int>{100});
  CHECK(cache.size() == 2);
  CHECK(cache.evictions() == 0);
  cache.insert(3, tracked(300, destroyed));  // evicts 2, not 1
  CHECK(destroyed == std::vector<int>{100, 200});
  REQUIRE(cache.find(1) != nullptr);
  CHECK((*cache.find(1))->id == 101);
}

TEST_CASE("lru cache: capacity 1 keeps the last entry only") {
  std::vector<int> destroyed;
  TrackedCache cache(1);
  for (int key = 0; key < 5; ++key) {
    Tracked& value = *cache.insert(key, tracked(key, destroyed));
    CHECK(value.id == key);
    CHECK(cache.size() == 1);
    REQUIRE(cache.find(key) != nullptr);
    CHECK((*cache.find(key))->id == key);
    if (key > 0) CHECK(cache.find(key - 1) == nullptr);
  }
  CHECK(cache.evictions() == 4);
  CHECK(destroyed == std::vector<int>{0, 1, 2, 3});
  CHECK(cache.capacity() == 1);
}

TEST_CASE("lru cache: move-only values are destroyed once, on eviction or with the cache") {
  std::vector<int> destroyed;
  {
    TrackedCache cache(3);
    for (int key = 0; key < 3; ++key) cache.insert(key, tracked(key, destroyed));
    cache.find(0);  // order of use: 1, 2, 0
    CHECK(destroyed.empty());
    cache.insert(3, tracked(3, destroyed));
    CHECK(destroyed == std::vector<int>{1});
    cache.insert(4, tracked(4, destroyed));
    CHECK(destroyed == std::vector<int>{1, 2});
    CHECK(cache.evictions() == 2);
    CHECK(cache.size() == 3);
  }
  // The three left (0, 3, 4) die with the cache, each once.
  REQUIRE(destroyed.size() == 5);
  std::vector<int> rest(destroyed.begin() + 2, destroyed.end());
  std::sort(rest.begin(), rest.end());
  CHECK(rest == std::vector<int>{0, 3, 4});
}

TEST_CASE("lru cache: a reference to a value survives other entries' inserts and finds") {
  // Held by value: the reference points into the cache's own storage, not into a heap object.
  LruCache<int, int> cache(4);
  int& first = cache.insert(1, 11);
  for (int key = 2; key <= 4; ++key) cache.insert(key, key * 11);
  cache.find(1);
  cache.find(3);
  cache.insert(5, 55);  // evicts 2, the oldest
  CHECK(cache.find(2) == nullptr);
  CHECK(first == 11);
  CHECK(cache.find(1) == &first);
}

TEST_CASE("lru cache: the eviction counter counts every eviction over a long run") {
  LruCache<int, int> cache(16);
  for (int key = 0; key < 1000; ++key) cache.insert(key, key);
  CHECK(cache.size() == 16);
  CHECK(cache.evictions() == 1000 - 16);
  for (int key = 0; key < 1000 - 16; ++key) CHECK(cache.find(key) == nullptr);
  for (int key = 1000 - 16; key < 1000; ++key) CHECK(*cache.find(key) == key);
}

TEST_CASE("lru cache: erase drops one entry at once, and its key is free again") {
  std::vector<int> destroyed;
  TrackedCache cache(3);
  for (int key = 0; key < 3; ++key) cache.insert(key, tracked(key, destroyed));
  CHECK(cache.erase(1));
  CHECK(destroyed == std::vector<int>{1});
  CHECK(cache.size() == 2);
  CHECK(cache.find(1) == nullptr);
  CHECK_FALSE(cache.erase(1));  // a key it does not hold: nothing changes
  CHECK(cache.size() == 2);
  // Room for a new entry without evicting; the erased one was not counted as an eviction.
  cache.insert(3, tracked(3, destroyed));
  CHECK(cache.evictions() == 0);
  CHECK(destroyed == std::vector<int>{1});
  cache.insert(1, tracked(10, destroyed));  // the erased key, built afresh: evicts 0, the oldest
  CHECK(cache.evictions() == 1);
  CHECK(destroyed == std::vector<int>{1, 0});
  REQUIRE(cache.find(1) != nullptr);
  CHECK((*cache.find(1))->id == 10);
}

TEST_CASE("lru cache: capacity 0 is refused") {
  CHECK_THROWS_AS((LruCache<int, int>(0)), std::invalid_argument);
}
