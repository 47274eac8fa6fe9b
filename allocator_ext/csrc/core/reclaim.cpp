// Giving memory back to the device: the out-of-memory path, empty_cache, and garbage
// collection. Each of these trades cached memory (fast reuse) for device calls (slow, and
// for ordinary segments a device-wide synchronisation inside cudaFree).
#include <algorithm>
#include <limits>
#include <vector>

#include "allocator.h"

namespace allocwatch {

bool CachingAllocator::release_available_cached_blocks(const AllocParams& p) {
  // Only oversize blocks (>= max_split_size) can be released one by one: they are never split.
  // Unless max_split_size was lowered at run time: a free part of a segment split earlier may
  // now count as oversize, and is skipped (releasing it would free the middle of a segment;
  // with settings that never change, as PyTorch assumes, no such block exists).
  if (config_.max_split_size == kNoMaxSplit) return false;
  BlockPool& pool = *p.pool;
  Block key(p.stream, std::max(p.size, config_.max_split_size), nullptr, 0);
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != p.stream) {
    // No single block is large enough: release oversize blocks, largest first, until the
    // request's size is covered.
    if (it == pool.blocks.begin()) return false;
    std::size_t released = 0;
    --it;
    while (released < key.size && (*it)->size >= config_.max_split_size &&
           (*it)->stream == p.stream) {
      auto cur = it;
      bool first = cur == pool.blocks.begin();
      if (!first) --it;
      if ((*cur)->expandable == nullptr && !(*cur)->is_split()) {
        released += (*cur)->size;
        release_block(*cur);
      }
      if (first) break;
    }
    if (released < key.size) return false;
  } else {
    if ((*it)->expandable != nullptr || (*it)->is_split()) return false;
    release_block(*it);
  }
  return true;
}

std::size_t CachingAllocator::release_cached_blocks() {
  // Pending blocks first: waiting on their events lets them be released too.
  synchronize_and_free_events();
  std::size_t released = release_blocks(large_blocks_) + release_blocks(small_blocks_);
  for (auto it = graph_pools_freeable_.begin(); it != graph_pools_freeable_.end();) {
    PrivatePool* pool = it->second;
    released += release_blocks(pool->small_blocks) + release_blocks(pool->large_blocks);
    if (pool->holds_no_memory()) {
      const MempoolId id = it->first;
      it = graph_pools_freeable_.erase(it);
      drop_pool(id);
    } else {
      ++it;
    }
  }
  return released;
}

void CachingAllocator::wait_before_unmapping(const Block* block, std::vector<StreamId>& waited) {
  // A block of whole pages only: the device must be done with them (cuMemUnmap does not wait).
  if (block->size < block->expandable->page_size()) return;
  const StreamId s = block->expandable->stream();
  if (std::find(waited.begin(), waited.end(), s) != waited.end()) return;
  host_wait_stream(s);
  waited.push_back(s);
}

std::size_t CachingAllocator::release_blocks(BlockPool& pool) {
  std::size_t released = 0;
  std::vector<Block*> to_unmap;
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    Block* block = *it++;
    if (block->expandable != nullptr) {
      to_unmap.push_back(block);  // unmapping edits the pool: collect first
    } else if (!block->is_split()) {
      released += block->size;
      release_block(block);
    }
  }
  // Unmapping does not wait for kernels still using the memory: each segment's stream first,
  // once (an explicit reclaim may wait; Note [moving pages] in expandable.cpp).
  std::vector<StreamId> waited;
  for (Block* block : to_unmap) wait_before_unmapping(block, waited);
  for (Block* block : to_unmap) {
    released += unmap_block(block);
    if (!block->is_split()) release_expandable_segment(block);
  }
  return released;
}

void CachingAllocator::release_block(Block* block) {
  const PrivatePool* owner = block->pool->owner;
  // Recorded before the memory goes, as PyTorch records SEGMENT_FREE before cudaFree: a trace
  // tracker (NCCL's) deregisters the segment from its communicators while it still exists.
  count_released(*block->pool, TraceAction::segment_free, block->ptr, block->size, block->stream);
  registration_.erase(block->ptr);
  if (owner != nullptr && owner->segments != nullptr) {
    // Freed by the pool's own allocator once the lock is let go (Note [pool allocators outside
    // the lock]); gone from the books now, so nothing hands it out meanwhile.
    outside_.push_back(OutsideWork{owner->segments, reinterpret_cast<void*>(block->ptr),
                                   block->size});
  } else {
    device_->free(reinterpret_cast<void*>(block->ptr), block->size);
  }
  block->pool->blocks.erase(block);
  delete_block(block);
}

