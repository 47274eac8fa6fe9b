// The core as the native back end (allocator_ext/native/) reaches it: what the back end asks
// of the core library, one object per process, from the core's only export for it,
// allocwatch_native_core().
//
// The back end is compiled on the user's machine against the installed torch; the core is
// compiled once, by pip, without torch. So the back end includes this header and the core's
// header-only structs, calls virtual functions through the object it is given, and needs no
// other symbol of the core. Nothing here throws: the core may carry its own copy of parts of
// libstdc++ (some build environments link it statically), and an exception must not cross from
// one copy to the other. A call that fails says so in its Failure.
//
// Devices are torch's indices; an allocator is made the first time a device allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "core/capture_graphs.h"
#include "core/checkpoint.h"
#include "core/history.h"
#include "core/trace.h"

namespace allocwatch::native_core {

// Bumped whenever NativeCore changes: a back end built for another version is refused.
constexpr int kNativeCoreVersion = 5;

// Text copied into a fixed buffer, cut to fit: errors cross between the libraries as plain
// bytes, never as objects whose memory one library allocates and the other frees.
template <std::size_t N>
void copy_text(char (&to)[N], const char* text) {
  std::size_t n = 0;
  if (text != nullptr) {
    while (n + 1 < N && text[n] != '\0') {
      to[n] = text[n];
      ++n;
    }
  }
  to[n] = '\0';
}

// Both are made on every allocation and filled only when it fails: the buffers are written
// before they are read, and left unset until then (zeroing them would cost the hot path).
struct Failure {
  enum Kind { none = 0, invalid_argument = 1, other = 2 };
  Kind kind = none;
  char message[2048];  // set with kind
  void set(Kind k, const char* text) {
    kind = k;
    copy_text(message, text);
  }
  explicit operator bool() const { return kind != none; }
};

// Why a request could not be met (the core's OutOfMemoryReport, field by field).
struct OutOfMemory {
  std::size_t requested = 0, alloc_size = 0, device_free = 0, device_total = 0;
  std::size_t allocated = 0, reserved = 0, limit = 0;
  char advice[1024];  // set with the rest, on out of memory
};

// The segments of a torch.cuda.MemPool made with an allocator of its own (NCCL's
// ncclMemAlloc, any CUDAPluggableAllocator): the back end asks that allocator for them. Its
// functions throw nothing, as the rest of this interface.
class PoolSegments {
 public:
  virtual ~PoolSegments() = default;
  // A segment of `size` bytes; nullptr where the allocator has no room, nullptr with `failure`
  // set where it failed otherwise.
  virtual void* allocate(std::size_t size, Failure* failure) = 0;
  virtual void release(void* ptr, std::size_t size) = 0;
};

// The settings an allocator runs with, as PyTorch's snapshots report them.
struct SettingsReport {
  std::string text;  // AllocatorConfig::to_string()
  double garbage_collection_threshold = 0;
  std::size_t max_split_size = 0;  // SIZE_MAX: unlimited
  bool expandable_segments = false;
  bool release_lock_on_cudamalloc = false;
  bool pinned_use_cuda_host_register = false;
  std::size_t pinned_num_register_threads = 1;
  std::vector<std::size_t> roundup_power2_divisions;
};

class NativeCore {
 public:
  // --- the hot path ---
  // A block of `size` bytes for `stream`; nullptr with `oom` filled when the device has no
  // room, nullptr with `failure` set on any other error. `context` goes with the trace entries
  // the call records (history.h); it may be empty.
  virtual void* malloc(int device, std::size_t size, StreamId stream,
                       const ContextHandle& context, OutOfMemory* oom, Failure* failure) = 0;
  // False when no device's allocator handed `ptr` out.
  virtual bool free(void* ptr, const ContextHandle& context, Failure* failure) = 0;
  virtual void record_stream(int device, void* ptr, StreamId stream, Failure* failure) = 0;

  // --- statistics and reclaiming ---
  // False (and `out` untouched) when the device has no allocator yet.
  virtual bool stats(int device, std::map<std::string, std::int64_t>* out) = 0;
  virtual void reset_peak(int device) = 0;
  virtual void reset_accumulated(int device) = 0;
  // Every device; pool {0, 0}: the ordinary pools (and released private ones), else that
  // private pool only (CachingAllocator::empty_pool_cache).
  virtual void empty_cache(MempoolId pool, const ContextHandle& context, Failure* failure) = 0;
  virtual void set_memory_fraction(int device, double fraction, Failure* failure) = 0;
  virtual std::size_t largest_free_block(int device) = 0;
  // CachingAllocator::workspace_room; false (and `room` untouched) when the device has no
  // allocator yet.
  virtual bool workspace_room(int device, std::int64_t fresh_for_ns, std::size_t* room) = 0;
  // The allocation of an allocated block at `ptr`, on whichever device has it (size 0: none).
  virtual SegmentSpan segment_of(const void* ptr) = 0;
  // The device and size of the allocated block at `ptr` (device -1: none), for the profiler.
  virtual std::pair<int, std::size_t> block_of(const void* ptr) = 0;

