// The few CUDA driver API types, constants and function signatures the cuda back end uses,
// declared here so that building needs no CUDA headers: libcuda.so.1 is loaded at run time.
//
// Everything below must match the driver ABI exactly (cuda.h of CUDA 12.x and 13.x, x86_64 and
// aarch64 Linux). C enums are passed and stored as 32-bit ints, so they are declared as int.
// Symbols are looked up by their versioned names (cuMemAlloc_v2, ...): the unversioned names in
// libcuda.so export the oldest ABI of each function, which for some of them is 32-bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace allocwatch {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;                   // CUdeviceptr_v2
using CUmemGenericAllocationHandle = unsigned long long;  // CUmemGenericAllocationHandle_v1
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

// CUresult values the back end tells apart.
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906;

// CUmemAllocationType, CUmemLocationType, CUmemAllocationHandleType, CUmemAccess_flags,
// CUmemAllocationGranularity_flags.
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0x0;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;

// CUdevice_attribute.
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;

// CUstreamCaptureStatus.
constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;

// CUevent_flags.
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 0x2;

// CUmemLocation: {CUmemLocationType type; int id;}. CUDA 13 wraps id in a union with a
// two-byte "localized" struct; size and the offset of id are unchanged.
struct CUmemLocation {
  int type;
  int id;
};

// CUmemAllocationProp (CUmemAllocationProp_v1).
struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType
  CUmemLocation location;
  void* win32HandleMetaData;  // must be null on Linux
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

// CUmemAccessDesc (CUmemAccessDesc_v1).
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};

// Guard the layout against a typo: these are the sizes and offsets of the real headers.
static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp layout");
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16,
              "CUmemAllocationProp layout");
static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp layout");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");

// Function signatures, one per symbol looked up (the symbol name is in the comment).
using PFN_cuInit = CUresult (*)(unsigned int flags);                     // cuInit
using PFN_cuDriverGetVersion = CUresult (*)(int* version);               // cuDriverGetVersion
using PFN_cuGetErrorName = CUresult (*)(CUresult, const char** name);    // cuGetErrorName
using PFN_cuGetErrorString = CUresult (*)(CUresult, const char** text);  // cuGetErrorString
using PFN_cuDeviceGet = CUresult (*)(CUdevice* device, int ordinal);     // cuDeviceGet
using PFN_cuDeviceGetName = CUresult (*)(char* name, int len, CUdevice);  // cuDeviceGetName
using PFN_cuDeviceGetAttribute = CUresult (*)(int* value, int attribute,
                                              CUdevice);  // cuDeviceGetAttribute
using PFN_cuDevicePrimaryCtxRetain = CUresult (*)(CUcontext* ctx,
                                                  CUdevice);     // cuDevicePrimaryCtxRetain
using PFN_cuDevicePrimaryCtxRelease = CUresult (*)(CUdevice);    // cuDevicePrimaryCtxRelease_v2
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext* ctx);        // cuCtxGetCurrent
using PFN_cuCtxSetCurrent = CUresult (*)(CUcontext ctx);         // cuCtxSetCurrent
using PFN_cuCtxSynchronize = CUresult (*)();                     // cuCtxSynchronize
using PFN_cuMemGetInfo = CUresult (*)(size_t* free, size_t* total);  // cuMemGetInfo_v2
using PFN_cuMemAlloc = CUresult (*)(CUdeviceptr* ptr, size_t size);  // cuMemAlloc_v2
using PFN_cuMemFree = CUresult (*)(CUdeviceptr ptr);                 // cuMemFree_v2
using PFN_cuMemAddressReserve = CUresult (*)(CUdeviceptr* ptr, size_t size, size_t alignment,
                                             CUdeviceptr hint,
                                             unsigned long long flags);  // cuMemAddressReserve
using PFN_cuMemAddressFree = CUresult (*)(CUdeviceptr ptr, size_t size);  // cuMemAddressFree
using PFN_cuMemCreate = CUresult (*)(CUmemGenericAllocationHandle* handle, size_t size,
                                     const CUmemAllocationProp* prop,
                                     unsigned long long flags);              // cuMemCreate
using PFN_cuMemRelease = CUresult (*)(CUmemGenericAllocationHandle handle);  // cuMemRelease
using PFN_cuMemMap = CUresult (*)(CUdeviceptr ptr, size_t size, size_t offset,
                                  CUmemGenericAllocationHandle handle,
                                  unsigned long long flags);        // cuMemMap
using PFN_cuMemUnmap = CUresult (*)(CUdeviceptr ptr, size_t size);  // cuMemUnmap
using PFN_cuMemSetAccess = CUresult (*)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                        size_t count);  // cuMemSetAccess
using PFN_cuMemGetAllocationGranularity = CUresult (*)(
    size_t* granularity, const CUmemAllocationProp* prop,
    int option);  // cuMemGetAllocationGranularity
using PFN_cuEventCreate = CUresult (*)(CUevent* event, unsigned int flags);  // cuEventCreate
using PFN_cuEventRecord = CUresult (*)(CUevent event, CUstream stream);     // cuEventRecord
using PFN_cuEventQuery = CUresult (*)(CUevent event);                       // cuEventQuery
using PFN_cuEventDestroy = CUresult (*)(CUevent event);                     // cuEventDestroy_v2
using PFN_cuEventSynchronize = CUresult (*)(CUevent event);                 // cuEventSynchronize
using PFN_cuStreamSynchronize = CUresult (*)(CUstream stream);              // cuStreamSynchronize
using PFN_cuStreamWaitEvent = CUresult (*)(CUstream stream, CUevent event,
                                           unsigned int flags);  // cuStreamWaitEvent
using PFN_cuStreamIsCapturing = CUresult (*)(CUstream stream,
                                             int* status);  // cuStreamIsCapturing
// CUstreamCaptureMode: 0 global, 1 thread-local, 2 relaxed.
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
using PFN_cuThreadExchangeStreamCaptureMode = CUresult (*)(int* mode);

// Sharing physical memory with another process (CUDA IPC of expandable segments): a handle
// created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR exports as a file descriptor, which the
// other process imports after taking it over (pidfd_getfd). For a file descriptor, the
// shareable handle is an int written at `shareable` and read from the pointer value itself.
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_PERMITTED = 800;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
using PFN_cuMemExportToShareableHandle = CUresult (*)(
    void* shareable, CUmemGenericAllocationHandle handle, int handle_type,
    unsigned long long flags);  // cuMemExportToShareableHandle
using PFN_cuMemImportFromShareableHandle = CUresult (*)(
    CUmemGenericAllocationHandle* handle, void* os_handle,
    int handle_type);  // cuMemImportFromShareableHandle

}  // namespace cuda
}  // namespace allocwatch
