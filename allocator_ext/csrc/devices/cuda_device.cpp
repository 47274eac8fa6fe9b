#include "devices/cuda_device.h"

#include "devices/cuda_context_guard.h"

#include <unistd.h>

namespace allocwatch {

using namespace cuda;  // the driver's own names read best unqualified here

namespace {

CUmemLocation this_device(CUdevice device) {
  CUmemLocation location{};
  location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  location.id = device;
  return location;
}

// Physical memory on this device, not exportable to other processes (no handle type): the
// cheapest kind to create, as PyTorch's expandable segments use.
CUmemAllocationProp device_allocation(CUdevice device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location = this_device(device);
  return prop;
}

CUdeviceptr as_device_pointer(std::uintptr_t address) {
  return static_cast<CUdeviceptr>(address);
}

}  // namespace

CudaDevice::CudaDevice(int index)
    : driver_(cuda_driver()), index_(index), events_(driver_) {
  check_result(driver_.cuDeviceGet(&device_, index), "cuDeviceGet");
  check_result(driver_.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
  try {
    check_result(driver_.cuDriverGetVersion(&driver_version_), "cuDriverGetVersion");
    char name[256] = {};
    check_result(driver_.cuDeviceGetName(name, sizeof(name) - 1, device_), "cuDeviceGetName");
    name_ = name;

    int vmm = 0;
    check_result(driver_.cuDeviceGetAttribute(
                     &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_),
                 "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
    if (vmm != 0) {
      ContextGuard guard(driver_, context_);
      CUmemAllocationProp prop = device_allocation(device_);
      check_result(driver_.cuMemGetAllocationGranularity(&granularity_, &prop,
                                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity");
      supports_virtual_memory_ = granularity_ != 0;
    }
  } catch (...) {
    driver_.cuDevicePrimaryCtxRelease(device_);
    throw;
  }
}

CudaDevice::~CudaDevice() {
  // Events first: they belong to the context, which the release below may destroy.
  events_.destroy_idle();
  // Balances the retain. PyTorch's runtime holds its own reference, so this never destroys
  // the context under a running training job; standalone, it tears the context down.
  driver_.cuDevicePrimaryCtxRelease(device_);
}

MemoryInfo CudaDevice::memory_info() {
  ContextGuard guard(driver_, context_);
  MemoryInfo info;
  check_result(driver_.cuMemGetInfo(&info.free, &info.total), "cuMemGetInfo_v2");
  return info;
}

namespace {
// During a CUDA graph capture in global mode, allocating is an "unsafe" call that would
// invalidate the capture. Like PyTorch (cudaMallocMaybeCapturing), switch this thread to relaxed
// mode around it: the allocation gets new memory at capture and is left alone by replays.
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const cuda::CudaDriver& d) : driver_(d) {
    mode_ = cuda::CU_STREAM_CAPTURE_MODE_RELAXED;
    driver_.cuThreadExchangeStreamCaptureMode(&mode_);
  }
  ~RelaxedCaptureMode() { driver_.cuThreadExchangeStreamCaptureMode(&mode_); }

 private:
  const cuda::CudaDriver& driver_;
  int mode_;
};
}  // namespace

bool CudaDevice::malloc(std::size_t size, void** ptr) {
  ContextGuard guard(driver_, context_);
  RelaxedCaptureMode relaxed(driver_);
  CUdeviceptr address = 0;
  CUresult result = driver_.cuMemAlloc(&address, size);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return false;
  check_result(result, "cuMemAlloc_v2");
  *ptr = reinterpret_cast<void*>(static_cast<std::uintptr_t>(address));
  return true;
}

void CudaDevice::free(void* ptr, std::size_t /*size*/) {
  ContextGuard guard(driver_, context_);
  check_release_result(
      driver_.cuMemFree(as_device_pointer(reinterpret_cast<std::uintptr_t>(ptr))),
      "cuMemFree_v2");
}

void CudaDevice::require_granular(std::size_t value, const char* what, const char* call) const {
  // The driver answers a misaligned size with a bare CUDA_ERROR_INVALID_VALUE; say why.
  if (!supports_virtual_memory_) {
    throw DeviceError(std::string(call) + ": device " + std::to_string(index_) +
                      " does not support virtual memory management");
  }
  if (value % granularity_ != 0) {
    throw DeviceError(std::string(call) + ": " + what + " " + std::to_string(value) +
                      " is not a multiple of the allocation granularity " +
                      std::to_string(granularity_));
  }
}

std::uintptr_t CudaDevice::reserve_address(std::size_t size, std::size_t alignment) {
  require_granular(size, "size", "cuMemAddressReserve");
  ContextGuard guard(driver_, context_);
  CUdeviceptr base = 0;
  // Address space is plentiful (tens of TiB), so running out of it is a failure, not an
  // out-of-memory the core could recover from: every error throws.
  check_result(driver_.cuMemAddressReserve(&base, size, alignment, 0, 0), "cuMemAddressReserve");
  return static_cast<std::uintptr_t>(base);
}

void CudaDevice::free_address(std::uintptr_t base, std::size_t size) {
  ContextGuard guard(driver_, context_);
  check_release_result(driver_.cuMemAddressFree(as_device_pointer(base), size),
                       "cuMemAddressFree");
}

bool CudaDevice::create_physical(std::size_t size, PhysicalHandle* handle) {
  require_granular(size, "size", "cuMemCreate");
  ContextGuard guard(driver_, context_);
  RelaxedCaptureMode relaxed(driver_);
  CUmemAllocationProp prop = device_allocation(device_);
  CUmemGenericAllocationHandle created = 0;
  CUresult result = CUDA_ERROR_NOT_SUPPORTED;
  if (exportable_ && driver_.cuMemExportToShareableHandle != nullptr) {
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    result = driver_.cuMemCreate(&created, size, &prop, 0);
    // Some containers and drivers do not permit shareable memory: plain memory from now on.
    if (result == CUDA_ERROR_NOT_PERMITTED || result == CUDA_ERROR_NOT_SUPPORTED ||
        result == CUDA_ERROR_INVALID_VALUE) {
      exportable_ = false;
    }
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  }
  if (!exportable_ || driver_.cuMemExportToShareableHandle == nullptr)
    result = driver_.cuMemCreate(&created, size, &prop, 0);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return false;
  check_result(result, "cuMemCreate");
  *handle = static_cast<PhysicalHandle>(created);
  return true;
}

void CudaDevice::release_physical(PhysicalHandle handle, std::size_t /*size*/) {
  {
    std::lock_guard<std::mutex> lock(sharing_mutex_);
    auto it = exported_.find(handle);
    if (it != exported_.end()) {
      ::close(it->second);
      exported_.erase(it);
    }
  }
  ContextGuard guard(driver_, context_);
  check_release_result(driver_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)),
                       "cuMemRelease");
}

int CudaDevice::export_physical(PhysicalHandle handle) {
  std::lock_guard<std::mutex> lock(sharing_mutex_);
  auto it = exported_.find(handle);
  if (it != exported_.end()) return it->second;
  if (driver_.cuMemExportToShareableHandle == nullptr) return -1;
  ContextGuard guard(driver_, context_);
  int fd = -1;
  CUresult result = driver_.cuMemExportToShareableHandle(
      &fd, static_cast<CUmemGenericAllocationHandle>(handle),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (result != CUDA_SUCCESS) return -1;  // made before sharing was refused: plain memory
  exported_[handle] = fd;
  return fd;
}

std::uintptr_t CudaDevice::import_physical(const std::vector<Imported>& pieces) {
  if (driver_.cuMemImportFromShareableHandle == nullptr)
    throw DeviceError("the CUDA driver has no cuMemImportFromShareableHandle");
  std::size_t total = 0;
  for (const Imported& piece : pieces) total += piece.size;
  const std::uintptr_t base = reserve_address(total, 0);
  ContextGuard guard(driver_, context_);
  Import import{total, {}};
  std::uintptr_t at = base;
  try {
    for (const Imported& piece : pieces) {
      CUmemGenericAllocationHandle handle = 0;
      check_result(driver_.cuMemImportFromShareableHandle(
                       &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(piece.fd)),
                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   "cuMemImportFromShareableHandle");
      import.handles.emplace_back(handle, piece.size);
      map_no_access(at, piece.size, handle);
      at += piece.size;
    }
    set_access(base, total);
  } catch (...) {
    std::uintptr_t undo = base;
    for (const auto& [handle, size] : import.handles) {
      if (undo < at) driver_.cuMemUnmap(as_device_pointer(undo), size);
      driver_.cuMemRelease(handle);
      undo += size;
    }
    free_address(base, total);
    throw;
  }
  std::lock_guard<std::mutex> lock(sharing_mutex_);
  imports_[base] = std::move(import);
  return base;
}

void CudaDevice::release_import(std::uintptr_t base) {
  Import import;
  {
    std::lock_guard<std::mutex> lock(sharing_mutex_);
    auto it = imports_.find(base);
    if (it == imports_.end()) return;
    import = std::move(it->second);
    imports_.erase(it);
  }
  ContextGuard guard(driver_, context_);
  std::uintptr_t at = base;
  for (const auto& [handle, size] : import.handles) {
    check_release_result(driver_.cuMemUnmap(as_device_pointer(at), size), "cuMemUnmap");
    check_release_result(driver_.cuMemRelease(handle), "cuMemRelease");
    at += size;
  }
  free_address(base, import.size);
}

void CudaDevice::map_no_access(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) {
  require_granular(addr, "address", "cuMemMap");
  require_granular(size, "size", "cuMemMap");
  ContextGuard guard(driver_, context_);
  check_result(driver_.cuMemMap(as_device_pointer(addr), size, 0,
                                static_cast<CUmemGenericAllocationHandle>(handle), 0),
               "cuMemMap");
}

void CudaDevice::set_access(std::uintptr_t addr, std::size_t size) {
  ContextGuard guard(driver_, context_);
  // A mapping is unusable until access is granted; grant read-write to this device only.
  CUmemAccessDesc access{};
  access.location = this_device(device_);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check_result(driver_.cuMemSetAccess(as_device_pointer(addr), size, &access, 1),
               "cuMemSetAccess");
}

void CudaDevice::map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) {
  map_range(addr, {Mapping{size, handle}});
}

void CudaDevice::map_range(std::uintptr_t addr, const std::vector<Mapping>& mappings) {
  ContextGuard guard(driver_, context_);
  RelaxedCaptureMode relaxed(driver_);
  std::uintptr_t at = addr;
  for (const Mapping& m : mappings) {
    map_no_access(at, m.size, m.handle);
    at += m.size;
  }
  try {
    set_access(addr, at - addr);
  } catch (...) {
    // Leave no half-made mapping behind.
    ContextGuard guard(driver_, context_);
    std::uintptr_t undo = addr;
    for (const Mapping& m : mappings) {
      driver_.cuMemUnmap(as_device_pointer(undo), m.size);
      undo += m.size;
    }
    throw;
  }
}

void CudaDevice::unmap(std::uintptr_t addr, std::size_t size) {
  require_granular(addr, "address", "cuMemUnmap");
  require_granular(size, "size", "cuMemUnmap");
  ContextGuard guard(driver_, context_);
  // The allocator's unmapping thread (core/unmapper.h) may call while another thread captures
  // a CUDA graph in global mode; the pages are no graph's.
  RelaxedCaptureMode relaxed(driver_);
  check_release_result(driver_.cuMemUnmap(as_device_pointer(addr), size), "cuMemUnmap");
}

EventId CudaDevice::record_event(StreamId stream) {
  ContextGuard guard(driver_, context_);
  CUevent event = events_.acquire();
  // The stream id is the runtime's cudaStream_t, which is the driver's CUstream (0 is the
  // legacy default stream, as for the runtime).
  CUresult result = driver_.cuEventRecord(event, reinterpret_cast<CUstream>(stream));
  if (result != CUDA_SUCCESS) {
    events_.release(event);
    check_result(result, "cuEventRecord");
  }
  return reinterpret_cast<EventId>(event);
}

bool CudaDevice::query_event(EventId event) {
  ContextGuard guard(driver_, context_);
  CUresult result = driver_.cuEventQuery(reinterpret_cast<CUevent>(event));
  if (result == CUDA_ERROR_NOT_READY) return false;
  check_result(result, "cuEventQuery");
  return true;
}

void CudaDevice::release_event(EventId event) {
  events_.release(reinterpret_cast<CUevent>(event));
}

void CudaDevice::wait_event(EventId event) {
  ContextGuard guard(driver_, context_);
  check_result(driver_.cuEventSynchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize");
}

void CudaDevice::stream_wait_event(StreamId stream, EventId event) {
  ContextGuard guard(driver_, context_);
  check_result(driver_.cuStreamWaitEvent(reinterpret_cast<CUstream>(stream),
                                         reinterpret_cast<CUevent>(event), 0),
               "cuStreamWaitEvent");
}

void CudaDevice::synchronize() {
  ContextGuard guard(driver_, context_);
  check_result(driver_.cuCtxSynchronize(), "cuCtxSynchronize");
}

void CudaDevice::synchronize_stream(StreamId stream) {
  ContextGuard guard(driver_, context_);
  check_result(driver_.cuStreamSynchronize(reinterpret_cast<CUstream>(stream)),
               "cuStreamSynchronize");
}

bool CudaDevice::is_capturing(StreamId stream) {
  ContextGuard guard(driver_, context_);
  int status = CU_STREAM_CAPTURE_STATUS_NONE;
  CUresult result = driver_.cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &status);
  // Asked about the legacy default stream while another (blocking) stream captures: the
  // default stream cannot be used until that capture ends, so treat it as capturing.
  if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
  check_result(result, "cuStreamIsCapturing");
  // An invalidated capture is still a capture until cuStreamEndCapture: stay capture-safe.
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

}  // namespace allocwatch
