// Hot-path benchmark: alloc + free pairs of cached blocks, the core on the simulated device.
//
// Each pattern first warms the cache (so every pair is served from cached blocks, no device
// call), then times batches of pairs and reports the median nanoseconds per pair. Absolute
// figures are meaningful only on an otherwise idle host (the H200 machine's), per DESIGN.md.
//
//   bench/run_hotpath.sh            builds with g++ -O2 and runs
//   hotpath [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/sim_device.h"
#include "core/allocator.h"

using namespace allocwatch;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  std::string name;
  double median_ns;
  double p10_ns;
  double p90_ns;
};

double median(std::vector<double> v, double q = 0.5) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * (v.size() - 1))];
}

// Times `pairs` alloc+free pairs of the given sizes (cycled) with `live` blocks held.
Result run(const std::string& name, const std::string& config, std::vector<std::size_t> sizes,
           std::size_t live, std::size_t live_min, std::size_t live_max) {
  auto device = std::make_shared<SimDevice>();
  CachingAllocator alloc(device, apply_config(AllocatorConfig::allocwatch(), config));
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<std::size_t> live_size(live_min, live_max);
  std::vector<void*> held;
  held.reserve(live);
  for (std::size_t i = 0; i < live; ++i) held.push_back(alloc.malloc(live_size(rng), 0));
  // Warm: allocate each pattern size once and free it, so the pairs below hit the cache.
  for (int round = 0; round < 2; ++round) {
    std::vector<void*> warm;
    for (std::size_t s : sizes) warm.push_back(alloc.malloc(s, 0));
    for (void* p : warm) alloc.free(p);
  }
  const int batches = 41;
  const std::size_t pairs = 20000;
  std::vector<double> per_pair;
  for (int b = 0; b < batches; ++b) {
    auto t0 = Clock::now();
    for (std::size_t i = 0; i < pairs; ++i) {
      void* p = alloc.malloc(sizes[i % sizes.size()], 0);
      alloc.free(p);
    }
    auto t1 = Clock::now();
    per_pair.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / pairs);
  }
  if (device->counters().count("malloc") && device->counters().at("malloc").count > live + 64) {
    std::fprintf(stderr, "warning: %s made device calls inside the timed loop\n", name.c_str());
  }
  for (void* p : held) alloc.free(p);
  return Result{name, median(per_pair), median(per_pair, 0.1), median(per_pair, 0.9)};
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];

  std::vector<Result> results;
  for (const char* cfg : {"native", ""}) {
    std::string tag = *cfg ? "native" : "allocwatch";
    results.push_back(run(tag + " 512B", cfg, {512}, 0, 512, 512));
    results.push_back(run(tag + " 64KiB", cfg, {64 << 10}, 0, 512, 512));
    results.push_back(run(tag + " 4MiB", cfg, {4 << 20}, 0, 512, 512));
    results.push_back(run(tag + " 64MiB", cfg, {64 << 20}, 0, 512, 512));
    results.push_back(run(tag + " mix, 1000 in use", cfg,
                          {512, 4096, 64 << 10, 1 << 20, 4 << 20, 64 << 20}, 1000, 512, 64 << 20));
    results.push_back(run(tag + " scale 1000 in use", cfg, {512, 8192, 64 << 10}, 1000, 512, 64 << 10));
    results.push_back(run(tag + " scale 100000 in use", cfg, {512, 8192, 64 << 10}, 100000, 512, 64 << 10));
  }
  std::printf("%-36s %12s %12s %12s\n", "pattern", "median ns", "p10 ns", "p90 ns");
  for (const Result& r : results)
    std::printf("%-36s %12.1f %12.1f %12.1f\n", r.name.c_str(), r.median_ns, r.p10_ns, r.p90_ns);
  for (const char* tag : {"native", "allocwatch"}) {
    double small = 0, large = 0;
    for (const Result& r : results) {
      if (r.name == std::string(tag) + " scale 1000 in use") small = r.median_ns;
      if (r.name == std::string(tag) + " scale 100000 in use") large = r.median_ns;
    }
    std::printf("%s: 100000 in use / 1000 in use = %.2fx\n", tag, large / small);
  }
  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    std::fprintf(f, "{\"results\": [");
    for (std::size_t i = 0; i < results.size(); ++i)
      std::fprintf(f, "%s{\"pattern\": \"%s\", \"median_ns\": %.2f, \"p10_ns\": %.2f, \"p90_ns\": %.2f}",
                   i ? ", " : "", results[i].name.c_str(), results[i].median_ns, results[i].p10_ns,
                   results[i].p90_ns);
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
