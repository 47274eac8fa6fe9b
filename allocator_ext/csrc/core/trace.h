// The allocator's history: a ring buffer of events whose export has the layout of
// torch.cuda.memory._snapshot()["device_traces"], so PyTorch's memory viewer opens it.
// Recording is off until asked for; when off, the hot path pays one predictable branch.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "device.h"

namespace allocwatch {

enum class TraceAction : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  snapshot,
  oom,
};

const char* trace_action_name(TraceAction a);

struct TraceEntry {
  TraceAction action;
  std::uintptr_t addr;  // for oom: the device's free memory, as PyTorch records it
  std::size_t size;
  StreamId stream;
  std::int64_t time_us;
};

class TraceRing {
 public:
  bool enabled() const { return enabled_; }
  void enable(std::size_t max_entries) {
    max_entries_ = max_entries == 0 ? 1 : max_entries;
    enabled_ = true;
    if (entries_.size() > max_entries_) clear();
  }
  void disable() {
    enabled_ = false;
    clear();
  }
  void clear() {
    entries_.clear();
    next_ = 0;
  }
  void record(TraceAction action, std::uintptr_t addr, std::size_t size, StreamId stream) {
    if (!enabled_) return;
    TraceEntry e{action, addr, size, stream, now_us()};
    if (entries_.size() < max_entries_) {
      entries_.push_back(e);
    } else {
      entries_[next_] = e;
      next_ = (next_ + 1) % max_entries_;
    }
  }
  // Oldest first.
  std::vector<TraceEntry> entries() const {
    std::vector<TraceEntry> out(entries_.begin() + static_cast<long>(next_), entries_.end());
    out.insert(out.end(), entries_.begin(), entries_.begin() + static_cast<long>(next_));
    return out;
  }
  // True once the ring has overwritten its oldest entries: the history no longer starts
  // from an empty allocator.
  bool wrapped() const { return entries_.size() == max_entries_ && next_ != 0; }

 private:
  static std::int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  bool enabled_ = false;
  std::size_t max_entries_ = 1;
  std::size_t next_ = 0;
  std::vector<TraceEntry> entries_;
};

}  // namespace allocwatch
