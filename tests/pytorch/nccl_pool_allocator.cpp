// NCCL's memory behind torch.cuda.memory.CUDAPluggableAllocator's two functions, as vLLM and
// Megatron build theirs for a torch.cuda.MemPool that NCCL registers: for the GPU scenario
// nccl_mempool (tests/pytorch/gpu_scenarios.py) where ProcessGroupNCCL refuses its own
// mem_allocator (it asks for multicast, which a GPU without NVLink fabric lacks, though
// ncclMemAlloc serves there). It counts its calls and remembers its segments, so that the
// scenario tells them from the device's and sees each go back to NCCL.
//
// No C++ library beyond the compiler's headers: it is built with whatever g++ is at hand
// (tests/pytorch/nccl_pool_allocator.py) and loaded into torch's process.
#include <nccl.h>
#include <pthread.h>

#include <cstddef>

namespace {

struct Segment {
  void* ptr;
  std::size_t size;
  bool live;
};

constexpr int kMaxSegments = 1024;
pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
Segment g_segments[kMaxSegments];
int g_count = 0;
long long g_allocations = 0, g_frees = 0, g_live = 0;
const char* g_last_error = "";

struct Locked {
  Locked() { pthread_mutex_lock(&g_mutex); }
  ~Locked() { pthread_mutex_unlock(&g_mutex); }
};

Segment* find(void* ptr) {
  for (int i = g_count - 1; i >= 0; --i)
    if (g_segments[i].ptr == ptr) return &g_segments[i];
  return nullptr;
}

}  // namespace

#define NCCL_POOL_EXPORT extern "C" __attribute__((visibility("default")))

// On the current device, the one CUDAPluggableAllocator names (ncclMemAlloc allocates there).
// Null where NCCL fails: PyTorch reads a pool allocator's null as no room.
NCCL_POOL_EXPORT void* nccl_pool_alloc(std::size_t size, int device, cudaStream_t stream) {
  (void)device;
  (void)stream;
  void* ptr = nullptr;
  const ncclResult_t result = ncclMemAlloc(&ptr, size);
  Locked locked;
  if (result != ncclSuccess) {
    g_last_error = ncclGetErrorString(result);
    return nullptr;
  }
  ++g_allocations;
  ++g_live;
  if (g_count < kMaxSegments) g_segments[g_count++] = Segment{ptr, size, true};
  return ptr;
}

NCCL_POOL_EXPORT void nccl_pool_free(void* ptr, std::size_t size, int device,
                                     cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  const ncclResult_t result = ncclMemFree(ptr);
  Locked locked;
  if (result != ncclSuccess) {
    g_last_error = ncclGetErrorString(result);
    return;
  }
  ++g_frees;
  --g_live;
  if (Segment* s = find(ptr)) s->live = false;
}

// NCCL's version as ncclGetVersion gives it (2.19.3 is 21903), -1 where it fails.
NCCL_POOL_EXPORT int nccl_pool_version() {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : -1;
}

// 0: segments allocated, 1: freed, 2: live.
NCCL_POOL_EXPORT long long nccl_pool_calls(int what) {
  Locked locked;
  return what == 0 ? g_allocations : what == 1 ? g_frees : g_live;
}

// 1: `ptr` is a segment of this allocator, live; 0: one it freed; -1: not one of its own.
NCCL_POOL_EXPORT int nccl_pool_segment(void* ptr) {
  Locked locked;
  const Segment* s = find(ptr);
  return s == nullptr ? -1 : s->live ? 1 : 0;
}

// NCCL's words for the last failure ("" where none).
NCCL_POOL_EXPORT const char* nccl_pool_last_error() {
  Locked locked;
  return g_last_error;
}
