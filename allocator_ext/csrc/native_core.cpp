// The core's side of native_core.h: every call goes to the registry of the allocators that
// serve PyTorch (torch_allocators.h: the same allocators the Python binding and the agent
// read), and every error becomes a Failure.
#include "native_core.h"

#include <chrono>
#include <exception>
#include <stdexcept>

#include "core/config.h"
#include "devices/pool_segments_device.h"
#include "torch_allocators.h"

namespace allocwatch::native_core {

namespace {

using namespace torch_allocators;

template <typename F>
auto guarded(Failure* failure, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    if (failure) failure->set(Failure::invalid_argument, e.what());
  } catch (const std::exception& e) {
    if (failure) failure->set(Failure::other, e.what());
  } catch (...) {
    if (failure) failure->set(Failure::other, "allocwatch: unknown error");
  }
  return decltype(f())();
}

SettingsReport report(const AllocatorConfig& c) {
  SettingsReport r;
  r.text = c.to_string();
  r.garbage_collection_threshold = c.garbage_collection_threshold;
  r.max_split_size = c.max_split_size;
  r.expandable_segments = c.expandable_segments;
  r.release_lock_on_cudamalloc = c.release_lock_on_cudamalloc;
  r.pinned_use_cuda_host_register = c.pinned_use_cuda_host_register;
  r.pinned_num_register_threads = c.pinned_num_register_threads;
  r.roundup_power2_divisions.assign(c.roundup_power2_divisions.begin(),
                                    c.roundup_power2_divisions.end());
  return r;
}

class CoreForNative final : public NativeCore {
 public:
  void* malloc(int device, std::size_t size, StreamId stream, const ContextHandle& context,
               OutOfMemory* oom, Failure* failure) override {
    // Out of memory is a report, not an exception, from the core up to the back end.
    OutOfMemoryReport report;
    void* ptr = guarded(failure, [&] {
      if (!context) return hot(device).malloc(size, stream, &report);
      TraceContextScope scope(context);
      return hot(device).malloc(size, stream, &report);
    });
    if (ptr == nullptr && oom != nullptr) {  // out of memory, or the failure says what else
      oom->requested = report.requested;
      oom->alloc_size = report.alloc_size;
      oom->device_free = report.device_free;
      oom->device_total = report.device_total;
      oom->allocated = report.allocated;
      oom->reserved = report.reserved;
      oom->limit = report.limit;
      copy_text(oom->advice, report.advice.c_str());
    }
    return ptr;
  }

  bool free(void* ptr, const ContextHandle& context, Failure* failure) override {
    return guarded(failure, [&] {
      if (!context) return free_any(ptr);
      TraceContextScope scope(context);
      return free_any(ptr);
    });
  }

  void record_stream(int device, void* ptr, StreamId stream, Failure* failure) override {
    guarded(failure, [&] { hot(device).record_stream(ptr, stream); });
  }

  bool stats(int device, std::map<std::string, std::int64_t>* out) override {
    auto a = existing(device);
    if (!a) return false;
    *out = a->stats();
    return true;
  }

  void reset_peak(int device) override {
    if (auto a = existing(device)) a->reset_peak_stats();
  }

  void reset_accumulated(int device) override {
    if (auto a = existing(device)) a->reset_accumulated_stats();
  }

  void empty_cache(MempoolId pool, const ContextHandle& context, Failure* failure) override {
    guarded(failure, [&] {
      TraceContextScope scope(context);
      for (auto& a : all()) {
        if (!a) continue;
        if (pool == MempoolId{0, 0}) {
          a->empty_cache();
        } else {
          a->empty_pool_cache(pool);
        }
      }
    });
  }

  void set_memory_fraction(int device, double fraction, Failure* failure) override {
    guarded(failure, [&] { get(device, true)->set_memory_fraction(fraction); });
  }

  std::size_t largest_free_block(int device) override {
    auto a = existing(device);
    return a ? a->largest_free_block() : 0;
  }

  bool workspace_room(int device, std::int64_t fresh_for_ns, std::size_t* room) override {
    auto a = existing(device);
    if (!a) return false;
    *room = a->workspace_room(std::chrono::nanoseconds(fresh_for_ns));
    return true;
  }

  SegmentSpan segment_of(const void* ptr) override {
    for (auto& a : all()) {
      if (!a) continue;
      SegmentSpan span = a->segment_of(ptr);
      if (span.size > 0) return span;
    }
    return SegmentSpan{};
  }

  std::pair<int, std::size_t> block_of(const void* ptr) override {
    auto allocators = all();
    for (std::size_t d = 0; d < allocators.size(); ++d) {
      if (!allocators[d]) continue;
      const std::size_t size = allocators[d]->block_size(const_cast<void*>(ptr));
      if (size > 0) return {static_cast<int>(d), size};
    }
    return {-1, 0};
  }

  void begin_allocate_to_pool(int device, MempoolId pool, std::function<bool(StreamId)> filter,
                              Failure* failure) override {
    guarded(failure, [&] {
      hot(device).begin_allocate_to_pool(pool, std::move(filter), /*plain_segments=*/true);
    });
  }

  void end_allocate_to_pool(int device, MempoolId pool, Failure* failure) override {
    guarded(failure, [&] { hot(device).end_allocate_to_pool(pool); });
  }

  void release_pool(int device, MempoolId pool, Failure* failure) override {
    guarded(failure, [&] { hot(device).release_pool(pool); });
  }

