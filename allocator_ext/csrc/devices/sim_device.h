// The simulated device: a capacity, an address space, streams and events whose completion the
// caller controls, and a counter of every device call with the bytes it moved. It makes every
// rule of the core testable without a GPU, and it is what trace replay runs on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <deque>
#include <utility>
#include <vector>

#include "../core/device.h"

namespace allocwatch {

struct CallCount {
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
};

class SimDevice : public Device {
 public:
  // capacity 0: unlimited; `total` is then what memory_info reports (it sizes the address
  // space of expandable segments and the per-process memory fraction).
  explicit SimDevice(std::size_t capacity = 0, int index = 0);

  int index() const override { return index_; }
  MemoryInfo memory_info() override;
  bool malloc(std::size_t size, void** ptr) override;
  void free(void* ptr, std::size_t size) override;
  bool supports_virtual_memory() const override { return true; }
  UnmapThread unmap_thread() const override { return unmap_thread_; }
  std::uintptr_t reserve_address(std::size_t size, std::size_t alignment) override;
  void free_address(std::uintptr_t base, std::size_t size) override;
  bool create_physical(std::size_t size, PhysicalHandle* handle) override;
  void release_physical(PhysicalHandle handle, std::size_t size) override;
  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override;
  void unmap(std::uintptr_t addr, std::size_t size) override;
  void map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) override;
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void release_event(EventId event) override;
  void wait_event(EventId event) override;
  void stream_wait_event(StreamId stream, EventId event) override;
  void synchronize() override;
  void synchronize_stream(StreamId stream) override;

  // --- control, for tests and replay ---
  // Completes every event recorded on `stream` so far, except those queued behind a
  // stream_wait_event whose event has not completed: the device would not run them yet.
  void complete_stream(StreamId stream);
  // Whether `stream` was last completed up to its latest event (false: work is queued).
  bool stream_idle(StreamId stream) const;
  // Where the core may make moved pages' unmap calls (caller by default). Those made on its
  // own thread count as "unmap_off_thread", not "unmap". With hold_unmaps, an unmap blocks
  // until hold_unmaps(false) (for two seconds at most): a test can see that the allocating
  // thread does not wait for it.
  void set_unmap_thread(UnmapThread where) { unmap_thread_ = where; }
  void hold_unmaps(bool on);
  // With auto-completion, every event is complete as soon as it is recorded.
  void set_auto_complete(bool on);
  // The same for one stream: a device that keeps up with it (replay's recorded streams).
  void set_stream_auto_complete(StreamId stream, bool on);
  // Addresses for the next segment allocations, in order: a malloc of the front entry's size
  // returns its address. Replay passes the recorded segment addresses, because best fit breaks
  // ties between equally sized free blocks by address: only the recorded addresses reproduce
  // the recorded choices. A size that does not match, or an address still in use, falls back to
  // the simulated address space.
  void plan_addresses(std::vector<std::pair<std::size_t, std::uintptr_t>> plan);
  std::size_t capacity() const { return capacity_; }
  void set_capacity(std::size_t bytes);
  std::size_t used() const;
  std::size_t outstanding_events() const;
  std::map<std::string, CallCount> counters() const;
  void reset_counters();

 private:
  void count(const char* call, std::size_t bytes);
  bool fits(std::size_t size) const { return capacity_ == 0 || used_ + size <= capacity_; }

  mutable std::mutex mutex_;
  UnmapThread unmap_thread_ = UnmapThread::caller;
  std::mutex hold_mutex_;  // hold_unmaps: unmap waits on hold_released_ while held_
  std::condition_variable hold_released_;
  bool held_ = false;
  int index_;
  std::size_t capacity_;
  std::size_t used_ = 0;
  bool overlaps_live_segment(std::uintptr_t addr, std::size_t size) const;
  std::deque<std::pair<std::size_t, std::uintptr_t>> plan_;
  // Far from where the driver puts memory, so planned (recorded) addresses never collide.
  std::uintptr_t next_address_ = 0x200000000000ull;
  std::uintptr_t next_reservation_ = 0x100000000000ull;
  PhysicalHandle next_handle_ = 1;
  std::map<std::uintptr_t, std::size_t> segments_;
  // As the driver keeps it (cuMemRelease): a released allocation still mapped somewhere holds
  // its memory until its last mapping goes.
  struct Physical {
    std::size_t size = 0;
    std::size_t mappings = 0;
    bool released = false;
  };
  std::unordered_map<PhysicalHandle, Physical> physical_;
  Physical& live_physical(PhysicalHandle handle);
  std::unordered_map<std::uintptr_t, PhysicalHandle> mappings_;
  // Work recorded on a stream after position `after` waits on the device for stream `on` to
  // reach `sequence` (stream_wait_event).
  struct Wait {
    std::uint64_t after;
    StreamId on;
    std::uint64_t sequence;
  };
  struct StreamState {
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
    std::vector<Wait> waits;
    bool auto_complete = false;
  };
  // Completes `stream` up to `sequence`, the streams it waits on first (the host waited).
  void finish(StreamId stream, std::uint64_t sequence);
  std::unordered_map<StreamId, StreamState> streams_;
  struct EventState {
    StreamId stream;
    std::uint64_t sequence;
  };
  std::unordered_map<EventId, EventState> events_;
  EventId next_event_ = 1;
  bool auto_complete_ = false;
  std::map<std::string, CallCount> counters_;
};

}  // namespace allocwatch