std::size_t CachingAllocator::garbage_collect_cached_blocks() {
  // Release cached blocks that have waited longest since their last use, until reserved memory
  // is back under threshold x allowed memory. Unlike release_cached_blocks, this does not wait
  // for pending events, so it is cheap enough to run on the allocation path.
  const auto gc_threshold = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                                     static_cast<double>(allowed_memory_maximum_));
  if (total_allocated_memory_ <= gc_threshold) return 0;
  const std::size_t target = total_allocated_memory_ - gc_threshold;
  std::size_t reclaimed = 0;

  // Only unsplit blocks of the large pool can be released; their mean age is the bar.
  std::int64_t total_age = 0;
  int freeable = 0;
  for (Block* b : large_blocks_.blocks) {
    if (!b->is_split()) {
      total_age += b->gc_count();
      ++freeable;
    }
  }
  if (freeable == 0) return 0;

  bool block_freed = true;
  while (reclaimed < target && block_freed && freeable > 0) {
    const double age_threshold = static_cast<double>(total_age) / freeable;
    block_freed = false;
    // Release every block at or above the mean age, not just enough for the target, so that
    // the next allocation does not have to collect again straight away.
    for (auto it = large_blocks_.blocks.begin(); it != large_blocks_.blocks.end();) {
      Block* block = *it++;
      if (!block->is_split() && static_cast<double>(block->gc_count()) >= age_threshold) {
        block_freed = true;
        reclaimed += block->size;
        total_age -= block->gc_count();
        --freeable;
        release_block(block);
      }
    }
  }
  if (reclaimed > 0) {
    stats_.num_gc_reclaims++;
    stats_.gc_reclaimed_bytes += static_cast<std::int64_t>(reclaimed);
  }
  return reclaimed;
}

std::size_t CachingAllocator::empty_cache() {
  Lock lock(*this);
  // A reclaim sent by the sidecar can arrive from another thread at any moment; during a
  // capture it must not invalidate the user's graph.
  if (captures_underway()) return 0;
  stats_.num_empty_cache_calls++;
  const std::size_t released = release_cached_blocks();
  // An explicit reclaim asks for less memory from now on: growth moves free pages again
  // before it raises reserved above what is left.
  page_policy_.reclaimed(total_allocated_memory_);
  return released;
}

std::size_t CachingAllocator::garbage_collect() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (captures_underway()) return 0;  // as empty_cache
  // Asked for explicitly: whatever it releases, growth moves free pages again before it
  // raises reserved memory above what is left (as after empty_cache).
  struct LowerMark {
    CachingAllocator& a;
    ~LowerMark() {
      a.page_policy_.reclaimed(a.total_allocated_memory_);
    }
  } lower_mark{*this};
  if (!set_fraction_ || config_.garbage_collection_threshold <= 0.0) return 0;
  std::size_t released = garbage_collect_cached_blocks();
  // Asked for explicitly (an operator's or a policy's reclaim), expandable segments give back
  // wholly free pages too, largest free blocks first, down to the same threshold. PyTorch's
  // own collection on the allocation path skips them (they are always "split"); that path is
  // left as PyTorch has it.
  const auto gc_threshold = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                                     static_cast<double>(allowed_memory_maximum_));
  if (total_allocated_memory_ <= gc_threshold) return released;
  std::vector<Block*> free_expandable;
  for (BlockPool* pool : {&large_blocks_, &small_blocks_})
    for (Block* b : pool->blocks)
      if (b->expandable != nullptr) free_expandable.push_back(b);
  std::sort(free_expandable.begin(), free_expandable.end(),
            [](const Block* a, const Block* b) { return a->size > b->size; });
  std::size_t unmapped = 0;
  std::vector<StreamId> waited;  // an unmap waits for its segment's stream, once each
  for (Block* b : free_expandable) {
    if (total_allocated_memory_ <= gc_threshold) break;
    if (b->size < b->expandable->page_size()) continue;
    wait_before_unmapping(b, waited);
    unmapped += unmap_block(b, total_allocated_memory_ - gc_threshold);
  }
  if (unmapped > 0) {
    if (released == 0) stats_.num_gc_reclaims++;
    stats_.gc_reclaimed_bytes += static_cast<std::int64_t>(unmapped);
  }
  return released + unmapped;
}

}  // namespace allocwatch
