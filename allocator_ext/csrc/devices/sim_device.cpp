#include "sim_device.h"

#include <algorithm>
#include <chrono>

#include "core/unmapper.h"

namespace allocwatch {

namespace {
// What an unlimited device reports as its total: an H200's (143771 MiB less the driver's
// reserve, as torch.cuda.mem_get_info reports it there). It sizes the address space reserved
// for expandable segments, whose cost the replay prices, so it should be a real GPU's.
constexpr std::size_t kUnlimitedTotal = 150109880320ull;

[[noreturn]] void misuse(const std::string& what) { throw DeviceError("sim device: " + what); }
}  // namespace

SimDevice::SimDevice(std::size_t capacity, int index) : index_(index), capacity_(capacity) {
  // Each device's addresses in a range of their own, as unified virtual addressing gives real
  // GPUs: a pointer names one device.
  const std::uintptr_t offset = static_cast<std::uintptr_t>(index) * 0x40000000000ull;  // 4 TiB
  next_address_ += offset;
  next_reservation_ += offset;
}

void SimDevice::count(const char* call, std::size_t bytes) {
  CallCount& c = counters_[call];
  c.count += 1;
  c.bytes += bytes;
}

MemoryInfo SimDevice::memory_info() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = capacity_ == 0 ? kUnlimitedTotal : capacity_;
  return MemoryInfo{total > used_ ? total - used_ : 0, total};
}

bool SimDevice::malloc(std::size_t size, void** ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fits(size)) {
    count("malloc_failed", size);
    return false;
  }
  count("malloc", size);
  used_ += size;
  std::uintptr_t addr = 0;
  if (!plan_.empty() && plan_.front().first == size &&
      !overlaps_live_segment(plan_.front().second, size)) {
    addr = plan_.front().second;
    plan_.pop_front();
  } else {
    addr = next_address_;
    // Keep segments 2 MiB aligned and apart, as the driver does.
    next_address_ += (size + (2u << 20) - 1) & ~std::uintptr_t((2u << 20) - 1);
  }
  segments_[addr] = size;
  *ptr = reinterpret_cast<void*>(addr);
  return true;
}

void SimDevice::plan_addresses(std::vector<std::pair<std::size_t, std::uintptr_t>> plan) {
  std::lock_guard<std::mutex> lock(mutex_);
  plan_.assign(plan.begin(), plan.end());
}

bool SimDevice::overlaps_live_segment(std::uintptr_t addr, std::size_t size) const {
  auto it = segments_.lower_bound(addr);
  if (it != segments_.end() && it->first < addr + size) return true;
  if (it != segments_.begin()) {
    --it;
    if (it->first + it->second > addr) return true;
  }
  return false;
}

void SimDevice::free(void* ptr, std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == segments_.end() || it->second != size) misuse("free of an unknown segment");
  count("free", size);
  used_ -= size;
  segments_.erase(it);
  // cudaFree waits for the device: every event recorded so far completes.
  for (auto& [id, s] : streams_) {
    s.completed = s.recorded;
    s.waits.clear();
  }
}

std::uintptr_t SimDevice::reserve_address(std::size_t size, std::size_t alignment) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("reserve", size);
  std::uintptr_t a = alignment == 0 ? 1 : alignment;
  std::uintptr_t base = (next_reservation_ + a - 1) / a * a;
  next_reservation_ = base + size;
  return base;
}

void SimDevice::free_address(std::uintptr_t, std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("address_free", size);
}

bool SimDevice::create_physical(std::size_t size, PhysicalHandle* handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fits(size)) {
    count("create_failed", size);
    return false;
  }
  count("create", size);
  used_ += size;
  *handle = next_handle_++;
  physical_[*handle] = Physical{size, 0, false};
  return true;
}

void SimDevice::release_physical(PhysicalHandle handle, std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = physical_.find(handle);
  if (it == physical_.end() || it->second.released || it->second.size != size)
    misuse("release of an unknown handle");
  count("release", size);
  if (it->second.mappings > 0) {
    it->second.released = true;  // freed by its last unmap
    return;
  }
  used_ -= size;
  physical_.erase(it);
}

SimDevice::Physical& SimDevice::live_physical(PhysicalHandle handle) {
  auto it = physical_.find(handle);
  if (it == physical_.end() || it->second.released) misuse("map of an unknown handle");
  return it->second;
}

void SimDevice::map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  Physical& physical = live_physical(handle);
  if (mappings_.count(addr) != 0) misuse("map over a mapped address " + std::to_string(addr));
  count("map", size);
  mappings_[addr] = handle;
  physical.mappings++;
}

