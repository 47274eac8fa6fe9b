// Allocation and free: the hot path, and the rules that decide which block serves a request.
#include "allocator.h"
#include "text.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace allocwatch {

namespace {

// Captures underway in the process, over every allocator (one per device).
std::atomic<int> g_captures_underway{0};

std::string format_size(std::size_t bytes) {
  char buf[64];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  } else if (bytes < kMiB) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", bytes / 1024.0);
  } else if (bytes < 1024 * kMiB) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / double(kMiB));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(1024 * kMiB));
  }
  return buf;
}

// Clears a flag for one scope and restores it after: malloc's expandable_segments setting
// while it serves a pool of plain segments (PrivatePool::plain_segments).
class ScopedFlagOff {
 public:
  ScopedFlagOff(bool& flag, bool off) : flag_(off ? &flag : nullptr), saved_(flag) {
    if (flag_ != nullptr) *flag_ = false;
  }
  ~ScopedFlagOff() {
    if (flag_ != nullptr) *flag_ = saved_;
  }
  ScopedFlagOff(const ScopedFlagOff&) = delete;
  ScopedFlagOff& operator=(const ScopedFlagOff&) = delete;

 private:
  bool* flag_;
  bool saved_;
};

}  // namespace

CachingAllocator::CachingAllocator(std::shared_ptr<Device> device, AllocatorConfig config)
    : config_(config) {
  auto counted = std::make_shared<CountedDevice>(std::move(device));
  counted_ = counted.get();
  device_ = std::move(counted);
  stats_.max_split_size = config_.max_split_size == kNoMaxSplit
                              ? -1
                              : static_cast<std::int64_t>(config_.max_split_size);
  device_total_ = device_->memory_info().total;
  unmapper_ = std::make_unique<Unmapper>(*device_);
}

CachingAllocator::~CachingAllocator() {
  // Blocks live in block_arena_ and are freed with it. Device memory still held is returned
  // where possible; a caller that tears down with allocations outstanding leaks them
  // deliberately rather than freeing memory that kernels may still use.
  try {
    Lock lock(*this);
    g_captures_underway -= static_cast<int>(captures_underway_.size());
    captures_underway_.clear();
    release_cached_blocks();
    for (auto& [stream, events] : free_events_)
      for (const auto& [seq, event] : events) device_->release_event(event);
  } catch (...) {
  }
}

bool CachingAllocator::captures_underway() { return g_captures_underway.load() > 0; }

Block* CachingAllocator::new_block(StreamId stream, std::size_t size, BlockPool* pool,
                                   std::uintptr_t ptr) {
  return new (block_arena_.get(sizeof(Block))) Block(stream, size, pool, ptr);
}

void CachingAllocator::delete_block(Block* block) {
  // Records are keyed by the block's address, which the arena hands out again.
  if (!block_to_capture_stream_uses_.empty()) block_to_capture_stream_uses_.erase(block);
  if (!freed_in_capture_.empty()) freed_in_capture_.erase(block);
  block->~Block();
  block_arena_.put(block);
}

BlockPool& CachingAllocator::get_pool(std::size_t size, StreamId stream) {
  // During a CUDA graph capture, allocations on the capturing stream come from the graph's
  // private pool: the graph bakes in their addresses, so nothing else may reuse them.
  // The latest pool first: use_mem_pool contexts nest, and the innermost one serves.
  if (!captures_underway_.empty()) {
    for (auto it = captures_underway_.rbegin(); it != captures_underway_.rend(); ++it) {
      if (it->second(stream)) {
        PrivatePool& p = *graph_pools_.at(it->first);
        return is_small_request(size) ? p.small_blocks : p.large_blocks;
      }
    }
  }
  return is_small_request(size) ? small_blocks_ : large_blocks_;
}

// Where malloc stands between its passes under the lock (Note [pool allocators outside the
// lock], allocator.h).
struct CachingAllocator::MallocRound {
  int stage = 1;               // the attempt at a new segment it is at (alloc_attempts); 4: none left
  bool released = false;       // that attempt's release of cached blocks is done
  bool collected = false;      // garbage collection ran
  bool counted_retry = false;  // num_alloc_retries counted this request's retry
  bool looked = false;         // the first pass: the cached blocks were just looked through
  bool flush = false;          // stopped for queued frees, to run before the attempt
  bool refused = false;        // the pool's allocator had no room for this attempt
  std::shared_ptr<Device> ask;  // stopped to ask this pool's allocator for `size` bytes
  std::shared_ptr<Device> from;  // it answered with `fresh`, not yet made a segment
  void* fresh = nullptr;
  std::size_t size = 0;
  bool stopped() const { return flush || ask != nullptr; }
};

__attribute__((always_inline)) inline void CachingAllocator::set_params(AllocParams& p,
                                                                      std::size_t orig_size,
                                                                      StreamId stream) {
  p.size = round_size(orig_size, config_.roundup_power2_divisions);
  p.orig_size = orig_size;
  p.stream = stream;
  p.pool = &get_pool(p.size, stream);
  p.alloc_size = segment_size_for(p.size);
}