  void create_or_incref_pool(int device, MempoolId pool, std::shared_ptr<PoolSegments> segments,
                             Failure* failure) override {
    guarded(failure, [&] {
      CachingAllocator& allocator = hot(device);
      std::shared_ptr<Device> from;
      if (segments) {
        from = std::make_shared<PoolSegmentsDevice>(
            allocator.device(),
            [segments](std::size_t size, void** ptr) {
              Failure failed;
              *ptr = segments->allocate(size, &failed);
              if (failed) throw DeviceError(failed.message);
              return *ptr != nullptr;
            },
            [segments](void* ptr, std::size_t size) { segments->release(ptr, size); });
      }
      allocator.create_or_incref_pool(pool, /*plain_segments=*/true, std::move(from));
    });
  }

  int pool_use_count(int device, MempoolId pool) override {
    auto a = existing(device);
    return a ? a->pool_use_count(pool) : 0;
  }

  void set_pool_no_split(int device, MempoolId pool, Failure* failure) override {
    guarded(failure, [&] { hot(device).set_pool_no_split(pool); });
  }

  void set_pool_use_on_oom(int device, MempoolId pool, bool use_on_oom,
                           Failure* failure) override {
    guarded(failure, [&] { hot(device).set_pool_use_on_oom(pool, use_on_oom); });
  }

  bool check_pool_live_allocations(int device, MempoolId pool,
                                   const std::vector<std::uintptr_t>& expected,
                                   Failure* failure) override {
    return guarded(failure,
                   [&] { return hot(device).check_pool_live_allocations(pool, expected); });
  }

  void set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs) override {
    torch_allocators::set_capture_graphs(std::move(graphs));
  }

  PoolCheckpoint checkpoint_pool(int device, MempoolId pool, Failure* failure) override {
    return guarded(failure, [&] { return hot(device).checkpoint_pool(pool); });
  }

  CheckpointRestore restore_pool(int device, const PoolCheckpoint& checkpoint,
                                 const ContextHandle& context, Failure* failure) override {
    return guarded(failure, [&] {
      TraceContextScope scope(context);
      return hot(device).restore_pool(checkpoint);
    });
  }

  void record_history(bool enabled, std::size_t max_entries, bool clear,
                      std::uint32_t skipped) override {
    set_history(enabled, max_entries, clear, skipped);
  }

  void add_trace_observer(std::function<void(int, const TraceEntry&)> observer) override {
    torch_allocators::add_trace_observer(std::move(observer));
  }

  std::vector<TraceEntry> trace(int device) override {
    auto a = existing(device);
    return a ? a->trace() : std::vector<TraceEntry>{};
  }

  std::vector<SegmentInfo> snapshot(int device) override {
    auto a = existing(device);
    return a ? a->snapshot() : std::vector<SegmentInfo>{};
  }

  std::vector<int> devices() override {
    std::vector<int> out;
    auto allocators = all();
    for (std::size_t d = 0; d < allocators.size(); ++d)
      if (allocators[d]) out.push_back(static_cast<int>(d));
    return out;
  }

  IpcExport export_ipc(const void* ptr, Failure* failure) override {
    return guarded(failure, [&] {
      for (auto& a : all()) {
        if (a && a->block_size(const_cast<void*>(ptr)) > 0) return a->export_ipc(ptr);
      }
      throw std::invalid_argument("allocwatch: no allocator handed out this pointer");
    });
  }

  std::uintptr_t import_ipc(int device, const std::vector<std::pair<int, std::size_t>>& pieces,
                            Failure* failure) override {
    return guarded(failure, [&] {
      std::vector<Device::Imported> imported;
      for (const auto& [fd, size] : pieces) imported.push_back(Device::Imported{fd, size});
      return hot(device).device().import_physical(imported);
    });
  }

  void close_ipc(int device, std::uintptr_t base) override {
    if (auto a = existing(device)) {
      try {
        a->device().release_import(base);
      } catch (...) {  // at exit the driver may be gone with the memory
      }
    }
  }

  void configure(const std::string& settings, bool as_pytorch_call,
                 std::vector<std::pair<std::string, std::string>>* others,
                 Failure* failure) override {
    guarded(failure, [&] {
      const std::string known = known_settings(settings, others);
      if (as_pytorch_call) {
        torch_allocators::configure_as_pytorch(known);  // "" too: it resets what PyTorch resets
      } else if (!known.empty()) {
        torch_allocators::configure(known);
      }
    });
  }

  SettingsReport settings(int device) override {
    if (auto a = existing(device)) return report(a->config());
    return report(current_config());
  }

  void set_default_memory_fraction(double fraction, Failure* failure) override {
    guarded(failure, [&] {
      torch_allocators::set_default_memory_fraction(fraction);
      for (auto& a : all())
        if (a) a->set_memory_fraction(fraction);
    });
  }

 private:
  static std::shared_ptr<CachingAllocator> existing(int device) {
    return device < 0 ? nullptr : get(device, false);
  }
};

}  // namespace

}  // namespace allocwatch::native_core

extern "C" __attribute__((visibility("default"))) allocwatch::native_core::NativeCore*
allocwatch_native_core(int version, std::size_t string_size) {
  if (version != allocwatch::native_core::kNativeCoreVersion ||
      string_size != sizeof(std::string)) {
    return nullptr;
  }
  // Never destroyed: tensors freed while the process exits still reach it.
  static auto* core = new allocwatch::native_core::CoreForNative();
  return core;
}
