// Settings, statistics, snapshots and self-checks: everything that looks at the allocator
// rather than allocating.
#include <algorithm>
#include <set>
#include <unordered_set>

#include "allocator.h"
#include "text.h"

namespace allocwatch {

void CachingAllocator::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("allocwatch: memory fraction " + std::to_string(fraction) +
                                " is outside [0, 1]");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  allowed_memory_maximum_ =
      static_cast<std::size_t>(fraction * static_cast<double>(device_->memory_info().total));
  set_fraction_ = true;
  page_policy_.limit_set(allowed_memory_maximum_ > 0 && fraction < 1.0);  // the ceiling now
}

void CachingAllocator::set_memory_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  allowed_memory_maximum_ = bytes;
  set_fraction_ = bytes > 0;
  page_policy_.limit_set(bytes > 0 && bytes < device_->memory_info().total);
}

std::size_t CachingAllocator::memory_limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return set_fraction_ ? allowed_memory_maximum_ : 0;
}

AllocatorConfig CachingAllocator::config() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_;
}

void CachingAllocator::set_config(const std::string& update) {
  std::lock_guard<std::mutex> lock(mutex_);
  AllocatorConfig next = apply_config(config_, update);  // throws, leaving config_ untouched
  config_ = next;
  stats_.max_split_size = config_.max_split_size == kNoMaxSplit
                              ? -1
                              : static_cast<std::int64_t>(config_.max_split_size);
}

std::map<std::string, std::int64_t> CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto out = stats_.flatten();
  // Counted from the queues, so they cannot drift from what is really pending.
  std::int64_t pending_events = 0;
  std::unordered_set<const Block*> pending;
  for (const auto& [stream, queue] : events_) {
    pending_events += static_cast<std::int64_t>(queue.size());
    for (const auto& [event, block] : queue) pending.insert(block);
  }
  for (const Block* b : needs_events_deferred_until_no_capture_) pending.insert(b);
  std::int64_t pending_bytes = 0;
  for (const Block* b : pending) pending_bytes += static_cast<std::int64_t>(b->size);
  out["pending_events"] = pending_events;
  out["pending_free_bytes"] = pending_bytes;
  std::int64_t pending_unmap_bytes = 0;
  for (const PageMove& move : page_moves_)
    for (const Range& r : move.still_mapped) pending_unmap_bytes += static_cast<std::int64_t>(r.size);
  out["pending_unmap_bytes"] = pending_unmap_bytes;
  out["memory_limit_bytes"] = set_fraction_ ? static_cast<std::int64_t>(allowed_memory_maximum_) : 0;
  for (const auto& [key, count] : counted_->counts()) out[key] = count;
  out["num_unmaps_off_thread"] = unmapper_->unmaps();
  return out;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peak();
}

std::int64_t CachingAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.reserved_bytes.by_pool[kAggregate].current;
}

bool CachingAllocator::aliases_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aliasing();
}

IntervalPeaks CachingAllocator::take_interval_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  const IntervalPeaks taken = stats_.interval_peaks;
  stats_.interval_peaks = {stats_.allocated_bytes.by_pool[kAggregate].current,
                           stats_.reserved_bytes.by_pool[kAggregate].current};
  return taken;
}

void CachingAllocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_accumulated();
  counted_->reset();
}

void CachingAllocator::record_history(bool enabled, std::size_t max_entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (enabled) {
    trace_.enable(max_entries);
  } else {
    trace_.disable();
  }
}

void CachingAllocator::clear_history() {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_.clear();
}

void CachingAllocator::set_trace_skipped(std::uint32_t actions) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_.set_skipped(actions);
}

void CachingAllocator::add_trace_observer(TraceObserver observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_.add_observer(std::move(observer));
}

std::vector<TraceEntry> CachingAllocator::trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.entries();
}

bool CachingAllocator::trace_wrapped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.wrapped();
}

