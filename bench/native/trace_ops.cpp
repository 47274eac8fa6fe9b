// A recorded trace's program through the core on the simulated device, timed an operation: what
// the allocator's own bookkeeping costs the host on a real workload's sequence of sizes, under
// several settings (the hot-path benchmark times fixed patterns instead).
//
// The program comes from bench/replay/trace_program.py. Each setting replays it on an allocator
// of its own, twice untimed (the layout settles, as a training run's does after its first
// steps), then once a round, the settings taking turns so that a host whose pace drifts slows
// each alike. Every event completes at once: a free is reused at once, as on its own stream.
// Reported: each setting's median ns an operation over the rounds, its ratio to the first
// setting's taken round by round, and the device calls of its timed passes.
//
//   bash bench/native/run_trace_ops.sh TRACE [--rounds N] [--json FILE] [SETTING...]
//   trace_ops PROGRAM [--rounds N] [--json FILE] SETTING...
// A setting is a PYTORCH_CUDA_ALLOC_CONF-style string applied to allocwatch's defaults
// ("native,..." starts from PyTorch's); "defaults" is allocwatch's defaults as they are.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "devices/sim_device.h"
#include "core/allocator.h"

using namespace allocwatch;

namespace {

struct Op {
  bool alloc;
  std::size_t id;
  std::size_t size;
  StreamId stream;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "trace_ops: %s\n", what.c_str());
  std::exit(2);
}

std::vector<Op> read_program(const char* path, std::size_t* ids) {
  std::ifstream in(path);
  if (!in) fail(std::string("cannot read ") + path);
  std::string line;
  std::getline(in, line);
  std::istringstream header(line);
  std::string magic;
  int version = 0;
  std::size_t count = 0;
  if (!(header >> magic >> version >> count >> *ids) || magic != "allocwatch-program" ||
      version != 1)
    fail(std::string(path) + ": not a program of bench/replay/trace_program.py (line 1: '" +
         line + "')");
  std::vector<Op> ops;
  ops.reserve(count);
  std::vector<bool> live(*ids, false);
  for (std::size_t n = 2; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    std::istringstream f(line);
    char kind = 0;
    Op op{};
    bool ok = static_cast<bool>(f >> kind >> op.id) && op.id < *ids;
    if (ok && kind == 'a') {
      op.alloc = true;
      ok = static_cast<bool>(f >> op.size >> op.stream) && !live[op.id];
      if (ok) live[op.id] = true;
    } else if (ok && kind == 'f') {
      ok = live[op.id];
      if (ok) live[op.id] = false;
    } else {
      ok = false;
    }
    if (!ok) fail(std::string(path) + ":" + std::to_string(n) + ": bad operation '" + line + "'");
    ops.push_back(op);
  }
  if (ops.size() != count)
    fail(std::string(path) + ": " + std::to_string(ops.size()) + " operations, the header says " +
         std::to_string(count));
  return ops;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::size_t device_calls(const SimDevice& d) {
  std::size_t calls = 0;
  for (const auto& [name, c] : d.counters()) calls += c.count;
  return calls;
}

// One setting: its allocator, and the program's pointers by id.
class Run {
 public:
  Run(std::string setting, const std::vector<Op>& ops, std::size_t ids)
      : setting_(std::move(setting)),
        ops_(ops),
        ptrs_(ids, nullptr),
        device_(std::make_shared<SimDevice>()),
        alloc_(device_, setting_ == "defaults"
                            ? AllocatorConfig::allocwatch()
                            : apply_config(AllocatorConfig::allocwatch(), setting_)) {
    device_->set_auto_complete(true);
    pass();
    pass();
    calls_before_timed_ = device_calls(*device_);
  }

  // Replays the program once; returns ns an operation.
  double pass() {
    const auto t0 = std::chrono::steady_clock::now();
    for (const Op& op : ops_) {
      if (op.alloc) {
        ptrs_[op.id] = alloc_.malloc(op.size, op.stream);
      } else {
        alloc_.free(ptrs_[op.id]);
        ptrs_[op.id] = nullptr;
      }
    }
    for (void*& p : ptrs_) {  // what the trace still held at its end
      if (p != nullptr) alloc_.free(p);
      p = nullptr;
    }
    const auto dt = std::chrono::steady_clock::now() - t0;
    return std::chrono::duration<double, std::nano>(dt).count() / static_cast<double>(ops_.size());
  }

  const std::string& setting() const { return setting_; }
  std::size_t timed_device_calls() const { return device_calls(*device_) - calls_before_timed_; }
  std::vector<double> ns;

 private:
  std::string setting_;
  const std::vector<Op>& ops_;
  std::vector<void*> ptrs_;
  std::shared_ptr<SimDevice> device_;
  CachingAllocator alloc_;
  std::size_t calls_before_timed_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const char* program = nullptr;
  const char* json = nullptr;
  int rounds = 15;
  std::vector<std::string> settings;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (argv[i][0] == '-') {
      program = nullptr;  // an option it does not know: the usage below
      break;
    } else if (program == nullptr) {
      program = argv[i];
    } else {
      settings.emplace_back(argv[i]);
    }
  }
  if (program == nullptr || settings.empty()) {
    std::fprintf(stderr, "usage: trace_ops PROGRAM [--rounds N] [--json FILE] SETTING...\n");
    return 2;
  }
  if (rounds < 1) fail("--rounds must be at least 1");
  std::size_t ids = 0;
  const std::vector<Op> ops = read_program(program, &ids);
  if (ops.empty()) fail(std::string(program) + ": no operations");

  std::vector<std::unique_ptr<Run>> runs;
  for (const std::string& s : settings) {
    try {
      runs.push_back(std::make_unique<Run>(s, ops, ids));
    } catch (const std::exception& e) {  // a bad setting, or a program the device cannot hold
      fail("setting '" + s + "': " + e.what());
    }
  }
  std::vector<std::vector<double>> ratios(runs.size());
  for (int r = 0; r < rounds; ++r) {
    for (auto& run : runs) run->ns.push_back(run->pass());
    for (std::size_t i = 0; i < runs.size(); ++i)
      ratios[i].push_back(runs[i]->ns.back() / runs[0]->ns.back());
  }

  std::printf("%zu operations, %d rounds\n%-44s %12s %16s %14s\n", ops.size(), rounds, "setting",
              "median ns/op", "ratio to first", "device calls");
  for (std::size_t i = 0; i < runs.size(); ++i)
    std::printf("%-44s %12.1f %16.3f %14zu\n", runs[i]->setting().c_str(), median(runs[i]->ns),
                median(ratios[i]), runs[i]->timed_device_calls());
  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    if (f == nullptr) {
      std::perror(json);
      return 1;
    }
    std::fprintf(f, "{\"operations\": %zu, \"rounds\": %d, \"results\": [", ops.size(), rounds);
    for (std::size_t i = 0; i < runs.size(); ++i)
      std::fprintf(f,
                   "%s{\"setting\": \"%s\", \"median_ns_per_op\": %.2f, \"ratio_to_first\": "
                   "%.4f, \"timed_device_calls\": %zu}",
                   i ? ", " : "", runs[i]->setting().c_str(), median(runs[i]->ns),
                   median(ratios[i]), runs[i]->timed_device_calls());
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
