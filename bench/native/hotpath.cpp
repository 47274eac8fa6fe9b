// Hot-path benchmark: alloc + free pairs of cached blocks, the core on the simulated device.
//
// Every pattern first warms its cache (so every pair is served from cached blocks, no device
// call). Then the patterns take turns, one batch of pairs each per round, for `--rounds`
// rounds: a host whose speed drifts (a shared VM's CPU can change pace within seconds) slows
// every pattern alike instead of whichever ran then.
// Reported: each pattern's median over its batches (ns a pair), p10 and p90, and the ratio of
// 100,000 to 1,000 blocks in use taken round by round (adjacent batches), then its median.
// Absolute figures are meaningful only on an otherwise idle host (the GPU machine's).
//
//   bash bench/native/run_hotpath.sh   builds it (bench/CMakeLists.txt, Release) and runs it
//   hotpath [--rounds N] [--json FILE]
// ALLOCWATCH_ALLOC_CONF, as for the allocator in PyTorch, adds settings to allocwatch's
// defaults for the "allocwatch" patterns (to measure a candidate default).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "devices/sim_device.h"
#include "core/allocator.h"

using namespace allocwatch;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kPairsPerBatch = 20000;

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * (v.size() - 1))];
}

// One pattern: its own allocator, blocks held in use, and the sizes its pairs cycle through.
class Pattern {
 public:
  Pattern(std::string name, const std::string& config, std::vector<std::size_t> sizes,
          std::size_t live, std::size_t live_min, std::size_t live_max)
      : name_(std::move(name)),
        sizes_(std::move(sizes)),
        device_(std::make_shared<SimDevice>()),
        alloc_(device_, apply_config(AllocatorConfig::allocwatch(), config)) {
    std::mt19937_64 rng(42);
    std::uniform_int_distribution<std::size_t> live_size(live_min, live_max);
    held_.reserve(live);
    for (std::size_t i = 0; i < live; ++i) held_.push_back(alloc_.malloc(live_size(rng), 0));
    // Warm: allocate each pattern size once and free it, so the pairs below hit the cache.
    for (int round = 0; round < 2; ++round) {
      std::vector<void*> warm;
      for (std::size_t s : sizes_) warm.push_back(alloc_.malloc(s, 0));
      for (void* p : warm) alloc_.free(p);
    }
    device_calls_after_warmup_ = device_calls();
  }
  ~Pattern() {
    for (void* p : held_) alloc_.free(p);
  }

  // Times one batch of pairs; returns ns a pair.
  double batch() {
    auto t0 = Clock::now();
    for (std::size_t i = 0; i < kPairsPerBatch; ++i) {
      void* p = alloc_.malloc(sizes_[i % sizes_.size()], 0);
      alloc_.free(p);
    }
    auto t1 = Clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / kPairsPerBatch;
    per_pair_.push_back(ns);
    return ns;
  }

  bool made_device_calls() const { return device_calls() != device_calls_after_warmup_; }
  const std::string& name() const { return name_; }
  const std::vector<double>& per_pair() const { return per_pair_; }

 private:
  std::size_t device_calls() const {
    auto counters = device_->counters();
    auto it = counters.find("malloc");
    return it == counters.end() ? 0 : it->second.count;
  }

  std::string name_;
  std::vector<std::size_t> sizes_;
  std::shared_ptr<SimDevice> device_;
  CachingAllocator alloc_;
  std::vector<void*> held_;
  std::vector<double> per_pair_;
  std::size_t device_calls_after_warmup_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  int rounds = 41;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: hotpath [--rounds N] [--json FILE]\n");
      return 2;
    }
  }
  if (rounds < 1) {
    std::fprintf(stderr, "hotpath: --rounds must be at least 1\n");
    return 2;
  }

  const char* tags[] = {"native", "allocwatch"};
  const char* extra = std::getenv("ALLOCWATCH_ALLOC_CONF");
  const std::string ours = extra != nullptr ? extra : "";
  if (!ours.empty()) std::printf("allocwatch patterns with ALLOCWATCH_ALLOC_CONF=%s\n", extra);
  std::vector<std::unique_ptr<Pattern>> patterns;
  for (const char* tag : tags) {
    const std::string cfg = std::strcmp(tag, "native") == 0 ? "native" : ours;
    auto add = [&](const char* what, std::vector<std::size_t> sizes, std::size_t live,
                   std::size_t live_min, std::size_t live_max) {
      patterns.push_back(std::make_unique<Pattern>(std::string(tag) + " " + what, cfg,
                                                   std::move(sizes), live, live_min, live_max));
    };
    add("512B", {512}, 0, 512, 512);
    add("64KiB", {64 << 10}, 0, 512, 512);
    add("4MiB", {4 << 20}, 0, 512, 512);
    add("64MiB", {64 << 20}, 0, 512, 512);
    add("mix, 1000 in use", {512, 4096, 64 << 10, 1 << 20, 4 << 20, 64 << 20}, 1000, 512,
        64 << 20);
    add("scale 1000 in use", {512, 8192, 64 << 10}, 1000, 512, 64 << 10);
    add("scale 100000 in use", {512, 8192, 64 << 10}, 100000, 512, 64 << 10);
  }
  // Round by round; the two scale patterns of a setting run back to back, so their ratio in a
  // round compares batches taken under the same host conditions.
  std::vector<std::vector<double>> scale_ratios(2);
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      double ns = patterns[i]->batch();
      if (patterns[i]->name().find("scale 100000") != std::string::npos) {
        const double small = patterns[i - 1]->per_pair().back();
        scale_ratios[i < patterns.size() / 2 ? 0 : 1].push_back(ns / small);
      }
    }
  }

  std::printf("%-36s %12s %12s %12s\n", "pattern", "median ns", "p10 ns", "p90 ns");
  for (const auto& p : patterns) {
    std::printf("%-36s %12.1f %12.1f %12.1f\n", p->name().c_str(), quantile(p->per_pair(), 0.5),
                quantile(p->per_pair(), 0.1), quantile(p->per_pair(), 0.9));
    if (p->made_device_calls())
      std::fprintf(stderr, "warning: %s made device calls inside the timed loop\n",
                   p->name().c_str());
  }
  for (int t = 0; t < 2; ++t)
    std::printf("%s: 100000 in use / 1000 in use = %.2fx (median of %d rounds)\n", tags[t],
                quantile(scale_ratios[t], 0.5), rounds);
  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    if (f == nullptr) {
      std::perror(json);
      return 1;
    }
    std::fprintf(f, "{\"rounds\": %d, \"pairs_per_batch\": %zu, \"allocwatch_settings\": \"%s\", "
                 "\"results\": [", rounds, kPairsPerBatch, ours.c_str());
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      const auto& v = patterns[i]->per_pair();
      std::fprintf(f,
                   "%s{\"pattern\": \"%s\", \"median_ns\": %.2f, \"p10_ns\": %.2f, "
                   "\"p90_ns\": %.2f}",
                   i ? ", " : "", patterns[i]->name().c_str(), quantile(v, 0.5),
                   quantile(v, 0.1), quantile(v, 0.9));
    }
    std::fprintf(f, "], \"scale_ratio\": {\"native\": %.3f, \"allocwatch\": %.3f}}\n",
                 quantile(scale_ratios[0], 0.5), quantile(scale_ratios[1], 0.5));
    std::fclose(f);
  }
  return 0;
}
