// allocwatch's allocator as PyTorch's CUDA allocator: an implementation of every virtual
// function of c10::cuda::CUDACachingAllocator::CUDAAllocator, installed as PyTorch installs its
// own (allocator.store and SetAllocator(kCUDA)), so that every caller, C++ and Python, reaches
// allocwatch's core: torch.cuda.memory.*, torch.accelerator.*, cuDNN's benchmark mode, NCCL,
// CUDA graphs and torch.compile's graph trees, MemPool, memory history and snapshots, IPC.
//
// Built on the machine that runs it, against the torch installed there (allocator_ext/native/
// build.py: plain g++, torch's headers and the CUDA runtime headers), because PyTorch's
// interface changes between releases: one source serves every release of
// allocator_ext/native/releases.py, each difference under ALLOCWATCH_TORCH_AT_LEAST (see
// "Differences between releases"; docs/torch.md's version table lists them).
// The core is reached through the one interface it exports for this (csrc/native_core.h), in
// the core library whose path install() is given: this library never links against it.
// Beside this file, PyTorch's interface: capture_graphs.* (walking CUDA graphs under capture)
// and ipc.* (sharing tensors with other processes).
#include <dlfcn.h>

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/api/include/torch/version.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "capture_graphs.h"
#include "core_link.h"
#include "ipc.h"

// --- Differences between releases -------------------------------------------------------------
// Each function whose declaration differs between releases is defined for the releases that
// declare it so, with `override`: a release whose interface moved again fails to build, saying
// which function, rather than leaving PyTorch calling its own default. The differences:
//   2.10: getExpandableSegmentSizes, setNoSplit, set/getUserMetadata; TraceEntry carries the
//         user's metadata;
//   2.11: snapshot(pool, include_traces), createOrIncrefPool takes a shared_ptr to the pool's
//         allocator (a raw pointer before), setUseOnOOM(device, pool, bool) (no bool before),
//         recordHistory's skip_actions;
//   2.12: getContextForPointer, attachOomRejectionObserver;
//   2.14: supportsUserMetadata (false unless overridden); its headers need C++20 (build.py);
//   2.15: none (TraceEntry gains internal_metadata_, left empty).
#define ALLOCWATCH_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#if !ALLOCWATCH_TORCH_AT_LEAST(2, 9)
#error "allocwatch's native back end serves torch 2.9 and later (allocator_ext/native/releases.py)"
#endif

namespace allocwatch::native_backend {
core::NativeCore* g_core = nullptr;
}  // namespace allocwatch::native_backend

