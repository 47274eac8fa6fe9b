// Blocks and the pools that cache them.
//
// A segment is one device allocation (or one expandable range of address space); it is cut
// into a doubly linked list of blocks in address order. A block is either allocated, waiting
// for events of other streams (pending), cached in its pool's free set, or — in expandable
// segments only — unmapped address space, or address space whose pages moved elsewhere and
// are unmapped here once the device is done with them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "device.h"
#include "node_arena.h"
#include "stats.h"

namespace allocwatch {

struct BlockPool;
class ExpandableSegment;

struct Block {
  StreamId stream = 0;          // the stream it was allocated on; reused only there
  std::size_t size = 0;
  std::size_t requested_size = 0;  // what the caller asked for (before rounding)
  BlockPool* pool = nullptr;
  std::uintptr_t ptr = 0;
  bool allocated = false;
  bool mapped = true;           // false: unmapped address space of an expandable segment
  // Pages moved elsewhere that stay mapped here until the device is done with them
  // (expandable.cpp, Note [moving pages]): neither free nor reusable address space yet.
  bool unmap_pending = false;
  Block* prev = nullptr;        // neighbours in the same segment
  Block* next = nullptr;
  int event_count = 0;          // outstanding events before the block may be reused
  std::int64_t gc_count_base = 0;  // the pool's lookup count when the block was cached
  ExpandableSegment* expandable = nullptr;
  std::vector<StreamId> stream_uses;  // other streams that used it (record_stream)

  Block(StreamId s, std::size_t sz, BlockPool* p, std::uintptr_t addr)
      : stream(s), size(sz), pool(p), ptr(addr) {}

  bool is_split() const { return prev != nullptr || next != nullptr; }
  // Neither in use nor waiting for another stream: free to cache, reuse or merge.
  bool is_free() const {
    return !allocated && event_count == 0 && stream_uses.empty() && !unmap_pending;
  }
  // Age for garbage collection: lookups in this pool since the block was cached.
  std::int64_t gc_count() const;
  // Links this block between `before` and `after`.
  void splice(Block* before, Block* after) {
    if (before) before->next = this;
    prev = before;
    if (after) after->prev = this;
    next = after;
  }
};

// Best fit: the smallest block on the same stream, lowest address among equals.
struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->ptr < b->ptr;
  }
};

struct PrivatePool;

struct BlockPool {
  using FreeSet = std::set<Block*, BySize, ArenaAllocator<Block*>>;

  BlockPool(bool small, PrivatePool* owner = nullptr)
      : blocks(BySize(), ArenaAllocator<Block*>(&arena)),
        unmapped(ByAddress(), ArenaAllocator<Block*>(&arena)),
        is_small(small),
        owner(owner) {}

  NodeArena arena;  // declared first: the sets' nodes live in it
  FreeSet blocks;                                                // cached, mapped, free
  std::set<Block*, ByAddress, ArenaAllocator<Block*>> unmapped;  // expandable address space
  const bool is_small;
  PrivatePool* const owner;  // the CUDA graph pool this belongs to, if any
  std::int64_t get_free_blocks_call_count = 0;

  PoolKind kind() const { return is_small ? kSmallPool : kLargePool; }
  void insert_into_blocks(Block* block) {
    block->gc_count_base = get_free_blocks_call_count;
    blocks.insert(block);
  }
  // The hot path's shortcut: a cached block that changes size and address keeps its place in
  // `blocks` where its new key still sorts between its neighbours there (an alloc + free pair
  // that splits a block and merges it back then moves nothing in the tree). The caller checks
  // with keeps_order before changing the block, then marks it cached anew.
  bool keeps_order(FreeSet::iterator it, std::size_t new_size, std::uintptr_t new_ptr) const {
    const Block* b = *it;
    const Block key(b->stream, new_size, nullptr, new_ptr);
    if (it != blocks.begin() && !BySize()(*std::prev(it), &key)) return false;
    auto next = std::next(it);
    return next == blocks.end() || BySize()(&key, *next);
  }
  void recache_in_place(Block* block) { block->gc_count_base = get_free_blocks_call_count; }
};

inline std::int64_t Block::gc_count() const {
  return pool->get_free_blocks_call_count - gc_count_base;
}

// Identifies a private pool, as PyTorch's MempoolId_t: (graph id, user pool id).
using MempoolId = std::pair<std::uint64_t, std::uint64_t>;

// Memory of CUDA graphs: allocations during a capture come from here and stay out of the
// general pools until every graph using the pool is released.
struct PrivatePool {
  PrivatePool() : large_blocks(false, this), small_blocks(true, this) {}
  int use_count = 1;          // graphs that share this pool
  int device_alloc_count = 0;  // live plain segments (cudaMalloc)
  // Bytes mapped in its expandable segments: one allocation may map several times and one
  // unmap may cover several allocations' pages, so bytes, not calls, say when it is empty.
  std::size_t mapped_bytes = 0;
  // The pool is dropped once no graph uses it and it holds no device memory.
  bool holds_no_memory() const { return device_alloc_count == 0 && mapped_bytes == 0; }
  // Plain segments, one device allocation each, whatever the settings (the pools PyTorch's
  // callers make through the native back end: torch.cuda.MemPool's, CUDA graphs'); with
  // no_split, a block is never split either.
  bool plain_segments = false;
  bool no_split = false;
  // Where its segments come from, when not the allocator's device: an allocator of the user's
  // (torch.cuda.MemPool(allocator=...), devices/pool_segments_device.h). Its segments are
  // plain; the pool, and with it the user's allocator, lives until its last segment is freed.
  // That allocator is never called under the allocator's lock (Note [pool allocators outside
  // the lock], allocator.h).
  std::shared_ptr<Device> segments;
  BlockPool large_blocks;
  BlockPool small_blocks;
};

}  // namespace allocwatch
