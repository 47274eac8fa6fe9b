// A stand-in for libcuda.so.1, built only by the tests: host memory behind the handful of
// driver functions the cuda back end loads, so that its loading, context handling, error paths
// and event pool run on a machine without a GPU.
//
// It reads the structures the back end passes byte by byte at the offsets of the real cuda.h
// (not through the back end's own declarations), so a layout mistake there fails here too.
// Test hooks (fake_cuda_*) let a test run out of memory, hold events pending and fake captures.
#include <sys/mman.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace {

using CUresult = int;
constexpr CUresult kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kDeinitialized = 4,
                   kInvalidDevice = 101,
                   kInvalidContext = 201, kInvalidHandle = 400, kNotReady = 600,
                   kCaptureImplicit = 906;
constexpr std::size_t kGranularity = std::size_t{2} << 20;

struct Event {
  bool pending = false;
  bool timing = false;  // created without CU_EVENT_DISABLE_TIMING
  std::chrono::steady_clock::time_point recorded;
};

std::mutex g_mutex;
int g_context_token = 0;  // the primary context is &g_context_token
int g_primary_references = 0;
std::size_t g_capacity = std::size_t{80} << 30;
std::size_t g_used = 0;
bool g_hold_events = false;
bool g_deinitialized = false;  // after fake_cuda_deinitialize: the calls below say so
int g_capture_status = 0;
bool g_capture_implicit = false;
std::map<std::uintptr_t, std::size_t> g_segments;      // cuMemAlloc
std::map<std::uintptr_t, std::size_t> g_reservations;  // cuMemAddressReserve
std::map<unsigned long long, std::size_t> g_handles;   // cuMemCreate
std::map<std::uintptr_t, std::size_t> g_mappings;      // cuMemMap, by address
std::set<std::uintptr_t> g_accessible;                 // mappings given access
std::set<Event*> g_events;
unsigned long long g_next_handle = 1;
thread_local void* t_current = nullptr;

void* primary() { return &g_context_token; }

template <typename T>
T read_at(const void* base, std::size_t offset) {
  T value;
  std::memcpy(&value, static_cast<const char*>(base) + offset, sizeof(T));
  return value;
}

// CUmemAllocationProp: type@0, requestedHandleTypes@4, location.type@8, location.id@12,
// win32HandleMetaData@16, allocFlags@24 (8 bytes); 32 bytes in all.
bool valid_device_prop(const void* prop) {
  return read_at<int>(prop, 0) == 1 && read_at<int>(prop, 4) == 0 && read_at<int>(prop, 8) == 1 &&
         read_at<int>(prop, 12) == 0 && read_at<void*>(prop, 16) == nullptr &&
         read_at<unsigned long long>(prop, 24) == 0;
}

bool has_context() { return t_current == primary(); }

bool inside_reservation(std::uintptr_t address, std::size_t size) {
  auto it = g_reservations.upper_bound(address);
  if (it == g_reservations.begin()) return false;
  --it;
  return address + size <= it->first + it->second;
}

}  // namespace

