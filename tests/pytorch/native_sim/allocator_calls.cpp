// PyTorch's C++ allocator interface (c10::cuda::CUDACachingAllocator), as plain C functions for
// tests/pytorch/test_native_sim.py to call with ctypes: what torch.empty, raw_alloc, the memory
// fraction, private pools and the out-of-memory observers reach in the native back end. Built
// against the same torch as the back end; every C++ exception stops here, as a return code
// with its message.
#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/version.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

std::vector<c10::DataPtr> g_held;
std::vector<std::vector<long long>> g_oom_calls;

void copy(const std::string& text, char* out, std::size_t capacity) {
  if (capacity == 0) return;
  const std::size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// 0: done; 1: torch.cuda.OutOfMemoryError; 2: another c10::Error; 3: another exception.
template <typename F>
int call(F&& f, char* message, std::size_t capacity) {
  try {
    f();
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    copy(e.what_without_backtrace(), message, capacity);
    return 1;
  } catch (const c10::Error& e) {
    copy(e.what_without_backtrace(), message, capacity);
    return 2;
  } catch (const std::exception& e) {
    copy(e.what(), message, capacity);
    return 3;
  }
}

c10::MempoolId_t pool(unsigned long long first, unsigned long long second) {
  return {first, second};
}

#define AW_TORCH_AT_LEAST(minor) (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= (minor))

// An allocator of the user's for a torch.cuda.MemPool (what NCCL's mem_allocator or a
// CUDAPluggableAllocator is to PyTorch): a stand-in that hands out addresses from a range of
// its own, never touched, and counts its calls, so that a scenario tells its segments from the
// device's. PyTorch asks a pool's allocator for raw_alloc and raw_delete only: the rest of the
// interface refuses.
struct PoolAllocatorCalls {
  long long allocations = 0, frees = 0, live = 0, destroyed = 0;
  std::size_t last_size = 0;
  // Room for segments (0: no limit) and the bytes handed out, for scenarios that run it out.
  std::size_t room = 0, live_bytes = 0;
  // With reenter, each call first asks PyTorch's allocator for its statistics, and a free also
  // allocates and frees memory of its own through it, as an allocator written in Python may
  // (logging torch.cuda.memory_allocated(), working with a tensor).
  bool reenter = false;
  long long reentries = 0;
  std::vector<long long> allocated_seen;  // allocated_bytes.all.current, at each raw_alloc
};
PoolAllocatorCalls g_pool_calls;
constexpr std::uintptr_t kPoolRangeBase = std::uintptr_t{0x7a0000000000};
constexpr std::uintptr_t kPoolRangeSize = std::uintptr_t{1} << 40;

class PoolAllocator final : public cca::CUDAAllocator {
 public:
  ~PoolAllocator() override { ++g_pool_calls.destroyed; }
  void* raw_alloc(std::size_t nbytes) override {
    if (g_pool_calls.reenter) {
      g_pool_calls.allocated_seen.push_back(cca::getDeviceStats(0).allocated_bytes[0].current);
      ++g_pool_calls.reentries;
    }
    if (g_pool_calls.room != 0 && g_pool_calls.live_bytes + nbytes > g_pool_calls.room)
      return nullptr;  // no room, as PyTorch reads a pool allocator's null
    ++g_pool_calls.allocations;
    ++g_pool_calls.live;
    g_pool_calls.last_size = nbytes;
    g_pool_calls.live_bytes += nbytes;
    void* ptr = reinterpret_cast<void*>(next_);
    sizes_[ptr] = nbytes;
    next_ += (nbytes + (std::size_t{2} << 20) - 1) / (std::size_t{2} << 20) * (std::size_t{2} << 20);
    return ptr;
  }
  void raw_delete(void* ptr) override {
    TORCH_CHECK(owns(ptr), "the pool's allocator was asked to free ", ptr, ", not its own");
    if (g_pool_calls.reenter) {
      (void)cca::getDeviceStats(0);
      void* own = cca::raw_alloc(std::size_t{1} << 20);
      TORCH_CHECK(own != nullptr, "PyTorch's allocator gave the pool's allocator nothing");
      cca::raw_delete(own);
      ++g_pool_calls.reentries;
    }
    ++g_pool_calls.frees;
    --g_pool_calls.live;
    g_pool_calls.live_bytes -= sizes_.at(ptr);
    sizes_.erase(ptr);
  }
  static bool owns(const void* ptr) {
    const auto at = reinterpret_cast<std::uintptr_t>(ptr);
    return at >= kPoolRangeBase && at < kPoolRangeBase + kPoolRangeSize;
  }

  std::string name() override { return "pool_allocator_stand_in"; }
  c10::DataPtr allocate(std::size_t) override { refuse(); }
  void copy_data(void*, const void*, std::size_t) const override { refuse(); }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  cca::DeviceStats getDeviceStats(c10::DeviceIndex) override { refuse(); }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {}
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t) override {
    return raw_alloc(nbytes);
  }
  void init(int) override {}
  double getMemoryFraction(c10::DeviceIndex) override { return 1.0; }
  void setMemoryFraction(double, c10::DeviceIndex) override { refuse(); }
#if AW_TORCH_AT_LEAST(10)
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }
#endif
  void enable(bool) override {}
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex, std::size_t*) override { refuse(); }
  void* getBaseAllocation(void*, std::size_t*) override { refuse(); }
  void recordStream(const c10::DataPtr&, c10::cuda::CUDAStream) override { refuse(); }
  using cca::CUDAAllocator::recordStream;