namespace {

using namespace allocwatch::native_backend;
namespace cca = c10::cuda::CUDACachingAllocator;
using DeviceStats = cca::DeviceStats;
// Named through members' types: their namespaces moved between releases.
using StatArray = decltype(DeviceStats::allocation);
using Stat = decltype(DeviceStats::oversize_allocations);
using TorchSegment = cca::SegmentInfo;
using TorchBlock = cca::BlockInfo;
using TorchTrace = cca::TraceEntry;
using SnapshotInfo = cca::SnapshotInfo;
using Annotation = decltype(SnapshotInfo::external_annotations)::value_type;
using RecordContext = cca::RecordContext;
using CreateContextFn = cca::CreateContextFn;
using c10::MempoolId_t;

const allocwatch::ContextHandle kNoContext;

allocwatch::StreamId stream_id(cudaStream_t s) { return reinterpret_cast<allocwatch::StreamId>(s); }
allocwatch::MempoolId pool_id(const MempoolId_t& id) { return {id.first, id.second}; }

// PyTorch's size format (its own is not exported by every release).
std::string format_size(std::uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return buf;
}

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What a trace entry of the history carries for PyTorch: the call's stack (when the history
// records stacks for entries), the compile context and the user's metadata.
const char kCallContextTag = 0;
struct CallContext : allocwatch::TraceContext {
  CallContext() : allocwatch::TraceContext(&kCallContextTag) {}
  std::shared_ptr<c10::GatheredContext> stack;
  std::string compile_context;
  std::string user_metadata;
};

const CallContext* call_context(const allocwatch::ContextHandle& handle) {
  if (!handle || handle->owner != &kCallContextTag) return nullptr;
  return static_cast<const CallContext*>(handle.get());
}

TorchTrace::Action torch_action(allocwatch::TraceAction a) {
  switch (a) {
    case allocwatch::TraceAction::alloc: return TorchTrace::ALLOC;
    case allocwatch::TraceAction::free_requested: return TorchTrace::FREE_REQUESTED;
    case allocwatch::TraceAction::free_completed: return TorchTrace::FREE_COMPLETED;
    case allocwatch::TraceAction::segment_alloc: return TorchTrace::SEGMENT_ALLOC;
    case allocwatch::TraceAction::segment_free: return TorchTrace::SEGMENT_FREE;
    case allocwatch::TraceAction::segment_map: return TorchTrace::SEGMENT_MAP;
    case allocwatch::TraceAction::segment_unmap: return TorchTrace::SEGMENT_UNMAP;
    case allocwatch::TraceAction::snapshot: return TorchTrace::SNAPSHOT;
    case allocwatch::TraceAction::oom: return TorchTrace::OOM;
  }
  return TorchTrace::SNAPSHOT;
}

TorchTrace torch_trace(int device, const allocwatch::TraceEntry& e) {
  const CallContext* c = call_context(e.context);
  TorchTrace t(torch_action(e.action), static_cast<c10::DeviceIndex>(device), e.addr, e.size,
               reinterpret_cast<cudaStream_t>(e.stream), MempoolId_t{0, 0},
               c10::getApproximateTime(), c ? c->stack : nullptr,
               c && !c->compile_context.empty() ? c->compile_context : std::string("N/A")
#if ALLOCWATCH_TORCH_AT_LEAST(2, 10)
               , c ? c->user_metadata : std::string()
#endif
  );
  // Snapshots report microseconds since the epoch here (PyTorch converts its clock likewise).
  t.time_.t_ = static_cast<time_t>(e.time_us);
  return t;
}

// memory_stats() keys ("allocated_bytes.small_pool.peak") into PyTorch's DeviceStats.
void fill_stat(Stat& stat, const std::string& field, std::int64_t value) {
  if (field == "current") stat.current = value;
  else if (field == "peak") stat.peak = value;
  else if (field == "allocated") stat.allocated = value;
  else if (field == "freed") stat.freed = value;
}

StatArray* stat_array(DeviceStats& stats, const std::string& name) {
  if (name == "allocation") return &stats.allocation;
  if (name == "segment") return &stats.segment;
  if (name == "active") return &stats.active;
  if (name == "inactive_split") return &stats.inactive_split;
  if (name == "allocated_bytes") return &stats.allocated_bytes;
  if (name == "reserved_bytes") return &stats.reserved_bytes;
  if (name == "active_bytes") return &stats.active_bytes;
  if (name == "inactive_split_bytes") return &stats.inactive_split_bytes;
  if (name == "requested_bytes") return &stats.requested_bytes;
  return nullptr;
}

DeviceStats torch_stats(const std::map<std::string, std::int64_t>& flat) {
  DeviceStats stats;
  for (const auto& [key, value] : flat) {
    const auto first = key.find('.');
    if (first == std::string::npos) {
      if (key == "num_alloc_retries") stats.num_alloc_retries = value;
      else if (key == "num_ooms") stats.num_ooms = value;
      else if (key == "num_sync_all_streams") stats.num_sync_all_streams = value;
      else if (key == "num_device_alloc") stats.num_device_alloc = value;
      else if (key == "num_device_free") stats.num_device_free = value;
      else if (key == "max_split_size") stats.max_split_size = value;
      continue;
    }
    const std::string name = key.substr(0, first), rest = key.substr(first + 1);
    if (name == "oversize_allocations") {
      fill_stat(stats.oversize_allocations, rest, value);
      continue;
    }
    if (name == "oversize_segments") {
      fill_stat(stats.oversize_segments, rest, value);
      continue;
    }
    const auto second = rest.find('.');
    StatArray* array = stat_array(stats, name);
    if (array == nullptr || second == std::string::npos) continue;
    const std::string pool = rest.substr(0, second);
    const std::size_t index = pool == "all" ? 0 : pool == "small_pool" ? 1 : pool == "large_pool" ? 2 : 3;
    if (index < 3) fill_stat((*array)[index], rest.substr(second + 1), value);
  }
  return stats;
}

// A private pool's layout for CUDA graph trees (the core's checkpoint), and the stacks of its
// allocated blocks, which a restore gives back to the blocks it carves again.
struct PoolState : cca::AllocatorState {
  int device = 0;
  allocwatch::PoolCheckpoint checkpoint;
  std::unordered_map<std::uintptr_t, std::shared_ptr<c10::GatheredContext>> stacks;
};

std::shared_ptr<TorchCaptureGraphs> g_capture_graphs;

// The segments of a torch.cuda.MemPool made with an allocator of its own, from that allocator,
// asked as PyTorch's allocator asks it (raw_alloc, raw_delete). Held by the pool while it has
// segments, which keeps the allocator alive after its user dropped it (PyTorch's
// test_tensor_delete_after_allocator_delete).
class UserAllocatorSegments final : public core::PoolSegments {
 public:
  explicit UserAllocatorSegments(std::shared_ptr<cca::CUDAAllocator> allocator)
      : allocator_(std::move(allocator)) {}

  void* allocate(std::size_t size, core::Failure* failure) override {
    try {
      return allocator_->raw_alloc(size);  // null: no room, as PyTorch reads it
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    } catch (const std::exception& e) {
      failure->set(core::Failure::other, e.what());
      return nullptr;
    }
  }

  void release(void* ptr, std::size_t) override {
    try {
      allocator_->raw_delete(ptr);
    } catch (const std::exception& e) {  // nothing may cross into the core: said, not thrown
      TORCH_WARN("allocwatch: the allocator of a torch.cuda.MemPool (", allocator_->name(),
                 ") failed to free a segment at ", ptr, ": ", e.what());
    }
  }