extern "C" {

// ---- test hooks
void fake_cuda_set_capacity(std::size_t bytes) { g_capacity = bytes; }
void fake_cuda_deinitialize() { g_deinitialized = true; }
void fake_cuda_hold_events(int hold) { g_hold_events = hold != 0; }
void fake_cuda_complete_events() {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (Event* e : g_events) e->pending = false;
}
void fake_cuda_set_capture(int status, int implicit) {
  g_capture_status = status;
  g_capture_implicit = implicit != 0;
}
int fake_cuda_primary_references() { return g_primary_references; }
int fake_cuda_live_events() { return static_cast<int>(g_events.size()); }
int fake_cuda_timed_events() {
  int n = 0;
  for (const Event* e : g_events) n += e->timing ? 1 : 0;
  return n;
}
int fake_cuda_live_handles() { return static_cast<int>(g_handles.size()); }
void* fake_cuda_current_context() { return t_current; }
void fake_cuda_set_current_context(void* ctx) { t_current = ctx; }

// ---- the driver
CUresult cuInit(unsigned int flags) { return flags == 0 ? kSuccess : kInvalidValue; }
CUresult cuDriverGetVersion(int* version) {
  *version = 13000;
  return kSuccess;
}
CUresult cuGetErrorName(CUresult r, const char** name) {
  switch (r) {
    case kSuccess: *name = "CUDA_SUCCESS"; return kSuccess;
    case kInvalidValue: *name = "CUDA_ERROR_INVALID_VALUE"; return kSuccess;
    case kOutOfMemory: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return kSuccess;
    case kDeinitialized: *name = "CUDA_ERROR_DEINITIALIZED"; return kSuccess;
    case kInvalidDevice: *name = "CUDA_ERROR_INVALID_DEVICE"; return kSuccess;
    case kInvalidContext: *name = "CUDA_ERROR_INVALID_CONTEXT"; return kSuccess;
    case kInvalidHandle: *name = "CUDA_ERROR_INVALID_HANDLE"; return kSuccess;
    case kNotReady: *name = "CUDA_ERROR_NOT_READY"; return kSuccess;
    case kCaptureImplicit: *name = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"; return kSuccess;
    default: *name = nullptr; return kInvalidValue;
  }
}
CUresult cuGetErrorString(CUresult r, const char** text) {
  *text = r == kInvalidValue ? "invalid argument" : "fake driver error";
  return kSuccess;
}
CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal != 0) return kInvalidDevice;
  *device = 0;
  return kSuccess;
}
CUresult cuDeviceGetName(char* name, int len, int device) {
  if (device != 0 || len < 9) return kInvalidValue;
  std::strcpy(name, "Fake GPU");
  return kSuccess;
}
CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  if (device != 0) return kInvalidDevice;
  *value = attribute == 102 ? 1 : 0;
  return kSuccess;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device != 0) return kInvalidDevice;
  ++g_primary_references;
  *ctx = primary();
  return kSuccess;
}
CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  if (g_deinitialized) return kDeinitialized;
  if (device != 0 || g_primary_references == 0) return kInvalidValue;
  --g_primary_references;
  return kSuccess;
}
CUresult cuCtxGetCurrent(void** ctx) {
  if (g_deinitialized) return kDeinitialized;
  *ctx = t_current;
  return kSuccess;
}
CUresult cuCtxSetCurrent(void* ctx) {
  t_current = ctx;
  return kSuccess;
}
CUresult cuCtxSynchronize() {
  if (g_deinitialized) return kDeinitialized;
  return has_context() ? kSuccess : kInvalidContext;
}
CUresult cuStreamSynchronize(void*) { return has_context() ? kSuccess : kInvalidContext; }
CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
  if (!has_context()) return kInvalidContext;
  *total = g_capacity;
  *free = g_capacity - g_used;
  return kSuccess;
}
CUresult cuMemAlloc_v2(unsigned long long* ptr, std::size_t size) {
  if (g_deinitialized) return kDeinitialized;
  if (!has_context()) return kInvalidContext;
  if (size == 0) return kInvalidValue;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_used + size > g_capacity) return kOutOfMemory;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  g_used += size;
  g_segments[reinterpret_cast<std::uintptr_t>(p)] = size;
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return kSuccess;
}
CUresult cuMemFree_v2(unsigned long long ptr) {
  if (g_deinitialized) return kDeinitialized;
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_segments.find(ptr);
  if (it == g_segments.end()) return kInvalidValue;
  munmap(reinterpret_cast<void*>(it->first), it->second);
  g_used -= it->second;
  g_segments.erase(it);
  return kSuccess;
}
CUresult cuMemAddressReserve(unsigned long long* ptr, std::size_t size, std::size_t alignment,
                             unsigned long long hint, unsigned long long flags) {
  if (!has_context()) return kInvalidContext;
  if (size == 0 || size % kGranularity || hint || flags) return kInvalidValue;
  if (alignment == 0) alignment = kGranularity;
  void* p = mmap(nullptr, size + alignment, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  std::uintptr_t base = (reinterpret_cast<std::uintptr_t>(p) + alignment - 1) / alignment * alignment;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_reservations[base] = size;  // the slack around it is leaked: test-sized
  *ptr = base;
  return kSuccess;
}
CUresult cuMemAddressFree(unsigned long long ptr, std::size_t size) {
  if (g_deinitialized) return kDeinitialized;
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_reservations.find(ptr);
  if (it == g_reservations.end() || it->second != size) return kInvalidValue;
  g_reservations.erase(it);
  return kSuccess;
}
CUresult cuMemCreate(unsigned long long* handle, std::size_t size, const void* prop,
                     unsigned long long flags) {
  if (!has_context()) return kInvalidContext;
  if (!valid_device_prop(prop) || flags || size == 0 || size % kGranularity) return kInvalidValue;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_used + size > g_capacity) return kOutOfMemory;
  g_used += size;
  *handle = g_next_handle++;
  g_handles[*handle] = size;
  return kSuccess;
}
CUresult cuMemRelease(unsigned long long handle) {
  if (g_deinitialized) return kDeinitialized;
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_handles.find(handle);
  if (it == g_handles.end()) return kInvalidHandle;
  g_used -= it->second;
  g_handles.erase(it);
  return kSuccess;
}
CUresult cuMemMap(unsigned long long ptr, std::size_t size, std::size_t offset,
                  unsigned long long handle, unsigned long long flags) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto h = g_handles.find(handle);
  if (h == g_handles.end()) return kInvalidHandle;
  if (offset || flags || size != h->second || !inside_reservation(ptr, size) ||
      g_mappings.count(ptr)) {
    return kInvalidValue;
  }
  g_mappings[ptr] = size;
  return kSuccess;
}
CUresult cuMemSetAccess(unsigned long long ptr, std::size_t size, const void* desc,
                        std::size_t count) {
  if (!has_context()) return kInvalidContext;
  // CUmemAccessDesc: location.type@0, location.id@4, flags@8; 12 bytes.
  if (count != 1 || read_at<int>(desc, 0) != 1 || read_at<int>(desc, 4) != 0 ||
      read_at<int>(desc, 8) != 3) {
    return kInvalidValue;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  // One call may cover a run of back-to-back mappings, as on the real driver (the allocator
  // grants access once per mapped run); it must cover whole mappings, nothing unmapped.
  std::vector<std::uintptr_t> run;
  for (std::uintptr_t at = ptr; at < ptr + size;) {
    auto it = g_mappings.find(at);
    if (it == g_mappings.end() || at + it->second > ptr + size) return kInvalidValue;
    run.push_back(at);
    at += it->second;
  }
  if (run.empty()) return kInvalidValue;
  mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE);
  g_accessible.insert(run.begin(), run.end());
  return kSuccess;
}
CUresult cuMemUnmap(unsigned long long ptr, std::size_t size) {
  if (g_deinitialized) return kDeinitialized;
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_mappings.find(ptr);
  if (it == g_mappings.end() || it->second != size) return kInvalidValue;
  madvise(reinterpret_cast<void*>(ptr), size, MADV_DONTNEED);
  mprotect(reinterpret_cast<void*>(ptr), size, PROT_NONE);
  g_mappings.erase(it);
  g_accessible.erase(ptr);
  return kSuccess;
}
CUresult cuMemGetAllocationGranularity(std::size_t* granularity, const void* prop, int option) {
  if (!valid_device_prop(prop) || (option != 0 && option != 1)) return kInvalidValue;
  *granularity = kGranularity;
  return kSuccess;
}
CUresult cuEventCreate(void** event, unsigned int flags) {
  if (!has_context()) return kInvalidContext;
  // The back end asks for timing disabled; device_call_costs times its own work.
  if (flags != 0x2 && flags != 0) return kInvalidValue;
  std::lock_guard<std::mutex> lock(g_mutex);
  Event* e = new Event;
  e->timing = flags == 0;
  g_events.insert(e);
  *event = e;
  return kSuccess;
}
CUresult cuEventRecord(void* event, void* /*stream*/) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_events.find(static_cast<Event*>(event));
  if (it == g_events.end()) return kInvalidHandle;
  (*it)->pending = g_hold_events;
  (*it)->recorded = std::chrono::steady_clock::now();
  return kSuccess;
}
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto a = g_events.find(static_cast<Event*>(start));
  auto b = g_events.find(static_cast<Event*>(end));
  if (a == g_events.end() || b == g_events.end() || !(*a)->timing || !(*b)->timing)
    return kInvalidHandle;  // as the driver answers for events without timing
  if ((*a)->pending || (*b)->pending) return kNotReady;
  *ms = std::chrono::duration<float, std::milli>((*b)->recorded - (*a)->recorded).count();
  return kSuccess;
}
CUresult cuEventQuery(void* event) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_events.find(static_cast<Event*>(event));
  if (it == g_events.end()) return kInvalidHandle;
  return (*it)->pending ? kNotReady : kSuccess;
}
CUresult cuEventSynchronize(void* event) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_events.find(static_cast<Event*>(event));
  if (it == g_events.end()) return kInvalidHandle;
  (*it)->pending = false;
  return kSuccess;
}
// Device-side ordering: nothing for the host to do, but the event must be one we made.
CUresult cuStreamWaitEvent(void*, void* event, unsigned int) {
  if (!has_context()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_events.count(static_cast<Event*>(event)) != 0 ? kSuccess : kInvalidHandle;
}
CUresult cuEventDestroy_v2(void* event) {
  if (g_deinitialized) return kDeinitialized;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_events.find(static_cast<Event*>(event));
  if (it == g_events.end()) return kInvalidHandle;
  delete *it;
  g_events.erase(it);
  return kSuccess;
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
  if (!has_context()) return kInvalidContext;
  if (stream == nullptr && g_capture_implicit) return kCaptureImplicit;
  *status = g_capture_status;
  return kSuccess;
}
int g_capture_mode = 0;
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  int previous = g_capture_mode;
  g_capture_mode = *mode;
  *mode = previous;
  return kSuccess;
}
// Used by bench/native/device_call_costs' memory check.
CUresult cuMemsetD8_v2(unsigned long long ptr, unsigned char value, std::size_t n) {
  if (!has_context()) return kInvalidContext;
  std::memset(reinterpret_cast<void*>(ptr), value, n);
  return kSuccess;
}
// The stand-in device does its work at once: the default stream is never busy after it.
CUresult cuMemsetD8Async(unsigned long long ptr, unsigned char value, std::size_t n, void*) {
  return cuMemsetD8_v2(ptr, value, n);
}
CUresult cuStreamQuery(void*) { return has_context() ? kSuccess : kInvalidContext; }
CUresult cuMemcpyDtoH_v2(void* dst, unsigned long long src, std::size_t n) {
  if (!has_context()) return kInvalidContext;
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return kSuccess;
}

}  // extern "C"
