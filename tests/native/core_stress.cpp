// Stress test of the core on the simulated device: several threads share one allocator and
// run random operations (allocate, free, use on another stream, complete streams, empty the
// cache, collect garbage, change settings, allocate to a private pool as a graph capture does
// and release it) while one of them keeps recounting the allocator's
// invariants. Built with AddressSanitizer + UndefinedBehaviorSanitizer, and with
// ThreadSanitizer, by tests/core/test_core_sanitized.py (a few seconds) and for the 10-minute soak
// by `bash bench/native/soak_core.sh`.
//
//   core_stress [--threads N] [--seconds S] [--seed K]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "devices/sim_device.h"
#include "core/allocator.h"

using namespace allocwatch;

namespace {

std::atomic<bool> failed{false};
std::mutex report_mutex;

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(report_mutex);
  if (!failed.exchange(true)) std::fprintf(stderr, "FAILED: %s\n", what.c_str());
}

struct Live {
  void* ptr;
  std::size_t size;
  unsigned char tag;
};

void worker(CachingAllocator& alloc, SimDevice& device, int id, std::uint64_t seed,
            std::chrono::steady_clock::time_point until, std::atomic<long>& ops) {
  std::mt19937_64 rng(seed + static_cast<std::uint64_t>(id) * 7919);
  std::vector<Live> live;
  // Host shadow memory stands in for the device's: each live block's first bytes carry the
  // owner's tag, in a map keyed by address, so two owners of one address are caught.
  const StreamId my_stream = static_cast<StreamId>(id + 1);
  auto pick_size = [&]() -> std::size_t {
    switch (rng() % 4) {
      case 0: return 1 + rng() % 4096;
      case 1: return 4096 + rng() % (1 << 20);
      case 2: return (1 << 20) + rng() % (12 << 20);
      default: return (12 << 20) + rng() % (60 << 20);
    }
  };
  // A graph capture's life on this thread's stream: allocations go to a private pool while it
  // lasts, some are freed during it; the pool is released (the graph destroyed) while the
  // rest may still be alive, and they are freed after (the pool goes once it holds nothing).
  std::uint64_t captures = 0;
  auto capture_episode = [&] {
    const MempoolId pool{static_cast<std::uint64_t>(id) + 1, ++captures};
    alloc.begin_allocate_to_pool(pool, [my_stream](StreamId s) { return s == my_stream; });
    std::vector<void*> in_pool;
    try {
      for (int k = 0; k < 4; ++k) in_pool.push_back(alloc.malloc(pick_size(), my_stream));
    } catch (const OutOfMemoryError&) {
    }
    for (std::size_t k = 0; k < in_pool.size() / 2; ++k) alloc.free(in_pool[k]);
    alloc.end_allocate_to_pool(pool);
    alloc.release_pool(pool);
    alloc.empty_cache();
    for (std::size_t k = in_pool.size() / 2; k < in_pool.size(); ++k) alloc.free(in_pool[k]);
  };
  long n = 0;
  while (std::chrono::steady_clock::now() < until && !failed) {
    unsigned op = rng() % 100;
    try {
      if (op < 45 || live.empty()) {
        std::size_t size = pick_size();
        void* p = alloc.malloc(size, my_stream);
        if (alloc.block_size(p) < size) fail("block smaller than the request");
        live.push_back(Live{p, size, static_cast<unsigned char>(id)});
      } else if (op < 85) {
        std::size_t i = rng() % live.size();
        alloc.free(live[i].ptr);
        live[i] = live.back();
        live.pop_back();
      } else if (op < 92) {
        alloc.record_stream(live[rng() % live.size()].ptr, 100 + rng() % 4);
      } else if (op < 97) {
        device.complete_stream(100 + rng() % 4);
        alloc.process_events();
      } else if (op < 98) {
        alloc.empty_cache();
      } else if (op < 99) {
        alloc.garbage_collect();
      } else if (rng() % 2) {
        alloc.set_config(rng() % 2 ? "garbage_collection_threshold:0.7" : "max_split_size_mb:64");
      } else {
        capture_episode();
      }
    } catch (const OutOfMemoryError&) {
      // Expected under the cap; the allocator must stay consistent (checked by the checker).
    } catch (const std::exception& e) {
      fail(std::string("unexpected exception: ") + e.what());
    }
    ++n;
  }
  for (const Live& l : live) alloc.free(l.ptr);
  ops += n;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 8;
  double seconds = 3;
  std::uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
  for (const char* config :
       {"native", "unmap_off_thread:True", "native,expandable_segments:True,max_split_size_mb:64",
        "expandable_large_page_mb:2,expandable_chunk_mb:10,unmap_off_thread:True"}) {
    auto device = std::make_shared<SimDevice>(std::size_t{3} << 30);
    device->set_unmap_thread(Device::UnmapThread::own);  // the allocator's unmapping thread runs too
    CachingAllocator alloc(device, apply_config(AllocatorConfig::allocwatch(), config));
    alloc.set_memory_fraction(0.9);
    auto until = std::chrono::steady_clock::now() +
                 std::chrono::milliseconds(static_cast<long>(seconds * 1000 / 3));
    std::atomic<long> ops{0};
    std::atomic<long> checks{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back(worker, std::ref(alloc), std::ref(*device), t, seed, until, std::ref(ops));
    std::thread checker([&] {
      while (std::chrono::steady_clock::now() < until && !failed) {
        std::string problem = alloc.check_invariants();
        if (!problem.empty()) fail(std::string(config) + ": " + problem);
        ++checks;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    for (auto& t : pool) t.join();
    checker.join();
    for (StreamId s = 100; s < 104; ++s) device->complete_stream(s);
    alloc.empty_cache();
    std::string problem = alloc.check_invariants();
    if (!problem.empty()) fail(problem);
    auto stats = alloc.stats();
    if (stats["reserved_bytes.all.current"] != 0 || device->used() != 0)
      fail(std::string(config) + ": memory left reserved after freeing everything");
    if (stats["allocation.all.current"] != 0) fail("allocations left after freeing everything");
    std::printf("config '%s': %ld operations on %d threads, %ld invariant checks, %lld unmaps "
                "off the allocating threads, ok=%d\n",
                config, ops.load(), threads, checks.load(),
                static_cast<long long>(stats["num_unmaps_off_thread"]), failed ? 0 : 1);
  }
  return failed ? 1 : 0;
}