 private:
  std::shared_ptr<cca::CUDAAllocator> allocator_;
};

void delete_block(void* ptr);
void delete_uncached(void* ptr);

class AllocwatchAllocator final : public cca::CUDAAllocator {
 public:
  // --- c10::Allocator --------------------------------------------------------------------------
  c10::DataPtr allocate(std::size_t size) override {
    constexpr std::size_t kOneExaByte = 1152921504606846976ULL;
    TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    if (C10_UNLIKELY(uncached())) {
      void* ptr = size == 0 ? nullptr : uncached_malloc(size);
      return {ptr, ptr, &delete_uncached, c10::Device(c10::DeviceType::CUDA, device)};
    }
    void* ptr = size == 0 ? nullptr
                          : malloc(device, size, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return force_uncached() ? &delete_uncached : &delete_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- c10::DeviceAllocator --------------------------------------------------------------------
  bool initialized() override { return device_count_.load() > 0; }

  void emptyCache(MempoolId_t mempool_id) override {
    core::Failure failure;
    g_core->empty_cache(pool_id(mempool_id), gather(RecordContext::ALL).trace, &failure);
    check(failure);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    assert_valid_device(device);
    std::map<std::string, std::int64_t> flat;
    if (!g_core->stats(device, &flat)) return DeviceStats{};
    return torch_stats(flat);
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    assert_valid_device(device);
    g_core->reset_accumulated(device);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    assert_valid_device(device);
    g_core->reset_peak(device);
  }

  // --- CUDAAllocator: allocation ---------------------------------------------------------------
  void* raw_alloc(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return raw_malloc(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return raw_malloc(device, nbytes, stream);
  }

  void raw_delete(void* ptr) override { free(ptr); }

  void init(int device_count) override {
    int known = device_count_.load();
    while (known < device_count && !device_count_.compare_exchange_weak(known, device_count)) {
    }
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    assert_valid_device(device);
    std::lock_guard<std::mutex> lock(settings_mutex_);
    auto it = fractions_.find(device);
    if (it != fractions_.end()) return it->second;
    return default_fraction_ >= 0 ? default_fraction_ : 1.0;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    assert_valid_device(device);
    TORCH_CHECK_VALUE(0 <= fraction && fraction <= 1, "invalid fraction: ", fraction,
                      ". Please set within [0, 1].");
    core::Failure failure;
    g_core->set_memory_fraction(device, fraction, &failure);
    check(failure);
    std::lock_guard<std::mutex> lock(settings_mutex_);
    fractions_[device] = fraction;
  }

#if ALLOCWATCH_TORCH_AT_LEAST(2, 10)
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    std::map<std::pair<allocwatch::StreamId, bool>, std::size_t> sizes;
    for (const allocwatch::SegmentInfo& s : g_core->snapshot(device))
      if (s.is_expandable) sizes[{s.stream, !s.is_large}] += s.total_size;
    std::vector<cca::StreamSegmentSize> out;
    for (const auto& [key, size] : sizes)
      out.emplace_back(reinterpret_cast<cudaStream_t>(key.first), key.second, size);
    return out;
  }
#endif

  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  // cuDNN's benchmark mode sizes its workspaces with this, for every convolution it plans. As
  // PyTorch's: a zero guess starts from the device's free memory, then the largest cached block
  // raises it. PyTorch asks the driver for the free memory every time; allocwatch's core at most
  // every kDeviceFreeFreshFor, counting its own mapping in between
  // (CachingAllocator::workspace_room).
  // Before the device has an allocator, the driver is asked.
  void cacheInfo(c10::DeviceIndex device, std::size_t* largestBlock) override {
    if (*largestBlock == 0 &&
        g_core->workspace_room(device, kDeviceFreeFreshFor.count(), largestBlock)) {
      return;
    }
    if (*largestBlock == 0) {
      c10::cuda::CUDAGuard guard(device);
      std::size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largestBlock, &total));
    }
    *largestBlock = std::max(*largestBlock, g_core->largest_free_block(device));
  }

  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    const allocwatch::SegmentSpan span = g_core->segment_of(ptr);
    TORCH_CHECK(span.size > 0, "invalid device pointer: ", ptr);
    if (size != nullptr) *size = span.size;
    return reinterpret_cast<void*>(span.base);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Empty tensors have no block; tensors received from another process (CUDA IPC) or
    // allocated without the cache are not this allocator's blocks.
    if (!ptr.get() || ptr.get_deleter() != &delete_block) return;
    core::Failure failure;
    g_core->record_stream(ptr.device().index(), ptr.get(), stream_id(stream.stream()), &failure);
    check(failure);
  }
  using cca::CUDAAllocator::recordStream;

  // --- snapshots -------------------------------------------------------------------------------
#if ALLOCWATCH_TORCH_AT_LEAST(2, 11)
  SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    return make_snapshot(mempool_id, include_traces);
  }
#else
  SnapshotInfo snapshot(MempoolId_t mempool_id) override { return make_snapshot(mempool_id, true); }
#endif

  // --- private pools: CUDA graphs and torch.cuda.MemPool ---------------------------------------
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    core::Failure failure;
    g_core->begin_allocate_to_pool(
        device, pool_id(mempool_id),
        [filter = std::move(filter)](allocwatch::StreamId s) {
          return filter(reinterpret_cast<cudaStream_t>(s));
        },
        &failure);
    check(failure);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    core::Failure failure;
    g_core->end_allocate_to_pool(device, pool_id(mempool_id), &failure);
    g_capture_graphs->forget_ended();
    check(failure);
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    core::Failure failure;
    g_core->release_pool(device, pool_id(mempool_id), &failure);
    check(failure);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    return g_core->pool_use_count(device, pool_id(mempool_id));
  }