// Inlined into malloc: one call less on the hot path is a measurable share of it.
__attribute__((always_inline)) inline void* CachingAllocator::malloc_cached(std::size_t orig_size,
                                                                          StreamId stream,
                                                                          AllocParams& p) {
  // Recycle blocks whose cross-stream uses have finished. Querying events is illegal while a
  // graph is being captured, so that waits until no capture is underway.
  if (captures_underway_.empty() &&
      (!events_.empty() || !needs_events_deferred_until_no_capture_.empty() ||
       !page_moves_.empty())) {
    process_events_locked();
  } else if (!freed_in_capture_.empty()) {
    reuse_freed_in_capture(stream);
  }
  set_params(p, orig_size, stream);
  // A torch.cuda.MemPool pool allocates as PyTorch would without expandable segments: one
  // device allocation per segment, which is what its users (NCCL registration, IPC) expect.
  const PrivatePool* owner = p.pool->owner;
  const ScopedFlagOff plain(config_.expandable_segments,
                            owner != nullptr && owner->plain_segments);
  if (!get_free_block(p)) return nullptr;
  const bool split = should_split(p.block, p.size) && !(owner != nullptr && owner->no_split);
  return reinterpret_cast<void*>(alloc_found_block(p, split)->ptr);
}

void* CachingAllocator::malloc(std::size_t orig_size, StreamId stream, OutOfMemoryReport* oom) {
  Lock lock(*this);
  // The hot path: a cached block serves, and none of the passes' machinery is paid for.
  AllocParams p{};
  if (void* ptr = malloc_cached(orig_size, stream, p)) return ptr;
  return malloc_new_segment(lock, p, oom);
}

void* CachingAllocator::malloc_new_segment(Lock& lock, const AllocParams& looked,
                                           OutOfMemoryReport* oom) {
  MallocRound round;
  round.looked = true;  // the first pass follows the lookup above without letting go the lock
  for (;;) {
    void* ptr = nullptr;
    try {
      ptr = malloc_pass(looked.orig_size, looked.stream, oom, round);
    } catch (...) {
      give_back(round);
      throw;
    }
    if (!round.stopped()) {
      give_back(round);  // served by a block that freed up meanwhile
      return ptr;
    }
    round.flush = false;
    lock.outside([&] {
      if (round.ask == nullptr) return;
      std::shared_ptr<Device> from = std::move(round.ask);
      void* fresh = nullptr;
      if (from->malloc(round.size, &fresh)) {
        round.fresh = fresh;
        round.from = std::move(from);
      } else {
        round.refused = true;
      }
    });
  }
}

void CachingAllocator::give_back(MallocRound& round) {
  if (round.fresh == nullptr) return;
  outside_.push_back(OutsideWork{std::move(round.from), round.fresh, round.size});
  round.fresh = nullptr;
}

void* CachingAllocator::serve(AllocParams& p, const PrivatePool* requested_by) {
  // The rules of the pool that serves: a use_on_oom pool's may differ from the request's.
  const PrivatePool* served = p.pool->owner;
  const ScopedFlagOff plain_served(config_.expandable_segments,
                                   served != requested_by && served != nullptr &&
                                       served->plain_segments);
  const bool split = should_split(p.block, p.size) && !(served != nullptr && served->no_split);
  return reinterpret_cast<void*>(alloc_found_block(p, split)->ptr);
}

void* CachingAllocator::malloc_pass(std::size_t orig_size, StreamId stream,
                                    OutOfMemoryReport* oom, MallocRound& round) {
  AllocParams p{};
  if (round.looked) {  // malloc looked for a cached block under this same hold of the lock
    round.looked = false;
    set_params(p, orig_size, stream);
  } else if (void* ptr = malloc_cached(orig_size, stream, p)) {
    return ptr;  // a block freed up while the lock was let go
  }
  const PrivatePool* owner = p.pool->owner;
  const ScopedFlagOff plain(config_.expandable_segments,
                            owner != nullptr && owner->plain_segments);
  // Garbage collection runs only under a memory fraction, and only once no cached block fits:
  // it trades cached memory for fewer out-of-memory retries, not for speed.
  if (!round.collected && set_fraction_ && config_.garbage_collection_threshold > 0.0) {
    garbage_collect_cached_blocks();
  }
  round.collected = true;
  bool found = alloc_attempts(p, round);
  if (round.stopped()) return nullptr;
  // About to run out of memory: a request outside private pools may take a free block of a
  // pool marked use_on_oom, as a last resort (PyTorch's order: after every retry).
  if (!found && owner == nullptr && !use_on_oom_pools_.empty()) {
    AllocParams in_pool = p;
    found = get_free_block_of_use_on_oom_pools(in_pool);
    if (found) p = in_pool;
  }
  if (!found) {
    give_back(round);
    OutOfMemoryReport report = out_of_memory(p);
    if (oom == nullptr) throw OutOfMemoryError(std::move(report));
    *oom = std::move(report);
    return nullptr;
  }
  return serve(p, owner);
}

