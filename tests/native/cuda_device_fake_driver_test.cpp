// The cuda back end against tests/native/fake_libcuda.cpp: driver loading, context handling on
// other threads, out-of-memory answers, error messages, the event pool and capture status, and
// the allocator's answer to a refused cuMemCreate.
// Run by tests/core/test_cuda_backend_fake_driver.py; prints "N passed, N failed".
#include <dlfcn.h>

#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include <memory>

#include "devices/cuda_device.h"
#include "core/allocator.h"

namespace {

using allocwatch::CudaDevice;
using allocwatch::DeviceError;

int passed = 0, failed = 0;

void expect(bool ok, const char* what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s\n", what);
  }
}

// The message of the DeviceError that call throws, or "" when it throws none.
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const DeviceError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <typename Fn>
Fn hook(const char* name) {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return library ? reinterpret_cast<Fn>(dlsym(library, name)) : nullptr;
}

constexpr std::size_t MiB = std::size_t{1} << 20;

}  // namespace

int main() {
  {
    std::string e = error_of([] { CudaDevice missing(3); });
    expect(contains(e, "cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE"),
           "a missing device names the call and the error");
  }
  auto set_capacity = hook<void (*)(std::size_t)>("fake_cuda_set_capacity");
  auto hold_events = hook<void (*)(int)>("fake_cuda_hold_events");
  auto complete_events = hook<void (*)()>("fake_cuda_complete_events");
  auto set_capture = hook<void (*)(int, int)>("fake_cuda_set_capture");
  auto references = hook<int (*)()>("fake_cuda_primary_references");
  auto live_events = hook<int (*)()>("fake_cuda_live_events");
  auto current = hook<void* (*)()>("fake_cuda_current_context");
  auto set_current = hook<void (*)(void*)>("fake_cuda_set_current_context");
  if (!set_capacity || !references) {
    std::printf("FAILED: the fake driver is not the libcuda.so.1 that was loaded\n");
    return 1;
  }
  expect(references() == 0, "a failed construction releases the primary context");

  {
    CudaDevice device(0);
    expect(references() == 1, "the primary context is retained");
    expect(device.name() == "Fake GPU", "device name");
    expect(device.driver_version() == 13000, "driver version");
    expect(device.supports_virtual_memory(), "virtual memory supported");
    expect(device.granularity() == 2 * MiB, "granularity");
    expect(device.memory_info().total == (std::size_t{80} << 30), "memory info");

    // Plain segments, and out of memory as false rather than an exception.
    void* p = nullptr;
    expect(device.malloc(20 * MiB, &p) && p != nullptr, "malloc");
    device.free(p, 20 * MiB);
    set_capacity(64 * MiB);
    expect(!device.malloc(128 * MiB, &p), "malloc out of memory returns false");
    allocwatch::PhysicalHandle h = 0;
    expect(!device.create_physical(128 * MiB, &h), "create out of memory returns false");
    set_capacity(std::size_t{80} << 30);

    std::string e = error_of([&] { device.free(reinterpret_cast<void*>(0x1000), 0); });
    expect(contains(e, "cuMemFree_v2 failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"),
           "other errors throw with the call and the driver's name and text");
    e = error_of([&] { device.create_physical(3 * MiB, &h); });
    expect(contains(e, "granularity"), "a misaligned size is explained");

    // Expandable segments: reserve, create, map with access, unmap, release, free.
    std::uintptr_t base = device.reserve_address(8 * MiB, 2 * MiB);
    expect(base % (2 * MiB) == 0, "reserved address is aligned");
    expect(device.create_physical(2 * MiB, &h), "create");
    device.map(base + 2 * MiB, 2 * MiB, h);
    static_cast<volatile char*>(reinterpret_cast<void*>(base + 2 * MiB))[123] = 7;  // accessible
    device.unmap(base + 2 * MiB, 2 * MiB);
    device.release_physical(h, 2 * MiB);
    device.free_address(base, 8 * MiB);

    // Events: pooled, pending until complete.
    hold_events(1);
    auto event = device.record_event(0);
    expect(!device.query_event(event), "an event of unfinished work is not ready");
    complete_events();
    expect(device.query_event(event), "a completed event is ready");
    device.release_event(event);
    auto again = device.record_event(7);
    expect(again == event, "a released event is reused");
    device.wait_event(again);
    expect(device.query_event(again), "wait_event waits");
    device.release_event(again);
    hold_events(0);
    expect(live_events() == 1, "one event created for both records");
    expect(hook<int (*)()>("fake_cuda_timed_events")() == 0,
           "the back end's events are created with timing disabled (cheaper to record)");

    // Capture status.
    expect(!device.is_capturing(0), "not capturing");
    set_capture(1, 0);
    expect(device.is_capturing(5), "capturing");
    set_capture(2, 0);
    expect(device.is_capturing(5), "an invalidated capture still counts as capturing");
    set_capture(0, 1);
    expect(device.is_capturing(0), "the default stream during another stream's capture");
    set_capture(0, 0);

    device.synchronize();
    device.synchronize_stream(0);

    // Threads with no context current, or another one, get ours for the call and keep theirs.
    std::thread fresh([&] {
      void* q = nullptr;
      expect(device.malloc(2 * MiB, &q), "malloc on a thread with no current context");
      device.free(q, 2 * MiB);
    });
    fresh.join();
    std::thread other([&] {
      int foreign = 0;
      set_current(&foreign);
      device.synchronize();
      expect(current() == &foreign, "the caller's context is restored");
    });
    other.join();
  }
  expect(references() == 0, "the primary context is released");
  expect(live_events() == 0, "pooled events are destroyed");

  // The allocator's defaults over the back end: a cuMemCreate the driver refuses sets the
  // growth ceiling from cuMemGetInfo, and growth near it creates single 2 MiB pages (Note
  // [page policy], page size and chunks).
  if (auto live_handles = hook<int (*)()>("fake_cuda_live_handles")) {
    set_capacity(100 * MiB);
    {
      allocwatch::CachingAllocator allocator(std::make_shared<CudaDevice>(0),
                                             allocwatch::AllocatorConfig::allocwatch());
      void* kept = allocator.malloc(50 * MiB, 0, nullptr);
      allocwatch::OutOfMemoryReport report;
      expect(allocator.malloc(60 * MiB, 0, &report) == nullptr,
             "a request past the driver's capacity is refused");
      const int before = live_handles();
      void* near = allocator.malloc(46 * MiB, 0, nullptr);  // to 96 MiB of a 100 MiB ceiling
      expect(live_handles() - before == 23, "growth near the ceiling creates 2 MiB pages");
      allocator.free(near);
      allocator.free(kept);
    }
    set_capacity(std::size_t{80} << 30);
  } else {
    expect(false, "the fake driver counts its handles");
  }
  expect(references() == 0, "the allocator releases the primary context");

  // Process exit: tensors freed after the driver shut down must not throw from the allocator.
  {
    CudaDevice device(0);
    void* p = nullptr;
    expect(device.malloc(2 * MiB, &p), "malloc before shutdown");
    std::uintptr_t base = device.reserve_address(2 * MiB, 2 * MiB);
    allocwatch::PhysicalHandle h = 0;
    expect(device.create_physical(2 * MiB, &h), "create before shutdown");
    device.map(base, 2 * MiB, h);
    hook<void (*)()>("fake_cuda_deinitialize")();
    expect(error_of([&] {
             device.free(p, 2 * MiB);
             device.unmap(base, 2 * MiB);
             device.release_physical(h, 2 * MiB);
             device.free_address(base, 2 * MiB);
           }).empty(),
           "giving memory back after the driver shut down does not throw");
    expect(contains(error_of([&] { device.synchronize(); }), "CUDA_ERROR_DEINITIALIZED"),
           "other calls after shutdown still report it");
  }  // the destructor must not throw either

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