#if ALLOCWATCH_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    create_or_incref_pool(device, mempool_id, std::move(allocator));
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    set_use_on_oom(device, mempool_id, use_on_oom);
  }
#else
  // These releases hand the pool's allocator over as a plain pointer: it lives as long as its
  // owner keeps it, as in PyTorch's own allocator.
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          cca::CUDAAllocator* allocator) override {
    create_or_incref_pool(device, mempool_id,
                          std::shared_ptr<cca::CUDAAllocator>(allocator, [](cca::CUDAAllocator*) {}));
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    set_use_on_oom(device, mempool_id, true);
  }
#endif

#if ALLOCWATCH_TORCH_AT_LEAST(2, 10)
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    core::Failure failure;
    g_core->set_pool_no_split(device, pool_id(mempool_id), &failure);
    check(failure);
  }
#endif

  // A pool with an allocator of its own (not this one) takes its segments from it.
  void create_or_incref_pool(c10::DeviceIndex device, MempoolId_t mempool_id,
                             std::shared_ptr<cca::CUDAAllocator> allocator) {
    std::shared_ptr<core::PoolSegments> segments;
    if (allocator != nullptr && allocator.get() != this)
      segments = std::make_shared<UserAllocatorSegments>(std::move(allocator));
    core::Failure failure;
    g_core->create_or_incref_pool(device, pool_id(mempool_id), std::move(segments), &failure);
    check(failure);
  }

  void set_use_on_oom(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) {
    core::Failure failure;
    g_core->set_pool_use_on_oom(device, pool_id(mempool_id), use_on_oom, &failure);
    check(failure);
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<std::uintptr_t> pointers;
    pointers.reserve(expected.size());
    for (void* p : expected) pointers.push_back(reinterpret_cast<std::uintptr_t>(p));
    core::Failure failure;
    const bool same = g_core->check_pool_live_allocations(device, pool_id(mempool_id), pointers,
                                                          &failure);
    check(failure);
    return same;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    auto state = std::make_shared<PoolState>();
    state->device = device;
    core::Failure failure;
    state->checkpoint = g_core->checkpoint_pool(device, pool_id(id), &failure);
    check(failure);
    if (any_stacks_.load()) {
      std::lock_guard<std::mutex> lock(stacks_mutex_);
      for (const auto& segment : state->checkpoint.segments) {
        for (const auto& block : segment.blocks) {
          auto it = stacks_.find(reinterpret_cast<void*>(block.ptr));
          if (block.allocated && it != stacks_.end()) state->stacks[block.ptr] = it->second;
        }
      }
    }
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(state != nullptr, "allocwatch: expected a checkpoint taken by allocwatch's allocator");
    TORCH_CHECK(state->device == device, "allocwatch: the checkpoint is of device ", state->device,
                ", not ", static_cast<int>(device));
    core::Failure failure;
    const allocwatch::CheckpointRestore restored =
        g_core->restore_pool(device, state->checkpoint, gather(RecordContext::ALL).trace, &failure);
    check(failure);
    cca::CheckpointDelta delta;
    for (std::uintptr_t p : restored.freed) {
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
      forget_stack(reinterpret_cast<void*>(p));
    }
    for (const auto& [p, size] : restored.allocated) {
      void* ptr = reinterpret_cast<void*>(p);
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &delete_block,
                                         c10::Device(c10::DeviceType::CUDA, device));
      auto it = state->stacks.find(p);
      if (it != state->stacks.end()) remember_stack(ptr, it->second);
    }
    return delta;
  }

  // --- CUDA IPC (ipc.h) ------------------------------------------------------------------------
  cca::ShareableHandle shareIpcHandle(void* ptr) override { return ipc_.share(ptr); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return ipc_.open(handle); }

  // --- memory history --------------------------------------------------------------------------
  bool isHistoryEnabled() override { return history_enabled_.load(); }

#if ALLOCWATCH_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory,
                   skip_actions);
  }
#else
  void recordHistory(bool enabled, CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, RecordContext when,
                     bool clearHistory) override {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory, {});
  }
#endif

  void record_history(bool enabled, CreateContextFn context_recorder,
                      std::size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                      const std::vector<std::string>& skip_actions) {
    TORCH_CHECK(when == RecordContext::NEVER || context_recorder != nullptr,
                "recording stacks needs a context recorder");
    std::uint32_t skipped = 0;
    for (const std::string& name : skip_actions) {
      allocwatch::TraceAction action;
      TORCH_CHECK_VALUE(allocwatch::trace_action_from_name(name, &action),
                        "unknown trace action to skip: ", name);
      skipped |= allocwatch::trace_action_bit(action);
    }
    recorder_.store(enabled ? context_recorder : nullptr);
    level_.store(static_cast<int>(enabled ? when : RecordContext::NEVER));
    history_enabled_.store(enabled);
    refresh_history_flag();
    g_core->record_history(enabled, alloc_trace_max_entries, clearHistory || !enabled, skipped);
    if (!enabled || clearHistory) {
      std::lock_guard<std::mutex> lock(metadata_mutex_);
      annotations_.clear();
    }
  }

#if ALLOCWATCH_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    std::lock_guard<std::mutex> lock(stacks_mutex_);
    auto it = stacks_.find(const_cast<void*>(ptr));
    return it == stacks_.end() ? nullptr : it->second;
  }