#if AW_TORCH_AT_LEAST(11)
  cca::SnapshotInfo snapshot(c10::MempoolId_t, bool) override { refuse(); }
  void recordHistory(bool, cca::CreateContextFn, std::size_t, cca::RecordContext, bool,
                     const std::vector<std::string>&) override { refuse(); }
#else
  cca::SnapshotInfo snapshot(c10::MempoolId_t) override { refuse(); }
  void recordHistory(bool, cca::CreateContextFn, std::size_t, cca::RecordContext,
                     bool) override { refuse(); }
#endif
  void beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t,
                           std::function<bool(cudaStream_t)>) override { refuse(); }
  void endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) override { refuse(); }
  void releasePool(c10::DeviceIndex, c10::MempoolId_t) override { refuse(); }
  cca::ShareableHandle shareIpcHandle(void*) override { refuse(); }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { refuse(); }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver) override {}
#if AW_TORCH_AT_LEAST(12)
  void attachOomRejectionObserver(cca::OomRejectionObserver) override {}
#endif
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {}
  void enablePeerAccess(c10::DeviceIndex, c10::DeviceIndex) override { refuse(); }
  cudaError_t memcpyAsync(void*, int, const void*, int, std::size_t, cudaStream_t,
                          bool) override { refuse(); }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex,
                                                          c10::MempoolId_t) override { refuse(); }
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override { refuse(); }

 private:
  [[noreturn]] static void refuse() {
    TORCH_CHECK(false, "the pool allocator stand-in serves raw_alloc and raw_delete only");
  }
  std::uintptr_t next_ = kPoolRangeBase;
  std::map<void*, std::size_t> sizes_;
};

// The stand-in as the test holds it (torch.cuda.memory.CUDAPluggableAllocator's object):
// dropped by aw_pool_allocator_drop, after which only the pools that use it keep it alive.
std::shared_ptr<PoolAllocator> g_pool_allocator;

}  // namespace

extern "C" {

int aw_init(int devices, char* message, std::size_t capacity) {
  return call([&] { cca::init(devices); }, message, capacity);
}

const char* aw_name() {
  static std::string name;
  name = cca::get()->name();
  return name.c_str();
}

// torch.empty's path: the allocator c10 hands out for CUDA.
int aw_alloc(std::size_t bytes, char* message, std::size_t capacity) {
  return call([&] { g_held.push_back(c10::GetAllocator(c10::kCUDA)->allocate(bytes)); }, message,
              capacity);
}

void aw_free_all() { g_held.clear(); }

int aw_empty_cache(char* message, std::size_t capacity) {
  return call([&] { cca::emptyCache(); }, message, capacity);
}

// The allocations held, by index (the last: aw_held() - 1).
int aw_held() { return static_cast<int>(g_held.size()); }
std::uintptr_t aw_address(int index) { return reinterpret_cast<std::uintptr_t>(g_held.at(index).get()); }
void aw_free(int index) { g_held.at(index).clear(); }

// torch.cuda.stream(s): the stream the next allocations are made on (0: the default stream).
void aw_use_stream(long stream) {
  c10::cuda::setCurrentCUDAStream(
      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(stream), 0));
}

