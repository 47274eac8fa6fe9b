// The device behind a private pool whose segments come from an allocator of the user's
// (torch.cuda.MemPool(allocator=...): NCCL's ncclMemAlloc for buffer registration and
// symmetric memory, or any CUDAPluggableAllocator): a segment is allocated and freed through
// that allocator's functions, and everything else (streams, events, memory information,
// synchronisation) is the GPU's own, the device it wraps. Such a pool's segments are plain
// (one allocation each, never pages of an expandable segment), as in PyTorch's allocator.
// The core calls its malloc and free without its lock held (Note [pool allocators outside the
// lock], core/allocator.h): the user's functions may call back into PyTorch's allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "../core/device.h"

namespace allocwatch {

class PoolSegmentsDevice final : public Device {
 public:
  // False where the allocator has no room for `size` bytes; throws DeviceError where it
  // failed otherwise.
  using Allocate = std::function<bool(std::size_t size, void** ptr)>;
  using Release = std::function<void(void* ptr, std::size_t size)>;

  // `gpu`: the device of the allocator whose pool this serves, which outlives its pools.
  PoolSegmentsDevice(Device& gpu, Allocate allocate, Release release);

  int index() const override { return gpu_.index(); }
  MemoryInfo memory_info() override { return gpu_.memory_info(); }
  bool malloc(std::size_t size, void** ptr) override;
  void free(void* ptr, std::size_t size) override;

  // Its segments are never expandable: no address space of its own to reserve or map.
  bool supports_virtual_memory() const override { return false; }
  std::uintptr_t reserve_address(std::size_t size, std::size_t alignment) override;
  void free_address(std::uintptr_t base, std::size_t size) override;
  bool create_physical(std::size_t size, PhysicalHandle* handle) override;
  void release_physical(PhysicalHandle handle, std::size_t size) override;
  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override;
  void unmap(std::uintptr_t addr, std::size_t size) override;

  EventId record_event(StreamId stream) override { return gpu_.record_event(stream); }
  bool query_event(EventId event) override { return gpu_.query_event(event); }
  void release_event(EventId event) override { gpu_.release_event(event); }
  void wait_event(EventId event) override { gpu_.wait_event(event); }
  void stream_wait_event(StreamId stream, EventId event) override {
    gpu_.stream_wait_event(stream, event);
  }
  void synchronize() override { gpu_.synchronize(); }
  void synchronize_stream(StreamId stream) override { gpu_.synchronize_stream(stream); }
  bool is_capturing(StreamId stream) override { return gpu_.is_capturing(stream); }

 private:
  Device& gpu_;
  Allocate allocate_;
  Release release_;
};

}  // namespace allocwatch
