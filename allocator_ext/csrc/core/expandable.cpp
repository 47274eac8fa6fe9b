// Expandable segments inside the allocator: finding room, mapping pages on demand, unmapping
// them on reclaim, and (allocwatch's addition) moving fully free pages to where growth is
// needed instead of asking the device for more.
#include <algorithm>

#include "allocator.h"

namespace allocwatch {

namespace {

// Free small-pool pages the large pool leaves in place when it takes the rest (see
// take_back_free_pages).
constexpr std::size_t kSmallPagesKept = 2;

bool allocatable(const Block* b) {
  return b != nullptr && b->is_free();
}

}  // namespace

Block* CachingAllocator::find_expandable_block(StreamId stream, BlockPool* pool,
                                               std::size_t size) {
  // The lowest address where `size` fits in unmapped space, possibly together with the free
  // block just before it: growing at the lowest address keeps each segment one piece.
  auto has_room = [&](Block* b) {
    std::size_t bytes = 0;
    while (bytes < size && allocatable(b)) {
      bytes += b->size;
      b = b->next;
    }
    return bytes >= size;
  };
  Block key(stream, 0, nullptr, 0);
  for (auto it = pool->unmapped.lower_bound(&key);
       it != pool->unmapped.end() && (*it)->stream == stream; ++it) {
    Block* c = *it;
    if (allocatable(c->prev)) c = c->prev;
    if (has_room(c)) return c;
  }
  // None: reserve a new segment with address space for all of the device's memory (and an
  // eighth more, so pages unmapped early in a segment can be remapped at its end).
  const std::size_t page = pool->is_small ? kSmallBuffer : config_.expandable_large_page;
  const std::size_t address_space = device_total_ + device_total_ / 8;
  expandable_segments_.push_back(
      std::make_unique<ExpandableSegment>(*device_, stream, address_space, page));
  ExpandableSegment* es = expandable_segments_.back().get();
  Block* candidate = new_block(stream, es->size(), pool, es->base());
  candidate->mapped = false;
  candidate->expandable = es;
  pool->unmapped.insert(candidate);
  return candidate;
}

std::size_t CachingAllocator::grow_size(const BlockPool* pool, std::size_t needed) const {
  // PyTorch maps exactly the pages needed. With expandable_grow_mb, the large pool grows by at
  // least that much at a time, in one chunk: fewer, larger device calls.
  if (pool->is_small || config_.expandable_grow == 0) return needed;
  return std::max(needed, config_.expandable_grow);
}

bool CachingAllocator::map_block(Block* to_map, std::size_t size, std::size_t needed) {
  ExpandableSegment* es = to_map->expandable;
  const std::size_t page = es->page_size();
  auto whole_pages = [page](std::size_t bytes) { return (bytes + page - 1) / page * page; };
  // With reuse_free_pages the memory fraction is checked here, after the take-back, against
  // what growth really adds (alloc_block leaves it to this); `native` keeps PyTorch's check.
  const bool cap_here = set_fraction_ && fraction_checked_when_mapping();
  if (cap_here && size > needed) {
    // Growth beyond the request (expandable_grow_mb) only as far as the memory fraction leaves
    // room: a small request must not fail because its generous growth would not fit.
    const std::size_t room = allowed_memory_maximum_ > total_allocated_memory_
                                 ? allowed_memory_maximum_ - total_allocated_memory_
                                 : 0;
    size = std::max(whole_pages(needed), std::min(size, room / page * page));
  }
  // Large-pool growth maps whole chunks where it can (few calls), single pages at the ends
  // (easy to give back; ExpandableSegment::map lays them out).
  std::size_t chunk_pages = 1;
  if (!to_map->pool->is_small) {
    if (config_.expandable_grow > 0) {
      chunk_pages = whole_pages(size) / page;
    } else if (config_.expandable_chunk > page) {
      chunk_pages = config_.expandable_chunk / page;
    }
  }
  const std::size_t rounded = whole_pages(size);
  // Taken-back chunks are mapped as they are (largest first) where they fit in the range.
  // Those that will not fit go back to the device before anything is created, so that
  // physical memory never holds both (it could run the device out, or pass the cap).
  auto release_spares_beyond = [&](std::size_t keep_pages) {
    std::sort(spare_pages_.begin(), spare_pages_.end(),
              [](const SparePhysical& a, const SparePhysical& b) { return a.pages > b.pages; });
    std::vector<SparePhysical> kept;
    for (const SparePhysical& s : spare_pages_) {
      if (s.pages <= keep_pages) {
        keep_pages -= s.pages;
        kept.push_back(s);
      } else {
        device_->release_physical(s.handle, s.pages * page);
      }
    }
    spare_pages_ = std::move(kept);
  };
  // Taken-back pages never outlive this call, even when a device call throws: another
  // segment (whose page size may differ) must not map or release them.
  struct ReleaseSparesOnExit {
    decltype(release_spares_beyond)& release;
    ~ReleaseSparesOnExit() {
      try {
        release(0);
      } catch (...) {
      }
    }
  } release_spares_on_exit{release_spares_beyond};
  // Taking pages back costs an unmap, which waits for the stream: worth it only where growing
  // would raise reserved memory above its high-water mark (the peak that counts), or where the
  // device has no memory left. Below the mark new pages are created instead, so a training
  // loop whose shapes vary settles with its peak's pages mapped and stops moving them (before
  // this rule, every large step moved pages: its step time 15 % over expandable segments').
  // Never while a CUDA graph is being captured: an unmap waits for a stream, which a capture
  // forbids (PyTorch releases nothing during capture either).
  const bool over_cap = cap_here && total_allocated_memory_ + rounded > allowed_memory_maximum_;
  const bool may_take_back = config_.reuse_free_pages && !captures_underway();
  const bool take_back = may_take_back &&
                         (total_allocated_memory_ + rounded > reserved_high_water_ || over_cap);
  if (take_back) take_back_free_pages(to_map->pool, to_map, rounded);
  if (cap_here && total_allocated_memory_ + rounded > allowed_memory_maximum_) {
    // Still over the memory fraction: pages taken back go to the device, and the caller's
    // out-of-memory path frees cached blocks and retries.
    release_spares_beyond(0);
    return false;
  }
  // Growth in one chunk (expandable_grow_mb) creates that chunk whole.
  const std::size_t spare_room = config_.expandable_grow > 0 && chunk_pages > 1 ? 0 : rounded / page;
  release_spares_beyond(spare_room);
  Range mapped = es->map(Range{to_map->ptr, size}, chunk_pages, &spare_pages_);
  if (mapped.size == 0 && may_take_back && !take_back &&
      take_back_free_pages(to_map->pool, to_map, rounded) > 0) {
    release_spares_beyond(spare_room);
    mapped = es->map(Range{to_map->ptr, size}, chunk_pages, &spare_pages_);
  }
  // Pages taken back but not mapped (a chunk was mapped instead, or the map failed) are
  // returned to the device.
  release_spares_beyond(0);
  if (mapped.size == 0) return false;

  BlockPool& pool = *to_map->pool;
  pool.unmapped.erase(to_map);
  to_map->mapped = true;
  if (mapped.size < to_map->size) {
    // to_map -> remaining (still unmapped) -> to_map->next
    Block* remaining = new_block(to_map->stream, to_map->size - mapped.size, &pool,
                                 to_map->ptr + mapped.size);
    remaining->mapped = false;
    remaining->expandable = es;
    remaining->splice(to_map, to_map->next);
    pool.unmapped.insert(remaining);
    to_map->size = mapped.size;
  }
  try_merge_blocks(to_map, to_map->prev, pool);
  try_merge_blocks(to_map, to_map->next, pool);
  pool.insert_into_blocks(to_map);

  total_allocated_memory_ += mapped.size;
  reserved_high_water_ = std::max(reserved_high_water_, total_allocated_memory_);
  if (pool.owner != nullptr) pool.owner->mapped_bytes += mapped.size;
  stats_.reserved_bytes.increase(pool.kind(), static_cast<std::int64_t>(mapped.size));
  stats_.num_device_alloc++;
  trace_.record(TraceAction::segment_map, mapped.ptr, mapped.size, to_map->stream);
  return true;
}

Block* CachingAllocator::try_allocate_expandable_block(StreamId stream, BlockPool* pool,
                                                       std::size_t size) {
  Block* candidate = find_expandable_block(stream, pool, size);
  // The candidate starts a run of free and unmapped blocks with at least `size` bytes:
  //   unmapped -> null | unmapped -> free -> ... | free -> unmapped -> ...
  if (!candidate->mapped &&
      !map_block(candidate, std::min(candidate->size, grow_size(pool, size)),
                 std::min(candidate->size, size))) {
    return nullptr;
  }
  while (candidate->size < size) {
    // free -> unmapped: map part of the unmapped block; it merges into the free one.
    std::size_t remaining = size - candidate->size;
    Block* next = candidate->next;
    if (!map_block(next, std::min(grow_size(pool, remaining), next->size),
                   std::min(remaining, next->size))) {
      return nullptr;
    }
    candidate = next;
  }
  pool->blocks.erase(candidate);
  return candidate;
}

std::size_t CachingAllocator::unmap_block(Block* block, std::size_t limit,
                                          std::vector<SparePhysical>* keep) {
  Range unmapped = block->expandable->unmap(Range{block->ptr, block->size}, limit, keep);
  if (unmapped.size == 0) return 0;
  BlockPool& pool = *block->pool;
  pool.blocks.erase(block);

  // The partial pages at either end stay mapped as free blocks of their own.
  const std::size_t before = unmapped.ptr - block->ptr;
  if (before > 0) {
    Block* before_free = new_block(block->stream, before, &pool, block->ptr);
    before_free->expandable = block->expandable;
    before_free->splice(block->prev, block);
    pool.insert_into_blocks(before_free);
  }
  const std::size_t after = block->size - (before + unmapped.size);
  if (after > 0) {
    Block* after_free = new_block(block->stream, after, &pool, unmapped.ptr + unmapped.size);
    after_free->expandable = block->expandable;
    after_free->splice(block, block->next);
    pool.insert_into_blocks(after_free);
  }
  block->ptr = unmapped.ptr;
  block->size = unmapped.size;
  block->mapped = false;
  try_merge_blocks(block, block->prev, pool);
  try_merge_blocks(block, block->next, pool);
  pool.unmapped.insert(block);

  total_allocated_memory_ -= unmapped.size;
  stats_.reserved_bytes.decrease(pool.kind(), static_cast<std::int64_t>(unmapped.size));
  if (pool.owner != nullptr) pool.owner->mapped_bytes -= unmapped.size;
  stats_.num_device_free++;
  trace_.record(TraceAction::segment_unmap, unmapped.ptr, unmapped.size, block->stream);
  return unmapped.size;
}

void CachingAllocator::release_expandable_segment(Block* block) {
  // The whole segment is one unmapped block: give its address space back.
  block->pool->unmapped.erase(block);
  ExpandableSegment* es = block->expandable;
  delete_block(block);
  expandable_segments_.erase(
      std::find_if(expandable_segments_.begin(), expandable_segments_.end(),
                   [&](const std::unique_ptr<ExpandableSegment>& p) { return p.get() == es; }));
}

std::size_t CachingAllocator::take_back_free_pages(BlockPool* pool, Block* exclude,
                                                   std::size_t bytes) {
  // Growing a segment while wholly free pages sit elsewhere raises reserved memory for
  // nothing: unmap those pages first, so the growth reuses their physical memory. The pool's
  // own free pages come first (same page size: they move as they are, no release and create);
  // then, for the small pool, the large pool's, whose pages are released: a decoder's small
  // KV-cache tensors then grow into memory its large pool no longer uses (decode trace: 1.050
  // -> 1.021 reserved/requested). The large pool takes the small pool's pages too: moved as
  // they are where the sizes match (2 MiB large pages; moe 1.032 -> 1.013), else released so
  // that their memory goes into the large page created instead — but never the small pool's
  // last kSmallPagesKept free pages: without that reserve the small pool at once re-creates
  // what it gave, and the churn cost out-of-memory errors on the convnet trace under a 1.03x
  // cap with 20 MiB pages (with it: convnet 1.036 -> 1.030, moe 1.038 -> 1.020, no error; a
  // reserve of 1 page was too few, 3 or more kept more than needed), and page moves in every
  // repeated pass with 2 MiB pages (moe: 49 -> 28 stream waits a pass, bench/steady_state.py).
  // Largest free blocks first: fewest calls per byte.
  const std::size_t page = exclude->expandable->page_size();
  BlockPool* sibling = nullptr;
  if (pool->owner == nullptr) {
    sibling = pool->is_small ? &large_blocks_ : &small_blocks_;
  } else {
    sibling = pool->is_small ? &pool->owner->large_blocks : &pool->owner->small_blocks;
  }
  std::size_t taken = 0;
  for (BlockPool* from : {pool, sibling}) {
    // The large pool taking small pages (moved or released): only beyond the reserve.
    const bool from_small_reserve = from == sibling && !pool->is_small;
    std::vector<Block*> donors;
    for (Block* b : from->blocks) {
      if (b->expandable == nullptr || b->size < b->expandable->page_size()) continue;
      // A donor next to the range being mapped would merge its hole into that range.
      if (b == exclude || b->prev == exclude || b->next == exclude) continue;
      donors.push_back(b);
    }
    std::sort(donors.begin(), donors.end(), [](const Block* a, const Block* b) {
      return a->size > b->size;
    });
    std::size_t budget = bytes;
    if (from_small_reserve) {
      // Counted in free bytes, partly used pages' included (they serve small requests too);
      // pages go whole, so a take-back can end up to one page below the reserve. Counting
      // whole pages only was measured (fifth session): fewer moves in repeated passes (moe 28
      // -> 13 stream waits) but convnet 1.013 -> 1.014 and, with 20 MiB large pages, 1.030 ->
      // 1.031 and a retry under a 1.03x fraction; kept as it is.
      std::size_t free_pages_bytes = 0;
      for (const Block* b : donors) free_pages_bytes += b->size;
      const std::size_t reserve = kSmallPagesKept * kSmallBuffer;
      budget = free_pages_bytes > reserve ? free_pages_bytes - reserve : 0;
    }
    for (Block* b : donors) {
      if (taken >= bytes || budget == 0) return taken;
      const bool movable = b->expandable->page_size() == page;
      const std::size_t got =
          unmap_block(b, std::min(bytes - taken, budget), movable ? &spare_pages_ : nullptr);
      taken += got;
      if (from_small_reserve) budget -= std::min(budget, got);
    }
  }
  return taken;
}

}  // namespace allocwatch