#endif

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_enabled_.load()) return;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    Annotation annotation(device, c10::getApproximateTime());
    annotation.time_.t_ = static_cast<time_t>(now_us());
    for (const auto& [name, value] : md) annotation.recordUserMetadata(name, value);
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    annotations_.push_back(std::move(annotation));
  }

  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    compile_contexts_.push_back(md);
    refresh_history_flag_locked();
  }

  void popCompileContext() override {
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    if (!compile_contexts_.empty()) compile_contexts_.pop_back();
    refresh_history_flag_locked();
  }

#if ALLOCWATCH_TORCH_AT_LEAST(2, 14)
  bool supportsUserMetadata() override { return true; }
#endif
#if ALLOCWATCH_TORCH_AT_LEAST(2, 10)
  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    user_metadata_ = metadata;
    refresh_history_flag_locked();
  }

  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    return user_metadata_;
  }
#endif

  // --- observers -------------------------------------------------------------------------------
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  // allocwatch rejects no allocation in advance (PyTorch's throw_on_cudamalloc_oom): these
  // observers are kept, and never called.
#if ALLOCWATCH_TORCH_AT_LEAST(2, 12)
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif

  // NCCL registers segments with these. Called under the device allocator's lock, as PyTorch
  // calls them.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    g_core->add_trace_observer([tracker = std::move(tracker)](int device,
                                                               const allocwatch::TraceEntry& e) {
      tracker(torch_trace(device, e));
    });
  }

  // --- several devices -------------------------------------------------------------------------
  // Peer access for memory from cudaMalloc. Pages of expandable segments are mapped for their
  // own device only: copies between devices go through cudaMemcpyPeerAsync (memcpyAsync).
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          std::size_t count, cudaStream_t stream, bool /*p2p_enabled*/) override {
    if (dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  // PyTorch's own code (its settings parser, segmented graph capture) asks for the native
  // caching allocator by this name; allocwatch serves that interface in full.
  std::string name() override { return "native"; }

  // --- the allocation path, for allocate() and raw_alloc() and the deleters --------------------
  void* malloc(c10::DeviceIndex device, std::size_t size, cudaStream_t stream) {
    core::OutOfMemory oom;
    core::Failure failure;
    void* ptr = nullptr;
    if (C10_LIKELY(!history_on_.load(std::memory_order_relaxed))) {
      ptr = g_core->malloc(device, size, stream_id(stream), kNoContext, &oom, &failure);
    } else {
      Gathered gathered = gather(RecordContext::ALLOC, RecordContext::STATE);
      ptr = g_core->malloc(device, size, stream_id(stream), gathered.trace, &oom, &failure);
      if (ptr != nullptr && gathered.stack) remember_stack(ptr, std::move(gathered.stack));
    }
    if (C10_UNLIKELY(ptr == nullptr)) {
      check(failure);
      raise_out_of_memory(device, size, oom);
    }
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(ptr, device, size, true);
    return ptr;
  }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    if (C10_UNLIKELY(any_uncached_.load(std::memory_order_relaxed)) && uncached_free(ptr)) return;
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      const auto [device, size] = g_core->block_of(ptr);
      if (device >= 0) report_to_profiler(ptr, static_cast<c10::DeviceIndex>(device), size, false);
    }
    core::Failure failure;
    bool freed = false;
    if (C10_LIKELY(!history_on_.load(std::memory_order_relaxed))) {
      freed = g_core->free(ptr, kNoContext, &failure);
    } else {
      freed = g_core->free(ptr, gather(RecordContext::ALL).trace, &failure);
    }
    if (C10_UNLIKELY(any_stacks_.load(std::memory_order_relaxed))) forget_stack(ptr);
    check(failure);
    TORCH_CHECK(freed, "invalid device pointer: ", ptr);
  }

  // Allocations that bypass the cache: PYTORCH_NO_CUDA_MEMORY_CACHING=1, or the cache switched
  // off (torch.cuda.memory.caching_allocator_enable(False)).
  static bool force_uncached() {
    static const bool forced = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING") != nullptr;
    return forced;
  }
  bool uncached() const { return force_uncached() || !enabled_.load(std::memory_order_relaxed); }

  void* uncached_malloc(std::size_t size) {
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, size));
    {
      std::lock_guard<std::mutex> lock(uncached_mutex_);
      uncached_.insert(ptr);
      any_uncached_.store(true);
    }
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
    }
    return ptr;
  }

  bool uncached_free(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(uncached_mutex_);
      if (uncached_.erase(ptr) == 0) return false;
      any_uncached_.store(!uncached_.empty());
    }
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
    }
    C10_CUDA_CHECK(cudaFree(ptr));
    return true;
  }

  // --- settings: _set_allocator_settings and the environment -----------------------------------
  // A settings string from PyTorch. as_pytorch_call (_set_allocator_settings): PyTorch's
  // semantics, the keys its parser resets return to their defaults unless named; otherwise
  // (the environment's keys at install) only the keys named change. per_process_memory_fraction
  // sets the fraction of every device.
  void apply_settings(const std::string& settings, bool as_pytorch_call) {
    std::vector<std::pair<std::string, std::string>> others;
    core::Failure failure;
    g_core->configure(settings, as_pytorch_call, &others, &failure);
    check(failure);
    for (const auto& [key, value] : others) {
      if (key != "per_process_memory_fraction") continue;  // PyTorch's, or parts it still runs
      char* end = nullptr;
      const double fraction = std::strtod(value.c_str(), &end);
      TORCH_CHECK_VALUE(end != value.c_str() && *end == '\0' && fraction >= 0 && fraction <= 1,
                        "per_process_memory_fraction is invalid: ", value);
      g_core->set_default_memory_fraction(fraction, &failure);
      check(failure);
      std::lock_guard<std::mutex> lock(settings_mutex_);
      default_fraction_ = fraction;
      fractions_.clear();
    }
  }

 private:
  // How old an answer from the driver cacheInfo may give: one driver call in a step rather than
  // one per convolution planned; other processes' use of the device shows within it.
  static constexpr std::chrono::nanoseconds kDeviceFreeFreshFor = std::chrono::milliseconds(100);
  struct Gathered {
    std::shared_ptr<c10::GatheredContext> stack;  // for the block (kept while it is allocated)
    allocwatch::ContextHandle trace;              // for the trace entries of the call
  };

  // What the history asks for at `trace_level` (entries) and `block_level` (blocks' stacks in
  // snapshots), gathered before the core's lock is taken: the recorder may need the GIL.
  Gathered gather(RecordContext trace_level, RecordContext block_level = RecordContext::NEVER) {
    Gathered g;
    if (!history_on_.load(std::memory_order_relaxed)) return g;
    const auto level = static_cast<RecordContext>(level_.load());
    const bool for_trace = level != RecordContext::NEVER && level >= trace_level;
    const bool for_block = block_level != RecordContext::NEVER && level >= block_level;
    std::shared_ptr<c10::GatheredContext> stack;
    if (for_trace || for_block) {
      if (CreateContextFn recorder = recorder_.load()) stack = recorder();
    }
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    if ((for_trace && stack) || has_metadata_) {
      auto context = std::make_shared<CallContext>();
      if (for_trace) context->stack = stack;
      if (!compile_contexts_.empty()) context->compile_context = compile_contexts_.back();
      context->user_metadata = user_metadata_;
      g.trace = std::move(context);
    }
    if (for_block) g.stack = std::move(stack);
    return g;
  }

  void refresh_history_flag() {
    std::lock_guard<std::mutex> lock(metadata_mutex_);
    refresh_history_flag_locked();
  }
  void refresh_history_flag_locked() {
    has_metadata_ = !compile_contexts_.empty() || !user_metadata_.empty();
    history_on_.store(has_metadata_ || static_cast<RecordContext>(level_.load()) != RecordContext::NEVER);
  }

  void remember_stack(void* ptr, std::shared_ptr<c10::GatheredContext> stack) {
    std::lock_guard<std::mutex> lock(stacks_mutex_);
    stacks_[ptr] = std::move(stack);
    any_stacks_.store(true);
  }
  void forget_stack(void* ptr) {
    std::lock_guard<std::mutex> lock(stacks_mutex_);
    stacks_.erase(ptr);
    any_stacks_.store(!stacks_.empty());
  }

  void* raw_malloc(c10::DeviceIndex device, std::size_t nbytes, cudaStream_t stream) {
    if (C10_UNLIKELY(uncached())) return uncached_malloc(nbytes);
    return malloc(device, nbytes, stream);
  }

  void assert_valid_device(c10::DeviceIndex device) const {
    const int count = device_count_.load();
    TORCH_CHECK(0 <= device && device < count, "Invalid device argument ",
                static_cast<int>(device), ": did you call init?");
  }

  void report_to_profiler(void* ptr, c10::DeviceIndex device, std::size_t size, bool alloc) {
    std::map<std::string, std::int64_t> flat;
    g_core->stats(device, &flat);
    c10::reportMemoryUsageToProfiler(
        ptr, alloc ? static_cast<std::int64_t>(size) : -static_cast<std::int64_t>(size),
        static_cast<std::size_t>(flat["allocated_bytes.all.current"]),
        static_cast<std::size_t>(flat["reserved_bytes.all.current"]),
        c10::Device(c10::DeviceType::CUDA, device));
  }

  // PyTorch's message first (tests and tools match its opening words), allocwatch's advice
  // after it; the out-of-memory observers (the memory viz's, the agent's) are told first.
  [[noreturn]] void raise_out_of_memory(c10::DeviceIndex device, std::size_t size,
                                        const core::OutOfMemory& oom) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mutex_);
      observers = oom_observers_;
    }
    for (const auto& observer : observers)
      observer(device, oom.alloc_size, oom.limit > 0 ? oom.limit : oom.device_total,
               oom.device_free);
    c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(size), oom.allocated, oom.reserved,
                                     c10::Device(c10::DeviceType::CUDA, device));
    const std::string allowed = oom.limit > 0 ? format_size(oom.limit) + " allowed; " : "";
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                     format_size(oom.alloc_size > 0 ? oom.alloc_size : size), ". GPU ",
                     static_cast<int>(device), " has a total capacity of ",
                     format_size(oom.device_total), " of which ", format_size(oom.device_free),
                     " is free. ", allowed, "Of the allocated memory ",
                     format_size(oom.allocated), " is allocated by PyTorch, and ",
                     format_size(oom.reserved > oom.allocated ? oom.reserved - oom.allocated : 0),
                     " is reserved by PyTorch but unallocated. allocwatch: ", oom.advice);
  }

  SnapshotInfo make_snapshot(MempoolId_t mempool_id, bool include_traces) {
    const bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
    const int count = device_count_.load();
    SnapshotInfo result{};
    std::lock_guard<std::mutex> stacks_lock(stacks_mutex_);
    for (int device = 0; device < count; ++device) {
      // The history first: the snapshot records an entry of its own, which (as in PyTorch's)
      // belongs to the next snapshot's history, not to this one.
      std::vector<TorchTrace> trace;
      if (include_traces)
        for (const allocwatch::TraceEntry& e : g_core->trace(device))
          trace.push_back(torch_trace(device, e));
      result.device_traces.push_back(std::move(trace));
      for (const allocwatch::SegmentInfo& s : g_core->snapshot(device)) {
        if (one_pool && pool_id(mempool_id) != s.pool_id) continue;
        result.segments.push_back(torch_segment(device, s));
      }
    }
    {
      std::lock_guard<std::mutex> lock(metadata_mutex_);
      if (include_traces) result.external_annotations = annotations_;
    }
    const core::SettingsReport settings = g_core->settings(count > 0 ? 0 : -1);
    auto& md = result.config_metadata;
    md.garbage_collection_threshold = settings.garbage_collection_threshold;
    md.max_split_size = settings.max_split_size;
    md.pinned_num_register_threads = settings.pinned_num_register_threads;
    md.expandable_segments = settings.expandable_segments;
    md.release_lock_on_malloc = settings.release_lock_on_cudamalloc;
    md.pinned_use_host_register = settings.pinned_use_cuda_host_register;
    md.last_allocator_settings = settings.text;
    md.roundup_power2_divisions = settings.roundup_power2_divisions;
    return result;
  }

  // Under stacks_mutex_.
  TorchSegment torch_segment(int device, const allocwatch::SegmentInfo& s) {
    TorchSegment t;
    t.device = static_cast<decltype(t.device)>(device);
    t.address = static_cast<decltype(t.address)>(s.address);
    t.total_size = static_cast<decltype(t.total_size)>(s.total_size);
    t.requested_size = static_cast<decltype(t.requested_size)>(s.requested_size);
    t.allocated_size = static_cast<decltype(t.allocated_size)>(s.allocated_size);
    t.active_size = static_cast<decltype(t.active_size)>(s.active_size);
    t.stream = reinterpret_cast<decltype(t.stream)>(s.stream);
    t.is_large = s.is_large;
    t.is_expandable = s.is_expandable;
    t.owner_private_pool_id = MempoolId_t{s.pool_id.first, s.pool_id.second};
#if ALLOCWATCH_TORCH_AT_LEAST(2, 11)
    // ProcessGroupNCCL::registerMemPool registers a pool's segments in this order, and refuses
    // a segment without one.
    t.registration_counter = s.registration_counter;
#endif
    for (const allocwatch::BlockInfo& b : s.blocks) {
      TorchBlock block;
      block.size = static_cast<decltype(block.size)>(b.size);
      block.requested_size = static_cast<decltype(block.requested_size)>(b.requested_size);
      block.allocated = std::strcmp(b.state, "active_allocated") == 0;
      block.active = std::strcmp(b.state, "inactive") != 0;
      if (block.allocated) {
        auto it = stacks_.find(reinterpret_cast<void*>(b.address));
        if (it != stacks_.end()) block.context_when_allocated = it->second;
      }
      t.blocks.push_back(std::move(block));
    }
    return t;
  }

  std::atomic<int> device_count_{0};
  std::atomic<bool> enabled_{true};

  std::mutex settings_mutex_;
  std::unordered_map<int, double> fractions_;
  double default_fraction_ = -1.0;  // none: 1.0

  // The history: what it records (RecordContext), with which recorder; whether any call must
  // gather something (history_on_, the one flag the hot path reads).
  std::atomic<CreateContextFn> recorder_{nullptr};
  std::atomic<int> level_{static_cast<int>(RecordContext::NEVER)};
  std::atomic<bool> history_enabled_{false};
  std::atomic<bool> history_on_{false};
  std::mutex metadata_mutex_;
  bool has_metadata_ = false;
  std::vector<std::string> compile_contexts_;
  std::string user_metadata_;
  std::vector<Annotation> annotations_;
  // Stacks of allocated blocks (RecordContext::STATE and above), for snapshots' frames.
  std::mutex stacks_mutex_;
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> stacks_;
  std::atomic<bool> any_stacks_{false};

  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if ALLOCWATCH_TORCH_AT_LEAST(2, 12)
  std::vector<cca::OomRejectionObserver> oom_rejection_observers_;
