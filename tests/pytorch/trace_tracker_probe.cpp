// A trace tracker attached as NCCL's process group attaches its own
// (c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker), keeping every entry it is
// given, for tests/pytorch/gpu_scenarios.py's trace_trackers scenario to read through ctypes.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace cca = c10::cuda::CUDACachingAllocator;

namespace {

struct Seen {
  int action;
  std::uint64_t addr;
  std::uint64_t size;
};

std::mutex seen_mutex;
std::vector<Seen> seen;

}  // namespace

#define PROBE_EXPORT extern "C" __attribute__((visibility("default")))

PROBE_EXPORT void probe_attach() {
  cca::attachAllocatorTraceTracker([](const cca::TraceEntry& e) {
    std::lock_guard<std::mutex> lock(seen_mutex);
    seen.push_back({static_cast<int>(e.action_), e.addr_, e.size_});
  });
}

PROBE_EXPORT int probe_count() {
  std::lock_guard<std::mutex> lock(seen_mutex);
  return static_cast<int>(seen.size());
}

// Entry i: its TraceEntry::Action, address and size; false past the end.
PROBE_EXPORT bool probe_entry(int i, int* action, std::uint64_t* addr, std::uint64_t* size) {
  std::lock_guard<std::mutex> lock(seen_mutex);
  if (i < 0 || i >= static_cast<int>(seen.size())) return false;
  *action = seen[i].action;
  *addr = seen[i].addr;
  *size = seen[i].size;
  return true;
}
