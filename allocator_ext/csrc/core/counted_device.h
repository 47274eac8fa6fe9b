// A device that counts the calls made of it, by kind: statistics as an adaptor around any
// back end (RMM's statistics_resource_adaptor), read as the allocator's num_device_calls.*.
//
// PyTorch's num_device_alloc and num_device_free count mappings: a growth, a page move. What
// the host pays is calls, and a mapping makes one a page (a move of 16 MiB in 2 MiB pages:
// eight maps now, eight unmaps later, and an access grant; an unmap costs per mapping, whatever
// the range), so where page moves cost step time these say how many calls it took.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device.h"

namespace allocwatch {

class CountedDevice final : public Device {
 public:
  // The kinds counted, as num_device_calls.<kind> names them. `map` counts physical
  // allocations mapped, `set_access` the grants (one a range mapped at once).
  enum Kind : int {
    kSegmentAlloc, kSegmentFree, kReserve, kAddressFree, kCreate, kRelease, kMap, kSetAccess,
    kUnmap, kEventRecord, kEventQuery, kNumKinds
  };
  static constexpr const char* kNames[kNumKinds] = {
      "segment_alloc", "segment_free", "reserve", "address_free", "create", "release", "map",
      "set_access", "unmap", "event_record", "event_query"};

  explicit CountedDevice(std::shared_ptr<Device> inner) : inner_(std::move(inner)) {}

  std::map<std::string, std::int64_t> counts() const {
    std::map<std::string, std::int64_t> out;
    for (int k = 0; k < kNumKinds; ++k)
      out[std::string("num_device_calls.") + kNames[k]] =
          counts_[k].load(std::memory_order_relaxed);
    return out;
  }
  void reset() {
    for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  }

  int index() const override { return inner_->index(); }
  MemoryInfo memory_info() override { return inner_->memory_info(); }
  bool malloc(std::size_t size, void** ptr) override {
    count(kSegmentAlloc);
    return inner_->malloc(size, ptr);
  }
  void free(void* ptr, std::size_t size) override {
    count(kSegmentFree);
    inner_->free(ptr, size);
  }
  bool supports_virtual_memory() const override { return inner_->supports_virtual_memory(); }
  UnmapThread unmap_thread() const override { return inner_->unmap_thread(); }
  std::uintptr_t reserve_address(std::size_t size, std::size_t alignment) override {
    count(kReserve);
    return inner_->reserve_address(size, alignment);
  }
  void free_address(std::uintptr_t base, std::size_t size) override {
    count(kAddressFree);
    inner_->free_address(base, size);
  }
  bool create_physical(std::size_t size, PhysicalHandle* handle) override {
    count(kCreate);
    return inner_->create_physical(size, handle);
  }
  void release_physical(PhysicalHandle handle, std::size_t size) override {
    count(kRelease);
    inner_->release_physical(handle, size);
  }
  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override {
    count(kMap);
    count(kSetAccess);
    inner_->map(addr, size, handle);
  }
  void unmap(std::uintptr_t addr, std::size_t size) override {
    count(kUnmap);
    inner_->unmap(addr, size);
  }
  void map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) override {
    count(kMap, static_cast<std::int64_t>(mappings.size()));
    count(kSetAccess);
    inner_->map_range(addr, mappings);
  }
  EventId record_event(StreamId stream) override {
    count(kEventRecord);
    return inner_->record_event(stream);
  }
  bool query_event(EventId event) override {
    count(kEventQuery);
    return inner_->query_event(event);
  }
  void release_event(EventId event) override { inner_->release_event(event); }
  void wait_event(EventId event) override { inner_->wait_event(event); }
  void stream_wait_event(StreamId stream, EventId event) override {
    inner_->stream_wait_event(stream, event);
  }
  void synchronize() override { inner_->synchronize(); }
  void synchronize_stream(StreamId stream) override { inner_->synchronize_stream(stream); }
  bool is_capturing(StreamId stream) override { return inner_->is_capturing(stream); }
  int export_physical(PhysicalHandle handle) override { return inner_->export_physical(handle); }
  std::uintptr_t import_physical(const std::vector<Imported>& pieces) override {
    return inner_->import_physical(pieces);
  }
  void release_import(std::uintptr_t base) override { inner_->release_import(base); }

 private:
  void count(Kind kind, std::int64_t n = 1) {
    counts_[kind].fetch_add(n, std::memory_order_relaxed);
  }
  std::shared_ptr<Device> inner_;
  std::atomic<std::int64_t> counts_[kNumKinds] = {};
};

}  // namespace allocwatch