// tensor.record_stream(s)
int aw_record_stream(int index, long stream, char* message, std::size_t capacity) {
  return call([&] {
    cca::recordStream(g_held.at(index),
                      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(stream), 0));
  }, message, capacity);
}

// torch.cuda.memory._set_allocator_settings(text)
int aw_settings(const char* text, char* message, std::size_t capacity) {
  return call([&] { c10::CachingAllocator::setAllocatorSettings(text); }, message, capacity);
}

// What torch.cuda.memory._set_allocator_settings calls in every release: on 2.9 PyTorch's
// CUDA parser alone, later the accelerator parser and the back end's hook.
int aw_cuda_settings(const char* text, char* message, std::size_t capacity) {
  return call([&] { cca::setAllocatorSettings(text); }, message, capacity);
}

int aw_torch_minor() { return TORCH_VERSION_MINOR; }

// What PyTorch's CUDA parser now holds.
std::size_t aw_pytorch_max_split_size() { return cca::CUDAAllocatorConfig::max_split_size(); }

int aw_raw_alloc(std::size_t bytes, void** out, char* message, std::size_t capacity) {
  return call([&] { *out = cca::raw_alloc(bytes); }, message, capacity);
}

int aw_raw_delete(void* ptr, char* message, std::size_t capacity) {
  return call([&] { cca::raw_delete(ptr); }, message, capacity);
}

long long aw_stat(const char* name) {
  const cca::DeviceStats s = cca::getDeviceStats(0);
  const std::string key = name;
  if (key == "num_ooms") return s.num_ooms;
  if (key == "allocated_bytes.all.current") return s.allocated_bytes[0].current;
  if (key == "requested_bytes.all.allocated") return s.requested_bytes[0].allocated;
  if (key == "segment.all.current") return s.segment[0].current;
  if (key == "active_bytes.all.allocated") return s.active_bytes[0].allocated;
  if (key == "reserved_bytes.all.current") return s.reserved_bytes[0].current;
  if (key == "num_alloc_retries") return s.num_alloc_retries;
  return -1;
}

// The keys PyTorch's settings parser accepts (its own and those registered with it), joined
// by ','.
int aw_config_keys(char* out, std::size_t capacity) {
  std::string keys;
  for (const std::string& key : c10::CachingAllocator::AcceleratorAllocatorConfig::getKeys())
    keys += (keys.empty() ? "" : ",") + key;
  copy(keys, out, capacity);
  return static_cast<int>(keys.size());
}

int aw_set_fraction(double fraction, char* message, std::size_t capacity) {
  return call([&] { cca::setMemoryFraction(fraction, 0); }, message, capacity);
}

void aw_attach_oom_observer() {
  cca::attachOutOfMemoryObserver([](int64_t device, size_t allocated, size_t total, size_t free) {
    g_oom_calls.push_back({static_cast<long long>(device), static_cast<long long>(allocated),
                           static_cast<long long>(total), static_cast<long long>(free)});
  });
}

int aw_oom_calls() { return static_cast<int>(g_oom_calls.size()); }
long long aw_oom_call(int call_index, int field) { return g_oom_calls.at(call_index).at(field); }

// A private pool as CUDA graphs and torch.cuda.use_mem_pool use one: this thread's
// allocations go to it until aw_end_pool.
int aw_begin_pool(unsigned long long first, unsigned long long second, char* message,
                  std::size_t capacity) {
  return call([&] { cca::beginAllocateToPool(0, pool(first, second), [](cudaStream_t) {
                      return true;
                    }); },
              message, capacity);
}

int aw_end_pool(unsigned long long first, unsigned long long second, char* message,
                std::size_t capacity) {
  return call([&] {
    cca::endAllocateToPool(0, pool(first, second));
    cca::releasePool(0, pool(first, second));
  }, message, capacity);
}