bool CachingAllocator::alloc_attempts(AllocParams& p, MallocRound& round) {
  for (; round.stage <= 3; ++round.stage, round.released = false, round.refused = false) {
    if (!round.released) {
      round.released = true;
      // Reserved memory cannot grow: before anything cached is released, a block of this
      // stream that waits only for other streams' uses serves, ordered after them on the
      // device (Note [waiting frees]); where none fits, the memory all of them free is tried.
      bool freed_waiting = false;
      if (round.stage == 2 && config_.reuse_waiting_frees &&
          reuse_waiting_free(p, &freed_waiting))
        return true;
      // Free enough oversize cached blocks (max_split_size) and retry.
      if (round.stage == 2 && !release_available_cached_blocks(p) && !freed_waiting) continue;
      // Free every unsplit cached block and retry (counted as a retry).
      if (round.stage == 3) {
        if (!captures_underway_.empty()) continue;
        release_cached_blocks();
      }
      // Segments of pools with an allocator of their own go back to it before the attempt.
      if (!outside_.empty()) {
        round.flush = true;
        return false;
      }
    }
    if (alloc_block(p, round.stage == 3, round)) return true;
    if (round.ask != nullptr) return false;
  }
  return false;
}

bool CachingAllocator::get_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  // Ages for garbage collection count lookups, and only matter when GC can run.
  if (set_fraction_ && config_.garbage_collection_threshold > 0.0) {
    ++pool.get_free_blocks_call_count;
  }
  Block key(p.stream, p.size, nullptr, 0);
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;

  if ((*it)->expandable != nullptr) {
    if (config_.expandable_segments) {
      // A block followed by unmapped space can grow: for best fit, judge it by the size it can
      // reach, which may mean passing over it for a larger block that fits better.
      auto expandable_size = [](const Block* b) {
        const Block* n = b->next;
        return b->size + (n != nullptr && !n->mapped && n->is_free() ? n->size : 0);
      };
      auto next = std::next(it);
      while ((*it)->expandable != nullptr && next != pool.blocks.end() &&
             (*next)->stream == p.stream && expandable_size(*next) < expandable_size(*it)) {
        it = next++;
      }
    } else {
      // Expandable segments were switched off after some were made: honour that by taking
      // only blocks of ordinary segments.
      do {
        ++it;
      } while (it != pool.blocks.end() && (*it)->expandable != nullptr &&
               (*it)->stream == p.stream);
      if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
    }
  }

  // With aliased pages, a block whose front is in use through other addresses serves from the
  // lowest address inside it that is usable; one with none is passed over (Note [aliased
  // pages] in expandable.cpp).
  std::uintptr_t inside = 0;
  while ((*it)->expandable != nullptr && (*it)->expandable->tracks_aliases() &&
         !(*it)->expandable->usable(
             Range{(*it)->ptr, should_split(*it, p.size) ? p.size : (*it)->size})) {
    const Block* b = *it;
    if (b->size >= p.size + kMinBlockSize) {
      inside = b->expandable->first_usable(Range{b->ptr, b->size - kMinBlockSize}, p.size);
      if (inside != 0) break;
    }
    if (++it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  }
  // Never hand an oversize block (>= max_split_size) to a smaller request: it could not be
  // split, and would waste the difference for the block's whole lifetime.
  if (p.size < config_.max_split_size && (*it)->size >= config_.max_split_size) return false;
  // An oversize request may round up into a cached oversize block, but only by a bounded amount.
  if (p.size >= config_.max_split_size &&
      (*it)->size >= p.size + config_.max_non_split_rounding)
    return false;
  if (inside != 0) {
    // The front, up to `inside`, stays behind as a free block of its own.
    Block* b = *it;
    pool.blocks.erase(it);
    Block* front = new_block(b->stream, inside - b->ptr, &pool, b->ptr);
    front->expandable = b->expandable;
    front->splice(b->prev, b);
    b->size -= front->size;
    b->ptr = inside;
    pool.insert_into_blocks(front);
    it = pool.blocks.insert(b).first;
  }
  p.block = *it;
  p.cached = true;
  p.cached_at = it;
  return true;
}

std::size_t CachingAllocator::page_alignment_gap(const Block* block, std::size_t size) const {
  // align_to_pages (Note [page policy] in expandable.cpp, alignment): for a block that growth
  // has just mapped single pages for, the bytes between its start and the next page boundary,
  // where starting there costs no page (the rest keeps as many whole pages); 0: it stays put.
  if (block->pool->is_small || block->expandable->tracks_aliases() ||
      !should_split(block, size) ||
      (block->pool->owner != nullptr && block->pool->owner->no_split))
    return 0;
  const std::size_t page = block->expandable->page_size();
  const std::uintptr_t base = block->expandable->base();
  auto page_end = [page, base](std::uintptr_t p) {
    return base + (p - base + page - 1) / page * page;
  };
  const std::uintptr_t aligned = page_end(block->ptr);
  const std::uintptr_t end = block->ptr + block->size;
  if (aligned == block->ptr || aligned + size > end) return 0;
  if (page_end(aligned + size) != page_end(block->ptr + size)) return 0;
  const std::size_t rest = end - (aligned + size);
  if (rest != 0 && rest < kMinBlockSize) return 0;
  return aligned - block->ptr;
}

