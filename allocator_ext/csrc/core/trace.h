// The allocator's history: a ring buffer of events whose export has the layout of
// torch.cuda.memory._snapshot()["device_traces"], so PyTorch's memory viewer opens it, and
// observers called on every event (PyTorch's allocator trace trackers: NCCL registers
// segments with them). Recording is off until asked for; with recording off and no observer,
// the hot path pays one predictable branch.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "device.h"
#include "history.h"

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

// Inline: the native back end, which reaches the core only through NativeCore, maps the
// actions PyTorch names (recordHistory's skip_actions) itself.
inline const char* trace_action_name(TraceAction a) {
  switch (a) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::snapshot: return "snapshot";
    case TraceAction::oom: return "oom";
  }
  return "unknown";
}

// The action named `name` (as trace_action_name spells it); false for an unknown name.
inline bool trace_action_from_name(const std::string& name, TraceAction* action) {
  for (TraceAction a : {TraceAction::alloc, TraceAction::free_requested,
                        TraceAction::free_completed, TraceAction::segment_alloc,
                        TraceAction::segment_free, TraceAction::segment_map,
                        TraceAction::segment_unmap, TraceAction::snapshot, TraceAction::oom}) {
    if (name == trace_action_name(a)) {
      *action = a;
      return true;
    }
  }
  return false;
}

struct TraceEntry {
  TraceAction action;
  std::uintptr_t addr;  // for oom: the device's free memory, as PyTorch records it
  std::size_t size;
  StreamId stream;
  std::int64_t time_us;
  ContextHandle context;  // the caller's, for the call that recorded it (history.h)
};

// Called under the allocator's lock on every event, recorded or not: it must not call back
// into the allocator. An observer that throws is ignored, so it cannot break an operation
// half-way.
using TraceObserver = std::function<void(const TraceEntry&)>;

constexpr std::uint32_t trace_action_bit(TraceAction a) {
  return std::uint32_t{1} << static_cast<unsigned>(a);
}

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
  // Actions left out of the ring (observers still see them): trace_action_bit of each.
  void set_skipped(std::uint32_t actions) { skipped_ = actions; }
  void add_observer(TraceObserver observer) { observers_.push_back(std::move(observer)); }
  void record(TraceAction action, std::uintptr_t addr, std::size_t size, StreamId stream) {
    if (!enabled_ && observers_.empty()) return;
    TraceEntry e{action, addr, size, stream, now_us(), TraceContextScope::current()};
    for (const TraceObserver& observer : observers_) {
      try {
        observer(e);
      } catch (...) {
      }
    }
    if (!enabled_ || (skipped_ & trace_action_bit(action)) != 0) return;
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
  std::uint32_t skipped_ = 0;
  std::vector<TraceObserver> observers_;
  std::size_t max_entries_ = 1;
  std::size_t next_ = 0;
  std::vector<TraceEntry> entries_;
};

}  // namespace allocwatch
