// What each kind of device call costs on the GPU, measured through the cuda back end itself
// (CudaDevice), so that it times exactly the calls the allocator core makes.
//
// For each kind (segment alloc/free, create, map + set access, unmap, release, address reserve
// and free, device synchronisation) it times many repeats at each size, takes the median, and
// fits fixed_seconds + seconds_per_byte. The JSON it writes (--json FILE) is the cost table
// that trace replay prices device calls with.
//
//   bash bench/native/build_native.sh && build/native/device_call_costs --json device_costs.json
// Printed: a table of each call and size (p10, median, p90 and the fit, µs); --quick times
// fewer sizes. Then the driver probes: one unmap over several mappings; pieces of one
// allocation mapped at offsets; a 1000 MiB growth made back to back; one page's calls while
// the device works (the table's are on an idle device).
//
// Every driver call is checked: CudaDevice throws on any error, and an out-of-memory answer
// (false) is turned into an error here, since the sizes are chosen to fit.
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "devices/cuda_device.h"
#include "devices/cuda_driver.h"
#include "cost_fit.h"

namespace {

using allocwatch::CudaDevice;
using allocwatch::DeviceError;
using allocwatch::PhysicalHandle;
using allocwatch::cuda::CUDA_ERROR_NOT_READY;
using allocwatch::cuda::CUDA_SUCCESS;
using allocwatch::cuda::CudaDriver;
using allocwatch::cuda::CUevent;
using allocwatch::cuda::CUresult;
using allocwatch::cuda::CUstream;
using allocwatch::cuda::cuda_driver;
using allocwatch::bench::CostFit;
using allocwatch::bench::CostPoint;
using allocwatch::bench::fit_cost;
using allocwatch::bench::quantile;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

// kind -> bytes -> seconds of each repeat
using Samples = std::map<std::string, std::map<std::size_t, std::vector<double>>>;

// The kinds of the cost table, in the order replay reports them, and the extras measured for
// information only (kept out of "calls" so that a reader of the table sees only its keys).
const std::vector<std::string> kTableKinds = {"segment_alloc", "segment_free", "create",
                                              "map",           "map_only",     "set_access",
                                              "unmap",         "release",      "reserve",
                                              "address_free",  "synchronize"};
const std::vector<std::string> kExtraKinds = {"synchronize_stream", "event_record",
                                              "event_query", "stream_wait_event"};

struct Options {
  int device = 0;
  int repeats = 25;
  int warmup = 3;
  bool quick = false;
  std::string json_path;
  std::string command;
};

void usage() {
  std::cerr << "usage: device_call_costs [--device N] [--repeats N] [--quick] [--json FILE]\n"
               "  --quick   2/20/128 MiB only, 5 repeats: a smoke run, not a measurement\n";
}

std::string shell_join(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i) out += ' ';
    if (arg.find_first_of(" \t\"'$") != std::string::npos) {
      out += "'" + arg + "'";
    } else {
      out += arg;
    }
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  o.command = shell_join(argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--device") {
      o.device = std::stoi(value());
    } else if (a == "--repeats") {
      o.repeats = std::stoi(value());
    } else if (a == "--json") {
      o.json_path = value();
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      std::cerr << "unknown argument: " << a << "\n";
      usage();
      std::exit(2);
    }
  }
  if (o.quick) {
    o.repeats = 5;
    o.warmup = 1;
  }
  if (o.repeats < 1) {
    std::cerr << "--repeats must be at least 1\n";
    std::exit(2);
  }
  return o;
}

