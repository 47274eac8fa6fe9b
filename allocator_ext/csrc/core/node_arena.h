// A free list of equally sized nodes, so that the hot path (split a block, insert into a pool)
// never calls the system allocator. Not thread-safe: used under the allocator's lock.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

namespace allocwatch {

class NodeArena {
 public:
  NodeArena() = default;
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;
  ~NodeArena() {
    for (void* chunk : chunks_) std::free(chunk);
  }

  void* get(std::size_t size) {
    if (node_size_ == 0) node_size_ = round_up(size < sizeof(void*) ? sizeof(void*) : size);
    assert(size <= node_size_);
    if (free_ == nullptr) grow();
    void* node = free_;
    free_ = *static_cast<void**>(free_);
    return node;
  }

  void put(void* node) {
    *static_cast<void**>(node) = free_;
    free_ = node;
  }

 private:
  static constexpr std::size_t kNodesPerChunk = 256;
  static std::size_t round_up(std::size_t n) { return (n + 15) & ~std::size_t{15}; }

  void grow() {
    char* chunk = static_cast<char*>(std::malloc(node_size_ * kNodesPerChunk));
    if (chunk == nullptr) throw std::bad_alloc();
    chunks_.push_back(chunk);
    for (std::size_t i = 0; i < kNodesPerChunk; ++i) put(chunk + i * node_size_);
  }

  std::size_t node_size_ = 0;
  void* free_ = nullptr;
  std::vector<void*> chunks_;
};

// std::allocator-compatible front for NodeArena, for the nodes of std::set.
template <typename T>
struct ArenaAllocator {
  using value_type = T;
  NodeArena* arena;

  explicit ArenaAllocator(NodeArena* a) : arena(a) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& other) : arena(other.arena) {}  // NOLINT

  T* allocate(std::size_t n) {
    if (n == 1) return static_cast<T*>(arena->get(sizeof(T)));
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, std::size_t n) {
    if (n == 1) return arena->put(p);
    std::allocator<T>().deallocate(p, n);
  }
  template <typename U>
  bool operator==(const ArenaAllocator<U>& o) const { return arena == o.arena; }
  template <typename U>
  bool operator!=(const ArenaAllocator<U>& o) const { return arena != o.arena; }
};

}  // namespace allocwatch