std::vector<const Block*> CachingAllocator::all_blocks() const {
  std::vector<const Block*> blocks;
  auto add_pool = [&](const BlockPool& pool) {
    blocks.insert(blocks.end(), pool.blocks.begin(), pool.blocks.end());
    blocks.insert(blocks.end(), pool.unmapped.begin(), pool.unmapped.end());
  };
  add_pool(large_blocks_);
  add_pool(small_blocks_);
  for (const auto& [id, pool] : graph_pools_) {
    add_pool(pool->large_blocks);
    add_pool(pool->small_blocks);
  }
  allocated_.for_each([&](const Block* b) { blocks.push_back(b); });
  for (const auto& [stream, queue] : events_)
    for (const auto& [event, block] : queue) blocks.push_back(block);
  for (const PageMove& move : page_moves_)
    blocks.insert(blocks.end(), move.blocks.begin(), move.blocks.end());
  for (const Block* b : needs_events_deferred_until_no_capture_) blocks.push_back(b);
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  return blocks;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<const BlockPool*, MempoolId> pool_ids;
  for (const auto& [id, pool] : graph_pools_) {
    pool_ids[&pool->large_blocks] = id;
    pool_ids[&pool->small_blocks] = id;
  }
  std::vector<SegmentInfo> result;
  std::size_t total_active = 0;
  for (const Block* head : all_blocks()) {
    // One segment per contiguous mapped range (expandable segments can have several).
    if (!head->mapped || (head->prev != nullptr && head->prev->mapped)) continue;
    SegmentInfo seg;
    seg.address = head->ptr;
    seg.stream = head->stream;
    seg.is_large = !head->pool->is_small;
    seg.is_expandable = head->expandable != nullptr;
    auto order = registration_.find(seg.is_expandable ? head->expandable->base() : head->ptr);
    if (order != registration_.end()) seg.registration_counter = order->second;
    auto id = pool_ids.find(head->pool);
    if (id != pool_ids.end()) seg.pool_id = id->second;
    for (const Block* b = head; b != nullptr && b->mapped; b = b->next) {
      const bool active = !b->is_free();
      const char* state = b->allocated ? "active_allocated"
                          : active     ? "active_pending_free"
                                       : "inactive";
      seg.blocks.push_back(BlockInfo{b->ptr, b->size, b->requested_size, state});
      seg.total_size += b->size;
      if (b->allocated) seg.allocated_size += b->size;
      if (active) {
        seg.active_size += b->size;
        seg.requested_size += b->requested_size;
      }
    }
    total_active += seg.active_size;
    result.push_back(std::move(seg));
  }
  std::sort(result.begin(), result.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  trace_.record(TraceAction::snapshot, 0, total_active, 0);
  return result;
}

std::string CachingAllocator::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Text err;
  // The pools' sets must still be in order: the hot path changes cached blocks in place.
  auto ordered = [](const BlockPool& pool) {
    return std::adjacent_find(pool.blocks.begin(), pool.blocks.end(),
                              [](const Block* a, const Block* b) { return !BySize()(a, b); }) ==
               pool.blocks.end() &&
           std::adjacent_find(pool.unmapped.begin(), pool.unmapped.end(),
                              [](const Block* a, const Block* b) {
                                return !ByAddress()(a, b);
                              }) == pool.unmapped.end();
  };
  bool in_order = ordered(large_blocks_) && ordered(small_blocks_);
  for (const auto& [id, pool] : graph_pools_)
    in_order = in_order && ordered(pool->large_blocks) && ordered(pool->small_blocks);
  if (!in_order) return "a pool's set of blocks is out of order";

  auto blocks = all_blocks();
  std::set<const Block*> known(blocks.begin(), blocks.end());

  std::int64_t allocated_bytes[kNumPoolKinds] = {}, active_bytes[kNumPoolKinds] = {};
  std::int64_t requested_bytes[kNumPoolKinds] = {}, reserved_bytes[kNumPoolKinds] = {};
  std::int64_t allocation[kNumPoolKinds] = {}, active[kNumPoolKinds] = {};
  std::int64_t segments[kNumPoolKinds] = {}, inactive_split_bytes[kNumPoolKinds] = {};
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> mapped_ranges;

  for (const Block* b : blocks) {
    if (b->prev != nullptr && b->prev->next != b) return "broken prev/next links";
    if (b->next != nullptr && b->next->prev != b) return "broken next/prev links";
    if (b->next != nullptr && b->ptr + b->size != b->next->ptr) {
      err << "block at " << b->ptr << " of " << b->size << " bytes does not end where its "
          << "neighbour starts";
      return err.str();
    }
    if (b->prev != nullptr && known.count(b->prev) == 0) return "a neighbour is in no pool";
    const int k = b->pool->kind();
    const bool is_free = b->is_free();
    const bool in_free_set = b->pool->blocks.count(const_cast<Block*>(b)) > 0;
    if (b->mapped && is_free != in_free_set) {
      err << "block at " << b->ptr << (is_free ? " is free but not cached in its pool"
                                               : " is in use but cached in its pool");
      return err.str();
    }
    if (!b->mapped && !b->unmap_pending &&
        (b->allocated || b->pool->unmapped.count(const_cast<Block*>(b)) == 0))
      return "an unmapped block is allocated or missing from its pool's unmapped set";
    if (b->unmap_pending && (b->mapped || b->pool->unmapped.count(const_cast<Block*>(b)) != 0))
      return "a block whose pages moved is still counted as mapped or as unmapped space";
    if (b->mapped && is_free && b->next != nullptr && b->next->mapped && b->next->is_free())
      return "two free neighbours were not coalesced";
    if (!b->mapped) continue;
    mapped_ranges.emplace_back(b->ptr, b->ptr + b->size);
    // Aliased pages count once, however many addresses map them: below, from the segment.
    if (b->expandable == nullptr || !b->expandable->tracks_aliases())
      reserved_bytes[k] += static_cast<std::int64_t>(b->size);
    if (b->prev == nullptr && b->expandable == nullptr) segments[k] += 1;
    if (b->allocated) {
      allocated_bytes[k] += static_cast<std::int64_t>(b->size);
      allocation[k] += 1;
    }
    if (!is_free) {
      active_bytes[k] += static_cast<std::int64_t>(b->size);
      active[k] += 1;
      requested_bytes[k] += static_cast<std::int64_t>(b->requested_size);
    } else if (b->is_split() && b->expandable == nullptr) {
      inactive_split_bytes[k] += static_cast<std::int64_t>(b->size);
    }
  }
  for (const auto& [page, physical] : shared_physical_) {
    reserved_bytes[kLargePool] += static_cast<std::int64_t>(physical->physical_bytes());
    PhysicalPages::InUseCounts in_use;
    for (const auto& es : expandable_segments_) {
      if (&es->physical() != physical.get()) continue;
      std::vector<Range> ranges;
      for (const Block* b : blocks)
        if (b->expandable == es.get() && b->mapped && !b->is_free())
          ranges.push_back(Range{b->ptr, b->size});
      es->count_in_use(ranges, &in_use);
    }
    const std::string wrong = physical->check(in_use);
    if (!wrong.empty()) return wrong;
  }
  std::sort(mapped_ranges.begin(), mapped_ranges.end());
  for (std::size_t i = 1; i < mapped_ranges.size(); ++i) {
    if (mapped_ranges[i].first < mapped_ranges[i - 1].second) return "two blocks overlap";
  }
  auto check = [&](const char* name, const StatArray& s, const std::int64_t* recount) {
    for (int k : {kSmallPool, kLargePool}) {
      if (s.by_pool[k].current != recount[k]) {
        err << name << (k == kSmallPool ? ".small_pool" : ".large_pool") << ".current is "
            << s.by_pool[k].current << " but a recount gives " << recount[k];
        return false;
      }
    }
    if (s.by_pool[kAggregate].current != recount[kSmallPool] + recount[kLargePool]) {
      err << name << ".all.current disagrees with its pools";
      return false;
    }
    return true;
  };
  if (!check("allocated_bytes", stats_.allocated_bytes, allocated_bytes) ||
      !check("allocation", stats_.allocation, allocation) ||
      !check("active_bytes", stats_.active_bytes, active_bytes) ||
      !check("active", stats_.active, active) ||
      !check("requested_bytes", stats_.requested_bytes, requested_bytes) ||
      !check("reserved_bytes", stats_.reserved_bytes, reserved_bytes) ||
      !check("segment", stats_.segment, segments) ||
      !check("inactive_split_bytes", stats_.inactive_split_bytes, inactive_split_bytes)) {
    return err.str();
  }
  std::size_t reserved_total = static_cast<std::size_t>(reserved_bytes[kSmallPool] +
                                                        reserved_bytes[kLargePool]);
  if (reserved_total != total_allocated_memory_) return "reserved bytes disagree with the total";
  std::size_t mapped = 0;
  for (const auto& es : expandable_segments_) mapped += es->mapped_bytes();
  std::size_t expandable_reserved = 0;
  for (const Block* b : blocks)
    if (b->mapped && b->expandable != nullptr) expandable_reserved += b->size;
  if (mapped != expandable_reserved) return "mapped pages disagree with expandable blocks";
  return "";
}

}  // namespace allocwatch
