#include "devices/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

#include "core/device.h"

namespace allocwatch {
namespace cuda {
namespace {

// The soname, not libcuda.so: only the driver package installs the versioned file, the
// unversioned link comes with the toolkit, which a training machine may not have.
constexpr const char* kDriverLibrary = "libcuda.so.1";

template <typename Fn>
void resolve(void* library, const char* symbol, Fn* slot) {
  dlerror();  // clear a stale error so the one below is ours
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    const char* why = dlerror();
    throw DeviceError(std::string("the CUDA driver has no symbol ") + symbol + " (" +
                      (why ? why : "not found") + "); is the NVIDIA driver too old?");
  }
  *slot = reinterpret_cast<Fn>(address);
}

CudaDriver load_driver() {
  void* library = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw DeviceError(std::string("cannot load the CUDA driver ") + kDriverLibrary + ": " +
                      (why ? why : "unknown error"));
  }
  CudaDriver d;
  resolve(library, "cuInit", &d.cuInit);
  resolve(library, "cuDriverGetVersion", &d.cuDriverGetVersion);
  resolve(library, "cuGetErrorName", &d.cuGetErrorName);
  resolve(library, "cuGetErrorString", &d.cuGetErrorString);
  resolve(library, "cuDeviceGet", &d.cuDeviceGet);
  resolve(library, "cuDeviceGetName", &d.cuDeviceGetName);
  resolve(library, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute);
  resolve(library, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain);
  resolve(library, "cuDevicePrimaryCtxRelease_v2", &d.cuDevicePrimaryCtxRelease);
  resolve(library, "cuCtxGetCurrent", &d.cuCtxGetCurrent);
  resolve(library, "cuCtxSetCurrent", &d.cuCtxSetCurrent);
  resolve(library, "cuCtxSynchronize", &d.cuCtxSynchronize);
  resolve(library, "cuMemGetInfo_v2", &d.cuMemGetInfo);
  resolve(library, "cuMemAlloc_v2", &d.cuMemAlloc);
  resolve(library, "cuMemFree_v2", &d.cuMemFree);
  resolve(library, "cuMemAddressReserve", &d.cuMemAddressReserve);
  resolve(library, "cuMemAddressFree", &d.cuMemAddressFree);
  resolve(library, "cuMemCreate", &d.cuMemCreate);
  resolve(library, "cuMemRelease", &d.cuMemRelease);
  resolve(library, "cuMemMap", &d.cuMemMap);
  resolve(library, "cuMemUnmap", &d.cuMemUnmap);
  resolve(library, "cuMemSetAccess", &d.cuMemSetAccess);
  resolve(library, "cuMemGetAllocationGranularity", &d.cuMemGetAllocationGranularity);
  resolve(library, "cuEventCreate", &d.cuEventCreate);
  resolve(library, "cuEventRecord", &d.cuEventRecord);
  resolve(library, "cuEventQuery", &d.cuEventQuery);
  resolve(library, "cuEventDestroy_v2", &d.cuEventDestroy);
  resolve(library, "cuEventSynchronize", &d.cuEventSynchronize);
  resolve(library, "cuStreamSynchronize", &d.cuStreamSynchronize);
  resolve(library, "cuStreamWaitEvent", &d.cuStreamWaitEvent);
  resolve(library, "cuStreamIsCapturing", &d.cuStreamIsCapturing);
  resolve(library, "cuThreadExchangeStreamCaptureMode", &d.cuThreadExchangeStreamCaptureMode);
  d.cuMemExportToShareableHandle = reinterpret_cast<PFN_cuMemExportToShareableHandle>(
      dlsym(library, "cuMemExportToShareableHandle"));
  d.cuMemImportFromShareableHandle = reinterpret_cast<PFN_cuMemImportFromShareableHandle>(
      dlsym(library, "cuMemImportFromShareableHandle"));
  return d;
}

}  // namespace

const CudaDriver& cuda_driver() {
  // Loaded once; a failed load is retried on the next call rather than cached, so that a
  // caller that catches the error and fixes its environment is not stuck with it.
  static std::mutex mutex;
  static CudaDriver driver;
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) {
    CudaDriver candidate = load_driver();
    CUresult init = candidate.cuInit(0);  // idempotent; PyTorch's runtime may have called it
    if (init != CUDA_SUCCESS) {
      // describe_result needs a loaded table; use the candidate's directly.
      const char* name = nullptr;
      candidate.cuGetErrorName(init, &name);
      throw DeviceError(std::string("cuInit failed: ") + (name ? name : "unknown error") +
                        " (code " + std::to_string(init) + "); is a GPU visible to this process?");
    }
    driver = candidate;
    loaded = true;
  }
  return driver;
}

std::string describe_result(CUresult result) {
  const CudaDriver& d = cuda_driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) name = nullptr;
  if (d.cuGetErrorString(result, &text) != CUDA_SUCCESS || text == nullptr) text = nullptr;
  std::string out = name ? name : "CUDA error " + std::to_string(result);
  if (text) out += std::string(" (") + text + ")";
  return out;
}

void check_result(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) {
    throw DeviceError(std::string(call) + " failed: " + describe_result(result));
  }
}

void check_release_result(CUresult result, const char* call) {
  if (result != CUDA_ERROR_DEINITIALIZED) check_result(result, call);
}

}  // namespace cuda
}  // namespace allocwatch
