// allocwatch's allocator as PyTorch's CUDA allocator, without the limits of the pluggable path.
//
// Built on the machine that runs it, against the torch installed there
// (allocator_ext/native_shim.py, through torch.utils.cpp_extension), because PyTorch's C++
// allocator interface changes between releases. The class derives from torch's own
// CUDAPluggableAllocator, which implements every method of that release's interface, and
// overrides only what the pluggable path cannot serve, or serves slowly:
//   allocate, raw_alloc, raw_alloc_with_stream, raw_delete  straight to the core: no pointer
//                                                            map under a lock, no std::function
//   getDeviceStats, resetPeakStats, resetAccumulatedStats   for C++ callers (memory_stats() and
//                                                            the functions built on it)
//   cacheInfo                                               cuDNN benchmark mode's workspace
// and raises PyTorch's OutOfMemoryError with the core's explanation.
// The pluggable hooks (record_stream, empty_cache, memory fraction, graph pools) are set exactly
// as the pluggable path sets them. The core is reached through the C ABI that
// allocator_ext/_core exports (torch_shim.cpp), looked up with dlsym in the library whose path
// install() is given, so this file never links against the core.
#include <dlfcn.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

using c10::cuda::MempoolId_t;
using Emit = void (*)(void*, const char*, std::int64_t);
// Named through the members' types: the namespaces of Stat and StatArray moved between torch
// releases, DeviceStats' fields and the pool order (all, small, large) did not.
using DeviceStats = c10::cuda::CUDACachingAllocator::DeviceStats;
using StatArray = decltype(DeviceStats::allocation);
using Stat = decltype(DeviceStats::oversize_allocations);
constexpr std::size_t kAll = 0, kSmallPool = 1, kLargePool = 2;

// The core's C ABI (torch_shim.cpp).
struct Core {
  void* (*malloc)(std::size_t, int, cudaStream_t) = nullptr;
  void* (*try_malloc)(std::size_t, int, cudaStream_t, char*, std::size_t) = nullptr;
  void (*free)(void*, std::size_t, int, cudaStream_t) = nullptr;
  void (*free_any)(void*) = nullptr;
  void (*init)(int) = nullptr;
  void (*empty_cache)() = nullptr;
  void (*memory_fraction)(double, int) = nullptr;
  void (*record_stream)(void*, cudaStream_t) = nullptr;
  void (*begin_pool)(int, MempoolId_t, std::function<bool(cudaStream_t)>) = nullptr;
  void (*end_pool)(int, MempoolId_t) = nullptr;
  void (*release_pool)(int, MempoolId_t) = nullptr;
  int (*stats)(int, Emit, void*) = nullptr;
  void (*reset_peak)(int) = nullptr;
  void (*reset_accumulated)(int) = nullptr;
  std::size_t (*largest_free_block)(int) = nullptr;
};

Core g_core;

template <typename F>
void resolve(void* library, const char* name, F& slot) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw std::runtime_error(std::string("allocwatch native shim: the core library lacks ") +
                             name + " (an older allocator_ext build?)");
  }
  slot = reinterpret_cast<F>(symbol);
}

void delete_any(void* ptr) {
  if (ptr != nullptr) g_core.free_any(ptr);
}

// The core's allocation, its out-of-memory explanation raised as PyTorch's OutOfMemoryError
// (torch.cuda.OutOfMemoryError in Python), which the pluggable path cannot do.
void* core_malloc(std::size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  char message[2048];
  void* ptr = g_core.try_malloc(size, device, stream, message, sizeof(message));
  TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, message);
  return ptr;
}

// memory_stats() keys ("allocated_bytes.small_pool.peak") into PyTorch's DeviceStats.
void fill(void* context, const char* key, std::int64_t value) {
  auto& stats = *static_cast<DeviceStats*>(context);
  std::string k(key);
  auto stat_field = [&](Stat& stat, const std::string& field) {
    if (field == "current") stat.current = value;
    else if (field == "peak") stat.peak = value;
    else if (field == "allocated") stat.allocated = value;
    else if (field == "freed") stat.freed = value;
  };
  const auto first = k.find('.');
  if (first == std::string::npos) {
    if (k == "num_alloc_retries") stats.num_alloc_retries = value;
    else if (k == "num_ooms") stats.num_ooms = value;
    else if (k == "num_sync_all_streams") stats.num_sync_all_streams = value;
    else if (k == "num_device_alloc") stats.num_device_alloc = value;
    else if (k == "num_device_free") stats.num_device_free = value;
    else if (k == "max_split_size") stats.max_split_size = value;
    return;
  }
  const std::string name = k.substr(0, first);
  const std::string rest = k.substr(first + 1);
  if (name == "oversize_allocations") return stat_field(stats.oversize_allocations, rest);
  if (name == "oversize_segments") return stat_field(stats.oversize_segments, rest);
  const auto second = rest.find('.');
  if (second == std::string::npos) return;
  const std::string pool = rest.substr(0, second);
  const std::string field = rest.substr(second + 1);
  std::size_t type = kAll;
  if (pool == "small_pool") type = kSmallPool;
  else if (pool == "large_pool") type = kLargePool;
  else if (pool != "all") return;
  StatArray* array = nullptr;
  if (name == "allocation") array = &stats.allocation;
  else if (name == "segment") array = &stats.segment;
  else if (name == "active") array = &stats.active;
  else if (name == "inactive_split") array = &stats.inactive_split;
  else if (name == "allocated_bytes") array = &stats.allocated_bytes;
  else if (name == "reserved_bytes") array = &stats.reserved_bytes;
  else if (name == "active_bytes") array = &stats.active_bytes;
  else if (name == "inactive_split_bytes") array = &stats.inactive_split_bytes;
  else if (name == "requested_bytes") array = &stats.requested_bytes;
  if (array != nullptr) stat_field((*array)[type], field);
}