void SimDevice::map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::uintptr_t at = addr;
  for (const Mapping& m : mappings) {
    Physical& physical = live_physical(m.handle);
    if (mappings_.count(at) != 0) misuse("map over a mapped address " + std::to_string(at));
    count("map_only", m.size);
    mappings_[at] = m.handle;
    physical.mappings++;
    at += m.size;
  }
  count("set_access", at - addr);
}

void SimDevice::hold_unmaps(bool on) {
  {
    std::lock_guard<std::mutex> lock(hold_mutex_);
    held_ = on;
  }
  if (!on) hold_released_.notify_all();
}

void SimDevice::unmap(std::uintptr_t addr, std::size_t size) {
  {
    std::unique_lock<std::mutex> hold(hold_mutex_);
    // At most a few seconds: a test that held an unmap its own thread makes fails, not hangs.
    hold_released_.wait_for(hold, std::chrono::seconds(2), [&] { return !held_; });
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto mapping = mappings_.find(addr);
  if (mapping == mappings_.end()) misuse("unmap of an address that is not mapped");
  count(Unmapper::on_this_thread() ? "unmap_off_thread" : "unmap", size);
  auto it = physical_.find(mapping->second);
  mappings_.erase(mapping);
  if (it != physical_.end() && --it->second.mappings == 0 && it->second.released) {
    used_ -= it->second.size;
    physical_.erase(it);
  }
}

EventId SimDevice::record_event(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("event_record", 0);
  StreamState& s = streams_[stream];
  s.recorded += 1;
  if (auto_complete_ || s.auto_complete) s.completed = s.recorded;
  EventId id = next_event_++;
  events_[id] = EventState{stream, s.recorded};
  return id;
}

bool SimDevice::query_event(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("event_query", 0);
  auto it = events_.find(event);
  if (it == events_.end()) misuse("query of an unknown event");
  return streams_[it->second.stream].completed >= it->second.sequence;
}

void SimDevice::release_event(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.erase(event) == 0) misuse("release of an unknown event");
}

void SimDevice::finish(StreamId stream, std::uint64_t sequence) {
  StreamState& s = streams_[stream];
  if (s.completed >= sequence) return;
  s.completed = sequence;  // first: streams that wait on each other end the recursion
  const std::vector<Wait> waits = s.waits;
  for (const Wait& w : waits) {
    if (w.after < sequence) finish(w.on, w.sequence);
  }
}

void SimDevice::wait_event(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("event_synchronize", 0);
  auto it = events_.find(event);
  if (it == events_.end()) misuse("wait on an unknown event");
  finish(it->second.stream, it->second.sequence);
}

void SimDevice::stream_wait_event(StreamId stream, EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("stream_wait_event", 0);
  auto it = events_.find(event);
  if (it == events_.end()) misuse("stream wait on an unknown event");
  const EventState e = it->second;
  if (streams_[e.stream].completed >= e.sequence || e.stream == stream) return;
  StreamState& s = streams_[stream];
  s.waits.push_back(Wait{s.recorded, e.stream, e.sequence});
}

void SimDevice::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  count("synchronize", 0);
  for (auto& [id, s] : streams_) {
    s.completed = s.recorded;
    s.waits.clear();
  }
}

void SimDevice::synchronize_stream(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  count("stream_synchronize", 0);
  finish(stream, streams_[stream].recorded);
}

void SimDevice::complete_stream(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamState& s = streams_[stream];
  std::uint64_t upto = s.recorded;
  for (const Wait& w : s.waits) {
    if (streams_[w.on].completed < w.sequence) upto = std::min(upto, w.after);
  }
  s.completed = std::max(s.completed, upto);
  s.waits.erase(std::remove_if(s.waits.begin(), s.waits.end(),
                               [&](const Wait& w) { return streams_[w.on].completed >= w.sequence; }),
                s.waits.end());
}

bool SimDevice::stream_idle(StreamId stream) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = streams_.find(stream);
  return it == streams_.end() || it->second.completed >= it->second.recorded;
}

void SimDevice::set_auto_complete(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto_complete_ = on;
  if (on)
    for (auto& [id, s] : streams_) {
      s.completed = s.recorded;
      s.waits.clear();
    }
}

void SimDevice::set_stream_auto_complete(StreamId stream, bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamState& s = streams_[stream];
  s.auto_complete = on;
  if (on) s.completed = s.recorded;
}

void SimDevice::set_capacity(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = bytes;
}

std::size_t SimDevice::used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

std::size_t SimDevice::outstanding_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::map<std::string, CallCount> SimDevice::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

void SimDevice::reset_counters() {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.clear();
}

}  // namespace allocwatch