#endif

  IpcSharing ipc_;

  std::mutex uncached_mutex_;
  std::unordered_set<void*> uncached_;
  std::atomic<bool> any_uncached_{false};
};

// Never destroyed: tensors freed while the process exits still reach it.
AllocwatchAllocator* g_allocator = nullptr;

void delete_block(void* ptr) { g_allocator->free(ptr); }

void delete_uncached(void* ptr) {
  if (ptr != nullptr && !g_allocator->uncached_free(ptr)) g_allocator->free(ptr);
}

// _set_allocator_settings and torch._C._accelerator_setAllocatorSettings reach a device's
// settings through one hook, PyTorch's CUDA parser's until now: it keeps running (PyTorch's
// pinned memory and graph capture read its keys), then allocwatch applies the keys it knows,
// as PyTorch's parser would. The environment was parsed before (install() asks for both
// parsers first), so the hook sees only run-time changes: the layering of ALLOCWATCH_ALLOC_CONF
// over PYTORCH_CUDA_ALLOC_CONF stays as install() made it. Every key of allocwatch's settings
// table that PyTorch's parser does not know is registered with it, so that PyTorch accepts it.
void register_settings_hook() {
  using c10::CachingAllocator::AcceleratorAllocatorConfig;
  (void)AcceleratorAllocatorConfig::instance();
  (void)cca::CUDAAllocatorConfig::instance();
  std::unordered_set<std::string> ours;
  const auto& known = AcceleratorAllocatorConfig::getKeys();
  for (const allocwatch::SettingInfo& setting : allocwatch::kSettings)
    if (known.count(setting.key) == 0) ours.insert(setting.key);
  AcceleratorAllocatorConfig::registerDeviceConfigParserHook(
      [](const std::string& settings) {
        cca::CUDAAllocatorConfig::instance().parseArgs(settings);
        g_allocator->apply_settings(settings, /*as_pytorch_call=*/true);
      },
      ours);
}

