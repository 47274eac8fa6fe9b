#include "stats.h"

namespace allocwatch {

namespace {

void put_stat(std::map<std::string, std::int64_t>& out, const std::string& prefix, const Stat& s) {
  out[prefix + ".current"] = s.current;
  out[prefix + ".peak"] = s.peak;
  out[prefix + ".allocated"] = s.allocated;
  out[prefix + ".freed"] = s.freed;
}

void put_array(std::map<std::string, std::int64_t>& out, const std::string& name,
               const StatArray& a) {
  put_stat(out, name + ".all", a.by_pool[kAggregate]);
  put_stat(out, name + ".small_pool", a.by_pool[kSmallPool]);
  put_stat(out, name + ".large_pool", a.by_pool[kLargePool]);
}

}  // namespace

void DeviceStats::reset_peak() {
  for (StatArray* a : {&allocation, &segment, &active, &inactive_split, &allocated_bytes,
                       &reserved_bytes, &active_bytes, &inactive_split_bytes, &requested_bytes})
    a->reset_peak();
  oversize_allocations.reset_peak();
  oversize_segments.reset_peak();
}

void DeviceStats::reset_accumulated() {
  for (StatArray* a : {&allocation, &segment, &active, &inactive_split, &allocated_bytes,
                       &reserved_bytes, &active_bytes, &inactive_split_bytes, &requested_bytes})
    a->reset_accumulated();
  oversize_allocations.reset_accumulated();
  oversize_segments.reset_accumulated();
  num_alloc_retries = num_ooms = num_sync_all_streams = 0;
  num_device_alloc = num_device_free = 0;
  num_host_waits_device = num_host_waits_stream = num_host_waits_event = 0;
  num_host_waits_unmap_thread = num_stream_waits = 0;
}

std::map<std::string, std::int64_t> DeviceStats::flatten() const {
  std::map<std::string, std::int64_t> out;
  put_array(out, "allocation", allocation);
  put_array(out, "segment", segment);
  put_array(out, "active", active);
  put_array(out, "inactive_split", inactive_split);
  put_array(out, "allocated_bytes", allocated_bytes);
  put_array(out, "reserved_bytes", reserved_bytes);
  put_array(out, "active_bytes", active_bytes);
  put_array(out, "inactive_split_bytes", inactive_split_bytes);
  put_array(out, "requested_bytes", requested_bytes);
  put_stat(out, "oversize_allocations", oversize_allocations);
  put_stat(out, "oversize_segments", oversize_segments);
  out["num_alloc_retries"] = num_alloc_retries;
  out["num_ooms"] = num_ooms;
  out["num_sync_all_streams"] = num_sync_all_streams;
  out["num_device_alloc"] = num_device_alloc;
  out["num_device_free"] = num_device_free;
  out["max_split_size"] = max_split_size;
  out["num_gc_reclaims"] = num_gc_reclaims;
  out["gc_reclaimed_bytes"] = gc_reclaimed_bytes;
  out["num_empty_cache_calls"] = num_empty_cache_calls;
  out["num_host_waits.device"] = num_host_waits_device;
  out["num_host_waits.stream"] = num_host_waits_stream;
  out["num_host_waits.event"] = num_host_waits_event;
  out["num_host_waits.unmap_thread"] = num_host_waits_unmap_thread;
  out["num_stream_waits"] = num_stream_waits;
  return out;
}

}  // namespace allocwatch
