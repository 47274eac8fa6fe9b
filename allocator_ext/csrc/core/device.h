// The device interface: everything the allocator core asks of a GPU.
//
// The core never talks to CUDA directly. It goes through this small interface so that the
// same rules run on a real GPU (devices/cuda_device.*, the driver loaded at run time) and on
// the simulated device (devices/sim_device.*) used by tests and trace replay.
//
// Calls that can run out of device memory return false instead of throwing: the core has an
// out-of-memory path (free cached blocks, retry) and must decide what to do. Any other failure
// is a bug or a broken device and throws DeviceError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace allocwatch {

// A stream as the caller names it (a cudaStream_t cast to an integer; 0 is the default stream).
using StreamId = std::uint64_t;
// An event recorded on a stream; opaque to the core.
using EventId = std::uint64_t;
// A physical allocation that can be mapped into reserved address space.
using PhysicalHandle = std::uint64_t;

class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct MemoryInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual int index() const = 0;
  virtual MemoryInfo memory_info() = 0;

  // Plain segments (cudaMalloc / cudaFree). malloc returns false when the device is out of memory.
  virtual bool malloc(std::size_t size, void** ptr) = 0;
  virtual void free(void* ptr, std::size_t size) = 0;

  // Virtual memory, for expandable segments (cuMemAddressReserve, cuMemCreate, cuMemMap +
  // cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree).
  virtual bool supports_virtual_memory() const = 0;
  // Where the core makes the unmap calls of moved pages (unmap_off_thread, core/unmapper.h):
  // on the allocating thread; on a thread of its own (CUDA's driver takes calls from any
  // thread); or on that thread with the allocating thread waiting for each hand-over, which
  // keeps the calls in one order from run to run (the simulated device of a replay, which
  // then prices them as the other thread's).
  enum class UnmapThread { caller, own, own_in_lockstep };
  virtual UnmapThread unmap_thread() const { return UnmapThread::caller; }
  virtual std::uintptr_t reserve_address(std::size_t size, std::size_t alignment) = 0;
  virtual void free_address(std::uintptr_t base, std::size_t size) = 0;
  virtual bool create_physical(std::size_t size, PhysicalHandle* handle) = 0;
  virtual void release_physical(PhysicalHandle handle, std::size_t size) = 0;
  virtual void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) = 0;
  virtual void unmap(std::uintptr_t addr, std::size_t size) = 0;
  // Maps physical allocations back to back from `addr`. Granting access is a call of its own
  // on CUDA and costs about as much as the map itself, so a back end should grant it once for
  // the whole range (PyTorch does the same); this default maps one by one.
  struct Mapping {
    std::size_t size;
    PhysicalHandle handle;
  };
  virtual void map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) {
    for (const Mapping& m : mappings) {
      map(addr, m.size, m.handle);
      addr += m.size;
    }
  }

  // Streams and events. record_event returns an event that completes once the work queued on
  // the stream so far has completed.
  virtual EventId record_event(StreamId stream) = 0;
  virtual bool query_event(EventId event) = 0;
  virtual void release_event(EventId event) = 0;
  // Blocks until one event has completed (cudaEventSynchronize).
  virtual void wait_event(EventId /*event*/) { synchronize(); }
  // Orders the work queued on `stream` from now on after `event`, on the device
  // (cudaStreamWaitEvent): the host does not wait. Memory that another stream used can be
  // handed to `stream` this way, as cudaMallocAsync orders cross-stream reuse. Back ends
  // without such a call wait on the host instead.
  virtual void stream_wait_event(StreamId /*stream*/, EventId event) { wait_event(event); }

  // A device-wide synchronisation (cudaDeviceSynchronize): the expensive call that releasing
  // cached memory needs, and that a well-tuned allocator makes rarely.
  virtual void synchronize() = 0;
  // Waits for the work queued on one stream (cudaStreamSynchronize). Unmapping pages of an
  // expandable segment only needs its own stream to be idle; back ends without a cheaper
  // call fall back to a device-wide synchronisation.
  virtual void synchronize_stream(StreamId /*stream*/) { synchronize(); }

  // True while the calling thread's stream is being captured into a CUDA graph: during capture
  // the core must not call anything that synchronises or queries events.
  virtual bool is_capturing(StreamId /*stream*/) { return false; }

  // Sharing physical memory with other processes (CUDA IPC of expandable segments).
  // export_physical: a file descriptor for the allocation, owned by the device and valid until
  // the allocation is released; -1 where the device cannot share it.
  virtual int export_physical(PhysicalHandle /*handle*/) { return -1; }
  // Maps, in this process, allocations another process exported (file descriptors this
  // process now owns, with their sizes, back to back) and returns where; release_import undoes
  // it. Throws DeviceError where the device cannot.
  struct Imported {
    int fd;
    std::size_t size;
  };
  virtual std::uintptr_t import_physical(const std::vector<Imported>& /*pieces*/) {
    throw DeviceError("this device cannot import memory from another process");
  }
  virtual void release_import(std::uintptr_t /*base*/) {}
};

}  // namespace allocwatch
