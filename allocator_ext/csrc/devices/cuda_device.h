// The cuda back end: the Device interface on a real NVIDIA GPU, through the driver API loaded
// at run time (see cuda_driver.h), so that building needs only a C++ compiler.
//
// It works in the device's primary context, the one PyTorch's runtime uses; the constructor
// retains it (creating it when used standalone, e.g. in bench/native/device_call_costs) and every call
// makes it current on the calling thread for its duration.
//
// Thread-safety: the core serialises calls under its own lock; the event pool has its own.
// What the core must do itself, as PyTorch does: synchronise (or wait on events of) every
// stream that used memory before unmap() or free() of it, and not call synchronize(),
// record_event() or query_event() while is_capturing() is true.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "devices/cuda_driver.h"
#include "devices/cuda_event_pool.h"
#include "core/device.h"

namespace allocwatch {

class CudaDevice final : public Device {
 public:
  // Loads the driver and retains device `index`'s primary context. Throws DeviceError when
  // there is no driver or no such device.
  explicit CudaDevice(int index);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  int index() const override { return index_; }
  MemoryInfo memory_info() override;

  bool malloc(std::size_t size, void** ptr) override;
  void free(void* ptr, std::size_t size) override;

  bool supports_virtual_memory() const override { return supports_virtual_memory_; }
  // Each call makes the device's context current on the calling thread (ContextGuard).
  UnmapThread unmap_thread() const override { return UnmapThread::own; }
  std::uintptr_t reserve_address(std::size_t size, std::size_t alignment) override;
  void free_address(std::uintptr_t base, std::size_t size) override;
  bool create_physical(std::size_t size, PhysicalHandle* handle) override;
  void release_physical(PhysicalHandle handle, std::size_t size) override;
  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override;
  void map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) override;
  // The two halves of map(), public for the cost benchmark.
  void map_no_access(std::uintptr_t addr, std::size_t size, PhysicalHandle handle);
  void set_access(std::uintptr_t addr, std::size_t size);
  void unmap(std::uintptr_t addr, std::size_t size) override;

  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void release_event(EventId event) override;
  void wait_event(EventId event) override;
  void stream_wait_event(StreamId stream, EventId event) override;

  void synchronize() override;
  void synchronize_stream(StreamId stream) override;
  bool is_capturing(StreamId stream) override;

  int export_physical(PhysicalHandle handle) override;
  std::uintptr_t import_physical(const std::vector<Imported>& pieces) override;
  void release_import(std::uintptr_t base) override;

  // Facts about the device, for reports and benchmarks.
  std::string name() const { return name_; }
  int driver_version() const { return driver_version_; }  // e.g. 13000 for CUDA 13.0
  // The size that reserve/create/map/unmap sizes and addresses must be multiples of (2 MiB on
  // current GPUs); 0 when virtual memory is not supported.
  std::size_t granularity() const { return granularity_; }

 private:
  void require_granular(std::size_t value, const char* what, const char* call) const;

  const cuda::CudaDriver& driver_;
  int index_;
  cuda::CUdevice device_ = 0;
  cuda::CUcontext context_ = nullptr;
  bool supports_virtual_memory_ = false;
  std::size_t granularity_ = 0;
  int driver_version_ = 0;
  std::string name_;
  cuda::EventPool events_;
  // Physical memory is made exportable as file descriptors (CUDA IPC), as PyTorch's expandable
  // segments do, until the driver refuses that kind; then it is made plain.
  bool exportable_ = true;
  std::mutex sharing_mutex_;
  std::map<PhysicalHandle, int> exported_;  // file descriptors handed out, closed on release
  struct Import {
    std::size_t size;
    std::vector<std::pair<cuda::CUmemGenericAllocationHandle, std::size_t>> handles;
  };
  std::map<std::uintptr_t, Import> imports_;
};

}  // namespace allocwatch