bool CachingAllocator::should_split(const Block* block, std::size_t size) const {
  std::size_t remaining = block->size - size;
  if (block->pool->is_small || config_.expandable_segments) {
    return remaining >= kMinBlockSize;
  }
  // Large blocks split only if the remainder is worth caching (more than 1 MiB) and the
  // request is below max_split_size (oversize blocks are never split).
  return size < config_.max_split_size && remaining > kSmallSize;
}

bool CachingAllocator::alloc_block(AllocParams& p, bool is_retry, MallocRound& round) {
  if (is_retry && !round.counted_retry) {
    stats_.num_alloc_retries += 1;
    round.counted_retry = true;
  }

  // PyTorch's check of the memory fraction: reserved memory plus the whole request. With
  // reuse_free_pages map_block checks instead (expandable.cpp, Note [page policy]).
  if (set_fraction_ && !fraction_checked_when_mapping() &&
      total_allocated_memory_ + p.alloc_size > allowed_memory_maximum_) {
    return false;
  }
  // More than the whole device can never be served: fail without device calls. (An
  // expandable segment would create pages until the device ran out, thousands of calls, and
  // then release them all.) The retries around this still run, as PyTorch's do.
  if (p.alloc_size > device_total_) return false;
  if (config_.expandable_segments) {
    p.block = try_allocate_expandable_block(p.stream, p.pool, p.size);
    return p.block != nullptr;
  }

  void* ptr = nullptr;
  const PrivatePool* owner = p.pool->owner;
  if (owner != nullptr && owner->segments != nullptr) {
    // The pool's own allocator is asked outside the lock (Note [pool allocators outside the
    // lock]): its answer arrives in the next pass.
    if (round.refused) return false;
    if (round.fresh == nullptr || round.from != owner->segments || round.size != p.alloc_size) {
      give_back(round);  // an answer for another pool, which took this thread's requests since
      round.ask = owner->segments;
      round.size = p.alloc_size;
      return false;
    }
    ptr = round.fresh;
    round.fresh = nullptr;
    round.from.reset();
  } else if (!device_->malloc(p.alloc_size, &ptr)) {
    return false;
  }
  p.block = new_block(p.stream, p.alloc_size, p.pool, reinterpret_cast<std::uintptr_t>(ptr));
  count_reserved(*p.pool, TraceAction::segment_alloc, p.block->ptr, p.block->size, p.stream);
  registration_[p.block->ptr] = next_registration_++;
  return true;
}

void CachingAllocator::count_reserved(BlockPool& pool, TraceAction how, std::uintptr_t ptr,
                                      std::size_t size, StreamId stream) {
  const bool segment = how == TraceAction::segment_alloc;  // else pages mapped
  const PoolKind kind = pool.kind();
  total_allocated_memory_ += size;
  page_policy_.reserved(total_allocated_memory_);
  stats_.reserved_bytes.increase(kind, static_cast<std::int64_t>(size));
  stats_.interval_peaks.reserved_bytes = std::max(
      stats_.interval_peaks.reserved_bytes, stats_.reserved_bytes.by_pool[kAggregate].current);
  stats_.num_device_alloc++;
  if (segment) {
    stats_.segment.increase(kind, 1);
    if (size >= config_.max_split_size) stats_.oversize_segments.increase(1);
  }
  if (pool.owner != nullptr) {
    if (segment) {
      pool.owner->device_alloc_count++;
    } else {
      pool.owner->mapped_bytes += size;
    }
  }
  trace_.record(how, ptr, size, stream);
}

void CachingAllocator::count_released(BlockPool& pool, TraceAction how, std::uintptr_t ptr,
                                      std::size_t size, StreamId stream) {
  const bool segment = how == TraceAction::segment_free;  // else pages unmapped
  const PoolKind kind = pool.kind();
  total_allocated_memory_ -= size;
  stats_.reserved_bytes.decrease(kind, static_cast<std::int64_t>(size));
  stats_.num_device_free++;
  if (segment) {
    stats_.segment.decrease(kind, 1);
    if (size >= config_.max_split_size) stats_.oversize_segments.decrease(1);
  }
  if (pool.owner != nullptr) {
    if (segment) {
      pool.owner->device_alloc_count--;
    } else {
      pool.owner->mapped_bytes -= size;
    }
  }
  trace_.record(how, ptr, size, stream);
}

