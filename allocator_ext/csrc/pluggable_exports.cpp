// The allocator as PyTorch's CUDA allocator, through torch.cuda.memory.CUDAPluggableAllocator.
//
// PyTorch loads this library by path and calls the exported functions below: allocation and
// free, and the hooks that make the pluggable path a complete allocator (without them
// record_stream and empty_cache silently do nothing, and graph capture fails). Nothing here
// includes a torch or CUDA header: PyTorch's callback types are spelled out with the same
// layout (a stream is a CUstream_st*, a pool id a pair of unsigned long long).
//
// Each call goes to the device's allocator of the process-wide registry (torch_allocators.h).
// Errors thrown from the allocation function reach Python as RuntimeError with their message
// (PyTorch converts them); a null pointer is never returned.
#include <cstddef>
#include <functional>
#include <utility>

#include "core/allocator.h"
#include "torch_allocators.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;
using MempoolId_t = std::pair<unsigned long long, unsigned long long>;

using namespace allocwatch;
using namespace allocwatch::torch_allocators;

namespace {

StreamId stream_id(cudaStream_t s) { return reinterpret_cast<StreamId>(s); }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* allocwatch_torch_malloc(std::size_t size, int device,
                                                                    cudaStream_t stream) {
  // OutOfMemoryError is a std::runtime_error: PyTorch turns it into a RuntimeError that
  // carries the allocator's explanation.
  return hot(device).malloc(size, stream_id(stream));
}

__attribute__((visibility("default"))) void allocwatch_torch_free(void* ptr, std::size_t /*size*/,
                                                                 int device,
                                                                 cudaStream_t /*stream*/) {
  hot(device).free(ptr);
}

__attribute__((visibility("default"))) void allocwatch_torch_init(int device_count) {
  ensure_devices(device_count);
}

// torch.cuda.empty_cache()
__attribute__((visibility("default"))) void allocwatch_torch_empty_cache() {
  for (auto& a : all())
    if (a) a->empty_cache();
}

// torch.cuda.set_per_process_memory_fraction(fraction, device)
__attribute__((visibility("default"))) void allocwatch_torch_memory_fraction(double fraction,
                                                                            int device) {
  auto a = get(device, true);
  a->set_memory_fraction(fraction);
}

// tensor.record_stream(stream): the block may not be reused before `stream`'s work is done.
__attribute__((visibility("default"))) void allocwatch_torch_record_stream(void* ptr,
                                                                          cudaStream_t stream) {
  for (auto& a : all()) {
    if (a && a->block_size(ptr) > 0) {
      a->record_stream(ptr, stream_id(stream));
      return;
    }
  }
}

// CUDA graph capture: allocations on the capturing stream(s) go to the graph's private pool.
__attribute__((visibility("default"))) void allocwatch_torch_begin_allocate_to_pool(
    int device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
  get(device, true)->begin_allocate_to_pool(
      id, [filter = std::move(filter)](StreamId s) {
        return filter(reinterpret_cast<cudaStream_t>(s));
      });
}

__attribute__((visibility("default"))) void allocwatch_torch_end_allocate_to_pool(int device,
                                                                                 MempoolId_t id) {
  get(device, true)->end_allocate_to_pool(id);
}

__attribute__((visibility("default"))) void allocwatch_torch_release_pool(int device,
                                                                         MempoolId_t id) {
  get(device, true)->release_pool(id);
}

}  // extern "C"