class NativeAllocator : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  NativeAllocator()
      : CUDAPluggableAllocator(
            [](std::size_t size, int device, cudaStream_t stream) {
              return g_core.malloc(size, device, stream);
            },
            [](void* ptr, std::size_t size, int device, cudaStream_t stream) {
              g_core.free(ptr, size, device, stream);
            }) {
    set_init_fn([](int count) { g_core.init(count); });
    set_reset_fn([] { g_core.empty_cache(); });
    set_memory_fraction_fn([](double f, int device) { g_core.memory_fraction(f, device); });
    set_record_stream_fn([](void* ptr, cudaStream_t s) { g_core.record_stream(ptr, s); });
    set_begin_allocate_to_pool(
        [](int device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
          g_core.begin_pool(device, id, std::move(filter));
        });
    set_end_allocate_to_pool_fn([](int device, MempoolId_t id) { g_core.end_pool(device, id); });
    set_release_pool([](int device, MempoolId_t id) { g_core.release_pool(device, id); });
  }

  // The hot path: the current device and stream, then the core. The base class would also
  // record every pointer in a map under its mutex, and call through std::function.
  c10::DataPtr allocate(std::size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = size == 0
                    ? nullptr
                    : core_malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &delete_any, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_any; }
  void* raw_alloc(std::size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return core_malloc(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    if (ptr != nullptr) g_core.free_any(ptr);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceStats stats;
    g_core.stats(device, &fill, &stats);
    return stats;
  }
  void resetPeakStats(c10::DeviceIndex device) override { g_core.reset_peak(device); }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    g_core.reset_accumulated(device);
  }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    // As PyTorch's allocator: a zero guess starts from the device's free memory, then the
    // largest cached block raises it.
    if (*largest_block == 0) {
      std::size_t free = 0, total = 0;
      if (cudaMemGetInfo(&free, &total) == cudaSuccess) *largest_block = free;
    }
    *largest_block = std::max(*largest_block, g_core.largest_free_block(device));
  }
  std::string name() override { return "allocwatch"; }
};

std::shared_ptr<NativeAllocator> g_allocator;

// Makes allocwatch's core PyTorch's CUDA allocator; `core_library` is allocator_ext/_core's
// path. Refused (by torch) once CUDA is initialised, as any allocator change is.
void install(const std::string& core_library) {
  void* library = dlopen(core_library.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    throw std::runtime_error("allocwatch native shim: cannot load " + core_library + ": " +
                             dlerror());
  }
  Core core;
  resolve(library, "allocwatch_torch_malloc", core.malloc);
  resolve(library, "allocwatch_torch_try_malloc", core.try_malloc);
  resolve(library, "allocwatch_torch_free", core.free);
  resolve(library, "allocwatch_torch_free_any", core.free_any);
  resolve(library, "allocwatch_torch_init", core.init);
  resolve(library, "allocwatch_torch_empty_cache", core.empty_cache);
  resolve(library, "allocwatch_torch_memory_fraction", core.memory_fraction);
  resolve(library, "allocwatch_torch_record_stream", core.record_stream);
  resolve(library, "allocwatch_torch_begin_allocate_to_pool", core.begin_pool);
  resolve(library, "allocwatch_torch_end_allocate_to_pool", core.end_pool);
  resolve(library, "allocwatch_torch_release_pool", core.release_pool);
  resolve(library, "allocwatch_torch_stats", core.stats);
  resolve(library, "allocwatch_torch_reset_peak", core.reset_peak);
  resolve(library, "allocwatch_torch_reset_accumulated", core.reset_accumulated);
  resolve(library, "allocwatch_torch_largest_free_block", core.largest_free_block);
  g_core = core;
  g_allocator = std::make_shared<NativeAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(g_allocator);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "allocwatch's allocator as PyTorch's CUDA allocator, built against this torch";
  m.def("install", &install, pybind11::arg("core_library"));
}