Block* CachingAllocator::alloc_found_block(AllocParams& p, bool split_remainder) {
  const std::size_t size = p.size;
  BlockPool* pool = p.pool;
  const PoolKind kind = pool->kind();
  Block* block = p.block;
  const bool already_split = block->is_split();
  // A cached block split from its front keeps its place in the pool when the remainder still
  // sorts there; otherwise it leaves the pool and the remainder is inserted anew.
  const bool remainder_in_place = p.cached && split_remainder &&
                                  pool->keeps_order(p.cached_at, block->size - size,
                                                    block->ptr + size);
  if (p.cached && !remainder_in_place) pool->blocks.erase(p.cached_at);
  p.cached = false;

  if (split_remainder) {
    // The front of the block serves the request; the remainder goes back to the pool.
    Block* remaining = block;
    block = new_block(p.stream, size, pool, remaining->ptr);
    block->expandable = remaining->expandable;
    block->prev = remaining->prev;
    if (block->prev) block->prev->next = block;
    block->next = remaining;
    remaining->prev = block;
    remaining->ptr += size;
    remaining->size -= size;
    if (remainder_in_place) {
      pool->recache_in_place(remaining);
    } else {
      pool->insert_into_blocks(remaining);
    }

    // inactive_split tracks free memory that cannot be released because its segment is
    // partly in use; expandable segments can always release whole pages, so they are left out.
    if (block->expandable == nullptr) {
      if (already_split) {
        stats_.inactive_split_bytes.decrease(kind, static_cast<std::int64_t>(size));
      } else {
        stats_.inactive_split_bytes.increase(kind, static_cast<std::int64_t>(remaining->size));
        stats_.inactive_split.increase(kind, 1);
      }
    }
  } else if (already_split && block->expandable == nullptr) {
    stats_.inactive_split_bytes.decrease(kind, static_cast<std::int64_t>(block->size));
    stats_.inactive_split.decrease(kind, 1);
  }

  block->allocated = true;
  block->requested_size = p.orig_size;
  if (block->expandable != nullptr && block->expandable->tracks_aliases())
    aliased_pages_handed_out(block);
  trace_.record(TraceAction::alloc, block->ptr, p.orig_size, block->stream);
  allocated_.insert(block->ptr, block);

  stats_.allocation.increase(kind, 1);
  stats_.allocated_bytes.increase(kind, static_cast<std::int64_t>(block->size));
  stats_.interval_peaks.allocated_bytes = std::max(
      stats_.interval_peaks.allocated_bytes, stats_.allocated_bytes.by_pool[kAggregate].current);
  stats_.active.increase(kind, 1);
  stats_.active_bytes.increase(kind, static_cast<std::int64_t>(block->size));
  stats_.requested_bytes.increase(kind, static_cast<std::int64_t>(block->requested_size));
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.increase(1);
  return block;
}

void CachingAllocator::free(void* ptr) {
  if (ptr == nullptr || free_if_owned(ptr)) return;
  Text msg;
  msg << "allocwatch: free of " << ptr << ", which this allocator did not hand out "
      << "(or which was already freed)";
  throw std::invalid_argument(msg.str());
}

bool CachingAllocator::free_if_owned(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = allocated_.erase(reinterpret_cast<std::uintptr_t>(ptr));
  if (block == nullptr) return false;
  free_allocated(block);
  return true;
}

void CachingAllocator::free_allocated(Block* block) {
  block->allocated = false;
  const PoolKind kind = block->pool->kind();
  stats_.allocation.decrease(kind, 1);
  stats_.allocated_bytes.decrease(kind, static_cast<std::int64_t>(block->size));
  trace_.record(TraceAction::free_requested, block->ptr, block->requested_size, block->stream);
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.decrease(1);

  if (!block->stream_uses.empty()) {
    // Used on other streams: the block may be reused only once their work up to now is done.
    if (!captures_underway_.empty()) {
      // Events recorded during capture cannot be queried; record them after the capture,
      // unless the capture's graph orders the uses first (reuse_freed_in_capture).
      needs_events_deferred_until_no_capture_.push_back(block);
      note_freed_in_capture(block);
    } else {
      // Uses recorded during a capture that has ended are ordinary uses now: the block's
      // memory must not carry that record into whatever block is made there next.
      block_to_capture_stream_uses_.erase(block);
      insert_events(block);
    }
  } else {
    free_block(block);
  }
}

void CachingAllocator::aliased_pages_handed_out(Block* block) {
  // Pages last handed out on another stream: their work there comes first (Note [aliased
  // pages]), ordered on the device.
  ExpandableSegment::HandOff hand_off;
  block->expandable->use(Range{block->ptr, block->size}, +1, hand_off);
  if (!hand_off.wait_for.empty()) wait_on_device(block->stream, hand_off.wait_for);
}

void CachingAllocator::aliased_pages_freed(Block* block) {
  // Pages that change stream keep an event of their free, for the next stream to wait on only
  // as long as it must (Note [aliased pages]).
  ExpandableSegment::HandOff hand_off;
  hand_off.free_seq = captures_underway() ? 0 : next_free_seq_;
  block->expandable->use(Range{block->ptr, block->size}, -1, hand_off);
  if (hand_off.record) record_free_event(block->stream);
}

void CachingAllocator::record_free_event(StreamId stream) {
  // Only a hand-out's query looks at an event (wait_on_device); the list is trimmed every
  // kFreeEventsBeforeTrim events, by bisection: a few queries however long it is.
  FreeEvents& events = free_events_[stream];
  if (!events.empty() && events.size() % kFreeEventsBeforeTrim == 0) trim_free_events(stream);
  events.emplace_back(next_free_seq_++, device_->record_event(stream));
}