template <typename Call>
double seconds_of(Call&& call) {
  auto start = std::chrono::steady_clock::now();
  call();
  auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

void require(bool ok, const std::string& what) {
  if (!ok) throw DeviceError(what);
}

// A symbol of the already loaded driver, for the memory check below only (the back end has no
// reason to memset or copy).
template <typename Fn>
Fn driver_symbol(const char* name) {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  require(library != nullptr, "libcuda.so.1 is not loaded");
  void* symbol = dlsym(library, name);
  require(symbol != nullptr, std::string("the CUDA driver has no symbol ") + name);
  return reinterpret_cast<Fn>(symbol);
}

// Before timing anything, prove that the back end's memory is real and usable: write it from
// the device and read it back, through a mapped expandable range and through a plain segment.
// A wrong struct layout (CUmemAccessDesc, CUmemAllocationProp) fails here, loudly.
// Writes `value` over [address, address + size) with the driver and reads back both ends.
void fill_and_verify(CudaDevice& device, std::uintptr_t address, std::size_t size,
                     unsigned char value) {
  using MemsetD8 = int (*)(unsigned long long, unsigned char, std::size_t);
  using CopyToHost = int (*)(void*, unsigned long long, std::size_t);
  auto memset_d8 = driver_symbol<MemsetD8>("cuMemsetD8_v2");
  auto copy_to_host = driver_symbol<CopyToHost>("cuMemcpyDtoH_v2");
  require(memset_d8(address, value, size) == 0, "cuMemsetD8_v2 on back-end memory failed");
  device.synchronize();
  std::vector<unsigned char> head(4096), tail(4096);
  require(copy_to_host(head.data(), address, head.size()) == 0, "cuMemcpyDtoH_v2 failed");
  require(copy_to_host(tail.data(), address + size - tail.size(), tail.size()) == 0,
          "cuMemcpyDtoH_v2 failed");
  for (std::size_t i = 0; i < head.size(); ++i) {
    require(head[i] == value && tail[i] == value, "device memory read back wrong bytes");
  }
}

void check_memory_is_usable(CudaDevice& device) {
  auto fill_and_verify = [&](std::uintptr_t address, std::size_t size, unsigned char value) {
    ::fill_and_verify(device, address, size, value);
  };

  if (device.supports_virtual_memory()) {
    std::size_t page = device.granularity();
    std::uintptr_t base = device.reserve_address(4 * page, page);
    PhysicalHandle first = 0, second = 0;
    require(device.create_physical(page, &first), "cuMemCreate: out of memory");
    require(device.create_physical(page, &second), "cuMemCreate: out of memory");
    device.map(base, page, first);
    device.map(base + page, page, second);  // two handles back to back, as segments grow
    fill_and_verify(base, 2 * page, 0xA5);
    device.unmap(base, page);
    device.unmap(base + page, page);
    device.release_physical(first, page);
    device.release_physical(second, page);
    device.free_address(base, 4 * page);
  }
  void* segment = nullptr;
  require(device.malloc(20 * MiB, &segment), "cuMemAlloc: out of memory");
  fill_and_verify(reinterpret_cast<std::uintptr_t>(segment), 20 * MiB, 0x5A);
  device.free(segment, 20 * MiB);

  auto event = device.record_event(0);
  device.wait_event(event);
  require(device.query_event(event), "an event waited on is not complete");
  device.release_event(event);
  require(!device.is_capturing(0), "the default stream reports a capture in progress");
  device.synchronize_stream(0);
}

void time_virtual_memory_cycle(CudaDevice& device, std::size_t size, Samples* out) {
  std::uintptr_t base = 0;
  PhysicalHandle handle = 0;
  bool created = false;
  (*out)["reserve"][size].push_back(
      seconds_of([&] { base = device.reserve_address(size, device.granularity()); }));
  (*out)["create"][size].push_back(
      seconds_of([&] { created = device.create_physical(size, &handle); }));
  require(created, "cuMemCreate of " + std::to_string(size) + " bytes: out of memory");
  (*out)["map"][size].push_back(seconds_of([&] { device.map(base, size, handle); }));
  (*out)["unmap"][size].push_back(seconds_of([&] { device.unmap(base, size); }));
  // The two halves of map, as map_range issues them (one set_access per mapped range).
  (*out)["map_only"][size].push_back(seconds_of([&] { device.map_no_access(base, size, handle); }));
  (*out)["set_access"][size].push_back(seconds_of([&] { device.set_access(base, size); }));
  device.unmap(base, size);
  (*out)["release"][size].push_back(
      seconds_of([&] { device.release_physical(handle, size); }));
  (*out)["address_free"][size].push_back(
      seconds_of([&] { device.free_address(base, size); }));
}

void time_segment_cycle(CudaDevice& device, std::size_t size, Samples* out) {
  void* segment = nullptr;
  bool allocated = false;
  (*out)["segment_alloc"][size].push_back(
      seconds_of([&] { allocated = device.malloc(size, &segment); }));
  require(allocated, "cuMemAlloc of " + std::to_string(size) + " bytes: out of memory");
  (*out)["segment_free"][size].push_back(seconds_of([&] { device.free(segment, size); }));
}

// Calls whose cost does not depend on a size, recorded at size 0.
void time_sizeless_calls(CudaDevice& device, Samples* out) {
  (*out)["synchronize"][0].push_back(seconds_of([&] { device.synchronize(); }));
  (*out)["synchronize_stream"][0].push_back(seconds_of([&] { device.synchronize_stream(0); }));
  allocwatch::EventId event = 0;
  (*out)["event_record"][0].push_back(seconds_of([&] { event = device.record_event(0); }));
  device.wait_event(event);
  bool done = false;
  (*out)["event_query"][0].push_back(seconds_of([&] { done = device.query_event(event); }));
  require(done, "a completed event queried as not ready");
  // A page moved from another stream: the receiving stream waits for it on the device.
  (*out)["stream_wait_event"][0].push_back(
      seconds_of([&] { device.stream_wait_event(0, event); }));
  device.release_event(event);
}

// What the driver allows beyond the calls the allocator makes today, for two designs that
// would cut expandable segments' costs (docs/benchmarks.md, "Fragmentation"): one cuMemUnmap
// over a range made of several mappings (one handle each) instead of one call per mapping,
// and pieces of one physical allocation mapped at separate addresses (cuMemMap's offset), one
// of them unmapped while the others stay in use. Run after the cost table is measured; every
// answer is reported and nothing here is fatal: the probes call the driver directly and clean
// up with direct calls whose results are ignored.
constexpr int kPieces = 8;

struct Probes {
  std::string error;                  // what stopped the probes early, if anything
  int span_result = -1;               // CUresult of one cuMemUnmap over kPieces mappings
  // A growth of kBurstBytes as the allocator makes it: created and mapped one 2 MiB page at a
  // time, or in kBurstChunk chunks, one set_access over the range either way; seconds each.
  std::vector<double> burst_pages_s, burst_chunks_s;
  std::vector<double> span_s;         // its times, when it worked
  std::vector<double> separate_s;     // kPieces cuMemUnmap calls, one per mapping
  std::string offset_step = "not run";  // "ok", or the step that was refused
  int offset_result = -1;             // CUresult of that step (0: all worked)
  // One page's calls first after a device synchronisation and while the device works, seconds
  // each by call (kBusyCalls); in how many rounds the work still ran after the calls.
  std::map<std::string, std::vector<double>> after_synchronize_s, busy_s;
  int busy_rounds = 0, still_running = 0;
  // The work's own time, alone and with kBusyPages pages' calls made meanwhile, seconds.
  std::vector<double> work_alone_s, work_with_calls_s;
};

void probe_range_calls(CudaDevice& device, int repeats, Probes* probes) {
  using Unmap = int (*)(unsigned long long, std::size_t);
  using Map = int (*)(unsigned long long, std::size_t, std::size_t, unsigned long long,
                      unsigned long long);
  auto unmap = driver_symbol<Unmap>("cuMemUnmap");
  auto map = driver_symbol<Map>("cuMemMap");
  const std::size_t page = device.granularity();
  const std::uintptr_t base = device.reserve_address(kPieces * page, page);
  auto unmap_each_ignoring_errors = [&] {
    for (int i = 0; i < kPieces; ++i) unmap(base + i * page, page);
  };

  std::vector<PhysicalHandle> handles(kPieces);
  for (auto& h : handles) require(device.create_physical(page, &h), "cuMemCreate: out of memory");
  auto map_all = [&] {
    for (int i = 0; i < kPieces; ++i) device.map_no_access(base + i * page, page, handles[i]);
    device.set_access(base, kPieces * page);
  };
  for (int r = 0; r < repeats; ++r) {
    map_all();
    int result = 0;
    const double seconds = seconds_of([&] { result = unmap(base, kPieces * page); });
    probes->span_result = result;
    if (result != 0) {  // refused; whatever is still mapped is undone one by one
      unmap_each_ignoring_errors();
      break;
    }
    probes->span_s.push_back(seconds);
    map_all();
    probes->separate_s.push_back(seconds_of(unmap_each_ignoring_errors));
  }
  for (auto h : handles) device.release_physical(h, page);

  PhysicalHandle whole = 0;
  require(device.create_physical(kPieces * page, &whole), "cuMemCreate: out of memory");
  int mapped = 0;  // pieces mapped, in reverse order: piece i at slot kPieces - 1 - i
  probes->offset_step = "map by offset";
  for (; mapped < kPieces; ++mapped) {
    probes->offset_result = map(base + (kPieces - 1 - mapped) * page, page, mapped * page, whole, 0);
    if (probes->offset_result != 0) break;
  }
  bool middle_unmapped = false;
  if (mapped == kPieces) {
    device.set_access(base, kPieces * page);
    fill_and_verify(device, base, kPieces * page, 0x3C);
    probes->offset_step = "unmap one piece";
    probes->offset_result = unmap(base + 3 * page, page);
    middle_unmapped = probes->offset_result == 0;
    if (middle_unmapped) {
      fill_and_verify(device, base, 3 * page, 0xC3);  // the other pieces still usable
      fill_and_verify(device, base + 4 * page, (kPieces - 4) * page, 0xC3);
      probes->offset_step = "ok";
    }
  }
  for (int i = 0; i < mapped; ++i) {
    const int slot = kPieces - 1 - i;
    if (!(middle_unmapped && slot == 3)) unmap(base + slot * page, page);
  }
  device.release_physical(whole, kPieces * page);
  device.free_address(base, kPieces * page);
}

// The cost table times one call at a time, each after other sizes' calls; a warm-up grows by
// hundreds of pages in a row. This times such a growth whole, single pages against chunks, so
// that the table's per-page price (create + map_only, one set_access a range) can be checked
// against the calls made back to back.
constexpr std::size_t kBurstBytes = 1000 * MiB;
constexpr std::size_t kBurstChunk = 10 * MiB;  // expandable_chunk_mb's default

void probe_growth_burst(CudaDevice& device, int repeats, Probes* probes) {
  const std::uintptr_t base = device.reserve_address(kBurstBytes, device.granularity());
  auto grow = [&](std::size_t piece, std::vector<double>* out) {
    std::vector<PhysicalHandle> handles(kBurstBytes / piece);
    out->push_back(seconds_of([&] {
      for (std::size_t i = 0; i < handles.size(); ++i) {
        require(device.create_physical(piece, &handles[i]), "cuMemCreate: out of memory");
        device.map_no_access(base + i * piece, piece, handles[i]);
      }
      device.set_access(base, kBurstBytes);
    }));
    fill_and_verify(device, base, kBurstBytes, 0x5A);
    for (std::size_t i = 0; i < handles.size(); ++i) {
      device.unmap(base + i * piece, piece);
      device.release_physical(handles[i], piece);
    }
  };
  for (int r = 0; r < repeats; ++r) {  // alternated, so that drift spreads over both
    grow(device.granularity(), &probes->burst_pages_s);
    grow(kBurstChunk, &probes->burst_chunks_s);
  }
  device.free_address(base, kBurstBytes);
}

// The table times each call on an idle device; the allocator moves pages while training
// kernels run. This times one page's calls both ways: first after a device synchronisation,
// and while a queue of memsets (about kBusySeconds of work on the default stream) runs. Whether
// the work still runs after the calls tells whether any of them waited for the device; the
// work's own time (device events), alone and with kBusyPages pages created, mapped, unmapped
// and released meanwhile, whether the calls hold the device up.
constexpr double kBusySeconds = 0.05;
constexpr std::size_t kBusyBytes = 1 * GiB;
constexpr int kBusyPages = 40;
const std::vector<std::string> kBusyCalls = {"create", "map_only", "set_access", "unmap",
                                             "release"};
void probe_calls_while_busy(CudaDevice& device, int repeats, Probes* probes) {
  // The events come from the back end's driver table; what the back end never calls, by name.
  const CudaDriver& driver = cuda_driver();
  using MemsetD8Async = CUresult (*)(unsigned long long, unsigned char, std::size_t, CUstream);
  using StreamQuery = CUresult (*)(CUstream);
  using EventElapsed = CUresult (*)(float*, CUevent, CUevent);
  auto memset_async = driver_symbol<MemsetD8Async>("cuMemsetD8Async");
  auto stream_query = driver_symbol<StreamQuery>("cuStreamQuery");
  auto event_elapsed = driver_symbol<EventElapsed>("cuEventElapsedTime");
  void* buffer = nullptr;
  require(device.malloc(kBusyBytes, &buffer), "cuMemAlloc of the busy buffer: out of memory");
  CUevent start = nullptr;
  CUevent end = nullptr;
  require(driver.cuEventCreate(&start, 0) == CUDA_SUCCESS &&
              driver.cuEventCreate(&end, 0) == CUDA_SUCCESS,
          "cuEventCreate failed");
  const auto work = [&](int memsets) {
    for (int i = 0; i < memsets; ++i)
      require(memset_async(reinterpret_cast<unsigned long long>(buffer),
                           static_cast<unsigned char>(i), kBusyBytes, nullptr) == CUDA_SUCCESS,
              "cuMemsetD8Async failed");
  };
  device.synchronize();
  const double one = seconds_of([&] {
    work(1);
    device.synchronize();
  });
  const int memsets = std::clamp(static_cast<int>(kBusySeconds / std::max(one, 1e-6)) + 1, 1, 512);
  const std::size_t page = device.granularity();
  const std::uintptr_t base = device.reserve_address(kBusyPages * page, page);
  auto cycle = [&](std::size_t i, std::map<std::string, std::vector<double>>* out) {
    const std::uintptr_t at = base + i * page;
    PhysicalHandle handle = 0;
    bool created = false;
    const double create = seconds_of([&] { created = device.create_physical(page, &handle); });
    require(created, "cuMemCreate: out of memory");
    const double map = seconds_of([&] { device.map_no_access(at, page, handle); });
    const double access = seconds_of([&] { device.set_access(at, page); });
    const double unmap = seconds_of([&] { device.unmap(at, page); });
    const double release = seconds_of([&] { device.release_physical(handle, page); });
    if (out == nullptr) return;
    for (const auto& [call, s] : {std::pair{"create", create}, std::pair{"map_only", map},
                                  std::pair{"set_access", access}, std::pair{"unmap", unmap},
                                  std::pair{"release", release}})
      (*out)[call].push_back(s);
  };
  // The work alone and with pages changing hands meanwhile, on the device's own clock.
  auto timed_work = [&](bool with_calls) {
    require(driver.cuEventRecord(start, nullptr) == CUDA_SUCCESS, "cuEventRecord failed");
    work(memsets);
    require(driver.cuEventRecord(end, nullptr) == CUDA_SUCCESS, "cuEventRecord failed");
    if (with_calls) {
      for (int i = 0; i < kBusyPages; ++i) cycle(i, i == 0 ? &probes->busy_s : nullptr);
      if (stream_query(nullptr) == CUDA_ERROR_NOT_READY) probes->still_running++;
    }
    require(driver.cuEventSynchronize(end) == CUDA_SUCCESS, "cuEventSynchronize failed");
    float ms = 0;
    require(event_elapsed(&ms, start, end) == CUDA_SUCCESS, "cuEventElapsedTime failed");
    (with_calls ? probes->work_with_calls_s : probes->work_alone_s).push_back(ms * 1e-3);
  };
  for (int r = 0; r < repeats; ++r) {  // alternated, so that drift spreads over both
    device.synchronize();
    cycle(0, &probes->after_synchronize_s);
    timed_work(false);
    timed_work(true);
    probes->busy_rounds++;
  }
  device.synchronize();
  driver.cuEventDestroy(start);
  driver.cuEventDestroy(end);
  device.free_address(base, kBusyPages * page);
  device.free(buffer, kBusyBytes);
}

Probes run_probes(CudaDevice& device, int repeats) {
  Probes probes;
  try {
    probe_range_calls(device, repeats, &probes);
    probe_growth_burst(device, repeats, &probes);
    probe_calls_while_busy(device, repeats, &probes);
  } catch (const std::exception& e) {
    probes.error = e.what();
  }
  if (!probes.error.empty()) std::printf("probes stopped early: %s\n", probes.error.c_str());
  if (!probes.burst_pages_s.empty() && !probes.burst_chunks_s.empty()) {
    const double pages = double(kBurstBytes / device.granularity());
    const double chunks = double(kBurstBytes / kBurstChunk);
    const double pages_s = quantile(probes.burst_pages_s, 0.5);
    const double chunks_s = quantile(probes.burst_chunks_s, 0.5);
    std::printf("probe: %zu MiB grown in a row: %.0f single pages %.1f ms (%.2f us a page), "
                "%.0f chunks of %zu MiB %.1f ms (%.2f us a chunk)\n",
                kBurstBytes / MiB, pages, pages_s * 1e3, pages_s / pages * 1e6, chunks,
                kBurstChunk / MiB, chunks_s * 1e3, chunks_s / chunks * 1e6);
  }
  if (probes.busy_rounds > 0) {
    std::printf("probe: one page's calls first after a synchronisation -> while the device works "
                "(median us):");
    for (const std::string& call : kBusyCalls)
      std::printf(" %s %.1f -> %.1f", call.c_str(),
                  quantile(probes.after_synchronize_s.at(call), 0.5) * 1e6,
                  quantile(probes.busy_s.at(call), 0.5) * 1e6);
    std::printf("; the work still ran after %d pages' calls in %d of %d; the work %.2f ms alone, "
                "%.2f ms with them\n",
                kBusyPages, probes.still_running, probes.busy_rounds,
                quantile(probes.work_alone_s, 0.5) * 1e3,
                quantile(probes.work_with_calls_s, 0.5) * 1e3);
  }
  if (probes.span_result == 0) {
    std::printf("probe: one cuMemUnmap over %d mappings works: %.1f us (one call each: %.1f us)\n",
                kPieces, quantile(probes.span_s, 0.5) * 1e6,
                probes.separate_s.empty() ? 0.0 : quantile(probes.separate_s, 0.5) * 1e6);
  } else {
    std::printf("probe: one cuMemUnmap over %d mappings refused (CUresult %d)\n", kPieces,
                probes.span_result);
  }
  std::printf("probe: pieces of one allocation mapped by offset, one unmapped: %s (%s, CUresult %d)\n",
              probes.offset_step == "ok" ? "works" : "refused", probes.offset_step.c_str(),
              probes.offset_result);
  return probes;
}

std::string nvidia_driver_version() {
  // The kernel module's version (e.g. 580.95.05), which cuDriverGetVersion does not give: the
  // first number after "Module" ("... Kernel Module  580.95.05 ..." or, for the open module,
  // "... Open Kernel Module for x86_64  580.95.05 ...").
  std::ifstream file("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(file, line)) return "unknown";
  std::istringstream words(line);
  std::string word;
  bool after_module = false;
  while (words >> word) {
    if (word == "Module") after_module = true;
    else if (after_module && std::isdigit(static_cast<unsigned char>(word[0]))) return word;
  }
  return "unknown";
}

std::string today() {
  std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%d", std::gmtime(&now));
  return buffer;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_number(double value) {
  std::ostringstream s;
  s << std::setprecision(6) << value;
  return s.str();
}

std::vector<CostPoint> medians(const std::map<std::size_t, std::vector<double>>& by_size) {
  std::vector<CostPoint> points;
  for (const auto& [bytes, seconds] : by_size) {
    points.push_back({static_cast<double>(bytes), quantile(seconds, 0.5)});
  }
  return points;
}

std::string size_label(std::size_t bytes) {
  if (bytes == 0) return "-";
  if (bytes % GiB == 0) return std::to_string(bytes / GiB) + " GiB";
  return std::to_string(bytes / MiB) + " MiB";
}

void print_table(const Samples& samples, const std::map<std::string, CostFit>& fits) {
  std::printf("\n%-18s %9s %12s %12s %12s %12s\n", "call", "size", "p10 us", "median us",
              "p90 us", "fit us");
  for (const auto& [kind, by_size] : samples) {
    for (const auto& [bytes, seconds] : by_size) {
      std::printf("%-18s %9s %12.2f %12.2f %12.2f %12.2f\n", kind.c_str(),
                  size_label(bytes).c_str(), quantile(seconds, 0.1) * 1e6,
                  quantile(seconds, 0.5) * 1e6, quantile(seconds, 0.9) * 1e6,
                  fits.at(kind).predict(static_cast<double>(bytes)) * 1e6);
    }
  }
  std::printf("\n%-18s %14s %18s %16s\n", "call", "fixed us", "per GiB us", "worst fit err");
  for (const auto& [kind, fit] : fits) {
    std::printf("%-18s %14.2f %18.1f %15.0f%%\n", kind.c_str(), fit.fixed_s * 1e6,
                fit.per_byte_s * static_cast<double>(GiB) * 1e6, fit.worst_relative_error * 100);
  }
}

void write_json(const std::string& path, const Options& options, CudaDevice& device,
                const Samples& samples, const std::map<std::string, CostFit>& fits,
                const Probes& probes) {
  auto fit_entry = [&](const std::string& kind) {
    const CostFit& fit = fits.at(kind);
    return "{\"fixed_s\": " + json_number(fit.fixed_s) +
           ", \"per_byte_s\": " + json_number(fit.per_byte_s) + "}";
  };
  std::ostringstream j;
  j << "{\n";
  j << "  \"device\": " << json_string(device.name()) << ",\n";
  j << "  \"driver\": " << json_string(nvidia_driver_version()) << ",\n";
  j << "  \"cuda_driver_version\": " << device.driver_version() << ",\n";
  j << "  \"measured_on\": " << json_string(today()) << ",\n";
  j << "  \"command\": " << json_string(options.command) << ",\n";
  j << "  \"granularity_bytes\": " << device.granularity() << ",\n";
  j << "  \"repeats\": " << options.repeats << ",\n";
  auto median_or_null = [](const std::vector<double>& v) {
    return v.empty() ? std::string("null") : json_number(quantile(v, 0.5));
  };
  j << "  \"probes\": {\"error\": " << (probes.error.empty() ? "null" : json_string(probes.error))
    << ", \"unmap_spanning_mappings\": {\"mappings\": " << kPieces
    << ", \"cu_result\": " << probes.span_result
    << ", \"one_call_s\": " << median_or_null(probes.span_s)
    << ", \"one_call_per_mapping_s\": " << median_or_null(probes.separate_s)
    << "}, \"map_pieces_by_offset\": {\"step\": " << json_string(probes.offset_step)
    << ", \"cu_result\": " << probes.offset_result << "}"
    << ", \"growth_burst\": {\"bytes\": " << kBurstBytes << ", \"chunk_bytes\": " << kBurstChunk
    << ", \"single_pages_s\": " << median_or_null(probes.burst_pages_s)
    << ", \"chunks_s\": " << median_or_null(probes.burst_chunks_s) << "}"
    << ", \"calls_while_busy\": {\"rounds\": " << probes.busy_rounds
    << ", \"pages\": " << kBusyPages << ", \"work_still_running\": " << probes.still_running
    << ", \"work_alone_s\": " << median_or_null(probes.work_alone_s)
    << ", \"work_with_calls_s\": " << median_or_null(probes.work_with_calls_s);
  for (const auto& [name, samples] : {std::pair{"after_synchronize_s", &probes.after_synchronize_s},
                                      std::pair{"busy_s", &probes.busy_s}}) {
    j << ", \"" << name << "\": {";
    int n = 0;
    for (const std::string& call : kBusyCalls) {
      auto it = samples->find(call);
      j << (n++ ? ", " : "") << json_string(call) << ": "
        << (it == samples->end() ? std::string("null") : median_or_null(it->second));
    }
    j << "}";
  }
  j << "}},\n";
  j << "  \"calls\": {\n";
  for (std::size_t i = 0; i < kTableKinds.size(); ++i) {
    const std::string& kind = kTableKinds[i];
    j << "    " << json_string(kind) << ": " << fit_entry(kind)
      << (i + 1 < kTableKinds.size() ? ",\n" : "\n");
  }
  j << "  },\n";
  j << "  \"extra_calls\": {\n";
  for (std::size_t i = 0; i < kExtraKinds.size(); ++i) {
    const std::string& kind = kExtraKinds[i];
    j << "    " << json_string(kind) << ": " << fit_entry(kind)
      << (i + 1 < kExtraKinds.size() ? ",\n" : "\n");
  }
  j << "  },\n";
  // The medians behind each fit, so a reader can judge the fit.
  j << "  \"median_s_by_bytes\": {\n";
  std::size_t k = 0;
  for (const auto& [kind, by_size] : samples) {
    j << "    " << json_string(kind) << ": {";
    std::size_t n = 0;
    for (const auto& [bytes, seconds] : by_size) {
      j << (n++ ? ", " : "") << "\"" << bytes << "\": " << json_number(quantile(seconds, 0.5));
    }
    j << "}" << (++k < samples.size() ? ",\n" : "\n");
  }
  j << "  }\n}\n";
  std::ofstream file(path);
  file << j.str();
  file.close();
  if (!file) throw std::runtime_error("cannot write " + path);
}

int run(const Options& options) {
  CudaDevice device(options.device);
  allocwatch::MemoryInfo memory = device.memory_info();
  std::printf("device %d: %s, CUDA driver %d, kernel module %s, %.1f GiB total, %.1f GiB free\n",
              options.device, device.name().c_str(), device.driver_version(),
              nvidia_driver_version().c_str(), double(memory.total) / GiB,
              double(memory.free) / GiB);
  require(device.supports_virtual_memory(),
          "this device does not support virtual memory management; nothing to measure");
  std::printf("allocation granularity: %zu bytes\n", device.granularity());

  check_memory_is_usable(device);
  std::printf("memory check: mapped and plain device memory written and read back\n");
  std::vector<std::size_t> sizes = {2 * MiB, 20 * MiB, 128 * MiB, 512 * MiB, 2 * GiB};
  std::vector<std::size_t> segment_sizes = sizes;
  segment_sizes.push_back(8 * GiB);
  if (options.quick) {
    sizes = {2 * MiB, 20 * MiB, 128 * MiB};
    segment_sizes = sizes;
  }
  auto fits_in_memory = [&](std::size_t size) {
    return double(size) * 1.1 < double(memory.free);  // a margin for other processes
  };

  Samples samples;
  Samples discarded;  // the warm-up rounds: first calls pay for driver-side setup
  for (int round = 0; round < options.warmup + options.repeats; ++round) {
    Samples* out = round < options.warmup ? &discarded : &samples;
    // Sizes interleaved within a round, so that a drift in the machine's state spreads over
    // all of them instead of biasing the last.
    for (std::size_t size : segment_sizes) {
      if (!fits_in_memory(size)) continue;
      if (std::find(sizes.begin(), sizes.end(), size) != sizes.end()) {
        time_virtual_memory_cycle(device, size, out);
      }
      time_segment_cycle(device, size, out);
    }
    time_sizeless_calls(device, out);
  }
  for (std::size_t size : segment_sizes) {
    if (!fits_in_memory(size)) std::printf("skipped %s: not enough free memory\n",
                                           size_label(size).c_str());
  }

  std::map<std::string, CostFit> fits;
  for (const auto& [kind, by_size] : samples) fits[kind] = fit_cost(medians(by_size));
  for (const std::string& kind : kTableKinds) {
    require(fits.count(kind) == 1, "no measurement of " + kind);
  }
  print_table(samples, fits);
  std::printf("\n");
  const Probes probes = run_probes(device, options.quick ? 3 : options.repeats);
  if (!options.json_path.empty()) {
    write_json(options.json_path, options, device, samples, fits, probes);
    std::printf("\nwrote %s\n", options.json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options = parse(argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "device_call_costs: %s\n", e.what());
    return 1;
  }
}