  // --- private pools: CUDA graphs and torch.cuda.MemPool ---
  // The pools PyTorch's callers make (CUDA graphs', torch.cuda.MemPool's) have plain
  // segments, as PyTorch's default makes them: their users and PyTorch's own tests expect
  // its layout there (docs/torch.md).
  virtual void begin_allocate_to_pool(int device, MempoolId pool,
                                      std::function<bool(StreamId)> filter, Failure* failure) = 0;
  virtual void end_allocate_to_pool(int device, MempoolId pool, Failure* failure) = 0;
  virtual void release_pool(int device, MempoolId pool, Failure* failure) = 0;
  // segments: where a new pool's segments come from (nullptr: the device, as for any pool).
  virtual void create_or_incref_pool(int device, MempoolId pool,
                                     std::shared_ptr<PoolSegments> segments,
                                     Failure* failure) = 0;
  virtual int pool_use_count(int device, MempoolId pool) = 0;
  virtual void set_pool_no_split(int device, MempoolId pool, Failure* failure) = 0;
  virtual void set_pool_use_on_oom(int device, MempoolId pool, bool use_on_oom,
                                   Failure* failure) = 0;
  virtual bool check_pool_live_allocations(int device, MempoolId pool,
                                           const std::vector<std::uintptr_t>& expected,
                                           Failure* failure) = 0;
  // How the allocators ask about captures, to reuse blocks the capture's graph has ordered
  // (PyTorch's graph_capture_record_stream_reuse; capture_graphs.h).
  virtual void set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs) = 0;
  virtual PoolCheckpoint checkpoint_pool(int device, MempoolId pool, Failure* failure) = 0;
  virtual CheckpointRestore restore_pool(int device, const PoolCheckpoint& checkpoint,
                                         const ContextHandle& context, Failure* failure) = 0;

  // --- history ---
  virtual void record_history(bool enabled, std::size_t max_entries, bool clear,
                              std::uint32_t skipped) = 0;
  virtual void add_trace_observer(std::function<void(int, const TraceEntry&)> observer) = 0;
  virtual std::vector<TraceEntry> trace(int device) = 0;
  virtual std::vector<SegmentInfo> snapshot(int device) = 0;
  virtual std::vector<int> devices() = 0;  // those with an allocator

  // --- CUDA IPC of expandable segments (ordinary segments use cudaIpc handles) ---
  // The allocated block at `ptr` as another process can map it.
  virtual IpcExport export_ipc(const void* ptr, Failure* failure) = 0;
  // Maps on `device` what another process exported (file descriptors this process took over;
  // the caller closes them afterwards) and returns where; close_ipc unmaps it.
  virtual std::uintptr_t import_ipc(int device,
                                    const std::vector<std::pair<int, std::size_t>>& pieces,
                                    Failure* failure) = 0;
  virtual void close_ipc(int device, std::uintptr_t base) = 0;

  // --- settings ---
  // A PyTorch settings string: the keys this allocator knows change (a bad one changes
  // nothing and fails as invalid_argument); `others` gets the rest (config.h, known_settings).
  // as_pytorch_call: as PyTorch's parser takes _set_allocator_settings, where the keys that
  // PyTorch resets return to their defaults unless named (config.h, apply_pytorch_settings);
  // otherwise only the keys named change.
  virtual void configure(const std::string& settings, bool as_pytorch_call,
                         std::vector<std::pair<std::string, std::string>>* others,
                         Failure* failure) = 0;
  // The settings of `device`'s allocator, or those new allocators get (device < 0).
  virtual SettingsReport settings(int device) = 0;
  // PyTorch's per_process_memory_fraction: for every device without a fraction of its own.
  virtual void set_default_memory_fraction(double fraction, Failure* failure) = 0;

 protected:
  ~NativeCore() = default;  // the object lives as long as the process
};

}  // namespace allocwatch::native_core

// The process's NativeCore, or nullptr when `version` is not kNativeCoreVersion or the
// caller's std::string is not the core's (a different C++ ABI).
extern "C" allocwatch::native_core::NativeCore* allocwatch_native_core(int version,
                                                                         std::size_t string_size);