// The pool's segments as torch.cuda.memory_snapshot(pool) counts them; `expandable` gets how
// many of them are expandable.
int aw_pool_segments(unsigned long long first, unsigned long long second, int* expandable) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 11
  const cca::SnapshotInfo info = cca::get()->snapshot(pool(first, second), false);
#else
  const cca::SnapshotInfo info = cca::get()->snapshot(pool(first, second));
#endif
  *expandable = static_cast<int>(std::count_if(info.segments.begin(), info.segments.end(),
                                               [](const cca::SegmentInfo& s) {
                                                 return s.is_expandable;
                                               }));
  return static_cast<int>(info.segments.size());
}

// torch.cuda.MemPool(allocator, use_on_oom=..., no_split=...): what at::cuda::MemPool's
// constructor asks of the allocator on the current device.
int aw_mempool_create(unsigned long long first, unsigned long long second, int with_allocator,
                      int use_on_oom, int no_split, char* message, std::size_t capacity) {
  return call([&] {
    if (with_allocator && !g_pool_allocator) g_pool_allocator = std::make_shared<PoolAllocator>();
#if AW_TORCH_AT_LEAST(11)
    std::shared_ptr<cca::CUDAAllocator> allocator;
    if (with_allocator) allocator = g_pool_allocator;
    cca::get()->createOrIncrefPool(0, pool(first, second), allocator);
    if (use_on_oom) cca::get()->setUseOnOOM(0, pool(first, second), true);
#else
    cca::get()->createOrIncrefPool(0, pool(first, second),
                                   with_allocator ? g_pool_allocator.get() : nullptr);
    if (use_on_oom) cca::get()->setUseOnOOM(0, pool(first, second));
#endif
#if AW_TORCH_AT_LEAST(10)
    if (no_split) cca::get()->setNoSplit(0, pool(first, second));
#else
    TORCH_CHECK(!no_split, "torch 2.9's MemPool has no no_split");
#endif
  }, message, capacity);
}

// What at::cuda::MemPool's destructor asks of the allocator.
int aw_mempool_destroy(unsigned long long first, unsigned long long second, char* message,
                       std::size_t capacity) {
  return call([&] {
#if AW_TORCH_AT_LEAST(11)
    cca::get()->setUseOnOOM(0, pool(first, second), false);
#endif
    cca::get()->releasePool(0, pool(first, second));
    cca::get()->emptyCache(pool(first, second));
  }, message, capacity);
}

// The test drops its own reference to the pool allocator, as `del allocator` does in Python.
void aw_pool_allocator_drop() { g_pool_allocator.reset(); }

// 0: allocations, 1: frees, 2: live segments, 3: destroyed, 4: the last segment's size,
// 5: calls that reached back into PyTorch's allocator, 6: bytes handed out.
long long aw_pool_allocator_calls(int what) {
  switch (what) {
    case 0: return g_pool_calls.allocations;
    case 1: return g_pool_calls.frees;
    case 2: return g_pool_calls.live;
    case 3: return g_pool_calls.destroyed;
    case 5: return g_pool_calls.reentries;
    case 6: return static_cast<long long>(g_pool_calls.live_bytes);
    default: return static_cast<long long>(g_pool_calls.last_size);
  }
}

// The pool's allocator reaches back into PyTorch's in each call (PoolAllocatorCalls::reenter).
void aw_pool_allocator_reenter(int on) { g_pool_calls.reenter = on != 0; }

// The most the pool's allocator hands out at once (0: no limit).
void aw_pool_allocator_room(std::size_t bytes) { g_pool_calls.room = bytes; }

// allocated_bytes.all.current as PyTorch's allocator told the pool's allocator in its
// raw_alloc calls, in order; -1 past the last.
long long aw_pool_allocator_seen(int index) {
  return index < static_cast<int>(g_pool_calls.allocated_seen.size())
             ? g_pool_calls.allocated_seen[index]
             : -1;
}

int aw_pool_allocator_owns(std::size_t address) {
  return PoolAllocator::owns(reinterpret_cast<const void*>(address)) ? 1 : 0;
}

}  // extern "C"
