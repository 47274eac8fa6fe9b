// Allocator statistics with the names and meaning of torch.cuda.memory_stats().
//
// Each Stat tracks current, peak, and the cumulative amounts added (allocated) and removed
// (freed). Most statistics exist three times: for all pools, the small pool and the large pool.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace allocwatch {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) {
    current += amount;
    peak = std::max(peak, current);
    allocated += amount;
  }
  void decrease(std::int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

enum PoolKind : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2 };
constexpr int kNumPoolKinds = 3;

// One Stat per pool kind; updates go to the aggregate and to the block's own pool.
struct StatArray {
  std::array<Stat, kNumPoolKinds> by_pool;
  void increase(PoolKind pool, std::int64_t amount) {
    by_pool[kAggregate].increase(amount);
    by_pool[pool].increase(amount);
  }
  void decrease(PoolKind pool, std::int64_t amount) {
    by_pool[kAggregate].decrease(amount);
    by_pool[pool].decrease(amount);
  }
  void reset_peak() {
    for (auto& s : by_pool) s.reset_peak();
  }
  void reset_accumulated() {
    for (auto& s : by_pool) s.reset_accumulated();
  }
};

struct IntervalPeaks {
  std::int64_t allocated_bytes = 0;
  std::int64_t reserved_bytes = 0;
};

struct DeviceStats {
  StatArray allocation;            // blocks handed out
  StatArray segment;               // device allocations (cudaMalloc'd or mapped ranges)
  StatArray active;                // allocated, or freed but waiting for events
  StatArray inactive_split;        // free blocks that cannot be released (part of a split)
  StatArray allocated_bytes;
  StatArray reserved_bytes;
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;       // what callers asked for, before rounding
  Stat oversize_allocations;       // blocks at or above max_split_size
  Stat oversize_segments;
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  std::int64_t max_split_size = -1;
  // allocwatch's additions
  std::int64_t num_gc_reclaims = 0;       // garbage-collection passes that released memory
  std::int64_t gc_reclaimed_bytes = 0;
  std::int64_t num_empty_cache_calls = 0;
  // Every wait the allocator makes on the host, by what it waits for: the whole device
  // (cudaDeviceSynchronize), one stream (cudaStreamSynchronize), one event
  // (cudaEventSynchronize), or the allocator's own unmapping thread (core/unmapper.h; waited
  // for only where the whole cache is released: an explicit reclaim, a last retry). The
  // training loop's CPU stalls for each. And the orderings it asks of the device instead
  // (cudaStreamWaitEvent), which cost the host nothing.
  std::int64_t num_host_waits_device = 0;
  std::int64_t num_host_waits_stream = 0;
  std::int64_t num_host_waits_event = 0;
  std::int64_t num_host_waits_unmap_thread = 0;
  std::int64_t num_stream_waits = 0;
  // The highest allocated and reserved bytes (all pools) since the last take_interval_peaks():
  // a window of its own, so that a reader sampling at intervals (the agent) sees each
  // interval's peak without resetting the peaks torch.cuda.max_memory_allocated() reports.
  IntervalPeaks interval_peaks;

  void reset_peak();
  void reset_accumulated();
  // Flattened like torch.cuda.memory_stats(): "allocated_bytes.all.current", ...
  // pending_events and pending_free_bytes are not kept here: they are counted from the event
  // queues when asked, so they can never drift.
  std::map<std::string, std::int64_t> flatten() const;
};

}  // namespace allocwatch