void CachingAllocator::free_block(Block* block) {
  trace_.record(TraceAction::free_completed, block->ptr, block->requested_size, block->stream);
  const std::size_t original_size = block->size;
  const std::size_t requested_size = block->requested_size;
  BlockPool& pool = *block->pool;
  if (block->expandable != nullptr && block->expandable->tracks_aliases())
    aliased_pages_freed(block);

  std::int64_t net_inactive_split_blocks = 0;
  std::int64_t net_inactive_split_bytes = 0;
  if (Block* merged = merge_into_cached_next(block, pool)) {
    net_inactive_split_blocks -= 1;
    net_inactive_split_bytes -= static_cast<std::int64_t>(merged->size - original_size);
    block = merged;
  } else {
    for (Block* candidate : {block->prev, block->next}) {
      std::size_t subsumed = try_merge_blocks(block, candidate, pool);
      if (subsumed > 0) {
        net_inactive_split_blocks -= 1;
        net_inactive_split_bytes -= static_cast<std::int64_t>(subsumed);
      }
    }
    pool.insert_into_blocks(block);
  }
  if (block->is_split()) {
    net_inactive_split_blocks += 1;
    net_inactive_split_bytes += static_cast<std::int64_t>(block->size);
  }

  const PoolKind kind = pool.kind();
  if (block->expandable == nullptr) {
    if (net_inactive_split_blocks > 0) {
      stats_.inactive_split.increase(kind, net_inactive_split_blocks);
    } else if (net_inactive_split_blocks < 0) {
      stats_.inactive_split.decrease(kind, -net_inactive_split_blocks);
    }
    if (net_inactive_split_bytes > 0) {
      stats_.inactive_split_bytes.increase(kind, net_inactive_split_bytes);
    } else if (net_inactive_split_bytes < 0) {
      stats_.inactive_split_bytes.decrease(kind, -net_inactive_split_bytes);
    }
  }
  stats_.active.decrease(kind, 1);
  stats_.active_bytes.decrease(kind, static_cast<std::int64_t>(original_size));
  stats_.requested_bytes.decrease(kind, static_cast<std::int64_t>(requested_size));
}

Block* CachingAllocator::merge_into_cached_next(Block* block, BlockPool& pool) {
  // The hot path's shortcut for a block freed in front of its cached remainder (the usual
  // alloc + free pair): the remainder grows back over it in place, if its place in the pool
  // still sorts, so the pool's tree is searched once and not rebalanced. Anything else — a
  // free block before it too, or an order that would change — takes the general merge.
  auto mergeable = [&](const Block* b) {
    return b != nullptr && b->is_free() && b->mapped == block->mapped;
  };
  Block* next = block->next;
  if (mergeable(block->prev) || !mergeable(next) || !block->mapped) return nullptr;
  auto it = pool.blocks.find(next);
  if (it == pool.blocks.end() || !pool.keeps_order(it, next->size + block->size, block->ptr)) {
    return nullptr;
  }
  next->ptr = block->ptr;
  next->size += block->size;
  next->requested_size = block->requested_size;  // as the general merge leaves it (snapshots)
  next->prev = block->prev;
  if (next->prev) next->prev->next = next;
  pool.recache_in_place(next);
  delete_block(block);
  return next;
}

std::size_t CachingAllocator::try_merge_blocks(Block* dst, Block* src, BlockPool& pool) {
  // Coalesce with a free neighbour, so that freed space becomes usable by larger requests.
  if (src == nullptr || !src->is_free() ||
      dst->mapped != src->mapped) {
    return 0;
  }
  if (dst->prev == src) {  // [src dst]
    dst->ptr = src->ptr;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
  } else {  // [dst src]
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  const std::size_t subsumed = src->size;
  dst->size += subsumed;
  if (src->mapped) {
    pool.blocks.erase(src);
  } else {
    pool.unmapped.erase(src);
  }
  delete_block(src);
  return subsumed;
}

void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (block == nullptr) {
    Text msg;
    msg << "allocwatch: record_stream on " << ptr << ", which is not an allocated block";
    throw std::invalid_argument(msg.str());
  }
  // Uses on the allocation stream are ordered by the stream itself.
  if (stream == block->stream) return;
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);

  if (!captures_underway_.empty()) {
    auto& during = block_to_capture_stream_uses_[block];
    if (std::find(during.begin(), during.end(), stream) == during.end()) during.push_back(stream);
  }
}

std::size_t CachingAllocator::block_size(void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return block == nullptr ? 0 : block->size;
}

std::size_t CachingAllocator::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return largest_free_block_locked();
}

std::size_t CachingAllocator::largest_free_block_locked() const {
  std::size_t largest = 0;
  for (const Block* b : large_blocks_.blocks) {
    // A block of aliased pages holds at most the memory in use through none of its addresses.
    const bool aliased = b->expandable != nullptr && b->expandable->tracks_aliases();
    largest = std::max(largest, aliased ? std::min(b->size, b->expandable->idle_bytes()) : b->size);
  }
  return largest;
}

std::size_t CachingAllocator::workspace_room(std::chrono::nanoseconds fresh_for) {
  std::lock_guard<std::mutex> lock(mutex_);
  // cuDNN's benchmark mode plans every convolution of a new shape, a few hundred in a step of a
  // convnet whose image sizes vary, and PyTorch's answer is a driver call each time. Between
  // two calls the device's free memory moves by this process's own mapping and unmapping,
  // which is counted here, and by other processes sharing the device, which an answer at most
  // `fresh_for` old misses: a workspace that then does not fit fails and cuDNN asks for less, as
  // it does when the device fills between PyTorch's call and its allocation.
  const std::int64_t reserved = stats_.reserved_bytes.by_pool[kAggregate].current;
  const auto now = std::chrono::steady_clock::now();
  DeviceFreeAsked& asked = device_free_asked_;
  if (!asked.known || now - asked.at >= fresh_for) {
    asked = DeviceFreeAsked{true, now, device_->memory_info().free, reserved};
  }
  const std::int64_t free_now = static_cast<std::int64_t>(asked.free) - (reserved - asked.reserved);
  return std::max(free_now > 0 ? static_cast<std::size_t>(free_now) : 0,
                  largest_free_block_locked());
}