void copy_message(const std::string& text, char* out, std::size_t capacity) {
  if (capacity == 0) return;
  const std::size_t n = std::min(text.size(), capacity - 1);
  text.copy(out, n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

// Makes allocwatch's allocator PyTorch's CUDA allocator, before CUDA is initialised;
// `core_library` is allocator_ext/_core's path. Returns 0, or -1 with the reason in `error`.
__attribute__((visibility("default"))) int allocwatch_native_install(const char* core_library,
                                                                      char* error,
                                                                      std::size_t capacity) {
  try {
    if (g_allocator != nullptr) return 0;
    // Local: the factory is looked up in this handle, and nothing else in the process may bind
    // to the core's symbols.
    void* library = dlopen(core_library, RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(library != nullptr, "cannot load ", core_library, ": ", dlerror());
    using Factory = core::NativeCore* (*)(int, std::size_t);
    auto factory = reinterpret_cast<Factory>(dlsym(library, "allocwatch_native_core"));
    TORCH_CHECK(factory != nullptr, core_library, " has no allocwatch_native_core (an older "
                "allocwatch build?): reinstall allocwatch");
    g_core = factory(core::kNativeCoreVersion, sizeof(std::string));
    TORCH_CHECK(g_core != nullptr, "the core library in ", core_library, " is of another "
                "version or C++ ABI than this back end: run `allocwatch native build`");
    cca::CUDAAllocator* current = cca::allocator.load();
    TORCH_CHECK(current == nullptr || !current->initialized(),
                "CUDA is already initialised: the allocator can only be changed before");
    auto* ours = new AllocwatchAllocator();
    // What PyTorch's BackendStaticInitializer does for its own: the allocator c10 hands out
    // for CUDA (torch.empty, torch.accelerator.*) and the one CUDACachingAllocator's functions
    // call (torch.cuda.memory.*, cuDNN, NCCL, CUDA graphs). c10 replaces an allocator only at
    // its priority or above, and releases register theirs at different ones (0 up to 2.11, 1
    // from 2.12), which c10 does not tell: the lowest priority that takes is the one PyTorch
    // used.
    for (int priority = 0; priority <= 255; ++priority) {
      c10::SetAllocator(c10::DeviceType::CUDA, ours, static_cast<std::uint8_t>(priority));
      if (c10::GetAllocator(c10::DeviceType::CUDA) == ours) break;
    }
    if (c10::GetAllocator(c10::DeviceType::CUDA) != ours) {
      delete ours;
      TORCH_CHECK(false, "PyTorch keeps another CUDA allocator registered with the highest "
                  "priority: allocwatch's was not installed");
    }
    g_allocator = ours;
    register_settings_hook();
    g_capture_graphs = std::make_shared<TorchCaptureGraphs>();
    g_core->set_capture_graphs(g_capture_graphs);
    cca::allocator.store(g_allocator);
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), error, capacity);
    return -1;
  }
}

// The settings string PyTorch's per_process_memory_fraction and friends came in, applied as a
// run-time change would be (install() calls it for the environment's PyTorch keys).
__attribute__((visibility("default"))) int allocwatch_native_apply_settings(const char* settings,
                                                                             char* error,
                                                                             std::size_t capacity) {
  try {
    TORCH_CHECK(g_allocator != nullptr, "the native back end is not installed");
    g_allocator->apply_settings(settings, /*as_pytorch_call=*/false);
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), error, capacity);
    return -1;
  }
}

// _set_allocator_settings on releases whose call reaches PyTorch's CUDA parser alone, not the
// hook register_settings_hook installs (torch 2.9: install() routes it here): allocwatch's keys
// as PyTorch's parser treats its own, those the call does not name returning to their defaults.
__attribute__((visibility("default"))) int allocwatch_native_set_allocator_settings(
    const char* settings, char* error, std::size_t capacity) {
  try {
    TORCH_CHECK(g_allocator != nullptr, "the native back end is not installed");
    g_allocator->apply_settings(settings, /*as_pytorch_call=*/true);
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), error, capacity);
    return -1;
  }
}

}  // extern "C"
