#include "pool_segments_device.h"

#include <utility>

namespace allocwatch {

namespace {

[[noreturn]] void no_virtual_memory() {
  throw DeviceError("allocwatch: a pool whose segments come from its own allocator has plain "
                    "segments only, no address space to map");
}

}  // namespace

PoolSegmentsDevice::PoolSegmentsDevice(Device& gpu, Allocate allocate, Release release)
    : gpu_(gpu), allocate_(std::move(allocate)), release_(std::move(release)) {
  if (!allocate_ || !release_)
    throw DeviceError("allocwatch: a pool's allocator needs functions to allocate and free "
                      "its segments");
}

bool PoolSegmentsDevice::malloc(std::size_t size, void** ptr) {
  *ptr = nullptr;
  // A null segment is no room, as PyTorch reads its pool allocators' answers.
  return allocate_(size, ptr) && *ptr != nullptr;
}

void PoolSegmentsDevice::free(void* ptr, std::size_t size) {
  release_(ptr, size);
}

std::uintptr_t PoolSegmentsDevice::reserve_address(std::size_t, std::size_t) {
  no_virtual_memory();
}
void PoolSegmentsDevice::free_address(std::uintptr_t, std::size_t) { no_virtual_memory(); }
bool PoolSegmentsDevice::create_physical(std::size_t, PhysicalHandle*) { no_virtual_memory(); }
void PoolSegmentsDevice::release_physical(PhysicalHandle, std::size_t) { no_virtual_memory(); }
void PoolSegmentsDevice::map(std::uintptr_t, std::size_t, PhysicalHandle) {
  no_virtual_memory();
}
void PoolSegmentsDevice::unmap(std::uintptr_t, std::size_t) { no_virtual_memory(); }

}  // namespace allocwatch