OutOfMemoryReport CachingAllocator::out_of_memory(const AllocParams& p) {
  MemoryInfo info = device_->memory_info();
  trace_.record(TraceAction::oom, info.free, p.size, p.stream);
  stats_.num_ooms += 1;
  OutOfMemoryReport r;
  r.requested = p.orig_size;
  r.device_free = info.free;
  r.device_total = info.total;
  r.allocated = static_cast<std::size_t>(stats_.allocated_bytes.by_pool[kAggregate].current);
  r.reserved = static_cast<std::size_t>(stats_.reserved_bytes.by_pool[kAggregate].current);
  r.alloc_size = p.alloc_size;
  r.limit = set_fraction_ ? allowed_memory_maximum_ : 0;
  Text advice;
  if (r.reserved > r.allocated + r.allocated / 20) {
    if (!config_.expandable_segments) {
      advice << "Reserved but unallocated memory is large: try expandable_segments:True "
             << "(allocwatch's default) to avoid fragmentation. ";
    } else if (config_.garbage_collection_threshold == 0.0 && set_fraction_) {
      advice << "Try garbage_collection_threshold:0.8 to release cached blocks earlier. ";
    }
  }
  advice << "Settings in force: " << config_.to_string() << ".";
  r.advice = advice.str();
  Text msg;
  msg << "CUDA out of memory. Tried to allocate " << format_size(p.alloc_size)
      << " (request of " << format_size(p.orig_size) << "). GPU " << device_->index()
      << " has a total capacity of " << format_size(info.total) << " of which "
      << format_size(info.free) << " is free. ";
  if (set_fraction_) msg << format_size(allowed_memory_maximum_) << " allowed; ";
  msg << "Of the allocated memory " << format_size(r.allocated)
      << " is allocated by PyTorch (allocwatch), and "
      << format_size(r.reserved > r.allocated ? r.reserved - r.allocated : 0)
      << " is reserved but unallocated. " << r.advice;
  r.message = msg.str();
  return r;
}

// --- events ---

void CachingAllocator::insert_events(Block* block) {
  std::vector<StreamId> streams = std::move(block->stream_uses);
  block->stream_uses.clear();
  for (StreamId s : streams) {
    EventId e = device_->record_event(s);
    block->event_count++;
    events_[s].emplace_back(e, block);
  }
}

// Note [waiting frees]
// A block freed while other streams may still use it (record_stream) waits for events that the
// host checks at later allocations; until they complete, its memory serves nobody. Where
// reserved memory can grow, that rule stays: the allocating stream waits for nothing. Where it
// cannot (the memory fraction, or the device is full, after the take-back of free pages),
// PyTorch's next steps release cached blocks and, at the retry, wait on the host for every
// stream's events (synchronize_and_free_events) and release everything cached. Ordering on the
// device does what that wait does, without the host and without releasing anything: the
// allocating stream waits for the block's events (cudaStreamWaitEvent), after which the other
// streams' uses are done before anything it runs next, as cudaMallocAsync orders reuse across
// streams. First a block of the allocating stream, whose own earlier work is ordered already:
// the one that fits best once its freed neighbours join it serves, and only its events are
// waited for. Where none fits alone, every waiting block of the pool is freed, each one's own
// stream waiting for its uses: the allocating stream's merge where they border each other,
// and another stream's are free pages like any, which the take-back moves to the allocating
// stream ordered after that stream's work (Note [moving pages]); what serves nobody stays
// cached, already ordered. Never during a capture: events there are graph nodes, and the
// capture's own rule (reuse_freed_in_capture) applies.
//
// Why only under pressure: the wait costs device time, since the allocating stream cannot run
// ahead of the other streams' uses any more. Taken whenever no cached block served, it held the
// record_stream pipeline's replay lower (1.687 -> 1.354 x its peak request), but on an H100
// that pipeline's steps ran 1.56 x PyTorch's, the producer waiting for the consumer at every
// item (docs/benchmarks.md, "Waiting frees reused on the device"). Under pressure the
// alternative is a retry, whose wait is for every stream, from the host.
bool CachingAllocator::reuse_waiting_free(AllocParams& p, bool* freed) {
  if (!captures_underway_.empty() || events_.empty()) return false;
  auto room = [](const Block* b) {  // its size once it and its freed neighbours merge
    std::size_t n = b->size;
    for (const Block* side : {b->prev, b->next}) {
      if (side != nullptr && side->mapped && side->is_free()) n += side->size;
    }
    return n;
  };
  auto ours = [&](const Block* b) { return b->stream == p.stream && b->pool == p.pool; };
  const Block* best = nullptr;
  std::size_t best_room = 0;
  for (auto& [stream, queue] : events_) {
    for (auto& [event, block] : queue) {
      if (!ours(block)) continue;
      const std::size_t r = room(block);
      if (r >= p.size && (best == nullptr || r < best_room)) {
        best = block;
        best_room = r;
      }
    }
  }
  // None fits alone: every waiting block of the pool, each one's stream ordered after its
  // uses. The request's own may merge into one that fits; another stream's free pages are
  // the take-back's to move, ordered after that stream's work (Note [moving pages]).
  *freed = free_waiting_blocks(
      [&](const Block* b) { return best != nullptr ? b == best : b->pool == p.pool; });
  return get_free_block(p);
}

