// The process-wide registry of the allocators that serve PyTorch, one per device, made on a
// device's first use: the pluggable path's exports (pluggable_exports.cpp), the native back
// end (through native_core.cpp) and the Python binding (settings, statistics and snapshots of
// the allocator torch uses) all reach the same ones here.
//
// Each allocator runs on the cuda device, or, with ALLOCWATCH_TORCH_DEVICE=sim, on the
// simulated device, so that the paths PyTorch takes can be exercised without a GPU.
#include <array>
#include <cstdlib>
#include <cstdint>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "devices/cuda_device.h"
#include "devices/sim_device.h"
#include "core/allocator.h"
#include "torch_allocators.h"

namespace allocwatch::torch_allocators {

namespace {

// Never destroyed: tensors held by static objects (cuBLAS workspaces, CUDA graphs) are freed
// while the process exits, after static destructors have run, and still reach their allocator.
struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<CachingAllocator>> allocators;
  std::vector<std::function<void(int, const TraceEntry&)>> observers;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}
std::mutex& g_mutex = registry().mutex;
std::vector<std::shared_ptr<CachingAllocator>>& g_allocators = registry().allocators;
std::vector<std::function<void(int, const TraceEntry&)>>& g_observers = registry().observers;
AllocatorConfig g_config = AllocatorConfig::allocwatch();
// What every allocator gets when it is made (set_history, add_trace_observer, ...).
struct History {
  bool enabled = false;
  std::size_t max_entries = 1;
  std::uint32_t skipped = 0;
} g_history;
double g_default_fraction = -1.0;  // none
std::shared_ptr<CaptureGraphs> g_capture_graphs;

// The hot path (every tensor's malloc and free) reads the device's allocator from here without
// the mutex or a shared_ptr copy: allocators are made once and live as long as the process
// (g_allocators keeps them), so a published pointer stays valid.
constexpr std::size_t kFastDevices = 64;
std::array<std::atomic<CachingAllocator*>, kFastDevices> g_fast{};

// The device behind each allocator: the GPU through libcuda, or, with ALLOCWATCH_TORCH_DEVICE=sim
// (its capacity in ALLOCWATCH_TORCH_SIM_BYTES), the simulated device, so that the entry points
// PyTorch calls can be exercised on a machine without a GPU (tests/pytorch/test_pluggable_exports.py,
// test_native_sim.py).
std::shared_ptr<Device> make_device(int device) {
  const char* kind = std::getenv("ALLOCWATCH_TORCH_DEVICE");
  if (kind != nullptr && std::string(kind) == "sim") {
    const char* bytes = std::getenv("ALLOCWATCH_TORCH_SIM_BYTES");
    return std::make_shared<SimDevice>(bytes ? std::stoull(bytes) : 0, device);
  }
  return std::make_shared<CudaDevice>(device);
}

}  // namespace

void configure(const std::string& settings) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_config = apply_config(g_config, settings);  // throws ConfigError, changing nothing
  for (auto& a : g_allocators)
    if (a) a->set_config(settings);
}

void configure_as_pytorch(const std::string& settings) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_config = apply_pytorch_settings(g_config, settings);  // throws ConfigError, changing nothing
  // Each allocator's own settings, reset and updated the same way, replace its settings whole
  // (to_string() begins with the preset, so it names every setting that is not PyTorch's).
  for (auto& a : g_allocators)
    if (a) a->set_config(apply_pytorch_settings(a->config(), settings).to_string());
}

AllocatorConfig current_config() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_config;
}

std::shared_ptr<CachingAllocator> get(int device, bool create) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0) throw std::invalid_argument("allocwatch: negative device index");
  if (static_cast<std::size_t>(device) >= g_allocators.size()) {
    if (!create) return nullptr;
    g_allocators.resize(device + 1);
  }
  auto& slot = g_allocators[device];
  if (!slot && create) {
    slot = std::make_shared<CachingAllocator>(make_device(device), g_config);
    if (g_default_fraction >= 0.0) slot->set_memory_fraction(g_default_fraction);
    if (g_history.enabled) slot->record_history(true, g_history.max_entries);
    slot->set_trace_skipped(g_history.skipped);
    if (g_capture_graphs) slot->set_capture_graphs(g_capture_graphs);
    for (const auto& observer : g_observers) {
      slot->add_trace_observer([observer, device](const TraceEntry& e) { observer(device, e); });
    }
    if (static_cast<std::size_t>(device) < kFastDevices)
      g_fast[device].store(slot.get(), std::memory_order_release);
  }
  return slot;
}

void ensure_devices(int count) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (static_cast<int>(g_allocators.size()) < count) g_allocators.resize(count);
}

CachingAllocator& hot(int device) {
  if (device >= 0 && static_cast<std::size_t>(device) < kFastDevices) {
    if (auto* a = g_fast[device].load(std::memory_order_acquire)) return *a;
  }
  return *get(device, true);  // first use of the device (or one beyond the fast table)
}

std::vector<std::shared_ptr<CachingAllocator>> all() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_allocators;
}

bool free_any(void* ptr) {
  // One lookup and one lock per allocator tried: the free itself says whether it was its block.
  for (std::size_t d = 0; d < kFastDevices; ++d) {
    CachingAllocator* a = g_fast[d].load(std::memory_order_acquire);
    if (a != nullptr && a->free_if_owned(ptr)) return true;
  }
  for (auto& a : all()) {
    if (a && a->free_if_owned(ptr)) return true;
  }
  return false;
}

void set_history(bool enabled, std::size_t max_entries, bool clear, std::uint32_t skipped) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_history = History{enabled, max_entries, skipped};
  for (auto& a : g_allocators) {
    if (!a) continue;
    a->record_history(enabled, max_entries);
    a->set_trace_skipped(skipped);
    if (clear) a->clear_history();
  }
}

void add_trace_observer(std::function<void(int, const TraceEntry&)> observer) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (std::size_t d = 0; d < g_allocators.size(); ++d) {
    if (!g_allocators[d]) continue;
    const int device = static_cast<int>(d);
    g_allocators[d]->add_trace_observer(
        [observer, device](const TraceEntry& e) { observer(device, e); });
  }
  g_observers.push_back(std::move(observer));
}

void set_default_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("allocwatch: memory fraction " + std::to_string(fraction) +
                                " is outside [0, 1]");
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_default_fraction = fraction;
}

void set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_capture_graphs = graphs;
  for (auto& a : g_allocators)
    if (a) a->set_capture_graphs(graphs);
}

double default_memory_fraction() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_default_fraction;
}

}  // namespace allocwatch::torch_allocators
