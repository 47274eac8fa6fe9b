// The CUDA driver, loaded once per process from libcuda.so.1 at run time.
//
// Loading on first use (not at library load) keeps the package importable on machines without
// a GPU or driver; a missing driver or symbol surfaces as a DeviceError that names it.
#pragma once

#include <string>

#include "devices/cuda_driver_api.h"

namespace allocwatch {
namespace cuda {

struct CudaDriver {
  PFN_cuInit cuInit = nullptr;
  PFN_cuDriverGetVersion cuDriverGetVersion = nullptr;
  PFN_cuGetErrorName cuGetErrorName = nullptr;
  PFN_cuGetErrorString cuGetErrorString = nullptr;
  PFN_cuDeviceGet cuDeviceGet = nullptr;
  PFN_cuDeviceGetName cuDeviceGetName = nullptr;
  PFN_cuDeviceGetAttribute cuDeviceGetAttribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease = nullptr;
  PFN_cuCtxGetCurrent cuCtxGetCurrent = nullptr;
  PFN_cuCtxSetCurrent cuCtxSetCurrent = nullptr;
  PFN_cuCtxSynchronize cuCtxSynchronize = nullptr;
  PFN_cuMemGetInfo cuMemGetInfo = nullptr;
  PFN_cuMemAlloc cuMemAlloc = nullptr;
  PFN_cuMemFree cuMemFree = nullptr;
  PFN_cuMemAddressReserve cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree cuMemAddressFree = nullptr;
  PFN_cuMemCreate cuMemCreate = nullptr;
  PFN_cuMemRelease cuMemRelease = nullptr;
  PFN_cuMemMap cuMemMap = nullptr;
  PFN_cuMemUnmap cuMemUnmap = nullptr;
  PFN_cuMemSetAccess cuMemSetAccess = nullptr;
  PFN_cuMemGetAllocationGranularity cuMemGetAllocationGranularity = nullptr;
  PFN_cuEventCreate cuEventCreate = nullptr;
  PFN_cuEventRecord cuEventRecord = nullptr;
  PFN_cuEventQuery cuEventQuery = nullptr;
  PFN_cuEventDestroy cuEventDestroy = nullptr;
  PFN_cuEventSynchronize cuEventSynchronize = nullptr;
  PFN_cuStreamSynchronize cuStreamSynchronize = nullptr;
  PFN_cuStreamWaitEvent cuStreamWaitEvent = nullptr;
  PFN_cuStreamIsCapturing cuStreamIsCapturing = nullptr;
  PFN_cuThreadExchangeStreamCaptureMode cuThreadExchangeStreamCaptureMode = nullptr;
  // Optional: nullptr where the driver lacks them (then expandable segments are not shared).
  PFN_cuMemExportToShareableHandle cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle cuMemImportFromShareableHandle = nullptr;
};

// The loaded driver (dlopen + dlsym of every symbol above, and cuInit(0)), the same table for
// every caller. Throws DeviceError when libcuda.so.1, a symbol or cuInit fails; a later call
// tries again. The library stays loaded for the life of the process.
const CudaDriver& cuda_driver();

// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for a result code.
std::string describe_result(CUresult result);

// Throws DeviceError "<call> failed: <describe_result>" unless result is CUDA_SUCCESS.
void check_result(CUresult result, const char* call);

// As check_result, for calls that give memory back: CUDA_ERROR_DEINITIALIZED is accepted too.
// Tensors freed while the process exits reach the allocator after the driver has shut down;
// their memory went with it, and throwing from a deleter would terminate the process.
void check_release_result(CUresult result, const char* call);

}  // namespace cuda
}  // namespace allocwatch