template <typename Which>
bool CachingAllocator::free_waiting_blocks(Which which) {
  bool freed = false;
  for (auto it = events_.begin(); it != events_.end();) {
    auto& queue = it->second;
    for (auto e = queue.begin(); e != queue.end();) {
      Block* block = e->second;
      if (!which(block)) {
        ++e;
        continue;
      }
      // The wait takes the event as it stands now: releasing it next is safe.
      device_->stream_wait_event(block->stream, e->first);
      device_->release_event(e->first);
      stats_.num_stream_waits++;
      e = queue.erase(e);
      // At once, as process_events does: a block still counting events merges with nothing.
      if (--block->event_count == 0) {
        free_block(block);
        freed = true;
      }
    }
    it = queue.empty() ? events_.erase(it) : std::next(it);
  }
  return freed;
}

void CachingAllocator::insert_events_deferred_until_no_capture() {
  if (needs_events_deferred_until_no_capture_.empty()) return;
  for (Block* block : needs_events_deferred_until_no_capture_) {
    // Streams first used during the capture need no event: the capture's end orders them.
    auto during = block_to_capture_stream_uses_.find(block);
    if (during != block_to_capture_stream_uses_.end()) {
      auto& uses = block->stream_uses;
      uses.erase(std::remove_if(uses.begin(), uses.end(),
                                [&](StreamId s) {
                                  return std::find(during->second.begin(), during->second.end(),
                                                   s) != during->second.end();
                                }),
                 uses.end());
      block_to_capture_stream_uses_.erase(during);
    }
    insert_events(block);
    if (block->event_count == 0) free_block(block);
  }
  needs_events_deferred_until_no_capture_.clear();
  freed_in_capture_.clear();
}

void CachingAllocator::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (captures_underway_.empty()) process_events_locked();
}

void CachingAllocator::process_events_locked() {
  insert_events_deferred_until_no_capture();
  if (!page_moves_.empty()) finish_page_moves(false);
  if (events_.empty()) return;
  for (auto it = events_.begin(); it != events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      auto [event, block] = queue.front();
      if (!device_->query_event(event)) break;
      device_->release_event(event);
      queue.pop_front();
      if (--block->event_count == 0) free_block(block);
    }
    it = queue.empty() ? events_.erase(it) : std::next(it);
  }
}

void CachingAllocator::synchronize_and_free_events() {
  stats_.num_sync_all_streams++;
  insert_events_deferred_until_no_capture();
  finish_page_moves(true);
  for (auto& [stream, queue] : events_) {
    for (auto& [event, block] : queue) {
      host_wait_event(event);
      device_->release_event(event);
      if (--block->event_count == 0) free_block(block);
    }
  }
  events_.clear();
}

void CachingAllocator::host_wait_device() {
  stats_.num_host_waits_device++;
  device_->synchronize();
}

void CachingAllocator::host_wait_stream(StreamId stream) {
  stats_.num_host_waits_stream++;
  device_->synchronize_stream(stream);
}

void CachingAllocator::host_wait_event(EventId event) {
  stats_.num_host_waits_event++;
  device_->wait_event(event);
}

// --- graph pools ---

void CachingAllocator::begin_allocate_to_pool(MempoolId id, std::function<bool(StreamId)> filter,
                                              bool plain_segments) {
  std::lock_guard<std::mutex> lock(mutex_);
  create_or_incref_pool_locked(id, plain_segments);  // another capture may share the pool
  for (auto& [other, f] : captures_underway_) {
    if (other == id) throw std::logic_error("allocwatch: already allocating to this private pool");
  }
  captures_underway_.emplace_back(id, std::move(filter));
  ++g_captures_underway;
}

void CachingAllocator::end_allocate_to_pool(MempoolId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = captures_underway_.begin(); it != captures_underway_.end(); ++it) {
    if (it->first == id) {
      captures_underway_.erase(it);
      --g_captures_underway;
      return;
    }
  }
  throw std::logic_error("allocwatch: end_allocate_to_pool for a pool not being allocated to");
}

void CachingAllocator::release_pool(MempoolId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The graph is gone, but other graphs may share the pool and callers may still hold its
  // outputs: the pool's blocks become releasable once unused, not immediately.
  auto it = graph_pools_.find(id);
  if (it == graph_pools_.end()) throw std::logic_error("allocwatch: release of an unknown pool");
  if (--it->second->use_count == 0) graph_pools_freeable_.emplace(id, it->second.get());
}

}  // namespace allocwatch
